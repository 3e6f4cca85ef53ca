"""Prefix caching: full pages of computed tokens are kept after their request is done, keyed by
their content and everything before it, and a new request whose tokens begin the same way
starts from those pages instead of computing them again.

Keys form a hash chain: a page's key is a BLAKE2b digest of its parent's key and its own
tokens, so one dictionary lookup per page finds the longest cached prefix, and a page is
only ever found after the same tokens in the same order (a radix tree gives the same
matches; the chain needs no tree upkeep when pages are evicted one by one). A cryptographic
digest, not Python's hash: that one is unkeyed and invertible, so a client could craft two
prefixes with one key and be served KV computed after the other's tokens. Each entry also
keeps its parent key and tokens, which a lookup compares.

A page holds more than the target's KV: the drafter's inputs and state at the same slots
(EAGLE-3's features and head KV, a draft model's KV). The target's entries depend only on
the tokens up to each position; an EAGLE-3 head's entry at position i also reads token
i + 1, so the entry at a page's last slot depends on the token after the page (its
successor). With such a drafter (`successor_bound`) a page matches only when the request's
token after it equals the one recorded when the page was published, so every request that
shares a page writes the same drafter values into it. Drafter entries count as cached only
on pages where the drafter of a request holding the page had reached the page's end; a
request catches up from the first page where none had.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import blake2b

from specserve.core.kv_cache import KVCache
from specserve.core.request import Request

_ROOT = b"specserve prefix"  # the parent key of a request's first page


@dataclass(slots=True)
class CachedPage:
    parent: bytes
    tokens: tuple[int, ...]
    successor: int  # the token after the page when it was published
    drafter: bool  # the drafter's entries of the whole page were computed


class PrefixCache:
    """The cached pages of one KV cache, found by content (see the module doc)."""

    def __init__(self, kv: KVCache, successor_bound: bool = False):
        self.kv, self.page_size = kv, kv.page_size
        self.successor_bound = successor_bound
        self._pages: dict[bytes, int] = {}  # key -> page
        self._entries: dict[int, tuple[bytes, CachedPage]] = {}  # page -> (key, entry)
        kv.allocator.on_evict = _forget_evicted(self._pages, self._entries)
        # Counters (engine.stats(), /metrics): prompt tokens looked up and found.
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_pages(self) -> int:
        """Pages in the cache (held by requests or idle)."""
        return len(self._entries)

    def _keys(self, req: Request, num_pages: int) -> list[bytes]:
        """The request's first num_pages page keys (kept on it: tokens never change once the
        host knows them)."""
        keys, size = req.page_keys, self.page_size
        while len(keys) < num_pages:
            i = len(keys)
            digest = blake2b(keys[-1] if keys else _ROOT, digest_size=16)
            digest.update(array("q", req.token_ids(i * size, (i + 1) * size)).tobytes())
            keys.append(digest.digest())
        return keys

    def attach(self, req: Request) -> None:
        """A request that holds no pages takes the longest cached prefix of its known tokens
        (all but its last: a step must compute at least one token): its page table starts
        with those pages, its cached length at their end, and its drafter length at the end
        of the pages whose drafter entries are there."""
        if req.page_table:
            raise RuntimeError(f"request {req.request_id} holds pages already")
        size = self.page_size
        known = req.num_known
        max_pages = (known - 1) // size
        if max_pages <= 0 or req.params.prompt_logprobs is not None:
            return  # (prompt logprobs: every prompt token's logits are computed)
        keys = self._keys(req, max_pages)
        pages, drafter_pages = [], 0
        parent = _ROOT
        for i, key in enumerate(keys):
            page = self._pages.get(key)
            if page is None:
                break
            entry = self._entries[page][1]
            end = (i + 1) * size
            if entry.parent != parent or entry.tokens != tuple(req.token_ids(i * size, end)):
                break  # a hash collision
            if self.successor_bound and req.token_ids(end, end + 1) != [entry.successor]:
                break
            pages.append(page)
            if entry.drafter and drafter_pages == i:
                drafter_pages += 1
            parent = key
        if not pages:
            return
        self.kv.allocator.share(pages)
        req.page_table = pages
        req.cached_len = len(pages) * size
        req.draft_cached_len = drafter_pages * size
        req.published_pages = len(pages)
        req.drafter_pages = drafter_pages

    def admitted(self, req: Request) -> None:
        """Count a request's first admission: its prompt tokens and those found cached."""
        prompt = len(req.prompt_token_ids)
        req.num_cached_prompt_tokens = min(req.cached_len, prompt)
        self.queried_tokens += prompt
        self.hit_tokens += req.num_cached_prompt_tokens

    def publish(self, req: Request) -> None:
        """Put the request's full pages of computed tokens whose successor the host knows
        into the cache (the ones not there yet), and mark the drafter entries of its cached
        pages that its drafter has reached since. Their KV is written by steps already
        launched, which run before any step that could read it (one stream, in order)."""
        size, table = self.page_size, req.page_table
        start = req.published_pages
        num_pages = min(min(req.cached_len, req.num_known - 1) // size, len(table))
        if num_pages > start:
            keys = self._keys(req, num_pages)
            allocator = self.kv.allocator
            for i in range(start, num_pages):
                key, page, end = keys[i], table[i], (i + 1) * size
                if key in self._pages or page in self._entries:
                    continue  # the same tokens cached from another request's page
                entry = CachedPage(
                    keys[i - 1] if i else _ROOT,
                    tuple(req.token_ids(i * size, end)),
                    req.token_ids(end, end + 1)[0],
                    False,
                )
                self._pages[key] = page
                self._entries[page] = (key, entry)
                allocator.keep(page)
            req.published_pages = num_pages
        # The drafter's entries on its pages: valid up to its drafter length (a page it
        # shares holds the same values for every holder: see the module doc).
        drafted = min(req.draft_cached_len // size, req.published_pages)
        for i in range(req.drafter_pages, drafted):
            cached = self._entries.get(table[i])
            if cached is not None:
                cached[1].drafter = True
        req.drafter_pages = max(req.drafter_pages, drafted)


def _forget_evicted(pages: dict, entries: dict) -> Callable[[int], None]:
    """The allocator's eviction hook: drops an evicted page from the cache's dictionaries.
    It holds them, not the cache: a bound method of the cache would make a reference cycle
    (cache -> KV cache -> allocator -> cache) that keeps the KV pool alive after its engine
    is dropped, until a full garbage collection."""

    def forget(page: int) -> None:
        key, _ = entries.pop(page)
        del pages[key]

    return forget
