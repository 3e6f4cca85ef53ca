"""The server through the official openai client: completions and chat, streaming or not,
n > 1, stop strings, seeds, usage, logprobs, and parity with the offline LLM."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from specserve import LLM, SamplingParams
from specserve.server.protocol import ChatCompletionResponse, CompletionResponse

PROMPTS = [
    "The quick brown fox",
    "Speculative decoding drafts tokens",
    "Héllo wörld, naïve café 你好",
    "Paged attention",
]
MODEL = "tinyllama"


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(str(tiny_llama))


def _stream_text(chunks) -> tuple[dict[int, str], dict[int, str | None]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for chunk in chunks:
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons


def test_models_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL, "tiny-alias"]
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert client.completions.create(model="tiny-alias", prompt="a", max_tokens=1).model == (
        "tiny-alias"
    )
    r = httpx.get(server.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_log_shows_the_engines_start_up(server):
    # the engine process logs as the HTTP process does: its start-up phases and their times
    log = server.log()
    assert re.search(r"INFO loading .+: \d+\.\d s", log), log
    assert re.search(r"INFO ready in \d+\.\d s", log), log


def test_greedy_equals_offline_generate(client, offline):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o.text for o in offline.generate(PROMPTS, params)]
    got = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    CompletionResponse.model_validate(got.model_dump())
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == expected
    assert got.usage.completion_tokens == 12 * len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):  # the concatenated stream equals the whole text
        chunks = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        texts, reasons = _stream_text(chunks)
        assert texts[0] == expected[i] and reasons[0] == "length"


def test_chat_stream_equals_whole_and_usage(client, offline, tiny_llama):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me about café 你好"},
    ]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    ChatCompletionResponse.model_validate(whole.model_dump())
    prompt_ids = offline.apply_chat_template(messages)
    offline_out = offline.generate(prompt_ids, SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert whole.choices[0].message.content == offline_out.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == len(offline_out.token_ids)
    assert whole.usage.total_tokens == len(prompt_ids) + len(offline_out.token_ids)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    texts, reasons = _stream_text(chunks)
    assert texts[0] == whole.choices[0].message.content
    assert reasons[0] == whole.choices[0].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.total_tokens == whole.usage.total_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens
    # the same prompt again: its whole pages were cached by the first request
    assert usage.prompt_tokens_details.cached_tokens == (len(prompt_ids) - 1) // 16 * 16
    assert all(c.usage is None for c in chunks[:-1])
    # the developer role is OpenAI's system role: rendered as system by a template that
    # does not name it
    developer = [{"role": "developer", "content": "Be brief."}, messages[1]]
    as_developer = client.chat.completions.create(
        model=MODEL, messages=developer, max_tokens=10, temperature=0
    )
    assert as_developer.usage.prompt_tokens == len(prompt_ids)
    assert as_developer.choices[0].message.content == whole.choices[0].message.content


def test_n_choices_and_seeds_reproduce(client):
    kw = dict(model=MODEL, prompt="The quick", max_tokens=16, temperature=1.0, n=3, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    ta = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(a.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert ta == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len(set(ta)) > 1, "choices of one request must use different seeds"
    single = client.completions.create(**{**kw, "n": 1})
    assert single.choices[0].text == ta[0]
    texts, _ = _stream_text(client.completions.create(**kw, stream=True))
    assert [texts[i] for i in range(3)] == ta
    chat = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        n=2,
        seed=7,
        temperature=1.0,
    )
    c1, c2 = client.chat.completions.create(**chat), client.chat.completions.create(**chat)
    assert [c.message.content for c in c1.choices] == [c.message.content for c in c2.choices]
    assert len(c1.choices) == 2 and c1.usage.completion_tokens <= 16


def test_stop_strings(client):
    base = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[1],
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = base.choices[0].text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip())
    cut = text[: text.find(stop)]
    for stream in (False, True):
        out = client.completions.create(
            model=MODEL,
            prompt=PROMPTS[1],
            max_tokens=24,
            temperature=0,
            stop=[stop, "\x00never"],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            texts, reasons = _stream_text(out)
            assert texts[0] == cut and reasons[0] == "stop"
        else:
            assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"


def test_completion_logprobs_shape(client):
    out = client.completions.create(
        model=MODEL,
        prompt="The quick",
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n == 6
    assert lp.text_offset == sorted(lp.text_offset)
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[tok] == pytest.approx(chosen)
        assert chosen <= 0 and chosen == pytest.approx(max(top.values()))  # greedy
    streamed = client.completions.create(
        model=MODEL,
        prompt="The quick",
        max_tokens=6,
        temperature=0,
        logprobs=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens = [t for c in streamed for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    assert tokens == lp.tokens
    # text_offset: where each token starts in the text, also when a stop string holds text
    # back, streamed or not (each offset as the run without the stop string had it)
    text = out.choices[0].text
    for tok, at in zip(lp.tokens, lp.text_offset):
        if not tok.startswith("bytes:") and at + len(tok) <= len(text):
            assert text[at : at + len(tok)] == tok
    # (a stop string at the first character past the second token not seen before it)
    at = next(a for a in range(lp.text_offset[2], len(text)) if text[a] not in text[:a])
    stop = text[at : at + 3]
    for stream in (False, True):
        cut = client.completions.create(
            model=MODEL, prompt="The quick", max_tokens=6, temperature=0, logprobs=3,
            stop=[stop], stream=stream,
        )  # fmt: skip
        parts = [ch.logprobs for c in (cut if stream else [cut]) for ch in c.choices if ch.logprobs]
        offsets = [x for part in parts for x in part.text_offset]
        assert len(offsets) >= 2 and offsets == lp.text_offset[: len(offsets)]


def test_chat_logprobs_shape(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert plain.choices[0].logprobs is None


def test_token_id_prompts_and_defaults(client, offline):
    ids = offline.engine.tokenize(PROMPTS[0])
    a = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    b = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(ids)
    # the legacy completions default of 16 tokens
    d = client.completions.create(prompt=PROMPTS[0], model=MODEL, extra_body={"ignore_eos": True})
    assert d.usage.completion_tokens == 16


def test_logit_bias_and_min_tokens_equal_offline_generate(client, offline):
    """logit_bias through the openai client (token ids as strings) and min_tokens (vLLM's
    extension, extra_body): the offline engine's output with the same rules."""
    bias = {40: 5.0, 41: 5.0, 2: 30.0}  # 2: EOS, all but certain once allowed
    params = SamplingParams(max_tokens=10, temperature=0.0, logit_bias=bias, min_tokens=4)
    expected = offline.generate(PROMPTS[:2], params)
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[:2],
        max_tokens=10,
        temperature=0,
        logit_bias={str(t): b for t, b in bias.items()},
        extra_body={"min_tokens": 4},
    )
    choices = sorted(got.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [o.text for o in expected]
    assert [c.finish_reason for c in choices] == ["stop", "stop"]
    assert got.usage.completion_tokens == sum(len(o.token_ids) for o in expected) == 2 * 5
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=10,
        temperature=0,
        logit_bias={"2": 30.0},
        extra_body={"min_tokens": 3},
    )
    assert chat.usage.completion_tokens == 4 and chat.choices[0].finish_reason == "stop"


def test_penalties_equal_offline_generate(client, offline):
    """presence_penalty and frequency_penalty (the API's) and repetition_penalty (vLLM's
    extension) through the openai client: the offline engine's output with the same."""
    rules = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.4)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **rules)
    expected = [o.text for o in offline.generate(PROMPTS[:2], params)]
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[:2],
        max_tokens=10,
        temperature=0,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.4, "ignore_eos": True},
    )
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == expected
    plain = offline.generate(PROMPTS[:2], SamplingParams(max_tokens=10, ignore_eos=True))
    assert expected != [o.text for o in plain]  # the penalties changed something


def test_top_k_min_p_and_stop_token_ids_equal_offline_generate(client, offline):
    """top_k, min_p (sampled, seeded) and stop_token_ids through the openai client: the
    offline engine's output with the same rules and seed, and each rule changes it."""
    from specserve.core.sampling_params import choice_seed

    def both(**rules):
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=choice_seed(7, 0), **rules)
        want = offline.generate(PROMPTS[:1], params)[0]
        got = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=7,
            extra_body=rules,
        ).choices[0]  # fmt: skip
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason), rules
        return want

    free = both()
    assert both(top_k=2).token_ids != free.token_ids
    assert both(min_p=0.3).token_ids != free.token_ids
    stop = free.token_ids[3]
    cut = both(stop_token_ids=[stop])
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]


def test_prefix_cache_through_the_api(server, client, offline):
    """A second chat turn finds the first turn's pages: usage reports the cached prompt
    tokens (whole pages, fewer than the prompt), /metrics counts them, and the answer is
    the model's own."""
    system = "You answer questions about paged attention and speculative decoding. " * 3
    first = [
        {"role": "system", "content": system},
        {"role": "user", "content": "The quick brown fox"},
    ]
    a = client.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0)
    assert a.usage.prompt_tokens_details.cached_tokens == 0  # (nothing like it before)
    before = server.metrics()
    second = first + [
        {"role": "assistant", "content": a.choices[0].message.content},
        {"role": "user", "content": "Paged attention"},
    ]
    b = client.chat.completions.create(model=MODEL, messages=second, max_tokens=8, temperature=0)
    ids = offline.apply_chat_template(second)
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert len(offline.apply_chat_template(first)) - 16 < cached < len(ids) and cached % 16 == 0
    params = SamplingParams(max_tokens=8, temperature=0.0)
    assert b.choices[0].message.content == offline.generate(ids, params)[0].text
    after = server.wait_metric(
        "specserve_prefix_cache_hit_tokens_total",
        before["specserve_prefix_cache_hit_tokens_total"] + cached,
    )
    assert after == before["specserve_prefix_cache_hit_tokens_total"] + cached
    assert server.metrics()["specserve_prefix_cache_pages"] > 0


def test_a_shared_prompt_prefix_is_tokenized_once(server, client, offline):
    """Long prompts sharing a prefix: the second is tokenized from a cut of the first
    (server/prompt_prefixes.py), its tokens are still the tokenizer's own (usage and the
    answer say so), and /metrics counts the reuse."""
    prefix = "The quick brown fox jumps over the lazy dog. " * 25  # (> MIN_CHARS)
    prompts = [prefix + "Speculative decoding", prefix + "Paged attention stores keys"]
    before = server.metrics()
    params = SamplingParams(max_tokens=4, temperature=0.0)
    for prompt in prompts:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        ids = offline.tokenizer.encode(prompt)
        assert out.usage.prompt_tokens == len(ids)
        assert out.choices[0].text == offline.generate(prompt, params)[0].text
    after = server.metrics()
    name = "specserve_prompt_prefix_reuses_total"
    assert after[name] - before.get(name, 0.0) == 1
    name = "specserve_prompt_prefix_reused_tokens_total"
    reused = after[name] - before.get(name, 0.0)
    assert len(offline.tokenizer.encode(prefix)) - 16 < reused < len(ids)
    assert after["specserve_prompt_prefix_kept_prompts"] >= 2


def test_structured_output_through_the_openai_client(client, offline):
    """chat.completions.parse with a pydantic model: the reply is that model, and it is
    what offline generate gives under the same schema; json_object mode as offline's
    object schema."""
    import json

    from pydantic import BaseModel, Field

    from specserve import Grammar

    class Pet(BaseModel):
        name: str = Field(max_length=4)
        happy: bool

    messages = [{"role": "user", "content": "The quick brown fox"}]
    got = client.beta.chat.completions.parse(
        model=MODEL, messages=messages, response_format=Pet, max_tokens=48, temperature=0
    )
    pet = got.choices[0].message.parsed
    assert isinstance(pet, Pet) and got.choices[0].finish_reason == "stop"
    ids = offline.apply_chat_template(messages)
    schema = json.dumps(
        {**Pet.model_json_schema(), "additionalProperties": False}  # (the client's strict form)
    )
    params = SamplingParams(max_tokens=48, grammar=Grammar("json_schema", schema))
    assert got.choices[0].message.content == offline.generate(ids, params)[0].text
    mode = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        response_format={"type": "json_object"},
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in mode if c.choices)
    params = SamplingParams(max_tokens=12, grammar=Grammar("json_schema", '{"type": "object"}'))
    assert text == offline.generate(ids, params)[0].text and text.startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_bad_response_formats_are_400s_naming_it(client, stream):
    cases = {
        "uniqueItems": {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
            },
        },
        "needs json_schema.schema": {"type": "json_schema", "json_schema": {"name": "x"}},
        "cannot be used": {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": {"type": "array", "prefixItems": [], "items": False, "minItems": 2},
            },
        },
    }
    for words, fmt in cases.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                response_format=fmt,
                max_tokens=4,
                stream=stream,
            )
        assert words in e.value.body["message"] and e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="hi", max_tokens=4, extra_body={"response_format": {"type": "xml"}}
        )
    assert "response_format" in str(e.value)


def test_echo_and_prompt_scoring(client, offline):
    """Completions' echo: the prompt ahead of the text, its tokens' logprobs ahead of the
    generated ones (the first rated by nothing), equal to offline prompt_logprobs; with
    max_tokens 0 the prompt alone (how evaluation harnesses score text), streamed or not."""
    prompt = "Paged attention stores keys"
    ids = offline.engine.tokenize(prompt)
    ref = offline.generate(prompt, SamplingParams(max_tokens=4, prompt_logprobs=2))[0]
    both = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True
    )
    c = both.choices[0]
    assert c.text == prompt + ref.text
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + len(ref.token_ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset == sorted(lp.text_offset)
    expected = [r.logprob for r in ref.prompt_logprobs[1:]]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-5)
    assert "".join(lp.tokens[: len(ids)]) == prompt  # (byte-level tokens of the prompt)
    scored = client.completions.create(
        model=MODEL, prompt=[prompt, prompt], max_tokens=0, logprobs=1, echo=True
    )
    for choice in scored.choices:
        assert choice.text == prompt and choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
        assert len(choice.logprobs.tokens) == len(ids)
    assert scored.usage.completion_tokens == 0
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True, stream=True
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == prompt
    streamed = [
        x
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for x in ch.choices[0].logprobs.token_logprobs
    ]
    assert streamed[1:] == pytest.approx(expected, abs=1e-5)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens 0"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
