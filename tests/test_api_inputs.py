"""What the Python API takes and how it refuses the rest: SamplingParams changed after
construction are checked when the request is added; arrays of token ids are prompts; a
conversation, the template's options and tools are checked before the template renders
them; seeds of any width draw distinctly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import LLM, InvalidRequestError, SamplingParams
from specserve.core.sampling_params import choice_seed, engine_seed
from specserve.model.loader import tools_template
from tests.support.tiny_models import CHAT_TEMPLATE

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
CHAT = [{"role": "user", "content": "The quick brown fox"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_tokens", 0, "max_tokens must be an integer >= 1; got 0"),  # (generated one)
        ("temperature", -1.0, r"temperature must be in \[0, 100\]; got -1.0"),  # (sampled)
        ("n", 0, r"n must be an integer in \[1, 128\]; got 0"),
        ("grammar", "json", "grammar must be a Grammar"),
    ],
)
def test_params_changed_after_construction_are_checked_when_added(llm, field, value, message):
    """SamplingParams stay mutable (the server sets `grammar` after construction), so the
    engine checks them again, in the constructor's words."""
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**{field: value})
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)
    with pytest.raises(InvalidRequestError, match=message) as err:
        llm.engine.add_request([5, 6, 7], params)
    assert err.value.field == field
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([5, 6, 7], params)
    assert not llm.engine.requests and not llm.engine.has_unfinished()


def test_a_stop_string_set_after_construction_is_one_string(llm):
    """A lone string set later is one stop string, as the constructor takes it (its
    characters each stopped the output)."""
    params = SamplingParams(max_tokens=4)
    params.stop = "ula"
    rid = llm.engine.add_request([5, 6, 7], params)
    try:
        assert llm.engine.requests[rid].params.stop == ["ula"]
    finally:
        llm.engine.abort_request(rid)
        while llm.engine.has_unfinished():
            llm.engine.step()


def test_arrays_of_token_ids_are_prompts(llm):
    ids = [5, 17, 33, 80]
    ref = llm.generate(ids, GREEDY)[0].token_ids
    for prompt in (np.array(ids), torch.tensor(ids), np.array(ids, dtype=np.int32)):
        out = llm.generate(prompt, GREEDY)
        assert len(out) == 1 and out[0].token_ids == ref and out[0].prompt_token_ids == ids
    two = [ids, [9, 8, 7, 6]]
    refs = [o.token_ids for o in llm.generate(two, GREEDY)]
    for prompts in (np.array(two), torch.tensor(two), [np.array(p) for p in two]):
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == refs
    assert "".join(llm.stream(torch.tensor(ids), GREEDY)) == llm.generate(ids, GREEDY)[0].text
    with pytest.raises(InvalidRequestError, match="prompt token ids must be integers"):
        llm.generate(torch.tensor([1.0, 2.0]), GREEDY)


def test_chat_refuses_tools_its_template_cannot_render(llm):
    """The template drops tools it never names: the same prompt, tools silently gone (the
    server answers 400). A template that renders them takes them."""
    assert tools_template(CHAT_TEMPLATE) is None
    with pytest.raises(InvalidRequestError, match="does not render tools") as err:
        llm.chat(CHAT, GREEDY, tools=TOOLS)
    assert err.value.field == "tools"
    with pytest.raises(InvalidRequestError, match="does not render tools"):
        llm.apply_chat_template(CHAT, tools=TOOLS)
    template = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = (
        "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
        + CHAT_TEMPLATE
    )
    try:
        assert tools_template(llm.tokenizer.chat_template) == llm.tokenizer.chat_template
        with_tools = llm.apply_chat_template(CHAT, tools=TOOLS)
        assert len(with_tools) > len(llm.apply_chat_template(CHAT))
        assert llm.chat(CHAT, GREEDY, tools=TOOLS)[0].prompt_token_ids == with_tools
    finally:
        llm.tokenizer.chat_template = template
    # named templates: transformers renders tools with "tool_use", else with "default"
    assert tools_template({"default": CHAT_TEMPLATE, "tool_use": "{{ tools }}"}) == "{{ tools }}"
    assert tools_template({"default": CHAT_TEMPLATE}) is None


@pytest.mark.parametrize(
    "messages, kwargs, field, message",
    [
        (["Hi"], {}, "messages", r"messages\[0\] must be a dict"),  # (a char a message)
        ([CHAT, "Hi"], {}, "messages", "messages must be a conversation"),
        ("Hi", {}, "messages", "no conversation"),
        ([[{"content": "Hi"}]], {}, "messages", r"messages\[0\] needs a role"),  # (jinja's)
        ([[CHAT[0], "Hi"]], {}, "messages", r"messages\[1\] must be a dict"),
        ([{"role": "user", "content": 5}], {}, "messages", r"messages\[0\]: content must be"),
        (
            CHAT,
            dict(chat_template_kwargs={"add_generation_prompt": False}),  # (a TypeError)
            "chat_template_kwargs",
            "chat_template_kwargs may not set add_generation_prompt",
        ),
        (CHAT, dict(chat_template_kwargs=[1]), "chat_template_kwargs", "must map names"),
    ],
)
def test_bad_conversations_name_the_field(llm, messages, kwargs, field, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        llm.chat(messages, GREEDY, **kwargs)
    assert err.value.field == field


def test_template_errors_name_the_messages(llm):
    template = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    try:
        with pytest.raises(InvalidRequestError, match="rejected the messages: roles") as err:
            llm.chat(CHAT, GREEDY)
        assert err.value.field == "messages"
    finally:
        llm.tokenizer.chat_template = template
    # a message without content is rendered with an empty one (as the server sends it)
    assert llm.apply_chat_template([{"role": "user"}]) == llm.apply_chat_template(
        [{"role": "user", "content": ""}]
    )
    # messages as dataclasses or pydantic models (which transformers takes) as their dicts
    from dataclasses import dataclass

    from pydantic import BaseModel

    @dataclass
    class Note:
        role: str
        content: str

    class Model(BaseModel):
        role: str
        content: str | None = None

    ids = llm.apply_chat_template(CHAT)
    assert llm.apply_chat_template([Note(**CHAT[0])]) == ids
    assert llm.chat([Model(**CHAT[0])], GREEDY)[0].prompt_token_ids == ids


def test_chat_gives_each_conversation_its_n_choices_in_a_row(llm):
    params = SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=3)
    conversations = [CHAT, [{"role": "user", "content": "Paged attention"}]]
    outs = llm.chat(conversations, params)
    assert len(outs) == 4
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids != outs[2].prompt_token_ids
    assert outs[2].prompt_token_ids == outs[3].prompt_token_ids


def test_seeds_of_any_width_draw_distinctly(llm):
    """Seeds were masked to 62 bits: -1 drew as 2**62 - 1 and 2**62 + 5 as 5. The server
    takes OpenAI's 64-bit seeds, signed or not, so wide seeds are hashed, never refused."""
    assert engine_seed(5) == 5 and engine_seed(2**62 - 1) == 2**62 - 1  # in range: as given
    wide = [-1, -(2**63), 2**62, 2**62 + 5, 2**64 - 1, 2**64 + 5, 10**30]
    seeds = [engine_seed(s) for s in wide]
    assert all(0 <= s < 2**62 for s in seeds)
    assert len(set(seeds) | {5, 2**62 - 1}) == len(wide) + 2
    assert choice_seed(-1, 1) != choice_seed(2**64 - 1, 1)  # (the same 64 bits)
    rids = [llm.engine.add_request([5, 6, 7], SamplingParams(seed=s)) for s in (-1, 2**62 - 1)]
    try:
        assert llm.engine.requests[rids[0]].seed == engine_seed(-1) != 2**62 - 1
        assert llm.engine.requests[rids[1]].seed == 2**62 - 1
    finally:
        for rid in rids:
            llm.engine.abort_request(rid)
        while llm.engine.has_unfinished():
            llm.engine.step()

    def draw(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
        return llm.generate([5, 6, 7], params)[0].token_ids

    assert draw(-1) != draw(2**62 - 1) and draw(2**62 + 5) != draw(5)
    assert draw(-1) == draw(-1)
