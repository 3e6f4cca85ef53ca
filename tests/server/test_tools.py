"""Tool calling: call formats found in chat templates, calls parsed from whole and streamed
replies, a forced call (tool_choice required or named) always a valid call of the right
function, and the API end to end through the openai client with Hermes-style and Llama 3.1-style
templates."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from specserve import LLM, SamplingParams
from specserve.server.tools import CallStream, call_grammar, parse_calls, tool_format
from tests.server.conftest import API_KEY, ServerProcess

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}\nCall one as "
    '<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "\n</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_HINT = '{% if tools %}Respond as {"name": function name, "parameters": ...}{% endif %}'
# Llama 3.1's shape, its header tokens shortened (the tiny model's context is 512 tokens):
# tools in the system turn, a call as the whole reply, results as ipython
LLAMA3_TEMPLATE = (
    "{% if tools %}<|h|>system<|e|>Tools: {{ tools | tojson }}"
    '\nRespond with {"name": function name, "parameters": its arguments}<|t|>'
    "{% endif %}{% for m in messages %}<|h|>"
    "{{ 'ipython' if m['role'] == 'tool' else m['role'] }}<|e|>"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "{{ {'name': c['function']['name'], 'parameters': c['function']['arguments']} | tojson }}"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|t|>{% endfor %}"
    "{% if add_generation_prompt %}<|h|>assistant<|e|>{% endif %}"
)


class Weather(BaseModel):
    city: str = Field(max_length=6)
    celsius: object  # (any JSON value: short to render)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 6}, "celsius": {}},
                "required": ["city", "celsius"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["utc", "cet"]}},
                "required": ["zone"],
            },
        },
    },
]


def test_call_formats_of_templates():
    assert tool_format(HERMES_TEMPLATE) == "hermes"
    assert tool_format(LLAMA3_HINT + "{{ tools }}<|python_tag|>") == "llama3"
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    # a tokenizer's named templates: the one transformers renders tools with (the server
    # took only a single template, so named ones refused every request with tools)
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert tool_format({"default": plain, "tool_use": HERMES_TEMPLATE}) == "hermes"
    assert tool_format({"default": HERMES_TEMPLATE}) == "hermes"
    assert tool_format({"default": plain}) is None


def test_calls_parsed_from_replies():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}'
        "\n</tool_call>"
    )
    content, calls, _ = parse_calls(text + text[12:], "hermes")
    assert content == "Let me look." and len(calls) == 2
    assert calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "utc"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    assert parse_calls("<tool_call>\n{oops}\n</tool_call>", "hermes")[1] == []
    assert parse_calls("just text", "hermes") == ("just text", [], True)
    content, calls, _ = parse_calls('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', "llama3")
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert parse_calls("The answer is {not a call}", "llama3")[1] == []
    deep = "[" * 100_000 + "]" * 100_000  # (past Python's recursion limit: no call, no 500)
    assert parse_calls(f"<tool_call>\n{deep}\n</tool_call>", "hermes")[1] == []


def _stream(text: str, fmt: str, size: int, most: int | None = None):
    """A reply pushed through CallStream in pieces of `size` characters: the content sent,
    the calls rebuilt from their deltas as a client does, and the deltas."""
    stream = CallStream(fmt, most)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    sent, deltas = "", []
    for piece in pieces:
        content, calls = stream.push(piece)
        sent, deltas = sent + content, deltas + calls
    content, calls = stream.finish()
    sent, deltas = sent + content, deltas + calls
    rebuilt: dict[int, dict] = {}
    for d in deltas:
        call = rebuilt.setdefault(d["index"], {"name": None, "arguments": ""})
        if "id" in d:
            assert call["name"] is None, "a call started twice"
            call["name"], call["id"] = d["function"]["name"], d["id"]
        call["arguments"] += d["function"]["arguments"]
    return sent, [rebuilt[i] for i in sorted(rebuilt)], deltas


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_a_streamed_call_is_held_back_and_text_is_not(fmt):
    call = (
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
        if fmt == "hermes"
        else '{"name": "f", "parameters": {"x": 1}}'
    )
    prefix = "Sure, ok " if fmt == "hermes" else " "
    sent, calls, _ = _stream(prefix + call, fmt, 3)  # (the call's start split across pieces)
    assert sent == ("Sure, ok" if fmt == "hermes" else "")
    assert calls == [{"name": "f", "arguments": '{"x": 1}', "id": calls[0]["id"]}]
    # text that only looked like a call's start goes out
    text = "<toolbox> is not a call" if fmt == "hermes" else "  {a} is text"
    for size in (1, 5):
        sent, calls, _ = _stream(text, fmt, size)
        assert sent == text and calls == []


REPLIES = [
    'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>',
    "  Hm \n\n<tool_call>\n" + '{"name": "f", "arguments": {}}\n</tool_call>',
    # two calls, text between and after them (not content), strings with braces and quotes
    '<tool_call>\n{"name": "a", "arguments": {"q": "}{\\"]", "n": [1, {"m": null}]}}\n'
    '</tool_call>\n\n<tool_call>{"name":"b","arguments":{"x":"\\\\"}}</tool_call> bye',
    # arguments first: taken whole at its end (either key); a marker inside a string
    '<tool_call>\n{"parameters": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',
    '<tool_call>{"name": "a</tool_call>", "arguments": {}}</tool_call>',
    '<tool_call>{"arguments": {"q": "</tool_call>"}, "name": "f"}</tool_call> and',
    # a brace missing: the call ends at its close, unfinished, and the next one is read
    '<tool_call>\n{"name": "f", "arguments": {"a": 1\n</tool_call>\n'
    '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>',
    # a lone surrogate escaped: arguments keep the escape, a name with one is no call
    '<tool_call>{"arguments": {"a": "\\ud800"}, "name": "f"}</tool_call>',
    '<tool_call>{"name": "f\\ud800", "arguments": {}}</tool_call>',
    # arguments first: taken whole at its end
    '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',
    "a  b \n",
    " x",
    "<tool_call>\n{oops}\n</tool_call> then text",
]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 1000])
def test_a_streamed_reply_gives_what_the_whole_one_does(size):
    """Content and calls streamed in pieces of any size are the whole reply's: the content
    ahead of a call (not the space before it), each call's name and arguments, and no call
    where the first is not one."""
    for text in REPLIES:
        sent, calls, _ = _stream(text, "hermes", size)
        content, whole, _ = parse_calls(text, "hermes")
        assert sent == ("" if content is None else content), text
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole
        ], text
    content, calls, _ = parse_calls(REPLIES[2], "hermes")
    assert content is None
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"q": '}{"]', "n": [1, {"m": None}]},
        {"x": "\\"},
    ]
    content, calls, _ = parse_calls(REPLIES[3], "hermes")
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert parse_calls(REPLIES[-1], "hermes") == (REPLIES[-1], [], True)


def test_a_calls_name_goes_out_when_written_and_its_arguments_as_written():
    """A call streams as OpenAI's do: its id and name in the first delta, before the reply
    ends, then its arguments in pieces as the model writes them, exactly as written (not
    parsed and written again: key order, spacing and non-ASCII kept)."""
    head = '<tool_call>\n{"name": "get_weather", "arguments": '
    arguments = '{"city":"Zürich",  "celsius": [1, 2]}'
    text = head + arguments + "}\n</tool_call>"
    stream = CallStream("hermes")
    assert stream.push(head[:-5]) == ("", [])  # (the name not yet followed by the arguments)
    content, deltas = stream.push(head[-5:])
    assert content == "" and len(deltas) == 1
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[0]["type"] == "function" and deltas[0]["id"].startswith("call_")
    pieces = [stream.push(ch)[1] for ch in arguments + "}\n</tool_call>"]
    assert all(
        d == [{"index": 0, "function": {"arguments": ch}}] for d, ch in zip(pieces, arguments)
    )
    assert pieces[len(arguments) :] == [[]] * len("}\n</tool_call>")
    assert stream.finish() == ("", [])
    assert parse_calls(text, "hermes")[1][0]["function"]["arguments"] == arguments


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_a_call_cut_off_keeps_what_was_written(fmt):
    """A reply cut inside a call's arguments (max_tokens) is a call with the arguments
    written so far, whole and streamed alike (finish_reason "length" says it is cut), as
    OpenAI gives one; a cut inside the name is no call."""
    start = "<tool_call>\n" if fmt == "hermes" else "<|python_tag|>"
    key = "arguments" if fmt == "hermes" else "parameters"
    text = start + '{"name": "get_time", "' + key + '": {"zone": "u'
    content, calls, complete = parse_calls(text, fmt)
    assert content is None and not complete
    assert [c["function"] for c in calls] == [{"name": "get_time", "arguments": '{"zone": "u'}]
    assert _stream(text, fmt, 4)[1][0]["arguments"] == '{"zone": "u'
    cut = start + '{"name": "get_t'
    assert parse_calls(cut, fmt) == (cut, [], True)
    assert _stream(cut, fmt, 4)[:2] == (cut, [])


def test_calls_parsed_from_replies_llama3():
    content, calls, _ = parse_calls('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', "llama3")
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert parse_calls("The answer is {not a call}", "llama3")[1] == []
    for size in (1, 7):
        sent, calls, _ = _stream(' {"name": "f", "parameters": 3} ', "llama3", size)
        assert sent == "" and calls[0]["name"] == "f" and calls[0]["arguments"] == "3"


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama))


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
@pytest.mark.parametrize("name", [None, "get_weather"])
def test_a_forced_call_is_a_valid_call(llm, fmt, name):
    """The grammar of tool_choice required / named: greedy and sampled replies of a random
    model are calls of the right function whose arguments follow its schema."""
    grammar = call_grammar(TOOLS, fmt, name)
    params = [SamplingParams(max_tokens=256, grammar=grammar)] + [
        SamplingParams(max_tokens=256, grammar=grammar, temperature=1.0, seed=s) for s in range(4)
    ]
    for out in llm.generate([[5, 6, 7]] * len(params), params):
        content, calls, _ = parse_calls(out.text, fmt)
        assert out.finish_reason == "stop" and len(calls) == 1, repr(out.text)
        function = calls[0]["function"]
        assert function["name"] == (name or function["name"])
        arguments = json.loads(function["arguments"])
        if function["name"] == "get_weather":
            Weather.model_validate(arguments)
        else:
            assert arguments["zone"] in ("utc", "cet")


@pytest.fixture(scope="module", params=["hermes", "llama3"])
def tool_server(request, tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    shutil.copytree(tiny_llama, folder, dirs_exist_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = {"hermes": HERMES_TEMPLATE, "llama3": LLAMA3_TEMPLATE}[request.param]
    assert tool_format(config["chat_template"]) == request.param
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    srv = ServerProcess(folder, tmp_path_factory.mktemp("tools"), api_key=API_KEY)
    yield srv
    srv.stop()


def test_tools_through_the_openai_client(tool_server):
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    tools = TOOLS[1:]  # (short: the tiny model's context is 512 tokens)
    messages = [{"role": "user", "content": "Time?"}]
    forced = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=100,
        temperature=0,
    )
    choice = forced.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    streamed = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice="required",
        max_tokens=100,
        temperature=0,
        stream=True,
    )
    chunks = [ch for ch in streamed if ch.choices]
    deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    # the name first, with the id, then the arguments in pieces as the model wrote them
    # (pieces that queued up behind each other go as one: how many is not fixed)
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == call.function.name
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments  # (greedy)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any("<tool" in (ch.choices[0].delta.content or "") for ch in chunks)
    # The client's stream helper says a call's arguments are done only when the finish
    # reason comes after the call's chunk (it came in the same chunk: no such event), and
    # a forced call's reply has no content (a role chunk's "" was a content event).
    with client.chat.completions.stream(
        model=model, messages=messages, tools=tools, tool_choice="required", max_tokens=100
    ) as events:
        kinds = [(e.type, getattr(e, "name", None), getattr(e, "arguments", None)) for e in events]
    done = [k for k in kinds if k[0] == "tool_calls.function.arguments.done"]
    assert done == [
        ("tool_calls.function.arguments.done", call.function.name, call.function.arguments)
    ]
    assert not [k for k in kinds if k[0].startswith("content.")], kinds
    # the call and its result go back through the template
    follow_up = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "noon"},
    ]
    answer = client.chat.completions.create(
        model=model, messages=follow_up, tools=tools, max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert answer.usage.prompt_tokens > forced.usage.prompt_tokens + 20  # the call rendered
    none = client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice="none", max_tokens=8
    )
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens < forced.usage.prompt_tokens  # no tools rendered
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model=model,
            messages=messages,
            tools=tools,
            max_tokens=8,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


def test_a_template_without_tools_refuses_them(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tinyllama",
            messages=[{"role": "user", "content": "hi"}],
            tools=TOOLS,
            max_tokens=4,
        )
    assert "does not render tools" in e.value.body["message"] and e.value.body["param"] == "tools"


def test_a_forced_call_refuses_parameters_it_cannot_enforce():
    from specserve.core.errors import InvalidRequestError

    tools = [
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}},
        }
    ]
    with pytest.raises(InvalidRequestError, match="tool 'f' use .* uniqueItems") as e:
        call_grammar(tools, "hermes")
    assert e.value.field == "tools"


def test_forced_calls_refuse_bad_parameters_and_names(tool_server):
    """A forced call whose parameters xgrammar cannot compile is a 400 naming tools, not a
    500 (the schema is compiled off the event loop with every grammar, and its errors are
    the request's; no xgrammar log prefix in the message); two tools of one name are a 400."""
    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Time?"}]
    for parameters in ({"type": "bogus"}, {"type": "string", "pattern": "(("}):
        tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
        for choice in ("required", {"type": "function", "function": {"name": "f"}}):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(
                    model=model, messages=messages, tools=tools, tool_choice=choice, max_tokens=8
                )
            assert e.value.body["param"] == "tool_choice", e.value.body
            assert ".cc:" not in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError, match="two tools are named 'get_time'") as e:
        client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS + TOOLS[1:], max_tokens=8
        )
    assert e.value.body["param"] == "tools"
    # a call sent back with arguments nested past Python's recursion limit: rendered as the
    # text it is (it was a 500)
    deep = "[" * 100_000 + "]" * 100_000
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": deep}}
    back = messages + [{"role": "assistant", "content": None, "tool_calls": [call]}]
    reply = httpx.post(
        tool_server.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": model, "messages": back, "tools": TOOLS[1:], "max_tokens": 4},
        timeout=60,
    )
    assert reply.status_code in (200, 400), reply.text
    assert httpx.get(tool_server.url + "/health").status_code == 200


def test_parallel_tool_calls_false_keeps_a_replys_first_call():
    """parallel_tool_calls false: a reply with two calls is given with its first only,
    whole and streamed; true (the API's default) gives both."""
    from specserve.server.messages import OutputDelta
    from specserve.server.openai_format import ChatFormatter

    call = '<tool_call>\n{{"name": "{}", "arguments": {{}}}}\n</tool_call>'
    text = "Both. " + call.format("get_time") + call.format("get_weather")
    for most, names in ((1, ["get_time"]), (None, ["get_time", "get_weather"])):
        whole = ChatFormatter("chatcmpl-1", "m", 1, 3, None, None)
        whole.tools_format, whole.most_calls = "hermes", most
        whole.add(0, OutputDelta("r-0", text, [7], None, True, "stop"))
        message = whole.response()["choices"][0]["message"]
        assert [c["function"]["name"] for c in message["tool_calls"]] == names
        streamed = ChatFormatter("chatcmpl-2", "m", 1, 3, None, None)
        streamed.tools_format, streamed.most_calls = "hermes", most
        *_, chunk, end = streamed.chunks(
            0, OutputDelta("r-0", text, [7], None, True, "stop"), False
        )
        calls = chunk["choices"][0]["delta"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == names
        assert (
            end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "tool_calls"
        )


def test_a_reply_cut_after_a_call_is_said_cut():
    """A reply whose calls max_tokens (or the context) cut off was given as finish_reason
    "tool_calls", complete to the client, with a call after the last one dropped unseen; it
    is "length", as OpenAI says it, with the complete calls, whole and streamed."""
    from specserve.server.messages import OutputDelta
    from specserve.server.openai_format import ChatFormatter

    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na'
    whole = ChatFormatter("chatcmpl-1", "m", 1, 3, None, None)
    whole.tools_format = "hermes"
    whole.add(0, OutputDelta("r-0", text, [7], None, True, "length"))
    choice = whole.response()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]
    streamed = ChatFormatter("chatcmpl-2", "m", 1, 3, None, None)
    streamed.tools_format = "hermes"
    *_, end = streamed.chunks(0, OutputDelta("r-0", text, [7], None, True, "length"), False)
    assert end["choices"][0]["finish_reason"] == "length"


def test_unfinished_or_odd_calls_are_given_as_written():
    """What a model may write: a call with a brace missing ends at its `</tool_call>`
    unfinished and the next call is still read; a reply ended by EOS inside a call is not
    "tool_calls" (its arguments do not parse); a lone surrogate escape cannot break the
    response; Llama 3's calls may come as `{...}; {...}`."""
    from specserve.server.messages import OutputDelta
    from specserve.server.openai_format import ChatFormatter

    content, calls, complete = parse_calls(REPLIES[6], "hermes")
    assert [c["function"]["name"] for c in calls] == ["f", "g"] and not complete
    assert (
        calls[0]["function"]["arguments"] == '{"a": 1\n'
        and calls[1]["function"]["arguments"] == "{}"
    )
    assert parse_calls(REPLIES[4], "hermes")[1][0]["function"]["name"] == "a</tool_call>"
    assert json.loads(parse_calls(REPLIES[5], "hermes")[1][0]["function"]["arguments"]) == {
        "q": "</tool_call>"
    }
    for text in REPLIES[7:9]:  # (every string of the response encodes)
        content, calls, _ = parse_calls(text, "hermes")
        json.dumps([content, calls], ensure_ascii=False).encode("utf-8")
    assert parse_calls(REPLIES[8], "hermes")[1] == []
    text = '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'
    for size in (1, 3, 1000):
        sent, calls, _ = _stream(text, "llama3", size)
        assert sent == "" and [(c["name"], c["arguments"]) for c in calls] == [
            ("f", '{"a": 1}'),
            ("g", "{}"),
        ]
    assert len(parse_calls(text, "llama3", most=1)[1]) == 1
    cut = '<tool_call>\n{"name": "f", "arguments": {"a": 1'
    for finish, said in (("stop", "stop"), ("length", "length")):
        whole = ChatFormatter("chatcmpl-1", "m", 1, 3, None, None)
        whole.tools_format = "hermes"
        whole.add(0, OutputDelta("r-0", cut, [7], None, True, finish))
        assert whole.response()["choices"][0]["finish_reason"] == said
        streamed = ChatFormatter("chatcmpl-2", "m", 1, 3, None, None)
        streamed.tools_format = "hermes"
        *_, end = streamed.chunks(0, OutputDelta("r-0", cut, [7], None, True, finish), False)
        assert end["choices"][0]["finish_reason"] == said


def test_a_long_reply_inside_a_call_streams_in_linear_work():
    """A call's start that never completes (a name 50k characters long, or a call's text
    with no end) pushed a character at a time: each push looks at what it adds, not at the
    whole reply again (the header was matched afresh on every push: 11 s for 20k
    characters, on the server's event loop)."""
    from specserve.server import tools

    calls = {"chars": 0}
    real = tools._HEADER

    class Counting:
        def match(self, text, pos, endpos=None):
            calls["chars"] += min(len(text) if endpos is None else endpos, len(text)) - pos
            return real.match(text, pos, len(text) if endpos is None else endpos)

    tools._HEADER = Counting()
    try:
        for text in (
            '<tool_call>{"name": "' + "x:" * 25_000,
            '<tool_call>{"arguments": {"a": "' + "y" * 50_000,
        ):
            stream = CallStream("hermes")
            for ch in text:
                stream.push(ch)
            stream.finish()
            assert calls["chars"] <= 2 * tools.HEADER_MOST**2, calls
    finally:
        tools._HEADER = real
