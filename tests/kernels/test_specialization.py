"""Serving compiles no Triton kernel variant that start-up did not: every key a launch would
compile under after start-up (tests/support/specialization_run.py, through the interpreter) was
already seen during it. On the GPU a new variant stalls a step for ~0.5 s."""

from __future__ import annotations

# the interpreter run (module, seconds idle) whose results the `interpreter_results` fixture
# gives this file's tests (conftest.py; started in the background: tests/support/interpreter_run.py)
INTERPRETER = ("tests.support.specialization_run", 600)


def test_no_kernel_variant_first_compiled_while_serving(interpreter_results):
    assert interpreter_results["startup"] > 0
    new = [f"{n['kernel']} at {n['site']}: {n['key']}" for n in interpreter_results["new"]]
    assert not new, "variants first compiled after start-up:\n" + "\n".join(new)
