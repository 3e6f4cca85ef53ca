"""KV cache size: explicit pages or bytes win; otherwise 256 MiB on the CPU and, on CUDA, a
fraction of the free device memory less the drafter's weights, shared with its KV pool."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specserve.core.config import EngineConfig
from specserve.core.errors import ConfigError
from specserve.engine.kv_sizing import CPU_KV_CACHE_BYTES, kv_cache_pages
from tests.support.model_cases import tiny_config

CFG = tiny_config()  # 2 layers, 2 KV heads of 16: 256 bytes a token in fp32
PAGE = 16 * CFG.kv_bytes_per_token(torch.float32)
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _pages(device=CPU, **kw):
    # (without CUDA graphs: their outputs' share is test_..._every_graphs_outputs's)
    config = EngineConfig.from_flags(speculative_algorithm="none", disable_cuda_graph=True, **kw)
    return kv_cache_pages(config, CFG, torch.float32, device)


def test_explicit_sizes_and_the_cpu_default():
    assert _pages(num_kv_pages=7) == 7
    assert _pages(kv_cache_bytes=10 * PAGE + 5) == 10
    assert _pages() == CPU_KV_CACHE_BYTES // PAGE


def _fake_cuda(monkeypatch, free, total, cached=0):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: cached + 100)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 100)


def test_cuda_takes_a_fraction_of_free_memory(monkeypatch):
    _fake_cuda(monkeypatch, 1000 * PAGE, 4000 * PAGE)
    assert _pages(CUDA) == 900
    assert _pages(CUDA, kv_cache_memory_fraction=0.5) == 500
    assert _pages(CUDA, kv_cache_bytes=3 * PAGE) == 3  # an explicit budget still wins
    _fake_cuda(monkeypatch, 600 * PAGE, 4000 * PAGE, cached=400 * PAGE)
    assert _pages(CUDA) == 900  # memory cached by PyTorch's allocator but unused counts
    # Never more than max_num_seqs sequences at full context (256 positions) can use:
    # 2 sequences of ceil((256 + 2) / 16) = 17 pages, and the scratch page.
    assert _pages(CUDA, max_num_seqs=2) == 2 * 17 + 1


def test_cuda_budget_leaves_room_for_the_eagle3_head(monkeypatch, tmp_path_factory):
    from tests.support.tiny_models import make_random_eagle3_head, make_tiny_model

    target = make_tiny_model(tmp_path_factory.mktemp("t"), "llama", num_layers=4)
    head = make_random_eagle3_head(tmp_path_factory.mktemp("h"), target, 50)
    weights = (head / "model.safetensors").stat().st_size
    from specserve.core.model_config import load_hf_config

    cfg = load_hf_config(target)
    page = 16 * cfg.kv_bytes_per_token(torch.float32)
    head_page = 16 * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # one layer
    head_page += 16 * cfg.hidden_size * 4  # the feature store
    free = 1000 * page + weights
    _fake_cuda(monkeypatch, free, 2 * free)
    config = EngineConfig.from_flags(
        model=str(target),
        speculative_algorithm="eagle3",
        speculative_draft_model_path=str(head),
        kv_cache_memory_fraction=1.0,
        disable_cuda_graph=True,
    )
    assert kv_cache_pages(config, cfg, torch.float32, CUDA) == 1000 * page // (page + head_page)
    # a byte budget, given or the CPU's default, holds the head's pool too
    config = replace(config, cache=replace(config.cache, size_bytes=1000 * page))
    assert kv_cache_pages(config, cfg, torch.float32, CUDA) == 1000 * page // (page + head_page)
    config = replace(config, cache=replace(config.cache, size_bytes=None))
    pages = kv_cache_pages(config, cfg, torch.float32, CPU)
    assert pages == CPU_KV_CACHE_BYTES // (page + head_page)


@pytest.mark.parametrize(
    "bad",
    [
        dict(kv_cache_memory_fraction=0.0),
        dict(kv_cache_memory_fraction=1.5),
        dict(kv_cache_bytes=0),
    ],
)
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        EngineConfig.from_flags(**bad)


def test_cuda_memory_too_small_for_one_sequence_is_refused(monkeypatch):
    # One 256-position sequence needs ceil((256 + 2) / 16) + 1 = 18 pages.
    _fake_cuda(monkeypatch, 19 * PAGE, 4000 * PAGE)
    assert _pages(CUDA, kv_cache_memory_fraction=1.0) == 19
    _fake_cuda(monkeypatch, 10 * PAGE, 4000 * PAGE)
    with pytest.raises(ConfigError, match="kv-cache-memory-fraction"):
        _pages(CUDA)
    assert _pages(CUDA, max_model_len=64) == 9  # a shorter context fits


def test_cuda_budget_leaves_room_for_every_graphs_outputs(monkeypatch):
    """Each captured (batch bucket, tokens per request) keeps its outputs alive in the
    graph pool (logits, hidden states, tokens): the KV budget leaves room for all of them,
    more at a larger K (K=5 ran out of memory at start-up on the H200 without this)."""
    from specserve.engine.kv_sizing import graph_output_bytes

    eight_b = replace(CFG, vocab_size=128256, hidden_size=4096)
    k3 = EngineConfig.from_flags(speculative_algorithm="ngram", speculative_num_steps=3)
    k5 = EngineConfig.from_flags(speculative_algorithm="ngram", speculative_num_steps=5)
    # buckets 1, 2, 4, 8, 16, 32, ..., 256: 2,191 requests; q = 1..K+1 tokens each; and
    # mixed steps' hidden states: token buckets 32, 64, 128, 256, 384, 512, ..., 1024 by 3, 4,
    # 4, then 5 request buckets (4, 16, 64, 256, 257 up to the first above the tokens): 23,264
    # rows
    mixed = 23264 * 4096 * 2
    assert graph_output_bytes(k3, eight_b, torch.bfloat16) == (
        2191 * 10 * ((128256 + 4096) * 2 + 16) + mixed
    )
    assert graph_output_bytes(k5, eight_b, torch.bfloat16) == (
        2191 * 21 * ((128256 + 4096) * 2 + 16) + mixed
    )
    no_mixed = replace(k3, execution=replace(k3.execution, cuda_graph_max_tokens=0))
    assert graph_output_bytes(no_mixed, eight_b, torch.bfloat16) == (
        2191 * 10 * ((128256 + 4096) * 2 + 16)
    )
    no_graphs = replace(k5, execution=replace(k5.execution, disable_cuda_graph=True))
    assert graph_output_bytes(no_graphs, eight_b, torch.bfloat16) == 0
    plain = EngineConfig.from_flags(speculative_algorithm="none", max_num_seqs=4)
    reserve = graph_output_bytes(plain, CFG, torch.float32)
    # mixed: request buckets 4 and 5 at every token bucket
    mixed_rows = 2 * (32 + 64 + 128 + 256 + 384 + 512 + 640 + 768 + 896 + 1024)
    assert (
        reserve
        == (1 + 2 + 4) * 1 * ((CFG.vocab_size + CFG.hidden_size) * 4 + 16)
        + mixed_rows * CFG.hidden_size * 4
    )
    _fake_cuda(monkeypatch, 1000 * PAGE, 4000 * PAGE)
    long_cfg = replace(CFG, max_position_embeddings=4000)  # no full-context cap here
    config = EngineConfig.from_flags(
        speculative_algorithm="none", max_num_seqs=4, kv_cache_memory_fraction=1.0
    )
    assert (
        kv_cache_pages(
            replace(config, execution=replace(config.execution, disable_cuda_graph=True)),
            long_cfg,
            torch.float32,
            CUDA,
        )
        == 1000
    )
    with_graphs = kv_cache_pages(config, long_cfg, torch.float32, CUDA)
    assert with_graphs == (1000 * PAGE - reserve) // PAGE < 1000
