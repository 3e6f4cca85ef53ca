"""Paged KV cache: one preallocated pool of fixed-size pages and the allocator that hands
them out. Page 0 is reserved as a scratch page (padding slots point there) and never lent."""

from __future__ import annotations

from collections import deque

import torch

from specserve.core.model_config import ModelConfig


class PageAllocator:
    """Hands out page ids 1..num_pages-1; never the same page twice, never loses one.

    Every page is either free (in the free queue) or owned (marked in `_owned`). Freeing a
    page that is not owned, or allocating more than is free, raises instead of corrupting
    the pool.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(1, num_pages))
        self._owned = [False] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def allocate(self, n: int) -> list[int]:
        if n < 0 or n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} pages: {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._owned[p] = True
        return pages

    def free(self, pages: list[int]) -> None:
        # Check every page before returning any, so a bad call leaves the pool unchanged.
        seen: set[int] = set()
        for p in pages:
            if not (0 < p < self.num_pages) or not self._owned[p] or p in seen:
                raise RuntimeError(f"page {p} freed but not owned")
            seen.add(p)
        for p in pages:
            self._owned[p] = False
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

    def release(self, page_table: list[int]) -> None:
        self.allocator.free(page_table)
        page_table.clear()
