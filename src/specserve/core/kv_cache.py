"""Paged KV cache: one preallocated pool of fixed-size pages and the allocator that hands
them out. Page 0 is reserved as a scratch page (padding slots point there) and never lent."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from specserve.core.model_config import ModelConfig


class PageAllocator:
    """Hands out page ids 1..num_pages-1; never the same page twice, never loses one.

    Every page is free, held (by one request or, shared through the prefix cache, by
    several: `_refs` counts them) or kept (in the prefix cache, held by no request: `_idle`,
    least recently released first). Kept pages count as free: `allocate` takes the free ones
    first, then evicts the least recently used kept ones (telling `on_evict`). Freeing a page
    that is not held, or allocating more than is free, raises instead of corrupting the pool.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._refs = [0] * num_pages
        self._kept = [False] * num_pages  # in the prefix cache (its KV is worth keeping)
        self._idle: OrderedDict[int, None] = OrderedDict()  # kept, held by no request
        self.on_evict: Callable[[int], None] | None = None
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages a request could get now (kept pages nobody holds included)."""
        return len(self._free) + len(self._idle)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_used(self) -> int:
        """Pages held by requests."""
        return self.num_usable - self.num_free

    @property
    def num_idle(self) -> int:
        """Kept pages no request holds (evictable)."""
        return len(self._idle)

    def allocate(self, n: int) -> list[int]:
        if n < 0 or n > self.num_free:
            raise RuntimeError(f"cannot allocate {n} pages: {self.num_free} free")
        pages = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        while len(pages) < n:
            page, _ = self._idle.popitem(last=False)
            self._kept[page] = False
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(page)
            pages.append(page)
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder for each of these kept pages (a prefix cache hit)."""
        for p in pages:
            if not self._kept[p]:
                raise RuntimeError(f"page {p} shared but not kept")
            if self._refs[p] == 0:
                del self._idle[p]
            self._refs[p] += 1

    def keep(self, page: int) -> None:
        """The page's KV is in the prefix cache: when its last holder frees it, it stays
        (idle) until evicted."""
        if self._refs[page] <= 0:
            raise RuntimeError(f"page {page} kept but not held")
        self._kept[page] = True

    def free(self, pages: list[int]) -> None:
        """One holder fewer for each page; a page nobody holds goes back to the pool, or
        to the idle kept pages when the prefix cache keeps it."""
        # Check every page before returning any, so a bad call leaves the pool unchanged.
        seen: set[int] = set()
        for p in pages:
            if not (0 < p < self.num_pages) or self._refs[p] <= 0 or p in seen:
                raise RuntimeError(f"page {p} freed but not owned")
            seen.add(p)
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if self._kept[p]:
                    self._idle[p] = None
                else:
                    self._free.append(p)


class KVCache:
    """The K and V page pools of every layer plus the allocator that lends their pages."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        shape = (cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.pool = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.pool[i, 0], self.pool[i, 1]) for i in range(cfg.num_layers)]

    @staticmethod
    def pages_for_budget(cfg: ModelConfig, page_size: int, dtype: torch.dtype, kv_bytes: int):
        return kv_bytes // (page_size * cfg.kv_bytes_per_token(dtype))

    @property
    def capacity_tokens(self) -> int:
        """Tokens one request could hold if it had every usable page."""
        return self.allocator.num_usable * self.page_size

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def grow(self, page_table: list[int], num_tokens: int) -> bool:
        """Extend `page_table` in place to cover `num_tokens`; False (and no change) if the
        pool lacks the pages."""
        extra = self.pages_needed(num_tokens) - len(page_table)
        if extra <= 0:
            return True
        if extra > self.allocator.num_free:
            return False
        page_table.extend(self.allocator.allocate(extra))
        return True

    def shrink(self, page_table: list[int], num_tokens: int) -> int:
        """Release the pages of `page_table` past those that cover `num_tokens` (last
        first); how many went back."""
        extra = page_table[self.pages_needed(num_tokens) :]
        if extra:
            self.allocator.free(extra[::-1])
            del page_table[len(page_table) - len(extra) :]
        return len(extra)

    def release(self, page_table: list[int]) -> None:
        # Last page first: kept pages are evicted least recently released first, so a
        # prefix's deeper pages go before the pages other prefixes may branch from.
        self.allocator.free(page_table[::-1])
        page_table.clear()
