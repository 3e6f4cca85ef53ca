"""Self-distillation: the target writes the replies the head learns from; the draft
vocabulary is the most frequent target tokens of those replies."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch
from tqdm import tqdm

from specserve.sampling_params import SamplingParams
from specserve.train.prompts import PromptItem


@dataclass
class Sample:
    """A prompt and the target's own reply as token ids (prompt first)."""

    key: str
    token_ids: list[int]
    prompt_len: int

    @property
    def response_len(self) -> int:
        return len(self.token_ids) - self.prompt_len


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation, ready for the assistant's reply."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def generate_samples(
    engine,
    prompts: list[PromptItem],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    max_prompt_tokens: int,
    time_budget_s: float | None = None,
    progress: bool = True,
    desc: str = "Generating",
) -> list[Sample]:
    """Run the target (a specserve LLMEngine) over the prompts with continuous batching.

    Greedy when temperature is 0, else sampled with seed + prompt index, so output does not
    depend on batching. With `time_budget_s`, no new prompt starts after the budget: queued
    ones are dropped, those already decoding finish. Prompts longer than `max_prompt_tokens`
    are skipped. Returns samples in prompt order."""
    tok = engine.tokenizer
    window = 2 * engine.config.max_num_seqs  # queued requests keep every batch slot busy
    pending = iter(enumerate(prompts))
    running: dict[str, tuple[int, PromptItem, list[int]]] = {}
    done: dict[int, Sample] = {}
    start = time.monotonic()
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress)
    new_tokens = 0
    exhausted = False
    started: set[str] = set()
    while True:
        while not exhausted and len(running) < window:
            if time_budget_s is not None and time.monotonic() - start > time_budget_s:
                exhausted = True
                for rid in [r for r in running if r not in started]:  # still queued: drop
                    engine.abort_request(rid)
                    del running[rid]
                break
            nxt = next(pending, None)
            if nxt is None:
                exhausted = True
                break
            index, item = nxt
            ids = chat_ids(tok, item.messages)
            if len(ids) > max_prompt_tokens:
                bar.update(1)
                continue
            params = SamplingParams(
                max_tokens=max_new_tokens,
                temperature=temperature,
                seed=None if temperature == 0 else seed + index,
            )
            running[engine.add_request(ids, params)] = (index, item, ids)
        if not running:
            break
        for out in engine.step():
            started.add(out.request_id)
            if out.finished and out.request_id in running:
                index, item, ids = running.pop(out.request_id)
                done[index] = Sample(item.key, ids + list(out.token_ids), len(ids))
                new_tokens += len(out.token_ids)
                bar.update(1)
                bar.set_postfix(tok_s=f"{new_tokens / (time.monotonic() - start):.0f}")
    bar.close()
    return [done[i] for i in sorted(done)]


def build_draft_vocab(
    samples: list[Sample], vocab_size: int, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(d2t, t2d, coverage): the `draft_vocab_size` most frequent reply tokens (ties and any
    shortfall filled by prompt-token frequency, then by lowest id), sorted by id.

    coverage is the fraction of reply tokens that the draft vocabulary holds."""
    replies = Counter(t for s in samples for t in s.token_ids[s.prompt_len :])
    prompts = Counter(t for s in samples for t in s.token_ids[: s.prompt_len])
    ranked = sorted(range(vocab_size), key=lambda t: (-replies[t], -prompts[t], t))
    chosen = torch.tensor(sorted(ranked[:draft_vocab_size]), dtype=torch.int64)
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d, vocab_coverage(samples, t2d)


def vocab_coverage(samples: list[Sample], t2d: torch.Tensor) -> float:
    """The fraction of reply tokens inside the draft vocabulary `t2d` marks."""
    replies = Counter(t for s in samples for t in s.token_ids[s.prompt_len :])
    covered = sum(c for t, c in replies.items() if t2d[t])
    return covered / max(sum(replies.values()), 1)
