"""Streaming text: deltas add up to the final text (multi-byte characters included), stop
strings are never emitted, stop tokens and eos end a request, ignore_eos keeps going."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve import LLM, SamplingParams
from specserve.core.detokenizer import IncrementalDetokenizer


def _byte_chars() -> dict[int, str]:
    """The byte-level BPE alphabet: every byte maps to one printable character."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_CHARS = _byte_chars()


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama))


def byte_ids(tok, text: str) -> list[int]:
    """One token per UTF-8 byte, so a 4-byte emoji arrives in four pieces."""
    ids = tok.convert_tokens_to_ids([BYTE_CHARS[b] for b in text.encode()])
    assert tok.unk_token_id is None or tok.unk_token_id not in ids
    return ids


def stream(tok, ids: list[int], prompt: list[int] | None = None, stop=()):
    """Push ids one at a time; return (deltas, detokenizer)."""
    detok = IncrementalDetokenizer(tok, prompt or [], list(stop))
    deltas = []
    for i, t in enumerate(ids):
        detok.push(t)
        deltas.append(detok.pop_delta(finished=i == len(ids) - 1 or detok.stopped))
        if detok.stopped:
            break
    return deltas, detok


PIECES = ["a", "b", " ", "é", "ü", "你", "好", "世界", "🙂", "—", "The", " fox", "café", "\n", "."]
texts = st.lists(st.sampled_from(PIECES), min_size=1, max_size=25).map("".join)


def tokenize(tok, text: str, mode: str) -> list[int]:
    if mode == "bpe":
        return tok.encode(text, add_special_tokens=False)
    if mode == "bytes":
        return byte_ids(tok, text)
    # Mixed: BPE for the first half of the characters, bytes for the rest.
    half = len(text) // 2
    return tok.encode(text[:half], add_special_tokens=False) + byte_ids(tok, text[half:])


def test_byte_ids_round_trip(tok):
    text = "Héllo 你好 🙂"
    assert tok.decode(byte_ids(tok, text)) == text
    assert len(byte_ids(tok, "🙂")) == 4


@given(
    text=texts,
    mode=st.sampled_from(["bpe", "bytes", "mixed"]),
    prompt=st.sampled_from(["", "Héllo wörld ", "你好 🙂"]),
)
@settings(max_examples=150, deadline=None)
def test_deltas_concatenate_to_the_text(tok, text, mode, prompt):
    ids = tokenize(tok, text, mode)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    deltas, detok = stream(tok, ids, prompt_ids)
    assert "".join(deltas) == detok.text == text == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas), "a partial character was streamed"


def test_multibyte_character_waits_for_its_last_byte(tok):
    ids = byte_ids(tok, "a🙂b")
    deltas, _ = stream(tok, ids)
    assert deltas == ["a", "", "", "", "🙂", "b"]


@given(
    text=texts,
    cut=st.integers(1, 3),
    mode=st.sampled_from(["bytes", "mixed"]),
    stray=st.lists(st.sampled_from([0xC3, 0xE4, 0xF0]), max_size=3),  # (lead bytes)
)
@settings(max_examples=120, deadline=None)
def test_an_output_ending_inside_a_character_ends_as_decode_makes_it(tok, text, cut, mode, stray):
    """An output cut by max_tokens inside a character (or ending in invalid bytes) dropped
    those tokens' text: '' for the first two bytes of an emoji, where the logprobs' bytes
    and `tokenizer.decode` say U+FFFD. The last delta now releases what decode makes of
    them, as the whole text does (and nothing partial before the end)."""
    ids = tokenize(tok, text + "🙂", mode)[:-cut]
    ids += tok.convert_tokens_to_ids([BYTE_CHARS[b] for b in stray])
    deltas, detok = stream(tok, ids)
    assert "".join(deltas) == detok.text == tok.decode(ids)
    assert detok.text.endswith("\ufffd")
    assert not any("\ufffd" in d for d in deltas[:-1])


def test_special_tokens_add_no_text(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = byte_ids(tok, "hi") + [eos]
    deltas, detok = stream(tok, ids)
    assert "".join(deltas) == detok.text == "hi"


def stop_cut(tok, ids: list[int], stops: list[str]) -> int:
    """Where generating `ids` stops: at the first token after which the text so far (whole
    characters) holds a stop string, cut at the earliest one it holds. Not simply the
    earliest occurrence in the whole text: a stop string that starts later but is complete
    first ends the request before an earlier-starting one can complete."""
    for k in range(1, len(ids) + 1):
        seen = tok.decode(ids[:k]).rstrip("\ufffd")
        found = [i for i in (seen.find(s) for s in stops) if i != -1]
        if found:
            return min(found)
    raise AssertionError("no stop string in the text")


@given(text=texts, mode=st.sampled_from(["bpe", "bytes"]), data=st.data())
@settings(max_examples=150, deadline=None)
def test_stop_string_is_never_emitted(tok, text, mode, data):
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 4))]
    other = data.draw(st.sampled_from(["zzz", "🙂a", "q"]))
    ids = tokenize(tok, text, mode)
    deltas, detok = stream(tok, ids, stop=[other, stop])
    assert detok.stopped
    assert detok.text == "".join(deltas) == text[: stop_cut(tok, ids, [other, stop])]
    assert stop not in "".join(deltas) and other not in "".join(deltas)


def test_the_stop_string_complete_first_ends_the_text(tok):
    """'🙂a' is complete one character before 'a🙂aa', which starts earlier (hypothesis found
    this case): the request ends at the first, as a model's stream would."""
    text = "aaaaa🙂aa"
    for ids in (byte_ids(tok, text), tokenize(tok, text, "bpe")):
        deltas, detok = stream(tok, ids, stop=["🙂a", "a🙂aa"])
        assert detok.stopped and detok.text == "".join(deltas) == "aaaaa"


def test_stop_string_split_across_byte_tokens(tok):
    text = "The quick brown fox jumps"
    deltas, detok = stream(tok, byte_ids(tok, text), stop=["fox", "你好"])
    assert detok.text == "".join(deltas) == "The quick brown "
    deltas, detok = stream(tok, byte_ids(tok, "ab你好cd"), stop=["你好"])
    assert "".join(deltas) == "ab" and detok.stopped
    # While a prefix of a stop string could still complete, it is held back.
    detok = IncrementalDetokenizer(tok, [], ["fox"])
    for t in byte_ids(tok, "a fo"):
        detok.push(t)
    assert detok.pop_delta(finished=False) == "a "
    detok.push(byte_ids(tok, "g")[0])
    assert detok.pop_delta(finished=False) == "f"  # the last 2 characters wait
    assert detok.pop_delta(finished=True) == "og"


# ---- through the engine: stop strings, stop tokens, eos, ignore_eos ----------------------

PROMPT = [40, 41, 42, 43, 44, 45]
N = 24


@pytest.fixture(scope="module")
def greedy_run(tiny_llama):
    llm = LLM(str(tiny_llama))
    out = llm.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))[0]
    return llm, out


def test_stop_string_in_generated_text(greedy_run):
    llm, ref = greedy_run
    pieces = [llm.tokenizer.decode([t]) for t in ref.token_ids]
    # A stop string made of the end of one token's text and the start of the next one's.
    i = next(k for k in range(3, N - 1) if pieces[k] and pieces[k + 1])
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, stop=[stop])
    out = llm.generate([PROMPT], params)[0]
    cut = ref.text.find(stop)
    assert out.finish_reason == "stop"
    assert out.text == ref.text[:cut]
    streamed = "".join(llm.stream(PROMPT, params))
    assert streamed == out.text and stop not in streamed
    assert out.token_ids == ref.token_ids[: len(out.token_ids)]


def test_stream_equals_final_text(greedy_run):
    llm, ref = greedy_run
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    assert "".join(llm.stream(PROMPT, params)) == ref.text


def test_stop_token_ids_end_the_request(greedy_run):
    llm, ref = greedy_run
    stop_token = ref.token_ids[5]
    j = ref.token_ids.index(stop_token)
    params = SamplingParams(
        max_tokens=N, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_token]
    )
    out = llm.generate([PROMPT], params)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[: j + 1]


def test_eos_ends_the_request_and_ignore_eos_keeps_going(greedy_run, tiny_llama, tmp_path):
    _, ref = greedy_run
    eos = ref.token_ids[4]
    folder = shutil.copytree(tiny_llama, tmp_path / "m")
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = eos
            path.write_text(json.dumps(cfg))
    llm = LLM(str(folder))
    assert eos in llm.engine.eos_token_ids
    stops = llm.engine.eos_token_ids
    j = next(k for k, t in enumerate(ref.token_ids) if t in stops)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0.0))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[: j + 1]
    kept = llm.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))[0]
    assert kept.finish_reason == "length" and kept.token_ids == ref.token_ids


def test_a_stop_string_in_the_text_held_back_at_the_end_stops(greedy_run, tok):
    """A token of a space and an emoji's first two bytes, forced three times: its text is
    held back as an incomplete character until max_tokens ends the request, and only then
    released (U+FFFD). A stop string in it cuts the text there and the request ends as a
    stop does (it said "length" with the text cut)."""
    llm, _ = greedy_run
    piece = next(
        i
        for i in range(len(tok))
        if tok.convert_ids_to_tokens(i).startswith("Ġ") and tok.decode([i]) == " \ufffd"
    )
    outs = {}
    for stop in (" ", "x"):
        params = SamplingParams(
            max_tokens=3, logit_bias={piece: 100.0}, stop=[stop], ignore_eos=True
        )
        outs[stop] = llm.generate([[5, 17, 33]], params)[0]
    assert outs["x"].token_ids == [piece] * 3
    assert outs["x"].text == tok.decode([piece] * 3) and outs["x"].finish_reason == "length"
    assert outs[" "].text == "" and outs[" "].finish_reason == "stop"
