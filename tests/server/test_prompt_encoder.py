"""The HTTP process's prompt tokenization: exactly `tokenizer.encode`'s ids through the Rust
tokenizer's encode_batch_fast, and long prompts encoded on worker threads, concurrent
requests' in parallel, never on the event loop (server/prompt_encoder.py); long prompts that
share a prefix with a recent one cut there, still exactly `encode`'s ids for every tokenizer
family (server/prompt_prefixes.py)."""

from __future__ import annotations

import asyncio
import random
import threading
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from specserve.model.dummy import dummy_config, synthetic_tokenizer
from specserve.server import prompt_prefixes
from specserve.server.inputs import InputProcessor
from specserve.server.messages import EngineInfo
from specserve.server.prompt_encoder import THREAD_CHARS, PromptEncoder
from specserve.server.prompt_prefixes import RecentPrompts, encode_with_cuts
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.support.tiny_models import make_tokenizer

_INFO = EngineInfo("m", 128256, 8192, 8192, 64, 4)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    make_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)  # (as the server loads one)


def _texts(tokenizer, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["The", "quick", "fox", "héllo", "你好", "🙂", "  ", "\n\n", "\t", "12", "7", "—"]
    words += list(tokenizer.all_special_tokens)
    texts = ["", "a", " leading space", "<|im_start|>user\nhi<|im_end|>\n"]
    for n in (3, 40, 700):
        texts.append("".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(n)))
    ids = [str(rng.randrange(3, 128000)) for _ in range(2112)]  # the synthetic tokenizer's
    return [*texts, " ".join(ids)]


@pytest.mark.parametrize("which", ["synthetic", "bpe"])
def test_fast_ids_are_encodes_ids(which, bpe):
    tokenizer = bpe if which == "bpe" else synthetic_tokenizer(dummy_config("llama-3.1-8b"))
    encoder = PromptEncoder(tokenizer)
    assert encoder.fast
    texts = _texts(tokenizer, seed=1)
    for add in (True, False):
        expected = [tokenizer.encode(t, add_special_tokens=add) if t else [] for t in texts]
        assert encoder.encode_many(texts, add_special_tokens=add) == expected


def test_chat_ids_are_apply_chat_templates(bpe):
    inputs = InputProcessor(bpe, _INFO)
    assert inputs.encoder.fast
    messages = [
        {"role": "system", "content": "héllo 🙂 " * 300},  # past THREAD_CHARS: on a thread
        {"role": "user", "content": "What is <|im_end|> doing here?"},
    ]
    for msgs in (messages, messages[1:]):
        req = ChatCompletionRequest(messages=msgs)
        out = bpe.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        expected = list(out["input_ids"] if hasattr(out, "keys") else out)
        assert asyncio.run(inputs.chat_prompt(req)) == expected


def test_a_tokenizer_with_its_own_encode_keeps_it(bpe):
    class Infilling(type(bpe)):
        def encode(self, text, *args, **kwargs):
            return [7, *super().encode(text, *args, **kwargs)]

    tokenizer = Infilling.from_pretrained(bpe.name_or_path)
    encoder = PromptEncoder(tokenizer)
    assert not encoder.fast
    assert encoder.encode_many(["hi", ""]) == [tokenizer.encode("hi"), []]


class _BarrierTokenizer:
    """encode of a long text waits until `parties` of them run at once (or fails after 10 s)."""

    chat_template = None
    eos_token_id = None

    def __init__(self, parties: int):
        self.barrier = threading.Barrier(parties, timeout=10)
        self.threads: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.get_ident())
        if len(text) > 100:
            self.barrier.wait()
        return [len(text) % 100 + 1]


def test_concurrent_long_prompts_are_encoded_in_parallel_off_the_loop():
    """Two requests whose prompts are just past THREAD_CHARS (less than the 4,096
    characters that went to a thread before): each encode waits for the other, so encoding
    either on the event loop would stop the other from starting (the barrier breaks)."""
    tokenizer = _BarrierTokenizer(parties=2)
    inputs = InputProcessor(tokenizer, _INFO)
    prompt = "x" * (THREAD_CHARS + 1)
    assert THREAD_CHARS + 1 < 4096

    async def two_requests() -> tuple[list, int]:
        reqs = [CompletionRequest(prompt=prompt), CompletionRequest(prompt=[prompt, "y"])]
        got = await asyncio.gather(*(inputs.completion_prompts(r) for r in reqs))
        return got, threading.get_ident()

    got, loop_thread = asyncio.run(two_requests())
    assert got == [[[THREAD_CHARS % 100 + 2]], [[THREAD_CHARS % 100 + 2], [2]]]
    assert loop_thread not in tokenizer.threads


# ---- long prompts sharing a prefix (server/prompt_prefixes.py) ------------------------------

_PIECES = [
    "the", "The", "fox", " ", "  ", "\n", "\n\n", " \n", "\t", "12", "3456", "'s", "don't",
    ".", ",", "!?", "—", "héllo", "e\u0301", "\u0301", "你好", "🙂", "Ω", "ﬁ", "\u00a0", "x",
]  # fmt: skip


def _family(name: str):
    """A small tokenizer of a real family's construction, trained here: byte-level BPE with
    GPT-2's split (`gpt2`) or Llama 3's pattern (`llama3`), NFC first (`qwen`); SentencePiece
    BPE over Metaspace (`metaspace`); Llama 2's legacy normalizer, a prepended marker and no
    pre-tokenizer (`legacy`); BERT's WordPiece, lowercased (`bert`); byte-level BPE whose
    post-processor trims the spaces off its offsets and ends every text with a token
    (`suffix`); and the synthetic tokenizer of dummy models (`synthetic`)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    if name == "synthetic":
        return synthetic_tokenizer(dummy_config("llama-3.1-8b"))
    corpus = ["".join(random.Random(i).choices(_PIECES, k=400)) for i in range(8)]
    corpus += ["The quick brown fox jumps over the lazy dog. " * 8]
    special = ["<s>", "</s>", "<|im_end|>"]
    if name == "bert":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]", *special])
    else:
        tok = Tokenizer(models.BPE(byte_fallback=name in ("metaspace", "legacy")))
        byte_level = dict(initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=special, **byte_level)
        if name in ("gpt2", "suffix"):
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        elif name in ("llama3", "qwen"):
            pattern = (
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
            )
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
            if name == "qwen":
                tok.normalizer = normalizers.NFC()
        elif name == "metaspace":
            tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        elif name == "legacy":
            tok.normalizer = normalizers.Sequence(
                [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
            )
        if name == "suffix":
            tok.post_processor = processors.RobertaProcessing(("</s>", 1), ("<s>", 0))
    tok.train_from_iterator(corpus, trainer)
    if name in ("gpt2", "llama3", "qwen", "suffix"):
        tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


_FAMILIES = ["gpt2", "llama3", "qwen", "metaspace", "legacy", "bert", "suffix", "synthetic"]
_CUT = {"gpt2", "llama3", "qwen", "metaspace", "bert", "synthetic"}  # the rest: no cache


@pytest.fixture(scope="module")
def families():
    return {name: _family(name) for name in _FAMILIES}


@pytest.fixture(scope="module")
def encoders(families):
    """Each family's encoder, kept across a test's examples (its recent prompts too)."""
    return {name: PromptEncoder(tok, prefix_min_chars=128) for name, tok in families.items()}


def test_tokenizers_whose_cuts_would_differ_get_no_cache(encoders):
    """A prepended marker (legacy), and offsets trimmed of their spaces with a token after
    every text (suffix), fail the start-up check; the other families pass it both with and
    without special tokens added."""
    cached = {
        name: {add for add, r in e.recent.items() if r is not None} for name, e in encoders.items()
    }
    assert cached == {name: {True, False} if name in _CUT else set() for name in _FAMILIES}


def _words(data, tokenizer, lo: int, hi: int) -> str:
    pieces = [*_PIECES, *tokenizer.all_special_tokens, str(data.draw(st.integers(0, 99999)))]
    n = data.draw(st.integers(lo, hi))
    drawn = data.draw(st.lists(st.sampled_from(pieces), min_size=n, max_size=n))
    spaces = data.draw(st.lists(st.sampled_from(["", " ", " ", "  "]), min_size=n, max_size=n))
    return "".join(w + s for w, s in zip(drawn, spaces))


@pytest.mark.parametrize("name", _FAMILIES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_prompts_sharing_a_prefix_encode_as_encode_does(name, families, encoders, data):
    """Texts sharing long prefixes (siblings after one prefix, and a conversation that grows
    turn by turn), through one encoder in turn: every text's ids equal the tokenizer's
    encode (cut or not: test_a_shared_prefix_is_encoded_once counts the cuts)."""
    tokenizer, encoder = families[name], encoders[name]
    prefix = _words(data, tokenizer, 120, 240)
    texts = [prefix + _words(data, tokenizer, 0, 20) for _ in range(3)]
    texts.append(texts[-1] + _words(data, tokenizer, 1, 20))
    texts.append(texts[-1] + _words(data, tokenizer, 1, 20))
    for add in (True, False):
        for text in texts:
            assert encoder.encode_many([text], add)[0] == tokenizer.encode(
                text, add_special_tokens=add
            )


@pytest.mark.parametrize("name", sorted(_CUT))
def test_a_shared_prefix_is_encoded_once(name, families):
    """Sixteen prompts after one 2,000-token-ish prefix: the first is encoded whole, the
    rest are cut in the prefix (reusing most of its characters) and equal encode."""
    tokenizer = families[name]
    encoder = PromptEncoder(tokenizer)
    rng = random.Random(3)
    prefix = "".join(rng.choice(_PIECES) + rng.choice(["", " "]) for _ in range(1500))
    prompts = [prefix + f" question {i}: " + "".join(rng.choices(_PIECES, k=40)) for i in range(16)]
    for prompt in prompts:
        assert encoder.encode_many([prompt]) == [tokenizer.encode(prompt)]
    recent = encoder.recent[True]
    assert recent.hits == 15
    assert recent.chars_reused > 15 * (len(prefix) - 200)


def test_a_cut_where_pieces_start_specially_would_differ(families):
    """Why the start-up check: Llama 2's legacy normalizer prepends its marker to every
    text, so a rest encoded alone starts with one the whole text has not there; forced to
    cut, such an encoder gives other ids than encode (the check refuses it: no cache)."""
    tokenizer = families["legacy"]
    assert prompt_prefixes.check(tokenizer.backend_tokenizer, False, []) is None
    recent = RecentPrompts(tokenizer.backend_tokenizer, False, "before-space", min_chars=64)
    texts = ["héllo 你好 12 dog. " * 40 + "and the dog", "héllo 你好 12 dog. " * 40 + "and a cat"]
    got = [encode_with_cuts(tokenizer.backend_tokenizer, [t], False, recent)[0] for t in texts]
    assert recent.hits == 1
    assert got[1] != tokenizer.encode(texts[1], add_special_tokens=False)


def test_chat_turns_reuse_the_conversation_so_far(bpe):
    """A conversation through the chat endpoint's path: each turn's rendered prompt starts
    with the last one's, so it is cut there, and its ids equal apply_chat_template's."""
    inputs = InputProcessor(bpe, _INFO)
    messages = [{"role": "system", "content": "You answer questions about foxes. " * 60}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question {turn}: why the quick fox?"})
        req = ChatCompletionRequest(messages=messages)
        out = bpe.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected = list(out["input_ids"] if hasattr(out, "keys") else out)
        assert asyncio.run(inputs.chat_prompt(req)) == expected
        messages.append({"role": "assistant", "content": f"Because {turn} dogs were lazy."})
    assert inputs.encoder.recent[False].hits == 3


def test_a_cut_prompt_with_a_short_rest_is_encoded_on_the_loop(bpe, monkeypatch):
    """The cut is looked up on the event loop: a prompt past THREAD_CHARS whose rest is
    short is encoded there (no hop to a thread); the first, whole, went to a thread."""
    encoder = PromptEncoder(bpe)
    to_thread = []
    real = asyncio.to_thread

    async def counted(*args):
        to_thread.append(args[0])
        return await real(*args)

    monkeypatch.setattr(asyncio, "to_thread", counted)
    prefix = "The quick brown fox jumps over the lazy dog. " * 60
    prompts = [prefix + "Why?", prefix + "And why not?", prefix + "Or else?"]
    for prompt in prompts:
        assert asyncio.run(encoder.encode([prompt])) == [bpe.encode(prompt)]
    assert len(to_thread) == 2  # the first, and the second: the first's spans found there
    assert encoder.recent[True].hits == 2


@pytest.mark.parametrize("name", ["gpt2", "bert", "synthetic"])
def test_an_added_token_longer_than_the_margin_is_never_cut_apart(name):
    """An added token with a space 6 characters in and 24 after it: a text where it is
    broken off leaves a cut at that space, and a text where it is whole must not be cut
    there (the margin covers the longest added token), or its rest encoded alone would
    miss the token."""
    from tokenizers import AddedToken

    tokenizer = _family(name)
    token = "<tool> call result here</tool>"
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False)])
    encoder = PromptEncoder(tokenizer, prefix_min_chars=128)
    assert encoder.recent[False].margin == len(token) + 2
    prefix = "the quick brown fox jumps over the lazy dog . " * 12
    texts = [prefix + token[:-3] + "xyz and more text", prefix + token + " and more text"]
    for text in texts:
        assert encoder.encode_many([text], False)[0] == tokenizer.encode(
            text, add_special_tokens=False
        )
    assert encoder.recent[False].hits == 1


def test_a_shared_prefix_without_a_cut_is_looked_at_once(families):
    """Prompts sharing a long prefix with no space in it (CJK) allow no cut: the first is
    kept, its spans found once, and the rest are encoded whole and not kept (else each
    would be the next one's best match, its spans found again: ~8x the plain encode)."""
    tokenizer = families["gpt2"]
    encoder = PromptEncoder(tokenizer, prefix_min_chars=128)
    recent = encoder.recent[False]
    found = []
    find_spans = recent._find_spans
    recent._find_spans = lambda entry: (found.append(entry.text), find_spans(entry))
    prefix = "你好世界" * 200
    for i in range(5):
        text = prefix + f" question {i}"
        assert encoder.encode_many([text], False)[0] == tokenizer.encode(
            text, add_special_tokens=False
        )
    assert (recent.hits, len(recent), found) == (0, 1, [prefix + " question 0"])


def test_the_most_recently_used_text_keeps_its_blocks_findable(families, monkeypatch):
    """Two texts after one prefix, the newer kept last (its blocks find it); the older one
    used since. When the newer goes (LRU), the prefix's blocks still find the older one."""
    monkeypatch.setattr(prompt_prefixes, "KEPT", 2)
    backend = families["gpt2"].backend_tokenizer
    recent = RecentPrompts(backend, False, "before-space", min_chars=128)

    def keep(text):
        enc = backend.encode_batch([text], add_special_tokens=False)[0]
        spans = (array("i", [s for s, _ in enc.offsets]), array("i", [e for _, e in enc.offsets]))
        recent.keep(text, array("i", enc.ids), spans)

    prefix = "the quick fox " * 40  # 560 characters: two whole blocks of its own
    first, second = prefix + "alpha beta " * 30, prefix + "gamma delta " * 30
    keep(first)
    keep(second)
    assert recent.cut(first + " and more").at > 0  # (its third block is its own: found)
    keep("an unrelated prompt " * 60)  # the second goes: least recently used
    assert len(recent) == 2
    assert recent.cut(prefix + "epsilon " * 40).at > 0


# the families whose token counts have a lower bound from a text's size alone: BPE, no
# normalizer, pre-tokenizers that drop nothing, unknown characters kept (not: the synthetic
# tokenizer, words split at whitespace dropped)
_BOUNDED = {"gpt2", "llama3", "suffix"}  # (metaspace: byte fallback without the byte tokens)


@pytest.mark.parametrize("name", _FAMILIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_fewest_tokens_of_a_text_is_a_lower_bound(name, families, encoders, data):
    """fewest_tokens never exceeds what the text encodes to, with or without special
    tokens, runs of one piece included (the most a token can cover); families whose
    normalizer or pre-tokenizer may drop or merge characters (NFC, Llama 2's legacy
    prepend, BERT's whitespace split and lowercasing) get no bound (0)."""
    tokenizer, encoder = families[name], encoders[name]
    text = _words(data, tokenizer, 0, 300)
    if data.draw(st.booleans()):
        text += data.draw(st.sampled_from([*_PIECES, "a", " "])) * data.draw(st.integers(1, 400))
    fewest = encoder.fewest_tokens(text)
    assert fewest <= len(tokenizer.encode(text, add_special_tokens=False))
    assert (encoder._floor is not None) == (name in _BOUNDED)
    if name not in _BOUNDED:
        assert fewest == 0
    elif len(text) > 4000:
        assert fewest > 0


def _built(model, pre_tokenizer=None, added=()):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(model)
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    tok.add_tokens(list(added))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_the_fewest_tokens_holds_where_characters_go_missing():
    """Tokenizers that drop or fuse what they cannot spell (a second reading's
    counterexamples): byte fallback without the byte tokens (no bound: characters dropped),
    an unknown token per character over one-byte pieces (a 4-byte character is one token),
    a byte-level model lacking a byte's symbol (that byte dropped, not counted: the default
    model lacks 21), each bound at most the tokens encoded."""
    from tokenizers import AddedToken, models, pre_tokenizers

    letters = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}
    fallback = _built(models.BPE(vocab={**letters, "abcdefgh": 27}, merges=[], byte_fallback=True))
    assert PromptEncoder(fallback).fewest_tokens("é" * 50) == 0
    unknown = _built(models.BPE(vocab={"a": 0, "b": 1, "?": 2}, merges=[], unk_token="?"))
    emoji = "😀" * 50
    assert 0 < PromptEncoder(unknown).fewest_tokens(emoji) <= len(unknown.encode(emoji))
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    symbols.remove("Ā")  # byte 0x00's symbol: only as an added token
    vocab = {s: i for i, s in enumerate(symbols)}
    byte_level = _built(
        models.BPE(vocab={**vocab, "abcdefgh": len(vocab)}, merges=[]),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        [AddedToken("Ā", normalized=False)],
    )
    encoder = PromptEncoder(byte_level)
    for text in ("\x00" * 50, "\x00" * 50 + "abc" * 30):
        assert encoder.fewest_tokens(text) <= len(byte_level.encode(text)), text
    assert encoder.fewest_tokens("abc" * 30) > 0


def test_a_conversation_of_many_short_messages_is_rendered_off_the_loop(bpe):
    """The template's work grows with the messages, not only their text: a conversation
    of many empty messages rendered on the event loop (150k of them: 2.6 s during which no
    other request was served), since only the text's length counted."""
    inputs = InputProcessor(bpe, _INFO)
    threads = []
    render = inputs._apply_template

    def spy(messages, tools):
        threads.append(threading.get_ident())
        return render(messages, tools)

    inputs._apply_template = spy

    async def chat(n: int) -> int:
        req = ChatCompletionRequest(messages=[{"role": "user", "content": ""}] * n)
        await inputs.chat_prompt(req)
        return threading.get_ident()

    loop_thread = asyncio.run(chat(2))  # short: rendered on the loop
    assert threads == [loop_thread]
    threads.clear()
    loop_thread = asyncio.run(chat(THREAD_CHARS // 16))
    assert threads and loop_thread not in threads
