"""logit_bias and min_tokens: greedy output equals transformers' generate with the same
biases (`sequence_bias`) and `min_new_tokens`, computed from the raw logits of a model no one
here wrote; with speculation (a draft model, n-gram, EAGLE-3; fixed and random K; the
overlapped loop) it equals plain decoding's with them; sampling draws from the changed
distribution too."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specserve import LLM, SamplingParams
from tests.support.overlap_cases import SPECULATION_PATHS, generate, make_models, prompts_for

EOS = 2  # the tiny models' <|im_end|>


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


class _OpenAIPenalties:
    """OpenAI's presence and frequency penalties over the generated tokens, written from its
    documented formula on transformers' raw logits (a LogitsProcessor)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        for row, ids in zip(scores, input_ids):
            counts = torch.bincount(ids[self.prompt_len :], minlength=scores.shape[-1]).float()
            row -= self.frequency * counts + self.presence * (counts > 0).float()
        return scores


def _hf_greedy(folder: str, prompts, max_new: int, rules: dict) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    bias = rules.get("logit_bias") or {}
    out = []
    for prompt in prompts:
        custom = LogitsProcessorList()
        if rules.get("presence_penalty") or rules.get("frequency_penalty"):
            custom.append(
                _OpenAIPenalties(
                    len(prompt),
                    rules.get("presence_penalty", 0.0),
                    rules.get("frequency_penalty", 0.0),
                )
            )
        ids = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new,
            do_sample=False,
            sequence_bias={(t,): b for t, b in bias.items()} or None,
            min_new_tokens=rules.get("min_tokens", 0),
            repetition_penalty=rules.get("repetition_penalty", 1.0),
            logits_processor=custom,
            eos_token_id=EOS,
            pad_token_id=0,
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out


CASES = {
    # EOS all but certain: min_tokens decides where the output ends
    "eos forced after min_tokens": dict(logit_bias={EOS: 40.0}, min_tokens=5),
    # the likeliest tokens pushed around, EOS left alone
    "biases": dict(logit_bias={40: 4.0, 41: 4.0, 100: -100.0, 7: 2.5}),
    "both": dict(logit_bias={EOS: 6.0, 60: 3.0}, min_tokens=3),
    "repetition": dict(repetition_penalty=1.8),
    "presence and frequency": dict(presence_penalty=1.5, frequency_penalty=0.7),
    "everything": dict(
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.4,
        logit_bias={60: 2.0},
        min_tokens=3,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_transformers(models, case):
    rules = CASES[case]
    prompts = prompts_for()[:5]
    params = SamplingParams(max_tokens=12, temperature=0.0, **rules)
    outs = LLM(models["target"]).generate(prompts, params)
    expected = _hf_greedy(models["target"], prompts, 12, rules)
    assert [o.token_ids for o in outs] == expected
    if case == "eos forced after min_tokens":
        assert all(len(o.token_ids) == 6 and o.token_ids[-1] == EOS for o in outs)
        assert all(o.finish_reason == "stop" for o in outs)
    if case in ("repetition", "presence and frequency"):  # the penalties changed something
        plain = LLM(models["target"]).generate(prompts, SamplingParams(max_tokens=12))
        assert [o.token_ids for o in outs] != [o.token_ids for o in plain]


def _params(case: str) -> SamplingParams:
    return SamplingParams(max_tokens=14, temperature=0.0, **CASES[case])


def _batch(penalized: bool) -> tuple[list, list, list[str]]:
    """Every prompt under each case with (or each without) penalties, in one batch: prompts,
    parameters, case names. (Apart: a penalized row makes the overlapped loop wait for every
    step in flight, which would hide the others' steps built on it.)"""
    names = [c for c in CASES if _params(c).penalized == penalized for _ in prompts_for()]
    return prompts_for() * (len(names) // len(prompts_for())), list(map(_params, names)), names


@pytest.fixture(scope="module")
def plain(models):
    """Plain decoding's outputs of both batches (the synchronous loop)."""
    return {p: generate(models, *_batch(p)[:2], "off")[1] for p in (False, True)}


@pytest.mark.parametrize(("drafter", "overlap", "random_k"), SPECULATION_PATHS)
def test_speculation_keeps_plain_decodings_output(models, plain, drafter, overlap, random_k):
    for penalized in (False, True):
        prompts, params, names = _batch(penalized)
        llm, outs = generate(models, prompts, params, overlap, drafter, random_k=random_k)
        expected = plain[penalized]
        assert outs == expected, sorted({n for n, a, b in zip(names, outs, expected) if a != b})
        waits = llm.engine.stats()["loop_wait_reasons"]
        if overlap == "on" and drafter == "eagle3" and not random_k and not penalized:
            # an EAGLE-3 step builds on the step in flight, and reads its tokens before
            # sampling where min_tokens hangs on that step's count
            assert waits.get("min_tokens_before_sampling", 0) > 0
        if overlap == "on" and drafter == "eagle3" and not random_k and penalized:
            # every row's penalties count prev's tokens, read before sampling
            assert waits.get("penalties_before_sampling", 0) > 0


def test_sampling_draws_from_the_changed_distribution(models):
    """Sampled, plain and speculative: a token biased by +100 is drawn every time, EOS
    never before min_tokens though biased towards."""
    prompts = prompts_for()[:4]
    params = SamplingParams(
        max_tokens=8, temperature=1.0, seed=5, logit_bias={77: 100.0}, ignore_eos=True
    )
    for drafter in (None, "random"):
        _, outs = generate(models, prompts, params, "off", drafter)
        assert all(tokens == [77] * 8 for tokens, _, _ in outs)
    params = SamplingParams(
        max_tokens=8, temperature=1.0, seed=5, logit_bias={EOS: 100.0}, min_tokens=4
    )
    for drafter in (None, "random"):
        _, outs = generate(models, prompts, params, "off", drafter)
        for tokens, _, reason in outs:
            assert len(tokens) == 5 and tokens[-1] == EOS and EOS not in tokens[:4]
            assert reason == "stop"


class _DeviceReads(TorchFunctionMode):
    """Records the calls that would make the host wait for the device on a GPU: a list
    copied straight to the device (from pageable memory: after the forward in flight), a
    tensor read back, an output sized by the data (bincount, nonzero)."""

    WAITS = {torch.bincount, torch.nonzero, torch.Tensor.nonzero, torch.Tensor.bincount}
    WAITS |= {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        copied = func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None
        if copied or func in self.WAITS:
            self.seen.append(getattr(func, "__name__", func))
        return func(*args, **kwargs)


def test_changes_are_made_without_waiting_for_the_device(models, monkeypatch):
    """Penalties, biases and min_tokens, on plain and draft rows, reach the device through
    pinned copies and read nothing back: on a GPU each of those would wait for the step's
    forward, queued before the changes so that they are made while it runs (bincount sizes
    its output on the device; a list copied from pageable memory waits for the stream)."""
    from specserve.runtime import model_runner

    shape, seen, drafted = model_runner.shape_logits, [], []

    def watched(logits, step, grammars):
        drafted.append(any(s.drafted for s in step.sampled))
        with _DeviceReads() as mode:
            out = shape(logits, step, grammars)
        seen.extend(mode.seen)
        return out

    monkeypatch.setattr(model_runner, "shape_logits", watched)
    for drafter in (None, "copy"):
        generate(models, prompts_for(), _params("everything"), "on", drafter)
    assert any(drafted) and not all(drafted)  # plain steps and steps with draft rows
    assert seen == []


def test_bad_rules_are_refused(models):
    from specserve.core.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    llm = LLM(models["target"])
    with pytest.raises(InvalidRequestError, match=r"logit_bias token ids must lie in \[0, "):
        llm.engine.add_request([5, 6], SamplingParams(logit_bias={10**6: 1.0}))
