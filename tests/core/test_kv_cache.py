"""PageAllocator and KVCache invariants: pages are never handed out twice, never lost, and
misuse raises without changing the pool; a dropped engine's pool is freed at once."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from specserve import LLM, SamplingParams
from specserve.core.kv_cache import KVCache, PageAllocator
from specserve.core.model_config import ModelConfig


def tiny_config(num_layers: int = 2) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def snapshot(alloc: PageAllocator) -> tuple:
    return (list(alloc._free), list(alloc._refs), alloc.num_free, alloc.num_used)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a model of who owns which page."""

    grants = Bundle("grants")

    def __init__(self):
        super().__init__()
        self.alloc = PageAllocator(9)
        self.owned: set[int] = set()

    @rule(target=grants, n=st.integers(0, 9))
    def allocate(self, n):
        if n > self.alloc.num_free:
            before = snapshot(self.alloc)
            with pytest.raises(RuntimeError, match="cannot allocate"):
                self.alloc.allocate(n)
            assert snapshot(self.alloc) == before
            return []
        pages = self.alloc.allocate(n)
        assert len(pages) == n == len(set(pages))
        assert 0 not in pages
        assert not self.owned & set(pages), "a page was handed out twice"
        self.owned |= set(pages)
        return pages

    @rule(pages=consumes(grants))
    def free(self, pages):
        self.alloc.free(pages)
        self.owned -= set(pages)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def double_free_raises(self, data):
        page = data.draw(st.sampled_from(sorted(set(range(1, 9)) - self.owned) or [0]))
        before = snapshot(self.alloc)
        with pytest.raises(RuntimeError, match="not owned"):
            self.alloc.free([page])
        assert snapshot(self.alloc) == before

    @rule(page=st.sampled_from([0, -1, 9, 100]))
    def free_outside_the_pool_raises(self, page):
        before = snapshot(self.alloc)
        with pytest.raises(RuntimeError):
            self.alloc.free([page])
        assert snapshot(self.alloc) == before

    @rule(n=st.integers(-5, -1))
    def negative_allocation_raises(self, n):
        with pytest.raises(RuntimeError):
            self.alloc.allocate(n)

    @invariant()
    def nothing_lost(self):
        assert self.alloc.num_free + len(self.owned) == self.alloc.num_usable
        assert self.alloc.num_used == len(self.owned)
        free = list(self.alloc._free)
        assert len(free) == len(set(free)), "a page sits twice in the free list"
        assert set(free) | self.owned == set(range(1, 9))
        assert 0 not in free


TestAllocatorStateMachine = AllocatorMachine.TestCase
TestAllocatorStateMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)


@given(st.lists(st.integers(1, 7), min_size=1, max_size=6))
@settings(max_examples=60, deadline=None)
def test_failed_free_changes_nothing(pages):
    """A free() that raises part-way (double free inside one call, or a stray page) must not
    have returned the pages before the bad one."""
    alloc = PageAllocator(8)
    granted = alloc.allocate(7)
    alloc.free(granted[:3])
    before = snapshot(alloc)
    bad = pages + [pages[0]]  # repeats a page; some may be free already
    with pytest.raises(RuntimeError):
        alloc.free(bad)
    assert snapshot(alloc) == before


def test_allocator_needs_a_usable_page():
    with pytest.raises(ValueError):
        PageAllocator(1)
    assert PageAllocator(2).num_usable == 1


def test_allocate_everything_then_nothing():
    alloc = PageAllocator(5)
    pages = alloc.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4]
    assert alloc.allocate(0) == []
    with pytest.raises(RuntimeError):
        alloc.allocate(1)
    alloc.free(pages)
    assert alloc.num_free == 4


def make_cache(num_pages=6, page_size=4) -> KVCache:
    return KVCache(tiny_config(), num_pages, page_size, torch.float32, torch.device("cpu"))


def test_kv_cache_shapes_and_capacity():
    kv = make_cache(num_pages=6, page_size=4)
    assert kv.capacity_tokens == 5 * 4
    assert len(kv.layers) == 2
    k, v = kv.layers[0]
    assert k.shape == v.shape == (6, 4, 1, 4)
    # The per-layer views share the pool's storage (writes land in the pool).
    k[1, 2] = 7.0
    assert kv.pool[0, 0, 1, 2].eq(7.0).all()
    assert kv.pages_needed(0) == 0
    assert kv.pages_needed(1) == kv.pages_needed(4) == 1
    assert kv.pages_needed(5) == 2


def test_pages_for_budget():
    cfg = tiny_config()
    per_token = cfg.kv_bytes_per_token(torch.float32)
    assert per_token == 2 * 2 * 1 * 4 * 4
    assert KVCache.pages_for_budget(cfg, 4, torch.float32, 10 * 4 * per_token + 3) == 10


def test_grow_covers_tokens_and_fails_without_change():
    kv = make_cache(num_pages=6, page_size=4)
    table: list[int] = []
    assert kv.grow(table, 1) and len(table) == 1
    assert kv.grow(table, 4) and len(table) == 1  # still within the first page
    assert kv.grow(table, 9) and len(table) == 3
    assert kv.grow(table, 2) and len(table) == 3  # never shrinks
    other: list[int] = []
    assert kv.grow(other, 8) and len(other) == 2
    assert not set(table) & set(other)
    before = (list(other), kv.allocator.num_free)
    assert not kv.grow(other, 20)  # needs 3 more pages, none free
    assert (list(other), kv.allocator.num_free) == before
    kv.release(table)
    assert table == [] and kv.allocator.num_free == 3
    assert kv.grow(other, 20) and len(other) == 5
    kv.release(other)
    assert kv.allocator.num_used == 0
    kv.release(other)  # releasing an empty table is a no-op


def test_release_twice_raises():
    kv = make_cache()
    table: list[int] = []
    kv.grow(table, 8)
    copy = list(table)
    kv.release(table)
    with pytest.raises(RuntimeError, match="not owned"):
        kv.release(copy)
    assert kv.allocator.num_used == 0


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30)), max_size=40))
@settings(max_examples=80, deadline=None)
def test_grow_release_random(ops):
    """Four page tables grown and released at random: each covers what it asked for, no page
    is shared, and free + owned always equals the usable pages."""
    kv = make_cache(num_pages=12, page_size=4)
    tables: list[list[int]] = [[] for _ in range(4)]
    for who, tokens in ops:
        if tokens == 0:
            kv.release(tables[who])
        elif kv.grow(tables[who], tokens):
            assert len(tables[who]) >= kv.pages_needed(tokens)
        owned = [p for t in tables for p in t]
        assert len(owned) == len(set(owned)) and 0 not in owned
        assert kv.allocator.num_free + len(owned) == kv.allocator.num_usable


@pytest.mark.parametrize(
    "kw",
    [{}, dict(speculative_algorithm="ngram", speculative_policy="fixed", overlap_schedule="on")],
)
def test_a_dropped_engine_frees_its_kv_cache_at_once(tiny_llama, kw):
    """No reference cycle holds the KV cache (256 MiB on the CPU, most of a GPU's memory):
    it goes with its engine, not at some later full garbage collection (the prefix cache's
    eviction hook made one)."""
    llm = LLM(str(tiny_llama), device="cpu", **kw)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # the second run starts from the first's cached pages
        llm.generate([[5, 6, 7, 8] * 5], params)
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0
    pool = weakref.ref(llm.engine.kv.pool)
    gc.disable()
    try:
        del llm
        assert pool() is None
    finally:
        gc.enable()
