"""Serving compiles no Triton kernel variant that start-up did not: every key a launch would
compile under after start-up (tests/specialization_run.py, through the interpreter) was
already seen during it. On the GPU a new variant stalls a step for ~0.5 s."""

from __future__ import annotations

from tests.interpreter_run import interpreter_results


def test_no_kernel_variant_first_compiled_while_serving():
    results = interpreter_results("tests.specialization_run")
    assert results["startup"] > 0
    new = [f"{n['kernel']} at {n['site']}: {n['key']}" for n in results["new"]]
    assert not new, "variants first compiled after start-up:\n" + "\n".join(new)
