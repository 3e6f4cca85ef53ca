"""Request.append_token decides finishes from precomputed limits: the same decisions as the
rule it replaces (eos unless ignore_eos, stop token ids, stop strings, max_tokens, the
context limit counting only processed tokens), and the length properties agree with the
token lists they summarize."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.core.request import Request
from specserve.core.sampling_params import SamplingParams

EOS = 2


def expected_finish(req: Request, token: int, stopped_by_text: bool) -> str | None:
    """The rule, written out plainly."""
    p = req.params
    if (not p.ignore_eos and token in req.eos_token_ids) or token in p.stop_token_ids:
        return "stop"
    if stopped_by_text:
        return "stop"
    processed = len(req.prompt_token_ids) + len(req.output_token_ids)
    if len(req.output_token_ids) >= p.max_tokens or processed >= req.max_len:
        return "length"
    return None


class FakeDetokenizer:
    """Stops when it sees token 7 (a stop string completed by that token)."""

    def __init__(self):
        self.stopped = False
        self.text = ""

    def push(self, token: int) -> None:
        self.stopped = self.stopped or token == 7

    def finish(self) -> None:  # (nothing held back)
        pass


@given(
    prompt_len=st.integers(1, 20),
    max_tokens=st.integers(1, 30),
    max_len=st.integers(21, 60),
    ignore_eos=st.booleans(),
    stop_ids=st.lists(st.integers(0, 9), max_size=2),
    tokens=st.lists(st.integers(0, 9), min_size=1, max_size=40),
    detokenize=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_finish_reasons(prompt_len, max_tokens, max_len, ignore_eos, stop_ids, tokens, detokenize):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_ids)
    req = Request(
        "r",
        list(range(prompt_len)),
        params,
        arrival=0,
        seed=0,
        max_len=max_len,
        eos_token_ids=frozenset([EOS]),
        detokenizer=FakeDetokenizer() if detokenize else None,
    )
    for token in tokens:
        req.append_token(token)
        assert req.finish_reason == expected_finish(req, token, detokenize and token == 7)
        if req.finish_reason is not None:
            break


@given(
    prompt_len=st.integers(1, 20),
    outputs=st.integers(0, 10),
    unprocessed=st.integers(0, 4),
    inflight=st.integers(0, 2),
    cached=st.integers(0, 30),
)
def test_length_properties(prompt_len, outputs, unprocessed, inflight, cached):
    params = SamplingParams(max_tokens=25)
    req = Request(
        "r",
        list(range(prompt_len)),
        params,
        arrival=0,
        seed=0,
        max_len=40,
        eos_token_ids=frozenset(),
    )
    req.output_token_ids = list(range(outputs))
    req.unprocessed_token_ids = list(range(unprocessed))
    req.num_inflight, req.cached_len = inflight, cached
    generated = outputs + unprocessed + inflight
    assert req.num_generated == generated
    assert req.committed_len == prompt_len + generated
    assert req.num_left == min(25 - generated, 40 - prompt_len - generated)
    assert req.num_uncached == prompt_len + generated - cached
    known = list(range(prompt_len)) + list(range(outputs)) + list(range(unprocessed))
    for start in range(0, len(known) + 1, 3):
        assert req.token_ids(start, start + 2) == known[start : start + 2]
