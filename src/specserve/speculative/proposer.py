"""The proposer interface: drafters fill in draft tokens for the requests that speculate."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from specserve.core.batch import ScheduledRequest
from specserve.layers.sampler import (
    argmax_rows,
    build_sampling_tensors,
    filter_logits,
    gumbel_noise,
    sample,
)
from specserve.runtime.packing import Segment, to_device

DRAFT_STREAM = 1  # the noise of drafts drawn from a distribution (requests without a seed)


class Proposer(ABC):
    """Drafts tokens for requests with draft_len > 0.

    `propose` sets `item.drafts` (at most item.draft_len tokens; items with draft_len 0 are
    only brought up to date, see `ride_alongs`) and, where a request without a seed of
    its own samples and the drafter draws from a distribution, `item.draft_probs` [k, V]
    over the target vocabulary (runtime/verify.py: rejection sampling); or it leaves
    exactly draft_len drafts on the device (`item.device_drafts`: a [B, k] tensor and the
    item's row), which the runner reads there. A proposer for which
    `reads_inflight(items)` holds also takes `prev`, the step in flight (overlap
    scheduling): the items' newest tokens are then still on the device.
    `commit` runs after verification with the accepted draft count of every scheduled
    request (0 for prefill chunks) and, when `aux_layer_ids` is non-empty, the step's
    drafter `features` (from `features(aux)`, taken right after the step's forward; rows
    from `first_rows`).
    Draft KV lives in the request's own pages (same page table), written past the committed
    length: no page is allocated or freed inside a step.
    """

    aux_layer_ids: tuple[int, ...] = ()
    # Its state at position i reads the token at i + 1 (EAGLE-3's pairs): a cached page's
    # drafter entries hold only for the token that followed the page (core/prefix_cache.py).
    reads_next_token = False
    # Tokens one catch-up pass may carry; longer catch-ups are split (`bounded_passes`).
    max_pass_tokens = 2048
    needs_commit = True  # False: `commit` does nothing (the loop skips building its inputs)
    # Drafter passes run eagerly (kernel by kernel from Python, not a graph replay) and the
    # tokens they took: each pays the host for every launch, which a fast model feels.
    eager_passes = 0
    eager_tokens = 0

    def count_eager(self, num_tokens: int) -> None:
        self.eager_passes += 1
        self.eager_tokens += num_tokens

    @abstractmethod
    def propose(self, items: list[ScheduledRequest]) -> None: ...

    def reads_inflight(self, items: list[ScheduledRequest]) -> bool:
        """Whether `propose(items, prev)` can read the step in flight on the device."""
        return False

    def ride_alongs(self, reqs: list) -> list[bool]:
        """Which of the requests that do not draft this step should still bring the
        drafter up to date in it (bounded state while plain steps run with the drafter
        kept up); default: none."""
        return [False] * len(reqs)

    def catch_up_prefill(self, items: list[ScheduledRequest]) -> None:
        """After a step's forward: bring the drafter up to date on the tokens its prefill
        chunks (`items`) fed, so that a request's first drafting step does not carry its
        whole prompt; default: nothing (drafters that catch up when they draft)."""

    def step_timer(self) -> Callable[[int], None] | None:
        """A function running one synchronized draft step for a batch of n requests, to
        measure the drafter's cost; None when drafting costs no device time."""
        return None

    def features(self, aux: list[torch.Tensor], slots: torch.Tensor | None = None):
        """The drafter's inputs from a step's auxiliary hidden states (concatenated by
        default; `slots`: its tokens' KV slots), computed when the step is launched: graph
        outputs are reused later."""
        return torch.cat(aux, dim=-1) if aux else None

    def feature_writer(self) -> Callable[[list[torch.Tensor], torch.Tensor], None] | None:
        """A function (aux hidden states, their tokens' KV slots) -> None that keeps the
        drafter's inputs on the device by itself, with no host work, so the target's CUDA
        graphs run it inside each replay (graph steps then hand `features` no aux); None:
        the drafter takes them through `features`."""
        return None

    def commit(
        self,
        items: list[ScheduledRequest],
        accepted: list[int],
        features: torch.Tensor | None,
        first_rows: list[int],
    ) -> None:
        """Update drafter state after verification (default: nothing to do)."""


def draw_drafts(logits: torch.Tensor, items: list[ScheduledRequest], step: int):
    """Draft one token per item from drafter logits [R, V] (over the target vocabulary).

    Greedy requests take the argmax. Sampled ones draw from the filtered distribution: a
    request with its own seed with the noise the target draws that position with (stream 0:
    verification accepts a draft when it equals the target's draw, runtime/verify.py), one
    without with noise of its own (DRAFT_STREAM), its distribution kept for rejection
    sampling. Returns (tokens [R] on the device, probs [R, V] or None when no request
    keeps them: their rows are the ones to keep)."""
    reqs = [it.request for it in items]
    if all(r.params.temperature == 0 for r in reqs):
        return argmax_rows(logits), None
    st = build_sampling_tensors(
        [r.params for r in reqs],
        [r.seed for r in reqs],
        [r.committed_len + step for r in reqs],
        logits.device,
    )
    if all(r.params.seed is not None for r in reqs):
        return sample(logits.float(), st), None
    greedy = argmax_rows(logits)
    filtered = filter_logits(logits.float(), st)
    vocab = logits.shape[-1]
    seeded = torch.tensor([r.params.seed is not None for r in reqs], device=logits.device)
    noise = torch.where(
        seeded[:, None], gumbel_noise(st, vocab), gumbel_noise(st, vocab, DRAFT_STREAM)
    )
    drawn = argmax_rows(filtered + noise)
    return torch.where(st.temperature > 0, drawn, greedy), filtered.softmax(dim=-1)


def keeps_probs(item: ScheduledRequest) -> bool:
    """Whether a request's sampled drafts keep the drafter's distribution (no seed of its
    own: verified by rejection sampling)."""
    params = item.request.params
    return params.temperature > 0 and params.seed is None


def bounded_passes(segments: list[Segment], max_tokens: int) -> list[list[Segment]]:
    """Catch-up segments regrouped into passes of at most max_tokens tokens, in order; a
    segment that does not fit continues in the next pass (its pieces run one pass after
    another, like prefill chunks). After a long stretch without drafting, every running
    request catches up at once (512 requests x 128 tokens is 65k tokens, gigabytes of
    activations that sizing the KV cache for one step's token budget never reserved)."""
    passes, current, used = [], [], 0
    for seg in segments:
        start, tokens = seg.start, list(seg.token_ids)
        while tokens:
            if used == max_tokens:
                passes.append(current)
                current, used = [], 0
            piece = tokens[: max_tokens - used]
            current.append(Segment(seg.page_table, start, piece))
            start, tokens, used = start + len(piece), tokens[len(piece) :], used + len(piece)
    if current:
        passes.append(current)
    return passes


def chain_draft(items: list[ScheduledRequest], first, step_fn, draw=draw_drafts) -> None:
    """Chain drafting shared by the drafters: `first` are the drafter's logits for every
    item's first draft; `step_fn(active, tokens, positions, index)` feeds each still-drafting
    item's latest draft (a device tensor) back and returns the next logits; `draw(logits,
    active, step)` turns logits into (target-vocabulary tokens, probs or None), by default
    `draw_drafts` over target-vocabulary logits. Draft tokens stay on the device until the
    chain ends: one host sync per step."""
    active, logits = items, first
    chain = []
    for step in range(max(it.draft_len for it in items)):
        tokens, probs = draw(logits, active, step)
        chain.append((active, tokens, probs))
        keep = [i for i, it in enumerate(active) if it.draft_len > step + 1]
        if not keep:
            break
        index = to_device(keep, tokens.device)
        active = [active[i] for i in keep]
        positions = [it.request.committed_len - 1 + step for it in active]
        logits = step_fn(active, tokens[index], positions, index)
    for active, tokens, probs in chain:
        for i, (it, tok) in enumerate(zip(active, tokens.tolist())):
            it.drafts.append(tok)
            if probs is not None and keeps_probs(it):
                row = probs[i : i + 1]
                it.draft_probs = row if it.draft_probs is None else torch.cat([it.draft_probs, row])
