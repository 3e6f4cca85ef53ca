"""Per-request state: tokens, committed and cached lengths, pages, finish reason."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request as the engine tracks it.

    committed_len counts prompt plus generated tokens; cached_len counts the tokens whose
    K/V sit in the request's pages. A request is in prefill while cached_len < committed_len
    - 1 and decodes one token a step after that.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    seed: int
    max_len: int  # stop (finish "length") when committed_len reaches it
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer | None = None
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)  # TokenLogprobs per output token
    page_table: list[int] = field(default_factory=list)
    cached_len: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def committed_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncached(self) -> int:
        return self.committed_len - self.cached_len

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer else ""

    def append_token(self, token: int, logprobs=None) -> None:
        """Commit one sampled token and decide whether the request is done."""
        self.output_token_ids.append(token)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        p = self.params
        if not p.ignore_eos and token in self.eos_token_ids:
            self.finish_reason = "stop"
        elif token in p.stop_token_ids:
            self.finish_reason = "stop"
        if self.detokenizer is not None:
            self.detokenizer.push(token)
            if self.finish_reason is None and self.detokenizer.stopped:
                self.finish_reason = "stop"
        if self.finish_reason is None and (
            len(self.output_token_ids) >= p.max_tokens or self.committed_len >= self.max_len
        ):
            self.finish_reason = "length"
