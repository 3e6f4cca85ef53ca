"""Continuous batching: which requests run this step and with how many tokens.

Each step has a token budget. Running requests go first in arrival order (a decoding
request takes one token, a request still in prefill takes the next chunk), then waiting
requests are admitted while pages and budget last. Prefill chunks and decodes share one
forward pass (see docs/ARCHITECTURE.md for why). When a running request needs a page and
none is free, the newest running request is preempted: its pages are freed and it is
recomputed later from its prompt and the tokens it already generated.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specserve.engine.kv_cache import KVCache
from specserve.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from specserve.spec.policy import SpeculationPolicy


@dataclass
class ScheduledRequest:
    """One request's share of a step: `num_tokens` committed tokens starting at
    `cached_len`, plus up to `draft_len` speculative tokens that the proposer fills in
    (`drafts`, and `draft_probs` [k, V] when the drafter sampled from a distribution)."""

    request: Request
    num_tokens: int
    draft_len: int = 0
    decoding: bool = False  # one committed token to feed (not a prefill chunk)
    drafts: list[int] = field(default_factory=list)
    draft_probs: Any = None
    # Drafts the proposer left on the device instead: (tokens [B, k], this request's row);
    # `drafts` gets their values once the step's tokens reach the host.
    device_drafts: Any = None

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the request's tokens, so a token is drawn."""
        req = self.request
        return req.cached_len + self.num_tokens == req.committed_len


class Scheduler:
    """Owns the waiting and running queues and the KV pages of every request."""

    def __init__(self, kv: KVCache, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, policy: SpeculationPolicy | None = None) -> list[ScheduledRequest]:
        """Pick this step's requests. The policy gives each decoding request a draft
        length; its pages then cover the K+1 verify tokens (KV lookahead)."""
        budget = self.max_num_batched_tokens
        batch: list[ScheduledRequest] = []
        preempted = False
        draft_lens = self._draft_lens(policy, budget)
        running, page_size = self.running, self.kv.page_size
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            left = req.num_left
            if left <= 0:  # done once the step in flight is processed (overlap)
                i += 1
                continue
            uncached = req.num_uncached
            n = min(uncached, budget)
            k = 0
            if uncached == 1 and draft_lens:
                # Drafts may pass max_tokens, never the context: the tokens past max_tokens
                # are dropped when processed (as those past a stop are), and the step's
                # draft lengths stay uniform (no host wait for mixed ones under overlap).
                room = req.max_len - req.committed_len - 1
                k = max(0, min(draft_lens.get(id(req), 0), budget - 1, room))
            # Pages for this step's tokens past whatever the step in flight may commit.
            reserve = req.cached_len + n + req.num_inflight_drafts
            if reserve + k > len(req.page_table) * page_size:  # else its pages cover it
                while not self.kv.grow(req.page_table, reserve + k):
                    if k > 0:  # give up the lookahead before taking anyone's pages: first
                        k = min(k, left - 1) if k > left - 1 else 0  # the useless drafts
                        continue
                    self._preempt(running[-1])
                    preempted = True
                    if req.status is not RequestStatus.RUNNING:
                        break
                if req.status is not RequestStatus.RUNNING:
                    continue  # it preempted itself: running[i] is the next request
            batch.append(ScheduledRequest(req, n, k, uncached == 1))  # decoding: 1 token
            budget -= n + k
            i += 1
        # Admit new work only when nothing was preempted, so a preempted request is not
        # immediately displaced by one that arrived after it.
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            req = self.waiting[0]
            n = min(req.num_uncached, budget)
            if not self.kv.grow(req.page_table, req.cached_len + n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.append(ScheduledRequest(req, n))
            budget -= n
        return batch

    def _draft_lens(self, policy: SpeculationPolicy | None, budget: int) -> dict[int, int]:
        if policy is None:
            return {}
        decoding, prefill = [], 0
        for r in self.running:
            uncached = r.num_uncached
            if uncached > 1:
                prefill += uncached
            elif uncached == 1:
                left = r.num_left
                if left > 0:
                    r.max_useful_drafts = left - 1  # the policy's cap, read for each request
                    decoding.append(r)
        ks = policy.choose(decoding, min(prefill, budget))
        return {id(r): k for r, k in zip(decoding, ks)}

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.release(req.page_table)
        req.reset_cache()
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the head of the queue, keeping arrival order among the preempted.
        pos = next((k for k, w in enumerate(self.waiting) if w.arrival > req.arrival), None)
        self.waiting.insert(len(self.waiting) if pos is None else pos, req)

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request and return its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.release(req.page_table)
        req.status = RequestStatus.FINISHED
