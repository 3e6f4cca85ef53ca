"""The Python API: `LLM.chat` is the chat template plus `generate`; `CompletionOutput`
carries the engine's logprobs when asked; defaults and start-up progress as documented."""

from __future__ import annotations

import re

import pytest

from specserve import LLM, InvalidRequestError, SamplingParams
from tests.support.tiny_models import CHAT_TEMPLATE

CONVERSATIONS = [
    [{"role": "user", "content": "The quick brown fox"}],
    [
        {"role": "system", "content": "Speculative decoding"},
        {"role": "user", "content": "Paged attention stores keys"},
    ],
]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama))


def test_chat_is_the_chat_template_then_generate(llm):
    one = llm.chat(CONVERSATIONS[0], GREEDY)
    both = llm.chat(CONVERSATIONS, GREEDY)
    assert len(one) == 1 and len(both) == 2
    for conversation, out in zip(CONVERSATIONS, both):
        text = (
            "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation)
            + "<|im_start|>assistant\n"
        )  # CHAT_TEMPLATE
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        assert llm.apply_chat_template(conversation) == ids
        assert out.prompt_token_ids == ids
        ref = llm.generate([ids], GREEDY)[0]
        assert (out.token_ids, out.text) == (ref.token_ids, ref.text)
    assert one[0].token_ids == both[0].token_ids
    assert "<|im_start|>" in CHAT_TEMPLATE


def test_generate_sends_text_without_the_chat_template(llm):
    out = llm.generate("The quick brown fox", GREEDY)[0]
    assert out.prompt == "The quick brown fox"
    assert out.prompt_token_ids == llm.tokenizer.encode("The quick brown fox")


def test_chat_without_a_template_says_what_to_do(llm):
    template, llm.tokenizer.chat_template = llm.tokenizer.chat_template, None
    try:
        with pytest.raises(InvalidRequestError, match="no chat template.*generate") as err:
            llm.chat(CONVERSATIONS[0])
        assert err.value.field == "messages"
    finally:
        llm.tokenizer.chat_template = template


def _engine_logprobs(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    """Each request's TokenLogprobs as the engine keeps them (Request.output_logprobs)."""
    engine = llm.engine
    rids = [engine.add_request(p, params) for p in prompts]
    requests = [engine.requests[rid] for rid in rids]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in requests], [r.output_logprobs for r in requests]


def test_logprobs_through_completion_output_equal_the_engines(llm):
    prompts = [llm.apply_chat_template(c) for c in CONVERSATIONS]
    params = SamplingParams(max_tokens=9, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params)
    tokens, logprobs = _engine_logprobs(llm, prompts, params)
    assert [o.token_ids for o in outs] == tokens
    assert [o.logprobs for o in outs] == logprobs
    for out in outs:
        assert len(out.logprobs) == len(out.token_ids) == 9
        for token, lp in zip(out.token_ids, out.logprobs):
            assert len(lp.top) == 3
            assert lp.top[0] == (token, lp.logprob)  # greedy: the likeliest token
    assert llm.generate(prompts, GREEDY)[0].logprobs is None  # not asked for


def test_logprobs_of_speculative_steps_cover_every_token(llm, tiny_llama):
    """A drafter that is always right (the target itself) commits several tokens a step;
    each keeps its own logprobs, as plain decoding computes them."""
    spec = LLM(
        str(tiny_llama),
        speculative_algorithm="draft",
        speculative_draft_model_path=str(tiny_llama),
        speculative_policy="fixed",
    )
    prompts = [llm.apply_chat_template(c) for c in CONVERSATIONS]
    params = SamplingParams(max_tokens=9, ignore_eos=True, logprobs=2)
    plain, drafted = llm.generate(prompts, params), spec.generate(prompts, params)
    for a, b in zip(plain, drafted):
        assert b.spec_stats.accepted > 0
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_sampling_defaults_are_greedy_with_128_tokens():
    params = SamplingParams()
    assert params.greedy and params.max_tokens == 128
    assert "greedy" in SamplingParams.__doc__ and "128" in SamplingParams.__doc__


def test_progress_reports_start_up_on_stderr(tiny_llama, capsys):
    LLM(str(tiny_llama), progress=True)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("specserve: ")]
    assert lines[0] == f"specserve: loading {tiny_llama.name} on cpu..."
    assert re.fullmatch(rf"specserve: loading {tiny_llama.name} on cpu: \d+\.\d s", lines[1])
    assert re.fullmatch(r"specserve: ready in \d+\.\d s", lines[-1])
    LLM(str(tiny_llama))
    assert capsys.readouterr().err == ""


def test_streams_and_generate_calls_share_the_engine(llm):
    """Outputs go to the call that waits for them: a stream whose request finished while a
    generate call drove the engine gives its whole text and ends (it spun forever on an
    idle engine), two streams read side by side give each its own whole text (each took
    the other's deltas), and a stream whose request was aborted ends."""
    prompts = ([5, 6, 7], [9, 10, 11, 12])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = [out.text for out in llm.generate(list(prompts), params)]
    stream = llm.stream(prompts[0], params)
    text = next(stream)
    assert llm.generate([prompts[1]], params)[0].text == expected[1]
    assert not llm.engine.has_unfinished()  # (the stream's request finished meanwhile)
    assert text + "".join(stream) == expected[0]
    streams = [llm.stream(prompts[0], params), llm.stream(prompts[1], params)]
    texts, live = ["", ""], [0, 1]
    while live:  # a delta from each in turn
        for i in list(live):
            delta = next(streams[i], None)
            if delta is None:
                live.remove(i)
            else:
                texts[i] += delta
    assert texts == expected
    stream = llm.stream(prompts[0], SamplingParams(max_tokens=64, ignore_eos=True))
    next(stream)
    (rid,) = llm._boxes
    llm.engine.abort_request(rid)
    list(stream)  # (ends)
    assert not llm._boxes and not llm.engine.has_unfinished()


def test_n_choices_fan_out_in_generate(llm):
    """n choices a prompt: n outputs in a row, seeded ones reproducible and distinct (the
    server's choice seeds); an engine request is one choice."""
    params = [
        SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3),
        SamplingParams(max_tokens=4, n=2),
    ]
    outs = llm.generate([[5, 6, 7], "The quick"], params)
    assert len(outs) == 5 and [len(o.token_ids) > 0 for o in outs] == [True] * 5
    again = llm.generate([[5, 6, 7]], params[0])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[:3]]
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1
    assert outs[3].text == outs[4].text  # (greedy)
    # a prompt's seeded choices never depend on where it stands in the batch
    later = llm.generate([[9, 9], "The quick", [5, 6, 7]], [params[1], params[1], params[0]])
    assert [o.token_ids for o in later[4:]] == [o.token_ids for o in outs[:3]]
    with pytest.raises(InvalidRequestError, match="one choice") as e:
        llm.engine.add_request([5, 6], SamplingParams(n=2))
    assert e.value.field == "n"


def test_generated_request_ids_never_take_a_callers(llm):
    engine = llm.engine
    upcoming = next(engine._ids) + 1  # (the next ids the engine would generate)
    taken = [engine.add_request([5, 6], GREEDY, request_id=f"req-{upcoming + i}") for i in range(4)]
    mine = engine.add_request([5, 6], GREEDY)
    assert mine not in taken
    for rid in [*taken, mine]:
        engine.abort_request(rid)


def test_a_prompt_larger_than_the_cache_is_named(tiny_llama):
    small = LLM(str(tiny_llama), page_size=1, num_kv_pages=17)
    with pytest.raises(InvalidRequestError, match="the prompt") as e:
        small.engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=1))
    assert e.value.field == "prompt"


def test_stop_strings_wait_for_min_tokens_and_stop_tokens_leave_no_text(llm):
    """As vLLM: a stop string ends the output only from min_tokens tokens on, and a token of
    stop_token_ids ends it without its text (it stays in token_ids)."""

    def run(**kw):
        kw = {"max_tokens": 24, "ignore_eos": True, **kw}
        return llm.generate([[5, 6, 7]], SamplingParams(**kw))[0]

    free = run()
    text = free.text
    k = next(
        i
        for i in range(1, len(text) - 1)
        if text[i : i + 2].isascii()
        and text[i : i + 2].isprintable()
        and text.find(text[i : i + 2]) == i
    )
    stopped = run(stop=[text[k : k + 2]])
    assert stopped.text == text[:k] and stopped.finish_reason == "stop"
    held = len(stopped.token_ids) + 3
    late = run(stop=[text[k : k + 2]], min_tokens=held)
    assert len(late.token_ids) >= held and late.text.startswith(text[: k + 2])
    token = free.token_ids[4]
    if token in free.token_ids[:4]:
        pytest.skip("the stop token occurs earlier")
    cut = run(stop_token_ids=[token])
    assert cut.token_ids == free.token_ids[:5] and cut.finish_reason == "stop"
    assert cut.text == run(max_tokens=4).text  # (without the stop token's text)


def test_an_engine_without_a_tokenizer_refuses_what_needs_text():
    """A prebuilt model without a tokenizer (the benchmarks'): stop strings were accepted
    and never applied, a stream yielded nothing; token ids of numpy's kinds are ids, a
    float or a bool is refused; booleans are no integers among the parameters."""
    import numpy as np
    import torch

    from specserve.core.config import EngineConfig
    from specserve.engine.engine import LLMEngine
    from tests.support.model_cases import tiny_config, tiny_model

    model = tiny_model(tiny_config(), torch.float32, "cpu")
    engine = LLMEngine(EngineConfig.from_flags(speculative_algorithm="none"), model=model)
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer, llm._boxes = engine, None, {}
    with pytest.raises(InvalidRequestError, match="stop strings need the model's tokenizer"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, stop=["x"]))
    with pytest.raises(InvalidRequestError, match="streaming text needs the model's tokenizer"):
        next(llm.stream([5, 6, 7]))
    ids = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].token_ids
    assert llm.generate([np.int64(5), np.int64(6), np.int64(7)])[0].token_ids[:4] == ids
    for bad in ([[1.0, 2.0]], [[True, 2]]):
        with pytest.raises(InvalidRequestError, match="prompt token ids must be integers"):
            llm.generate(bad, SamplingParams(max_tokens=4))
    for kw in (dict(logprobs=True), dict(n=True), dict(temperature="hot"), dict(top_p=None)):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**kw)
    assert engine.stats()["running"] == 0 and engine.kv.allocator.num_used == 0


def test_chat_takes_content_parts_and_the_templates_options(llm):
    """OpenAI-style text parts are their texts (a template rendered the list's repr), as the
    server takes them; add_generation_prompt and chat_template_kwargs reach the template;
    no conversation, or an image part, is a clear error."""
    plain = [{"role": "user", "content": "The quick brown fox"}]
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "The quick "},
                {"type": "text", "text": "brown fox"},
            ],
        }
    ]
    assert llm.apply_chat_template(parts) == llm.apply_chat_template(plain)
    assert llm.chat(parts, GREEDY)[0].token_ids == llm.chat(plain, GREEDY)[0].token_ids
    bare = llm.apply_chat_template(plain, add_generation_prompt=False)
    suffix = llm.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert bare + suffix == llm.apply_chat_template(plain)
    assert llm.apply_chat_template(plain, chat_template_kwargs={"unused": 1})
    with pytest.raises(InvalidRequestError, match="no conversation"):
        llm.chat([])
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(InvalidRequestError, match="only text content parts"):
        llm.chat(image)
