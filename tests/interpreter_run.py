"""Kernel cases run through the Triton interpreter on the CPU, in a subprocess: TRITON_INTERPRET
is read when kernels are defined and would leak into other tests otherwise. A module that
uses this writes its results as one JSON line when run as `python -m MODULE` with
TRITON_INTERPRET=1; its fixture calls `interpreter_results(MODULE)`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def interpreter_unusable() -> str | None:
    """Why this machine's Triton interpreter cannot run the kernels, or None."""
    try:
        major, minor = (int(x) for x in version("triton").split(".")[:2])
    except PackageNotFoundError:
        return "triton is not installed (pip install -e '.[test]')"
    if (major, minor) < (3, 7):
        return "the interpreter of triton < 3.7 cannot run loops with loaded bounds (numpy 2)"
    return None


def interpreter_results(module: str, timeout: int = 600) -> dict:
    """The JSON results `python -m module` prints under the interpreter (skips the calling
    test when the interpreter is unusable)."""
    reason = interpreter_unusable()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def record_case(results: dict, name: str, fn, *args, **kwargs) -> None:
    """results[name] = fn(*args, **kwargs), or the exception's type and message: a case that
    raises is reported by its own test, not by the whole interpreter run failing."""
    try:
        results[name] = fn(*args, **kwargs)
    except Exception as e:
        results[name] = f"{type(e).__name__}: {e}"
