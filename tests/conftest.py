"""Shared fixtures: tiny random checkpoints written with transformers, never downloaded."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models gain nothing from intra-op threads, and a second thread fighting the server
# subprocesses (or anything else on a small machine) slows every op down many times.
torch.set_num_threads(1)

from tests.support.spies import remove_spies  # noqa: E402
from tests.support.tiny_models import make_tiny_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    # Modules whose tests read a Triton interpreter run go last, whole (their module-scoped
    # fixtures set up once): their runs start in the background when collection ends
    # (`pytest_collection_finish`) and finish while every other test runs here.
    last = [i for i in items if getattr(getattr(i, "module", None), "INTERPRETER", None)]
    if last:
        moved = set(map(id, last))
        items[:] = [i for i in items if id(i) not in moved] + last


def pytest_collection_finish(session):
    """Start the Triton interpreter runs the selected tests read, in their order, beside
    the tests (tests/support/interpreter_run.py)."""
    from tests.support.interpreter_run import start_in_background

    if session.config.option.collectonly:
        return
    runs = []
    for item in session.items:
        run = getattr(getattr(item, "module", None), "INTERPRETER", None)
        needs = "interpreter_results" in getattr(item, "fixturenames", ())
        if run and needs and run not in runs and not item.get_closest_marker("skip"):
            runs.append(run)
    start_in_background(runs)


@pytest.fixture(scope="module")
def interpreter_results(request) -> dict:
    """The results of the interpreter run the test file names in `INTERPRETER`."""
    from tests.support.interpreter_run import interpreter_results as run

    return run(*request.module.INTERPRETER)


def pytest_sessionfinish(session, exitstatus):
    from tests.support.interpreter_run import stop_background

    stop_background()


@pytest.fixture(autouse=True)
def _remove_spies():
    """Spies set with `spy_on` come off when each test ends (tests/support/spies.py)."""
    yield
    remove_spies()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3")
