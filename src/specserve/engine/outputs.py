"""What a step hands back: each request's output, and the sink the step loop hands processed
requests to (a finished request leaves the engine there)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.core.request import Request, SpecStats
from specserve.engine.scheduler import Scheduler
from specserve.engine.step_plan import PlanPublisher
from specserve.speculative.speculator import Speculator


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step: cumulative text and tokens plus this step's delta."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]  # the request's own list (grows while it runs; do not mutate)
    delta_text: str
    finished: bool
    finish_reason: str | None
    num_new_tokens: int = 0  # tokens committed this step: token_ids[-num_new_tokens:]
    new_logprobs: list = field(default_factory=list)  # their TokenLogprobs, if asked for
    spec_stats: SpecStats | None = None  # present when the engine speculates
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    prompt_logprobs: list | None = None  # TokenLogprobs per prompt token, when asked for


class RequestSink:
    """Where the step loop hands each processed request: `finish` when it finished (its pages
    go back, its speculation estimates are dropped, the engine forgets it), then `output`."""

    def __init__(self, scheduler: Scheduler, requests: dict[str, Request], spec: Speculator | None):
        self.scheduler = scheduler
        self.requests = requests
        self.spec = spec
        self.plans: PlanPublisher | None = None  # rank 0 under tensor parallelism

    def finish(self, req: Request) -> None:
        """A request leaves: its pages go back, per-request speculation state is dropped
        (and the other ranks drop their mirrors of it)."""
        self.scheduler.finish(req)
        self.requests.pop(req.request_id, None)
        if req.grammar_state is not None:  # (a grammar worker's matcher goes too)
            req.grammar_state.release()
        if self.spec is not None:
            self.spec.acceptance.forget(req.request_id)
        if self.plans is not None:
            self.plans.gone(req)

    def output(self, req: Request, num_new: int) -> RequestOutput:
        """The request's state after this step, with the `num_new` tokens it committed."""
        detokenizer, finished = req.detokenizer, req.finished
        if detokenizer is not None:
            delta = detokenizer.pop_delta(finished)  # (first: a finished one flushes)
            text = detokenizer.text
        else:
            text = delta = ""
        return RequestOutput(  # positional, in field order: twice as fast as keywords
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            text,
            req.output_token_ids,  # token_ids: a live view, no per-step copy
            delta,
            finished,
            req.finish_reason,
            num_new,
            req.output_logprobs[-num_new:] if req.output_logprobs and num_new else [],
            req.spec if self.spec is not None else None,
            req.num_cached_prompt_tokens,
            req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
        )
