"""Kernel cases run through the Triton interpreter on the CPU, in a subprocess: TRITON_INTERPRET
is read when kernels are defined and would leak into other tests otherwise. A module that
uses this writes its results as one JSON line when run as `python -m MODULE` with
TRITON_INTERPRET=1; its test file names it in `INTERPRETER = (MODULE, seconds)`, and the
module-scoped fixture `interpreter_results` (conftest.py) gives its tests those results.

`seconds` is what the run takes on an idle machine, not a limit: a loaded machine must give
slow tests, not killed runs and errors. The run dies with the test process (whose own limit,
a CI job's, bounds it) and is killed when the session ends; SPECSERVE_TEST_TIMEOUT_SCALE=X
kills a child process after X times its seconds (`child_timeout`).

The runs take most of the CPU suite's time and need no test's state, so once pytest has
collected the tests, conftest.py starts them (`start_in_background`): one after another,
the longest first, in a second process while the other tests run in this one (two cores);
their tests run last. A fixture then waits for its run's result; a run nobody started yet
goes in the foreground.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def interpreter_unusable() -> str | None:
    """Why this machine's Triton interpreter cannot run the kernels, or None."""
    try:
        major, minor = (int(x) for x in version("triton").split(".")[:2])
    except PackageNotFoundError:
        return "triton is not installed (pip install -e '.[test]')"
    if (major, minor) < (3, 7):
        return "the interpreter of triton < 3.7 cannot run loops with loaded bounds (numpy 2)"
    return None


def module_main(run_cases, compile_cases=None) -> None:
    """A test module's `__main__`: `compile_cases()` with the argument "compile" (no
    interpreter: kernels compiled for the GPU target, tests/support/pdl_compile.py), else
    `run_cases()` under the interpreter; prints the results as the last JSON line."""
    if compile_cases is not None and sys.argv[1:] == ["compile"]:
        results = compile_cases()
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
        results = run_cases()
    sys.stdout.write("\n" + json.dumps(results) + "\n")


def child_timeout(seconds: float) -> float | None:
    """The limit of a test's child process that takes `seconds` on an idle machine: none
    (the test run's own limit bounds it), unless SPECSERVE_TEST_TIMEOUT_SCALE=X asks for X
    times `seconds` (0 or unset: none)."""
    scale = float(os.environ.get("SPECSERVE_TEST_TIMEOUT_SCALE") or 0)
    return seconds * scale if scale > 0 else None


# `python -m MODULE` that dies with the thread that started it (Linux: PR_SET_PDEATHSIG), so
# a test process killed by its job's limit leaves no interpreter run behind.
_LAUNCH = """\
import ctypes, os, runpy, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):  # not Linux: the session's end still kills it
    pass
if os.getppid() != int(sys.argv[2]):  # the parent died before prctl took effect
    sys.exit(1)
module = sys.argv[1]
sys.argv = [module]
import tests.support.interpreter_dot  # noqa: E402,F401 (a dot whose bits ignore its shape)
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def _run(module: str, seconds: float) -> tuple[int, str, str]:
    """`python -m module` under the interpreter, one intra-op thread (the tests run beside
    it): (exit status, stdout, stderr). Killed (status -9) only past `child_timeout`."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    timeout = child_timeout(seconds)
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCH, module, str(os.getpid())],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    with _lock:
        _background.running.add(proc)
        if _background.stopped:  # the session ended while this one started
            proc.kill()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += (
            f"\n{module}: killed after {timeout:.0f} s (SPECSERVE_TEST_TIMEOUT_SCALE x {seconds} s)"
        )
    finally:
        with _lock:
            _background.running.discard(proc)
    return proc.returncode, out, err


class _Background:
    """The runs started ahead: their queue, results (module -> _run's triple) and events."""

    def __init__(self):
        self.queue: list[tuple[str, float]] = []
        self.results: dict[str, tuple[int, str, str]] = {}
        self.done: dict[str, threading.Event] = {}
        self.running: set[subprocess.Popen] = set()  # this run's and the foreground's
        self.stopped = False

    def work(self) -> None:
        while True:
            with _lock:
                if self.stopped or not self.queue:
                    return
                module, seconds = self.queue.pop(0)
            try:
                self.results[module] = _run(module, seconds)
            except Exception as e:  # reported by the fixture that reads it
                self.results[module] = (1, "", f"{module}: {type(e).__name__}: {e}")
            finally:
                self.done[module].set()


_lock = threading.Lock()
_background = _Background()


def start_in_background(runs: list[tuple[str, float]]) -> None:
    """Run these (module, seconds) one after another in a thread, from now on, the longest
    first: the tests that read them come last, and a run still queued when its test comes
    goes in the foreground, so the two share the runs and the long one does not start
    last (none when the interpreter is unusable: their tests skip)."""
    if interpreter_unusable() or not runs:
        return
    with _lock:
        for module, seconds in sorted(runs, key=lambda run: -run[1]):
            if module not in _background.done:
                _background.done[module] = threading.Event()
                _background.queue.append((module, seconds))
    threading.Thread(target=_background.work, name="interpreter-runs", daemon=True).start()


def stop_background() -> None:
    """Drop the runs not started and kill those running (the session is over)."""
    with _lock:
        _background.stopped = True
        _background.queue.clear()
        for proc in _background.running:
            proc.kill()


def interpreter_results(module: str, seconds: float = 600) -> dict:
    """The JSON results `python -m module` prints under the interpreter (skips the calling
    test when the interpreter is unusable): the background run's when one was started, else
    a run now."""
    reason = interpreter_unusable()
    if reason:
        pytest.skip(reason)
    with _lock:
        queued = any(m == module for m, _ in _background.queue)
        if queued:  # not started yet: run it here rather than wait behind others
            _background.queue = [(m, t) for m, t in _background.queue if m != module]
        event = None if queued else _background.done.get(module)
    if event is not None:
        event.wait()
        status, out, err = _background.results.get(module, (1, "", f"{module}: run failed"))
    else:
        try:
            status, out, err = result = _run(module, seconds)
            if queued:
                _background.results[module] = result
        finally:  # nobody waits for a result that never comes
            if queued:
                _background.done[module].set()
    assert status == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def record_case(results: dict, name: str, fn, *args, **kwargs) -> None:
    """results[name] = fn(*args, **kwargs), or the exception's type and message: a case that
    raises is reported by its own test, not by the whole interpreter run failing."""
    try:
        results[name] = fn(*args, **kwargs)
    except Exception as e:
        results[name] = f"{type(e).__name__}: {e}"
