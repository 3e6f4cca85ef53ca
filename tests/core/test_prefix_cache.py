"""PrefixCache and the allocator's reference counts: matches by content and position, a hash
collision is a miss, the successor rule, eviction order, and every page accounted for under
random publish / attach / release / allocate sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from specserve.core.kv_cache import KVCache
from specserve.core.prefix_cache import PrefixCache
from specserve.core.request import Request
from specserve.core.sampling_params import SamplingParams
from tests.core.test_kv_cache import tiny_config

PAGE = 4


def _kv(num_pages=16) -> KVCache:
    return KVCache(tiny_config(), num_pages, PAGE, torch.float32, torch.device("cpu"))


def _request(tokens: list[int], name="r") -> Request:
    return Request(name, list(tokens), SamplingParams(max_tokens=8), 0, 0, 1000, frozenset())


def _computed(kv: KVCache, cache: PrefixCache, tokens: list[int], drafter=0) -> Request:
    """A request that computed its tokens (all but the last, as a step leaves them) in pages
    of its own and published them."""
    req = _request(tokens)
    assert kv.grow(req.page_table, len(tokens))
    req.cached_len = len(tokens) - 1
    req.draft_cached_len = drafter
    cache.publish(req)
    return req


def test_a_request_starts_from_the_longest_cached_prefix():
    kv = _kv()
    cache = PrefixCache(kv)
    a = _computed(kv, cache, list(range(10, 24)))  # 14 tokens: 3 full pages computed
    assert a.published_pages == 3 and cache.num_pages == 3
    b = _request(list(range(10, 22)) + [99, 98, 97])  # the same first 12 tokens
    cache.attach(b)
    assert b.page_table == a.page_table[:3] and b.cached_len == 12
    assert kv.allocator._refs[a.page_table[0]] == 2  # shared
    c = _request(list(range(10, 17)) + [5] * 9)  # differs inside page 2
    cache.attach(c)
    assert c.page_table == a.page_table[:1] and c.cached_len == 4
    d = _request(list(range(10, 22)))  # all 12 tokens cached: its last one is computed again
    cache.attach(d)
    assert d.cached_len == 8 and d.num_uncached == 4
    e = _request([1, 2] + list(range(12, 22)))  # the same page 1 after another page 0
    cache.attach(e)
    assert e.page_table == [] and e.cached_len == 0


def test_a_hash_collision_is_a_miss():
    kv = _kv()
    cache = PrefixCache(kv)
    a = _computed(kv, cache, [1, 2, 3, 4, 5, 6])
    b = _request([7, 8, 9, 10, 11, 12])
    cache._keys(b, 1)
    cache._pages[b.page_keys[0]] = a.page_table[0]  # b's key now finds a's page
    cache.attach(b)
    assert b.page_table == [] and b.cached_len == 0


def test_the_successor_rule_and_drafter_entries():
    kv = _kv()
    cache = PrefixCache(kv, successor_bound=True)
    tokens = list(range(20, 33))  # 13 tokens: 3 pages, then token 32 follows page 2
    a = _computed(kv, cache, tokens, drafter=8)  # its drafter reached the end of page 1
    same = _request(tokens + [1])
    cache.attach(same)
    assert same.cached_len == 12 and same.draft_cached_len == 8
    other = _request(tokens[:12] + [7, 7])  # another token after page 2
    cache.attach(other)
    assert other.cached_len == 8 and other.page_table == a.page_table[:2]
    # a's drafter catches up: its pages' drafter entries count from then on
    a.draft_cached_len = 12
    cache.publish(a)
    late = _request(tokens + [2])
    cache.attach(late)
    assert late.draft_cached_len == 12 and late.drafter_pages == 3


def test_idle_pages_are_free_and_evicted_least_recently_released_deepest_first():
    kv = _kv(num_pages=9)  # 8 usable
    cache = PrefixCache(kv)
    alloc = kv.allocator
    a = _computed(kv, cache, list(range(10, 23)))  # 4 pages, 3 published
    b = _computed(kv, cache, list(range(40, 53)))
    assert alloc.num_free == 0
    kv.release(a.page_table[:])
    a_pages = list(reversed([p for p in cache._entries if p not in b.page_table]))
    kv.release(b.page_table)
    assert alloc.num_free == 8 and alloc.num_idle == 6 and alloc.num_used == 0
    got = alloc.allocate(4)  # the 2 unkept pages, then a's two deepest cached pages
    assert cache.num_pages == 4 and alloc.num_evictions == 2
    assert set(got[2:]) == set(a_pages[:2]) - set(cache._entries)
    r = _request(list(range(10, 23)))
    cache.attach(r)
    assert r.cached_len == 4  # a's first page is still there
    with pytest.raises(RuntimeError, match="cannot allocate"):
        alloc.allocate(4)  # 3 of b's idle pages and nothing else: r holds a's page
    assert alloc.num_free == 3


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admissions (attach, then pages of its own), computation (publishing pages as
    they fill, the drafter behind or level), finishing, aborting and preempting (publish,
    release; a preempted request comes back with its tokens and finds its pages again or
    not), and raw allocations that evict idle pages, against a model of who holds what."""

    def __init__(self):
        super().__init__()
        self.kv = _kv(num_pages=20)
        self.cache = PrefixCache(self.kv, successor_bound=True)
        self.live: list[Request] = []
        self.preempted: list[Request] = []
        self.raw: list[list[int]] = []
        self.stems = [[s * 7 % 50 + i for i in range(9)] for s in range(3)]

    def _admit(self, req: Request) -> None:
        self.cache.attach(req)
        tokens = req.all_token_ids
        assert req.cached_len < len(tokens)
        for i, page in enumerate(req.page_table):  # every page it found holds its tokens
            assert self.cache._entries[page][1].tokens == tuple(tokens[i * PAGE : (i + 1) * PAGE])
        if self.kv.grow(req.page_table, len(tokens)):
            self.live.append(req)
        else:
            self.kv.release(req.page_table)
            req.reset_cache()

    @rule(stem=st.integers(0, 2), tail=st.lists(st.integers(0, 49), min_size=1, max_size=11))
    def admit(self, stem, tail):
        self._admit(_request(self.stems[stem] + tail))

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def readmit(self, data):
        self._admit(self.preempted.pop(data.draw(st.integers(0, len(self.preempted) - 1))))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), lag=st.integers(0, 6))
    def compute(self, data, lag):
        """It computes every token it holds but the last; its drafter `lag` behind."""
        req = self.live[data.draw(st.integers(0, len(self.live) - 1))]
        req.cached_len = max(req.cached_len, req.num_known - 1)
        req.draft_cached_len = max(req.draft_cached_len, req.cached_len - lag)
        self.cache.publish(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 49), min_size=1, max_size=6))
    def generate(self, data, new):
        """It commits more tokens (pages for them when there are any)."""
        req = self.live[data.draw(st.integers(0, len(self.live) - 1))]
        if self.kv.grow(req.page_table, req.num_known + len(new)):
            req.output_token_ids.extend(new)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def leave(self, data, preempt):
        """Finished, aborted or preempted: its full pages published, all released."""
        req = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.cache.publish(req)
        self.kv.release(req.page_table)
        if preempt:
            req.reset_cache()
            self.preempted.append(req)

    @rule(n=st.integers(1, 6))
    def allocate(self, n):
        if n <= self.kv.allocator.num_free:
            self.raw.append(self.kv.allocator.allocate(n))

    @precondition(lambda self: self.raw)
    @rule()
    def free(self):
        self.kv.allocator.free(self.raw.pop())

    @invariant()
    def every_page_accounted_for(self):
        alloc, cache = self.kv.allocator, self.cache
        held: dict[int, int] = {}
        for pages in [r.page_table for r in self.live] + self.raw:
            for p in pages:
                held[p] = held.get(p, 0) + 1
        for page in range(1, alloc.num_pages):
            assert alloc._refs[page] == held.get(page, 0) >= 0
            idle, free = page in alloc._idle, page in alloc._free
            assert idle + free + (page in held) == 1  # exactly one state
            assert idle == (page in cache._entries and page not in held)
        assert alloc.num_used == len(held)
        assert {cache._pages[k] for k in cache._pages} == set(cache._entries)
        assert len(cache._pages) == len(cache._entries)

    def teardown(self):
        for req in self.live:
            self.kv.release(req.page_table)
        for pages in self.raw:
            self.kv.allocator.free(pages)
        assert self.kv.allocator.num_used == 0  # every page back, cached ones idle


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
