"""The embedded SmolLM2-135M-Instruct GGUF: specserve's greedy output equals transformers'
own load of the same file, token for token, on chat prompts."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.model.loader import default_model_path

pytestmark = pytest.mark.slow  # runs by default (and in CI); `-m "not slow"` leaves it out

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about caches.",
    "Explain speculative decoding in one sentence.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def specserve_llm():
    return LLM()  # model=None: the embedded default model


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None  # never stop early
    return model.eval()


@pytest.fixture(scope="module")
def chat_prompts(specserve_llm):
    return [specserve_llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def test_default_model_is_the_smollm2_gguf(specserve_llm):
    engine = specserve_llm.engine
    assert engine.source.kind == "gguf" and engine.source.path == default_model_path()
    cfg = engine.model_config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 100000.0


def test_chat_template_is_applied(specserve_llm, chat_prompts):
    text = specserve_llm.tokenizer.decode(chat_prompts[0])
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.rstrip().endswith("<|im_start|>assistant")


def test_greedy_matches_transformers_gguf_load(specserve_llm, hf_model, chat_prompts):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = specserve_llm.generate(chat_prompts, params)  # all three in one batch
    expected = []
    with torch.no_grad():
        for ids in chat_prompts:
            x = torch.tensor([ids])
            y = hf_model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
            )
            expected.append(y[0, len(ids) :].tolist())
    assert [o.token_ids for o in outs] == expected
    assert "Paris" in outs[0].text  # a trained model, not noise


def test_the_gguf_tokenizer_is_cached_as_converted(tmp_path, monkeypatch):
    """The tokenizer converted from the GGUF is kept on disk and loaded from there: the same
    ids, text, special tokens and chat template as transformers' conversion; a changed file
    (its modification time) is converted again, and a cache that cannot be written is
    only skipped."""
    import os
    import shutil

    from transformers import AutoTokenizer

    from specserve.model import loader

    path = default_model_path()
    fresh = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    converted = []
    real = AutoTokenizer.from_pretrained

    def counting(name, *args, **kwargs):
        converted.append("gguf_file" in kwargs)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", counting)
    first, second = loader.gguf_tokenizer(path), loader.gguf_tokenizer(path)
    assert converted == [True, False]  # converted once, then read from the cache
    texts = [
        "Hello, world!",
        "  spaces\tand\nnewlines ",
        "héllo 世界 🙂",
        "<|im_start|>x<|im_end|>",
    ]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    for tok in (first, second):
        for text in texts:
            ids = fresh.encode(text)
            assert tok.encode(text) == ids and tok.decode(ids) == fresh.decode(ids)
        assert tok.all_special_ids == fresh.all_special_ids
        assert (tok.bos_token_id, tok.eos_token_id) == (fresh.bos_token_id, fresh.eos_token_id)
        want = fresh.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == want
    copy = tmp_path / "model.gguf"
    shutil.copy2(path, copy)  # another file: converted once, then read
    loader.gguf_tokenizer(copy), loader.gguf_tokenizer(copy)
    assert converted[-2:] == [True, False]
    os.utime(copy, ns=(0, copy.stat().st_mtime_ns + 10**9))  # changed: converted again
    loader.gguf_tokenizer(copy)
    assert converted[-1] is True
    (tmp_path / "file").write_text("")  # a cache that cannot be made: skipped
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "file" / "cache"))
    assert loader.gguf_tokenizer(copy).encode("Hello") == fresh.encode("Hello")
