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
from typing import TYPE_CHECKING

from specserve.core.batch import ScheduledRequest
from specserve.core.kv_cache import KVCache
from specserve.core.prefix_cache import PrefixCache
from specserve.core.request import NEVER, Request, RequestStatus
from specserve.engine.overlap_wait import RunningCounts
from specserve.speculative.policy_base import StepLoad

if TYPE_CHECKING:
    from specserve.speculative.policy import SpeculationPolicy


class Scheduler:
    """Owns the waiting and running queues and the KV pages of every request."""

    # How fast the queue's prompt-to-output ratio follows finished requests (EWMA weight)
    RATIO_WEIGHT = 1 / 16

    def __init__(
        self,
        kv: KVCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefix: PrefixCache | None = None,
        max_model_len: int = NEVER,
    ):
        self.kv = kv
        self.prefix = prefix  # prefix caching: admitted requests start from cached pages
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        # Joined by admission only, left by preemption and finish (abort included), which
        # keep `counts` (what the overlap loop checks each step: engine/overlap_wait.py;
        # the context it holds rows to: `max_model_len`).
        self.running: list[Request] = []
        self.counts = RunningCounts(max_model_len=max_model_len)
        self.num_preemptions = 0
        # The next step is scheduled before this one's tokens are resolved (overlap): a
        # request's lookahead then covers the next step's token too (`_draft`).
        self.overlap = False
        self._after_idle = True  # no step has decoded since nothing was running
        # whether the policy gave any request of the last schedule a draft length (pages
        # may have cut it to 0 since): the step loop runs no proposer pass without one
        self.drafted = False
        self._stalled: tuple | None = None  # (request, budget, free and cached pages): short
        # Mean prompt and output tokens of finished requests (EWMA): the prefill each
        # generated token brings along (`StepLoad.prefill_per_token`).
        self._prompt_mean = self._output_mean = 0.0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, policy: SpeculationPolicy | None = None) -> list[ScheduledRequest]:
        """Pick this step's requests: every running request's next committed token or
        prefill chunk, then new requests while budget, pages and sequence slots last, then
        drafts. Speculation takes only what is left: the policy gets the step's remaining
        token budget (`StepLoad`) and each request's drafts get pages only from the free
        ones, none while a waiting request lacks pages (its lookahead then stays within
        the pages it holds). Decode and verify rows come first in the step, prefill chunks
        after them (attention serves the two groups with different kernels)."""
        budget = self.max_num_batched_tokens
        self.drafted = False
        if not self.running:
            self._after_idle = True  # (until a step decodes: `_draft`)
        batch: list[ScheduledRequest] = []
        preempted = False
        running, page_size, prefix = self.running, self.kv.page_size, self.prefix
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.cached_len >= req.publish_at:  # its prompt's pages, for later requests
                prefix.publish(req)
                req.publish_at = NEVER  # (its other pages when it leaves)
            if req.num_left <= 0:  # done once the step in flight is processed (overlap)
                i += 1
                continue
            uncached = req.num_uncached
            n = min(uncached, budget)
            # Pages for this step's tokens past whatever the step in flight may commit.
            reserve = req.cached_len + n + req.num_inflight_drafts
            if reserve > len(req.page_table) * page_size:  # else its pages cover it
                reclaimed = False
                while not self.kv.grow(req.page_table, reserve):
                    if not reclaimed:  # speculation's lookahead goes back before anyone
                        reclaimed = True  # is preempted
                        if self._reclaim_lookahead(batch):
                            continue
                    self._preempt(running[-1])
                    preempted = True
                    if req.status is not RequestStatus.RUNNING:
                        break
                if req.status is not RequestStatus.RUNNING:
                    continue  # it preempted itself: running[i] is the next request
            batch.append(ScheduledRequest(req, n, 0, uncached == 1))  # decoding: 1 token
            budget -= n
            i += 1
        # Admit new work only when nothing was preempted, so a preempted request is not
        # immediately displaced by one that arrived after it.
        short_of_pages = preempted
        while self.waiting and budget > 0 and not preempted:
            if len(self.running) >= self.max_num_seqs:
                break
            req = self.waiting[0]
            # The request that lacked pages last time, asking as much, when nothing has
            # freed or joined the cache since: it would lack them again (and a long
            # prompt's lookup costs).
            state = (req, budget, self.kv.allocator.num_free, prefix.num_pages if prefix else 0)
            if state == self._stalled:
                short_of_pages = True
                break
            if prefix is not None:
                prefix.attach(req)
            n = min(req.num_uncached, budget)
            if not self.kv.grow(req.page_table, req.cached_len + n) and not (
                self._reclaim_lookahead(batch) and self.kv.grow(req.page_table, req.cached_len + n)
            ):  # (a waiting request comes before speculation's lookahead)
                if req.page_table:  # its cached pages go back (idle, still cached)
                    self.kv.release(req.page_table)
                    req.reset_cache()
                self._stalled = state
                short_of_pages = True
                break
            if prefix is not None:
                if req.num_preemptions == 0:
                    prefix.admitted(req)
                # Publishing as it computes costs the host per page; its prompt's pages
                # (system prompts, earlier turns: what concurrent requests share) go once
                # computed, its output's when it leaves.
                req.publish_at = (req.num_known - 1) // page_size * page_size or NEVER
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.counts.add(req)
            batch.append(ScheduledRequest(req, n))
            budget -= n
        if policy is not None:
            self._draft(batch, policy, budget, short_of_pages)
        batch.sort(key=_prefill_last)  # stable: arrival order within each group
        return batch

    def _draft(
        self,
        batch: list[ScheduledRequest],
        policy: SpeculationPolicy,
        budget: int,
        short_of_pages: bool,
    ) -> None:
        """Draft lengths from the policy for the step's decoding requests, within `budget`
        tokens and the pages they can get (none while a waiting request lacks pages)."""
        decoding = [s for s in batch if s.decoding]
        prefill = (
            sum(s.num_tokens for s in batch if not s.decoding) if len(decoding) < len(batch) else 0
        )
        # (requests waiting for budget or pages, not for a sequence slot: drafts take neither)
        waiting = len(self.waiting) if len(self.running) < self.max_num_seqs else 0
        load = StepLoad(
            prefill, budget, self.prefill_per_token, waiting, self._after_idle, self.occupancy
        )
        if policy.reads_caps(load):  # (not a held decision for plain decoding)
            for s in decoding:
                r = s.request
                r.max_useful_drafts = r.num_left - 1  # the policy's cap, read for each request
        if decoding:
            self._after_idle = False
        draft_lens = policy.choose([s.request for s in decoding], load)
        if not any(draft_lens):  # plain decoding (often, with the goodput policy dormant): done
            return
        self.drafted = True
        cap = load.k_cap(len(decoding), max(draft_lens))
        # Every draft length set below is at most cap: the bound the overlap loop's context
        # count rests on (overlap_wait.max_reach).
        if cap > self.counts.max_drafts:
            self.counts.raise_max_drafts(cap, self.running)
        page_size = self.kv.page_size
        page_cap = cap  # the most drafts every request's pages allow
        clamped = []
        for s, draft_len in zip(decoding, draft_lens):
            req = s.request
            # Drafts may pass max_tokens, never the context: the tokens past max_tokens are
            # dropped when processed (as those past a stop are), and the step's draft lengths
            # stay uniform (no host wait for mixed ones under overlap).
            draft_len = max(0, min(draft_len, cap, req.max_len - req.committed_len - 1))
            if draft_len:
                # Held already: its token and the drafts in flight. Under overlap the
                # lookahead covers the next step's token too: that step is scheduled before
                # this one's drafts are resolved and needs a slot for every one of them and
                # its own (it preempted for that last slot, a lone request itself, where
                # drafts past max_tokens had taken the last free pages).
                reserve = req.cached_len + 1 + req.num_inflight_drafts + self.overlap
                held = len(req.page_table) * page_size
                if reserve + draft_len > held and (
                    short_of_pages or not self.kv.grow(req.page_table, reserve + draft_len)
                ):
                    # no page for the lookahead: first drop the drafts that could never be
                    # committed, then keep what the pages it holds cover
                    draft_len = min(draft_len, max(0, req.num_left - 1))
                    if reserve + draft_len > held and (
                        short_of_pages or not self.kv.grow(req.page_table, reserve + draft_len)
                    ):
                        draft_len = max(0, held - reserve)
                        page_cap = min(page_cap, draft_len)
            clamped.append(draft_len)
        # The one place a step's draft lengths are set (the overlap loop only shrinks them
        # to the context once it has waited for the step in flight: overlap_wait.settle).
        # Short of pages: one draft length for all, as the policy chose.
        for s, draft_len in zip(decoding, clamped):
            s.draft_len = min(draft_len, page_cap)

    def _reclaim_lookahead(self, batch: list[ScheduledRequest]) -> bool:
        """Pages running requests hold past their need go back: speculation's lookahead
        for drafts not in flight, drafts past max_tokens. A request keeps its committed
        tokens, this step's (those scheduled, else one), the drafts in flight and, under
        overlap, the next step's slot (`_draft`'s reserve without new drafts). Before a
        preemption or a waiting request left without pages: else a request that fits
        was preempted while another held pages no token of its could ever fill. True if
        any page went back."""
        scheduled = {id(s.request): s.num_tokens for s in batch}
        freed, overlap = 0, self.overlap
        for r in self.running:
            keep = r.cached_len + scheduled.get(id(r), 1) + r.num_inflight_drafts + overlap
            if keep < len(r.page_table) * self.kv.page_size:
                freed += self.kv.shrink(r.page_table, keep)
        return freed > 0

    @property
    def occupancy(self) -> float:
        """The share of the server's room the running requests take: of its sequence slots,
        or of the requests of the finished ones' mean length its KV cache holds, whichever
        is fuller (1.0 until a request finished)."""
        footprint = self._prompt_mean + self._output_mean
        if footprint <= 0:
            return 1.0
        room = min(self.max_num_seqs, self.kv.capacity_tokens / footprint)
        return min(1.0, len(self.running) / max(1.0, room))

    @property
    def prefill_per_token(self) -> float:
        """Prompt tokens per generated token of the requests finished lately (EWMA)."""
        return self._prompt_mean / self._output_mean if self._output_mean > 0 else 0.0

    def _release(self, req: Request) -> None:
        if self.prefix is not None:
            self.prefix.publish(req)  # its last full pages stay for later requests
        self.kv.release(req.page_table)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.counts.add(req, -1)
        self._release(req)
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
            self.counts.add(req, -1)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = RequestStatus.FINISHED
        generated = len(req.output_token_ids)
        if generated and req.finish_reason != "abort":
            w = self.RATIO_WEIGHT if self._output_mean else 1.0
            self._prompt_mean += w * (len(req.prompt_token_ids) - self._prompt_mean)
            self._output_mean += w * (generated - self._output_mean)


def _prefill_last(s: ScheduledRequest) -> bool:
    return not s.decoding
