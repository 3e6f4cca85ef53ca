"""The fast detokenizer paths (the backend's DecodeStream, the backend's decode) stream exactly
what the plain algorithm over `tokenizer.decode` streams, delta by delta, for byte-level BPE
(the tiny tokenizer and the real SmolLM2 one), byte-fallback BPE and a WordPiece tokenizer
whose clean-up keeps it on `tokenizer.decode`; random ids include partial characters,
special tokens and invalid byte sequences."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.core.detokenizer import IncrementalDetokenizer, TokenDecoder

CORPUS = ["The quick brown fox jumps over the lazy dog. Héllo wörld, naïve café 你好 🙂 . , ! ?"]


class Reference:
    """The plain algorithm: two `tokenizer.decode` calls per token (what the engine did
    before the fast paths); the oracle for every path."""

    def __init__(self, tok, prompt_ids, stop):
        self.tok, self.ids, self.stop = tok, list(prompt_ids[-5:]), stop
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text, self.emitted, self.stopped = "", 0, False

    def push(self, token):
        if self.stopped:
            return
        self.ids.append(token)
        self._release(finished=False)

    def finish(self):
        if not self.stopped:
            self._release(finished=True)

    def _release(self, finished):
        decode = lambda ids: self.tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if (full.endswith("\ufffd") and not finished) or len(full) <= len(prefix):
            return
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.holdback)
        self.text += full[len(prefix) :]
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i != -1]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True

    pop_delta = IncrementalDetokenizer.pop_delta


def byte_fallback_tokenizer():
    """A Llama-2-style tokenizer: Metaspace BPE with <0xNN> byte-fallback tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens]
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    spec = json.loads(tok.to_str())  # byte tokens are ordinary vocabulary, not special
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in byte_tokens]
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def wordpiece_tokenizer():
    """A BERT-style tokenizer whose decode cleans up spaces before punctuation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)  # transformers cleans up instead
    tok.train_from_iterator(
        CORPUS * 4, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "[SEP]"])
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        sep_token="[SEP]",
        clean_up_tokenization_spaces=True,
    )


@pytest.fixture(scope="module")
def tokenizers(tiny_llama):
    from transformers import AutoTokenizer

    from specserve.model.loader import load_tokenizer, resolve_model

    return {
        "tiny": AutoTokenizer.from_pretrained(str(tiny_llama)),
        "smollm2": load_tokenizer(resolve_model(None)),
        "byte_fallback": byte_fallback_tokenizer(),
        "wordpiece": wordpiece_tokenizer(),
    }


def stream_deltas(detok, ids):
    out = []
    for i, t in enumerate(ids):
        detok.push(t)
        out.append(detok.pop_delta(finished=i == len(ids) - 1 or detok.stopped))
    return out


def test_paths_chosen(tokenizers):
    for name in ("tiny", "smollm2", "byte_fallback"):
        assert TokenDecoder(tokenizers[name]).streams, name
    assert TokenDecoder(tokenizers["wordpiece"]).backend is None  # its clean-up is not native


ids_strategy = st.lists(st.one_of(st.integers(0, 400), st.integers(0, 49151)), max_size=30)


@given(
    name=st.sampled_from(["tiny", "smollm2", "byte_fallback", "wordpiece"]),
    ids=ids_strategy,
    prompt=ids_strategy,
    path=st.sampled_from(["stream", "decode"]),
    stop=st.lists(st.sampled_from(["a", "o w", "🙂", "\ufffd", "你好", ". "]), max_size=2),
)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_same_deltas_as_the_plain_algorithm(tokenizers, name, ids, prompt, path, stop):
    tok = tokenizers[name]
    vocab = len(tok)
    ids, prompt = [t % vocab for t in ids], [t % vocab for t in prompt]
    decoder = TokenDecoder(tok)
    if path == "decode":
        decoder.streams, decoder._stream_class = False, None
    fast = IncrementalDetokenizer(tok, prompt, stop, decoder)
    ref = Reference(tok, prompt, stop)
    assert stream_deltas(fast, ids) == stream_deltas(ref, ids)
    assert (fast.text, fast.stopped) == (ref.text, ref.stopped)


@pytest.mark.parametrize(
    "text",
    [
        "Héllo wörld 你好世界 🙂🙂 naïve — café.",
        "Hello , world ! What ? It 's fine . (yes)",
        "👩‍👩‍👧 emoji sequences and 🇫🇷 flags",
        "tabs\tand\nnew lines\n\n  double  spaces ",
    ],
)
def test_whole_text_equals_decode(tokenizers, text):
    """For tokenizers whose decode concatenates (byte-level, byte-fallback), the streamed text
    is what `decode` gives for the whole output, special tokens in the middle included."""
    for name in ("tiny", "smollm2", "byte_fallback"):
        tok = tokenizers[name]
        ids = tok.encode(text, add_special_tokens=False)
        eos = tok.convert_tokens_to_ids(tok.eos_token)
        ids = ids[: len(ids) // 2] + [eos] + ids[len(ids) // 2 :]
        prompt = tok.encode("Say:", add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt, [])
        deltas = stream_deltas(detok, ids)
        want = tok.decode(ids, skip_special_tokens=True)
        if name == "byte_fallback":  # the context keeps the first token's leading space
            want = tok.decode(prompt + ids, skip_special_tokens=True)[len("Say:") :]
        assert "".join(deltas) == detok.text == want, name
        assert not any("\ufffd" in d for d in deltas), name


def test_prompt_ending_inside_a_character(tokenizers):
    """The context's unfinished character is not output text (the stream is not used)."""
    tok = tokenizers["smollm2"]
    emoji = tok.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1
    prompt = tok.encode("Hi", add_special_tokens=False) + emoji[:1]
    ids = emoji[1:] + tok.encode(" there", add_special_tokens=False)
    fast, ref = IncrementalDetokenizer(tok, prompt, []), Reference(tok, prompt, [])
    assert stream_deltas(fast, ids) == stream_deltas(ref, ids)
