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

from tests.tiny_models import make_tiny_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3")
