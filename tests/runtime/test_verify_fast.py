"""The runner's verify path (one upload, no logit gather for uniform drafts, greedy rows
without sampling tensors) draws exactly what the general verifier draws."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve.core.batch import ScheduledRequest
from specserve.core.sampling_params import SamplingParams
from specserve.layers.sampler import build_sampling_tensors
from specserve.runtime.model_runner import ModelRunner
from specserve.runtime.step_input import StepInput
from specserve.runtime.verify import verify, verify_greedy

VOCAB, HIDDEN = 64, 8


def _runner(weight):
    runner = ModelRunner.__new__(ModelRunner)
    runner.model = SimpleNamespace(compute_logits=lambda h, fp32=True: (h @ weight.T).float())
    runner.device = torch.device("cpu")
    runner.step_head = None  # no CUDA graph took the logits
    return runner


def _step(draft_lens, temps, gen, with_probs=False, logprobs=None, on_device=False):
    """A verify step's StepInput: each request's last token then its drafts in the input
    ids; `on_device`: greedy requests' drafts are left on the device (a [B, draft_len] tensor per
    draft length, as the EAGLE-3 chain leaves them), the others' on the host."""
    sampled, rows, row, ids, device = [], [], 0, [], {}
    for i, (draft_len, temp) in enumerate(zip(draft_lens, temps)):
        params = SamplingParams(
            temperature=temp,
            top_k=5 if i % 3 == 1 else 0,
            top_p=0.9 if i % 3 == 2 else 1.0,
            seed=i,
            max_tokens=10,
            logprobs=logprobs,
        )
        req = SimpleNamespace(
            params=params,
            seed=1000 + i,
            committed_len=20 + i,
            shapes_logits=params.shapes_logits,
            penalized=params.penalized,
        )
        s = ScheduledRequest(req, 1, draft_len, decoding=True)
        drafts = torch.randint(0, VOCAB, (draft_len,), generator=gen).tolist()
        if on_device and temp == 0 and draft_len:
            device.setdefault(draft_len, []).append((s, drafts))
        else:
            s.drafts = drafts
        if with_probs and temp > 0 and draft_len:  # (rejection-sampled rows)
            s.draft_probs = torch.rand(draft_len, VOCAB, generator=gen).softmax(-1)
        s.expected_drafts = drafts  # what the reference verifies
        sampled.append(s)
        ids += [int(torch.randint(0, VOCAB, (1,), generator=gen))] + drafts
        rows += range(row, row + draft_len + 1)
        row += draft_len + 1
    for items in device.values():
        tokens = torch.tensor([d for _, d in items[::-1]])  # rows in another order
        for r, (s, _) in enumerate(items[::-1]):
            s.device_drafts = (tokens, r)
    step = StepInput(torch.tensor(ids), None, [], sampled, rows)
    return step, torch.randn(row, HIDDEN, generator=gen)


def _reference(runner, step, hidden, simulate_rate):
    """The general path: logits gathered into [R, K+1, V], every sampling tensor built."""
    sampled = step.sampled
    logits = runner.model.compute_logits(hidden[torch.tensor(step.sample_rows)])
    max_draft_len = max(len(s.expected_drafts) for s in sampled)
    index, drafts, offset = [], [], 0
    for s in sampled:
        draft_len = len(s.expected_drafts)
        index += [offset + min(j, draft_len) for j in range(max_draft_len + 1)]
        drafts += s.expected_drafts + [0] * (max_draft_len - draft_len)
        offset += draft_len + 1
    padded = logits[torch.tensor(index)].view(len(sampled), max_draft_len + 1, -1)
    draft_t = torch.tensor(drafts, dtype=torch.int64).view(len(sampled), max_draft_len)
    reqs = [s.request for s in sampled]
    st = build_sampling_tensors(
        [r.params for r in reqs],
        [r.seed for r in reqs],
        [r.committed_len for r in reqs],
        torch.device("cpu"),
    )
    probs = None
    if any(s.draft_probs is not None for s in sampled):
        probs = torch.zeros(len(sampled), max_draft_len, logits.shape[-1])
        for i, s in enumerate(sampled):
            if s.draft_probs is not None:
                probs[i, : len(s.expected_drafts)] = s.draft_probs
    draft_lens = torch.tensor([len(s.expected_drafts) for s in sampled])
    simulated = simulate_rate if max_draft_len else None
    res = verify(padded, draft_t, draft_lens, st, probs, simulated)
    accept = res.accept_len.tolist()
    return [row[: a + 1] for row, a in zip(res.tokens.tolist(), accept)]


@pytest.mark.parametrize("draft_lens", [[3] * 6, [3, 0, 1, 3, 2, 0], [2], [0, 0, 0]])
@pytest.mark.parametrize("temp", ["greedy", "sampled", "mixed"])
@pytest.mark.parametrize("simulate_rate", [None, 0.7])
@pytest.mark.parametrize("with_probs, on_device", [(False, False), (True, False), (False, True)])
def test_runner_verify_matches_general_verifier(
    draft_lens, temp, simulate_rate, with_probs, on_device
):
    gen = torch.Generator().manual_seed(len(draft_lens) * 7 + int(with_probs))
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 3
    temps = {
        "greedy": [0.0] * len(draft_lens),
        "sampled": [1.0] * len(draft_lens),
        "mixed": [0.0, 0.8] * len(draft_lens),
    }[temp][: len(draft_lens)]
    runner = _runner(weight)
    for trial in range(5):
        step, hidden = _step(draft_lens, temps, gen, with_probs, on_device=on_device)
        result = runner.sample_async(step, hidden, simulate_rate).result()
        assert result.tokens == _reference(runner, step, hidden, simulate_rate), trial
        if any(s.device_drafts is not None for s in step.sampled):  # they come back
            assert [d[: len(s.expected_drafts)] for d, s in zip(result.drafts, step.sampled)] == [
                s.expected_drafts for s in step.sampled
            ]


def test_greedy_drafts_equal_to_argmax_are_all_accepted():
    logits = torch.randn(4, 4, VOCAB)
    drafts = logits.argmax(-1)[:, :3]
    res = verify_greedy(logits, drafts, torch.tensor([3, 2, 1, 0]))
    assert res.accept_len.tolist() == [3, 2, 1, 0]
    drafts[0, 1] = (drafts[0, 1] + 1) % VOCAB
    assert verify_greedy(logits, drafts, torch.full((4,), 3)).accept_len[0].item() == 1


def test_logprobs_rows_follow_the_committed_tokens():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen)
    runner = _runner(weight)
    step, hidden = _step([3, 1, 0], [0.0, 0.0, 0.0], gen, logprobs=2)
    result = runner.sample_async(step, hidden).result()
    logits = runner.model.compute_logits(hidden).log_softmax(-1)
    row = 0
    for s, tokens, lps in zip(step.sampled, result.tokens, result.logprobs):
        for j, (token, lp) in enumerate(zip(tokens, lps)):
            assert lp.logprob == pytest.approx(logits[row + j, token].item(), abs=1e-5)
        row += len(s.expected_drafts) + 1


def test_greedy_logits_without_fp32_copy_give_the_same_ids():
    """compute_logits(fp32=False), taken by greedy rows without logprobs: the logits in the
    model's dtype, whose argmax is the fp32 logits' argmax (the conversion is exact)."""
    from tests.support.model_cases import tiny_config, tiny_model

    model = tiny_model(tiny_config(), torch.bfloat16, "cpu")
    hidden = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    hidden = hidden.to(torch.bfloat16)
    raw, full = model.compute_logits(hidden, fp32=False), model.compute_logits(hidden)
    assert raw.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert torch.equal(raw.float(), full) and torch.equal(raw.argmax(-1), full.argmax(-1))
