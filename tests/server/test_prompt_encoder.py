"""The HTTP process's prompt tokenization: exactly `tokenizer.encode`'s ids through the Rust
tokenizer's encode_batch_fast, and long prompts encoded on worker threads, concurrent
requests' in parallel, never on the event loop (server/prompt_encoder.py)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from transformers import AutoTokenizer

from specserve.model.dummy import dummy_config, synthetic_tokenizer
from specserve.server.inputs import InputProcessor
from specserve.server.messages import EngineInfo
from specserve.server.prompt_encoder import THREAD_CHARS, PromptEncoder
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
