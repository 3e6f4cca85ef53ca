"""What one step of the target reads (`StepInput`, packed by ModelRunner.prepare) and how its
sampled requests draw their tokens (`SamplePlan`, read once from it by
ModelRunner.sample_async)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.core.batch import ScheduledRequest
from specserve.layers.attention import AttentionMetadata
from specserve.runtime.logit_shaping import shapes_step


@dataclass
class StepInput:
    """Everything the forward pass of one step reads, on the device."""

    input_ids: torch.Tensor  # [T]
    meta: AttentionMetadata
    first_rows: list[int]  # first packed row of each scheduled request
    sampled: list[ScheduledRequest]  # requests that draw tokens this step
    sample_rows: list[int]  # their logit rows: last committed token, then each draft
    # [R] per sampled request: how far the step in flight moved it on the device (its
    # accept length: the host packed it as if that step accepted nothing); None: nowhere.
    sample_shift: torch.Tensor | None = None
    grammar_drafts: tuple | None = None  # runtime/grammar.py: PackedDrafts, at pack time
    grammar_pending: tuple | None = None  # runtime/grammar.py: masks sent to its workers
    # ms the host waited for the device while sampling (grammar masks: their drafts' copy);
    # the step loop counts them as waits, not as sampling
    sample_wait_ms: float = 0.0


@dataclass
class SamplePlan:
    """How a step's sampled requests draw their tokens, read once from the step."""

    reqs: list  # the sampled requests
    draft_lens: list[int]  # drafts each sampled request carries (`ScheduledRequest.drafted`)
    max_draft_len: int
    greedy: bool  # every sampled request decodes greedily
    all_rows: bool  # the sampled rows are every row of the step's hidden states, in order
    fp32: bool  # sampling or logprobs read fp32 logits (greedy argmaxes need none)
    uniform: bool  # every request drafts max_draft_len
    want: list[int | None]  # the logprobs each request asked for
    # What the step's CUDA graph took from these hidden states (`ModelRunner.step_head`):
    # (hidden, logits, greedy tokens[, greedy accept lengths]); None when it took nothing
    # or a request's logits are changed first (its greedy tokens are not the graph's).
    head: tuple[torch.Tensor, ...] | None
    shaped: bool = False  # a request's logits are changed before the draw (logit_shaping.py)

    @classmethod
    def of(cls, step: StepInput, hidden: torch.Tensor, step_head) -> SamplePlan:
        reqs = [s.request for s in step.sampled]
        want = [r.params.logprobs for r in reqs]
        draft_lens = [s.drafted for s in step.sampled]
        max_draft_len = max(draft_lens)
        greedy = all(r.params.temperature == 0 for r in reqs)
        rows = step.sample_rows  # increasing: every row of `hidden` when it spans them all
        shaped = shapes_step(step.sampled)
        return cls(
            reqs=reqs,
            draft_lens=draft_lens,
            max_draft_len=max_draft_len,
            greedy=greedy,
            all_rows=len(rows) == hidden.shape[0] and rows[-1] == len(rows) - 1,
            fp32=not greedy or any(w is not None for w in want),
            uniform=all(d == max_draft_len for d in draft_lens),
            want=want,
            head=step_head if step_head and step_head[0] is hidden and not shaped else None,
            shaped=shaped,
        )

    @property
    def max_q_len(self) -> int:
        return self.max_draft_len + 1

    @property
    def dense(self) -> bool:
        """A decode/verify step where every row samples and every request drafts K: logits
        and drafts are views of the step's rows, and a greedy one uploads nothing."""
        return self.uniform and self.all_rows and self.max_draft_len > 0
