"""A step's drawn tokens on their way from the device to the host, without blocking.

The sampler (or verifier) leaves its tokens on the device; `SampledTokens` starts one
non-blocking copy of them (and of accept lengths and logprobs, when asked for) into pinned
host memory and records a CUDA event behind it. The host reads them with `result()`, which
waits for that event only: the engine can launch the next step first (overlap scheduling).
On the CPU the copies are plain copies and there is nothing to wait for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    """The chosen token's log-probability and the top alternatives as (id, logprob)."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class StepResult:
    """Per sampled request: new tokens (accepted drafts + one drawn), their logprobs, and
    the drafts verified (only when they were drawn on the device: the host had not seen
    them; padded to the step's longest)."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]
    drafts: list[list[int]] | None = None


def logprob_tensors(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    """On the device: each row's chosen-token logprob [N], and top-k (logprobs, ids) [N, k],
    under the model's raw distribution (before temperature and filters)."""
    logp = logits.log_softmax(dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    return chosen, top_lp, top_ids


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class SampledTokens:
    """Tokens drawn by one step for its sampled requests (in `StepInput.sampled` order).

    `tokens` [R, W] on the device (W: the step's max_q_len): request r's new tokens are
    tokens[r, :accept_len[r] + 1] (plain steps: W = 1 and accept lengths are all 0).
    `want_logprobs[r]` is the top-k count request r asked for (None: no logprobs); `lp_rows`
    maps each (r, j < W) with j <= its draft count to a row of the logprob tensors. `drafts`
    [R, K] (device drafts the host has not seen) come back too. `tokens` may be a view of
    the target graph's output (a greedy decode step's, or a greedy verify step's whose
    requests all draft K; runtime/cuda_graphs.py), valid until the next target replay: its
    readers (the host copy here, the next step's inputs and the drafter's catch-up) are all
    enqueued before that replay. (The accept lengths such a verify step takes from its graph
    are copied: the next step may read them after its replay.)
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        accept_len: torch.Tensor | None,
        want_logprobs: list[int | None],
        lp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        lp_rows: list[list[int]] | None = None,
        drafts: torch.Tensor | None = None,
    ):
        self.tokens = tokens
        self.accept_len = accept_len
        self.want_logprobs = want_logprobs
        self.lp_rows = lp_rows
        # Tokens, accept lengths and drafts (all int64) go to the host in one copy.
        parts = [tokens]
        if accept_len is not None:
            parts.append(accept_len[:, None])
        if drafts is not None:
            parts.append(drafts)
        self._host = _to_host(torch.cat(parts, dim=1) if len(parts) > 1 else tokens)
        self._lp_host = [_to_host(t) for t in lp] if lp is not None else None
        self._has_drafts = drafts is not None
        self._event = None
        if tokens.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        """The tokens on the host (waits for this step's copies, nothing later)."""
        if self._result is not None:
            return self._result
        if self._event is not None:
            self._event.synchronize()
        host = self._host.tolist()
        max_q_len = self.tokens.shape[1]
        if self.accept_len is None:  # one token a row
            rows = host if max_q_len == 1 and not self._has_drafts else [t[:1] for t in host]
        else:
            rows = [t[: t[max_q_len] + 1] for t in host]
        logprobs: list = [None] * len(rows)
        if self._lp_host is not None:
            chosen, top_lp, top_ids = (t.tolist() for t in self._lp_host)
            for r, (want, row) in enumerate(zip(self.want_logprobs, rows)):
                if want is None:
                    continue
                picked = self.lp_rows[r][: len(row)]
                logprobs[r] = [
                    TokenLogprobs(chosen[i], list(zip(top_ids[i][:want], top_lp[i][:want])))
                    for i in picked
                ]
        drafts = None
        if self._has_drafts:
            skip = max_q_len + (self.accept_len is not None)
            drafts = [t[skip:] for t in host]
        self._result = StepResult(rows, logprobs, drafts)
        return self._result
