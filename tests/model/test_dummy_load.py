"""`--load-format dummy`: random weights of a named or given shape, a synthetic tokenizer
that round-trips every id, a random EAGLE-3 head, and the server serving it."""

from __future__ import annotations

import json
import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.core.errors import CheckpointError, ConfigError
from specserve.model.dummy import PRESETS, dummy_config, synthetic_tokenizer
from specserve.model.loader import resolve_model

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "eos_token_id": 2,
    "bos_token_id": 1,
}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("dummy") / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def test_presets_have_the_real_shapes():
    cfg = dummy_config("llama-3.1-8b")
    assert (
        cfg.hidden_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.intermediate_size,
        cfg.vocab_size,
    ) == (4096, 32, 32, 8, 14336, 128256)
    assert cfg.rope_scaling is not None and cfg.rope_theta == 500000.0
    cfg = dummy_config("llama-3.1-70b")
    assert (
        cfg.hidden_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.intermediate_size,
    ) == (8192, 80, 64, 8, 28672)
    assert dummy_config(None) == dummy_config("smollm2-135m")  # the default model's shape
    assert resolve_model("llama-3.1-8b", "dummy").name == "dummy-llama-3.1-8b"


def test_a_shape_that_is_not_there_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="llama-3.1-8b"):  # the message lists presets
        resolve_model("llama-9b", "dummy")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        (tmp_path / "config.json").write_text("{")
        resolve_model(str(tmp_path), "dummy")
    with pytest.raises(ConfigError, match="load_format"):
        LLM(load_format="random")


def test_synthetic_tokenizer_round_trips_every_id():
    cfg = dummy_config("llama-3.1-8b")
    tok = synthetic_tokenizer(cfg)
    rng = random.Random(0)
    ids = [0, 1, cfg.vocab_size - 1] + [rng.randrange(cfg.vocab_size) for _ in range(200)]
    text = tok.decode(ids)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.eos_token_id == 128001
    chat = tok.apply_chat_template([{"role": "user", "content": "5 6"}], tokenize=False)
    assert tok.encode(chat, add_special_tokens=False) == [5, 6]


def test_dummy_weights_are_seeded(tiny_config):
    def tokens(seed):
        llm = LLM(str(tiny_config), load_format="dummy", seed=seed)
        assert llm.engine.source.name == f"dummy-{tiny_config.parent.name}"
        return llm.generate([[5, 6, 7], "8 9 10 11"], GREEDY)

    a, b, c = tokens(0), tokens(0), tokens(1)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    assert a[0].text.split() == [str(t) for t in a[0].token_ids]  # ids as text
    # every parameter random (none left at a default init), norms at one
    model = LLM(str(tiny_config), load_format="dummy").engine.runner.model
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.all(p == 1), name
        else:
            assert 0.015 < p.float().std().item() < 0.025, name


def test_random_eagle3_head_drafts(tiny_config):
    llm = LLM(
        str(tiny_config),
        load_format="dummy",
        speculative_algorithm="eagle3",
        speculative_policy="fixed",
        speculative_num_steps=3,
        speculative_simulate_acceptance=3.0,
    )
    head = llm.engine.spec.proposer.head
    assert head.config.target_hidden_size == TINY["hidden_size"]
    assert head.config.draft_vocab_size == TINY["vocab_size"]  # min(32000, vocab)
    outs = llm.generate([[5, 6, 7, 8]] * 3, SamplingParams(max_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    stats = llm.engine.stats()
    assert stats["spec_steps_by_draft_len"][3] > 0 and stats["spec_position_drafted"][0] > 0
    # no auto speculation on random weights; eagle3 without a head only with dummy weights
    assert LLM(str(tiny_config), load_format="dummy").engine.spec is None
    with pytest.raises(ConfigError, match="speculative_draft_model_path"):
        LLM(str(tiny_config), speculative_algorithm="eagle3")


def test_server_serves_a_dummy_model(tiny_config, tmp_path):
    import openai

    from tests.server.conftest import ServerProcess

    with ServerProcess(tiny_config, tmp_path, "--load-format", "dummy") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert client.models.list().data[0].id == f"dummy-{tiny_config.parent.name}"
        out = client.completions.create(
            model=f"dummy-{tiny_config.parent.name}",
            prompt="5 6 7",
            max_tokens=4,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 4
        assert len(out.choices[0].text.split()) == 4
    assert set(PRESETS) >= {"llama-3.1-8b", "llama-3.1-70b", "smollm2-135m"}
