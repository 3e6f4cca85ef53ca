"""When the overlap loop waits for the step in flight (engine/step_loop.py), and the batch it
then settles on that step's tokens.

A step is built from the step in flight's results on the device in the common cases; it
waits for them on the host when its rows need their values or count there before it is
launched (`wait_reason`), or only before it samples (`sampling_reason`: penalties, grammar
masks and a pending min_tokens change its logits by the tokens before each row; the loop
reads the step in flight's tokens once this step's forward is queued, and makes the changes
while it runs).
Three such needs belong to requests, not to the step (penalties, a grammar, a pending
min_tokens), and a fourth, a row that may reach past the context after a speculative step,
is possible only for requests whose prompt and max_tokens come within two steps' drafts of
it; the scheduler counts the running requests of each kind (`RunningCounts`) so that a
step's rows are scanned for one only while such a request runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specserve.core.batch import ScheduledRequest
from specserve.core.request import NEVER, Request

if TYPE_CHECKING:
    from specserve.engine.launched_step import LaunchedStep
    from specserve.speculative.speculator import Speculator


@dataclass
class RunningCounts:
    """How many of the scheduler's running requests are penalized, grammar-constrained,
    ask for min_tokens or may reach past `max_model_len` in the context check
    (`near_context`, by `max_reach` with `max_drafts`): what may make a step wait for the
    step in flight's tokens whoever else is in it. The scheduler keeps them as requests join
    and leave `running` (admission, preemption, finish, abort) and raises `max_drafts` (the
    most drafts it has given a request in one step) before a step drafts more; a step's rows
    are a subset of the running requests, so a zero count means no row of the step has that
    need."""

    penalized: int = 0
    constrained: int = 0
    min_tokens: int = 0
    near_context: int = 0
    max_model_len: int = NEVER  # the context every row is held to (NEVER: none)
    max_drafts: int = 0

    def add(self, req: Request, n: int = 1) -> None:
        """Count `req` in (`n` = 1: it joined) or out (`n` = -1: it left)."""
        if req.penalized:
            self.penalized += n
        if req.constrained:
            self.constrained += n
        if req.params.min_tokens > 0:
            self.min_tokens += n
        if max_reach(req, self.max_drafts) > self.max_model_len:
            self.near_context += n

    def raise_max_drafts(self, max_drafts: int, running: list[Request]) -> None:
        """A step is about to give a request `max_drafts` drafts, more than any before:
        `running` recounted for the context (a few times in an engine's life)."""
        self.max_drafts = max_drafts
        limit = self.max_model_len
        self.near_context = sum(max_reach(r, max_drafts) > limit for r in running)

    @classmethod
    def of(cls, requests, max_model_len: int = NEVER, max_drafts: int = 0) -> RunningCounts:
        """The counts of `requests`, scanned afresh."""
        counts = cls(max_model_len=max_model_len, max_drafts=max_drafts)
        for req in requests:
            counts.add(req)
        return counts


def max_reach(req: Request, max_drafts: int) -> int:
    """The furthest the context check can find a row of `req` reaching (its committed
    length, plus the drafts of the step in flight, plus its own) while no step gives a
    request more than `max_drafts` drafts. A decoding row is scheduled only with a token
    left (committed_len <= final - 1, `final` the length at which max_tokens or max_len ends
    it; drafts past it are allowed) and its drafts end inside max_len (committed_len +
    draft_len <= max_len - 1, Scheduler._draft); a prefill row carries no drafts, has
    committed_len <= final and none of its request's tokens are in flight (a request that
    samples decodes in the next step, and a schedule that preempts admits nobody)."""
    prompt_len = len(req.prompt_token_ids)
    final = prompt_len + max(0, min(req.params.max_tokens, req.max_len - prompt_len))
    return max(final, min(final - 1 + max_drafts, req.max_len - 1) + max_drafts)


def wait_reason(
    prev: LaunchedStep,
    batch: list[ScheduledRequest],
    drafting: list[ScheduledRequest],
    counts: RunningCounts,
    spec: Speculator | None,
) -> str | None:
    """None when `batch` can be launched before prev's tokens reach the host, built on the
    device from prev's drawn tokens and accept lengths (runtime/inflight.py): when its
    drafter reads them there (EAGLE-3, greedy, one draft length) and, after a speculative
    step, every position it may reach lies within the context. Else why not: "sampled" (a
    drafting request samples), "mixed_draft_lens", "host_drafts" (the proposer drafts on
    the host) or "context_limit" (past `counts.max_model_len`). `counts`: the scheduler's running
    requests', of which `batch` is a subset; a zero count skips its scan of the batch."""
    if drafting and not spec.proposer.reads_inflight(drafting):
        if any(s.request.params.temperature > 0 for s in drafting):
            return "sampled"
        if len({s.draft_len for s in drafting}) > 1:
            return "mixed_draft_lens"
        return "host_drafts"
    if not prev.speculative:
        return None
    if not counts.near_context:
        return None  # no row can pass the context, whatever prev accepts
    limit = counts.max_model_len
    moved = {id(s.request): s.drafted for s in prev.step_input.sampled}
    if all(
        s.request.committed_len + moved.get(id(s.request), 0) + s.draft_len <= limit for s in batch
    ):
        return None
    return "context_limit"


def sampling_reason(
    prev: LaunchedStep, batch: list[ScheduledRequest], counts: RunningCounts
) -> str | None:
    """Why a step launched before prev's tokens reach the host must read them before it
    samples, or None: "penalties" (a request's penalties count every token before each
    row), "grammar" (a decoding request's masks follow every token before each row:
    runtime/grammar.py) or "min_tokens" (after a speculative step, a request whose EOS is
    still masked: which rows may end its output depends on prev's count;
    runtime/logit_shaping.py). Zero counts skip the scans, as in `wait_reason`."""
    if counts.penalized and any(s.request.penalized for s in batch):
        return "penalties"
    if counts.constrained and any(s.request.constrained and s.decoding for s in batch):
        return "grammar"
    if (
        prev.speculative
        and counts.min_tokens
        and any(s.request.params.min_tokens > s.request.num_generated for s in batch)
    ):
        return "min_tokens"
    return None


def settle(batch: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """After waiting for the previous step's tokens: requests they end leave the batch
    (max_tokens, the context, a stop or EOS token among them; stop strings need the
    detokenizer and are found when the tokens are processed), draft lengths shrink to what
    the context leaves (as the synchronous loop's: drafts may pass max_tokens, and seeded
    draws depend on the draft lengths)."""
    settled = []
    for s in batch:
        req = s.request
        if req.num_left > 0 and not _stop_token_in(req, req.unprocessed_token_ids):
            s.draft_len = min(s.draft_len, req.max_len - req.committed_len - 1)
            settled.append(s)
    return settled


def _stop_token_in(req: Request, tokens: list[int]) -> bool:
    """Whether committing `tokens` finishes the request at a stop token (or EOS)."""
    p = req.params
    return any(
        t in p.stop_token_ids or (not p.ignore_eos and t in req.eos_token_ids) for t in tokens
    )
