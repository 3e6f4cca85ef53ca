"""Logprobs' token strings, bytes and text offsets: a token's text keeps its leading space
in SentencePiece vocabularies as in byte-level ones, and completions' text_offset says where
each token starts in the text, whatever the engine held back of that text when the token
came (stop-string candidates, an unfinished character), with echo and without."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specserve.server.inputs import InputProcessor
from specserve.server.messages import OutputDelta
from specserve.server.openai_format import CompletionFormatter, TokenText
from tests.support.tiny_models import make_sentencepiece_tokenizer, make_tokenizer

TEXT = "The quick brown fox 你好"


@pytest.fixture(scope="module")
def sentencepiece():
    return make_sentencepiece_tokenizer()


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_sentencepiece_tokens_keep_their_spaces(sentencepiece):
    """Decoding a lone "▁quick" gives "quick" (the decoder strips the text's first space);
    its logprob entry is " quick", and the tokens' bytes rebuild the text (with the space
    SentencePiece puts ahead of its first word), byte-fallback tokens included."""
    text = TokenText(sentencepiece)
    ids = sentencepiece.encode(TEXT, add_special_tokens=False)
    pieces = sentencepiece.convert_ids_to_tokens(ids)
    assert "▁quick" in pieces or "▁qu" in pieces
    assert sentencepiece.decode([ids[1]]) == text.get(ids[1])[0].lstrip(" ")
    assert text.get(ids[1])[0].startswith(" ")
    assert bytes(b for t in ids for b in text.get(t)[1]) == (" " + TEXT).encode()
    fallback = [t for t, p in zip(ids, pieces) if p.startswith("<0x")]
    assert fallback and all(text.get(t)[0].startswith("bytes:\\x") for t in fallback)
    bos = sentencepiece.bos_token_id
    assert text.get(bos) == ("<s>", list(b"<s>")) and text.is_special(bos)


def _deltas(ids: list[int]) -> list[OutputDelta]:
    """The tokens one a step, without text (held back, as a stop string's candidates are)."""
    out = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        reason = "length" if last else None
        out.append(OutputDelta("r-0", "", [t], [(-0.5, [(t, -0.5)])], last, reason))
    return out


@pytest.mark.parametrize("vocab", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("echo", [False, True])
def test_text_offsets_follow_the_tokens(vocab, echo, request):
    """Each token's offset is where its text starts in prompt + answer: with the answer's
    text all held back until the end (the offsets may not lag it), and with echo, the
    prompt's tokens at their places in the text sent, its BOS at 0."""
    tok = request.getfixturevalue(vocab)
    text = TokenText(tok)
    prompt = "The lazy dog"
    prompt_ids = tok.encode(prompt)  # (with BOS where the tokenizer adds one)
    answer_ids = tok.encode(" jumps over 你好 fox", add_special_tokens=False)
    answer = tok.decode(prompt_ids + answer_ids, skip_special_tokens=True)[
        len(tok.decode(prompt_ids, skip_special_tokens=True)) :
    ]
    fmt = CompletionFormatter("cmpl-1", "m", 1, len(prompt_ids), 1, text)
    if echo:
        offsets = InputProcessor.prompt_offsets(SimpleNamespace(tokenizer=tok), prompt, prompt_ids)
        assert offsets is not None
        fmt.echo = [(prompt, prompt_ids, offsets)]
    deltas = _deltas(answer_ids)
    deltas[-1].delta_text = answer  # (all of it at the end)
    for d in deltas:
        fmt.add(0, d)
    choice = fmt.response()["choices"][0]
    full = choice["text"]
    assert full == (prompt if echo else "") + answer
    lp = choice["logprobs"]
    starts = lp["text_offset"]
    assert len(starts) == len(lp["tokens"]) == len(answer_ids) + (len(prompt_ids) if echo else 0)
    ids = (prompt_ids if echo else []) + answer_ids
    for i, (t, at) in enumerate(zip(ids, starts)):
        shown = lp["tokens"][i]
        if text.is_special(t):
            assert at == 0, (i, shown)
        elif not shown.startswith("bytes:"):
            # (SentencePiece's first word: its space is not in the text)
            expect = shown[1:] if echo and i <= 1 and vocab == "sentencepiece" else shown
            assert full[at : at + len(expect)] == expect, (i, shown, at)
    assert starts == sorted(starts)
