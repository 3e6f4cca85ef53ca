"""The offline API: LLM(model=...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields

from tqdm import tqdm

from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine, RequestOutput
from specserve.engine.request import SpecStats
from specserve.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    """One finished generation."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    spec_stats: SpecStats | None = None  # drafted / accepted counts when speculating


class LLM:
    """Generate text with a local model; keyword arguments are EngineConfig fields."""

    def __init__(self, model: str | None = None, progress: bool = False, **engine_kwargs):
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_kwargs) - known
        if unknown:
            raise TypeError(f"unknown LLM option(s) {sorted(unknown)}; known: {sorted(known)}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs), progress=progress)
        self.tokenizer = self.engine.tokenizer

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation, ready for the assistant's reply."""
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion, batched together; outputs keep prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [_completion(finished[rid]) for rid in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one prompt as they are decoded."""
        rid = self.engine.add_request(prompt, params or SamplingParams())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        if out.delta_text:
                            yield out.delta_text
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)


def _completion(out: RequestOutput) -> CompletionOutput:
    return CompletionOutput(
        request_id=out.request_id,
        prompt=out.prompt,
        prompt_token_ids=out.prompt_token_ids,
        text=out.text,
        token_ids=out.token_ids,
        finish_reason=out.finish_reason or "abort",
        spec_stats=out.spec_stats,
    )
