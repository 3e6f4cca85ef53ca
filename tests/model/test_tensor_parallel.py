"""The target model sharded over 2, 3 and 4 ranks (gloo, one process per rank, spawned once
for the module) computes the unsharded model's logits on every rank, through a prefill and
decode steps: Llama (llama3 rope, untied), Qwen2 (qkv bias, tied), Qwen3 (q/k norm,
untied), a GGUF file with quantized weights and `--load-format dummy` weights (each rank's
shards equal to the unsharded weights' parts); a vocabulary that no size divides, KV heads
split and replicated. The unsharded model is checked against transformers' forward too."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specserve.core.errors import ConfigError
from specserve.core.parallel import SINGLE_RANK, TensorParallel, split_evenly
from specserve.model.gguf_file import GgufTensor
from specserve.model.loader import ModelSource
from tests.support.distributed import run_ranks
from tests.support.tiny_models import make_tiny_model
from tests.support.tp_cases import (
    DECODE,
    EMBED_IDS,
    PROMPTS,
    Case,
    load,
    rank_results,
    sequences,
    step_logits,
)

VOCAB = 383  # divisible by none of 2, 3, 4: the last vocabulary shard is padded
SHAPE = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=96, num_attention_heads=12)
WORLD = 4
TOL = dict(rtol=1e-5, atol=1e-5)
# name -> (family, tied, KV heads, sizes): 2 KV heads split at 2, replicated at 4; 6 split
# at 2 and 3; 1 replicated everywhere
HF_CASES = {
    "llama": ("llama", False, 2, (2, 4)),
    "qwen2": ("qwen2", True, 6, (2, 3)),
    "qwen3": ("qwen3", False, 1, (2, 3, 4)),
}


def _write_gguf(path, seed=0):
    """A tiny llama-architecture GGUF: 2-D weights Q8_0 (blocks of 32 columns), norms F32.
    At 2 ranks down_proj's shard (64 of 128 columns) starts on a block boundary and o_proj's
    (48 of 96) does not; at 4 ranks neither of o_proj's (24)."""
    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    rng = np.random.default_rng(seed)
    hidden, inter, heads, kv_heads, head_dim = 96, 128, 12, 2, 8
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "vocab_size": VOCAB,
        "embedding_length": hidden,
        "feed_forward_length": inter,
        "block_count": 2,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "context_length": 64,
    }.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)

    def add(name, *shape):
        if len(shape) == 1:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        data = (0.2 * rng.standard_normal(shape)).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(data, q8), raw_dtype=q8)

    add("token_embd.weight", VOCAB, hidden)
    add("output.weight", VOCAB, hidden)
    add("output_norm.weight", hidden)
    for i in range(2):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        add(f"blk.{i}.ffn_gate.weight", inter, hidden)
        add(f"blk.{i}.ffn_up.weight", inter, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> list[Case]:
    out = []
    for name, (family, tied, kv_heads, sizes) in HF_CASES.items():
        folder = make_tiny_model(
            tmp_path_factory.mktemp(name),
            family,
            tie=tied,
            overrides={**SHAPE, "num_key_value_heads": kv_heads},
        )
        out.append(Case(name, ModelSource(folder, "hf"), sizes))
    gguf_path = _write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    out.append(Case("gguf", ModelSource(gguf_path, "gguf"), (2, 4)))
    config = tmp_path_factory.mktemp("dummy") / "config.json"
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 96,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 12,
        "num_key_value_heads": 6,
        "max_position_embeddings": 64,
        "vocab_size": VOCAB,
        "tie_word_embeddings": False,
    }
    config.write_text(json.dumps(raw))
    out.append(Case("dummy", ModelSource(config, "dummy"), (2, 3)))
    return out


@pytest.fixture(scope="module")
def ranks(cases) -> list[dict]:
    """Every rank's results, from one spawn of WORLD processes."""
    return run_ranks(rank_results, WORLD, cases)


@pytest.fixture(scope="module")
def unsharded(cases) -> dict:
    out = {}
    for case in cases:
        model = load(case)
        out[case.name] = {
            "logits": step_logits(model),
            "embed": model.model.embed_tokens(EMBED_IDS).detach(),
            "model": model,
        }
    return out


CASE_SIZES = [(name, size) for name, (*_, sizes) in HF_CASES.items() for size in sizes]
CASE_SIZES += [("gguf", 2), ("gguf", 4), ("dummy", 2), ("dummy", 3)]


@pytest.mark.parametrize("name, size", CASE_SIZES)
def test_every_rank_has_the_unsharded_logits(ranks, unsharded, name, size):
    want = unsharded[name]
    for rank in range(size):
        got = ranks[rank][f"{name}/{size}"]
        assert len(got["logits"]) == 1 + len(DECODE)
        for step, (a, b) in enumerate(zip(got["logits"], want["logits"])):
            assert a.shape == tuple(b.shape)  # the whole vocabulary, padding dropped
            torch.testing.assert_close(torch.from_numpy(a), b, **TOL, msg=f"rank {rank} {step}")
        # full embeddings from the vocabulary-parallel embedding (what EAGLE-3 reads)
        torch.testing.assert_close(torch.from_numpy(got["embed"]), want["embed"], **TOL)


@pytest.mark.parametrize("name, size", CASE_SIZES)
def test_local_heads_keep_the_gqa_ratio(ranks, unsharded, name, size):
    cfg = unsharded[name]["model"].config
    q, kv, cache_kv = ranks[0][f"{name}/{size}"]["heads"]
    assert q == cfg.num_heads // size
    assert kv == cache_kv == max(1, cfg.num_kv_heads // size)  # replicated below the size
    assert q // kv == cfg.num_heads // cfg.num_kv_heads or cfg.num_kv_heads < size


@pytest.mark.parametrize("name", list(HF_CASES))
def test_unsharded_logits_match_transformers(cases, unsharded, name):
    import transformers

    case = next(c for c in cases if c.name == name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(case.source.path, dtype=torch.float32)
    got = unsharded[name]["logits"]
    with torch.no_grad():
        for i, seq in enumerate(sequences()):
            want = ref(torch.tensor([seq])).logits[0]
            n = len(PROMPTS[i])
            first = sum(len(p) for p in PROMPTS[:i])
            torch.testing.assert_close(got[0][first : first + n], want[:n], rtol=1e-4, atol=1e-4)
            for step in range(len(DECODE)):
                torch.testing.assert_close(got[1 + step][i], want[n + step], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("size", [2, 3])
def test_dummy_shards_are_the_unsharded_weights_parts(ranks, unsharded, size):
    model = unsharded["dummy"]["model"]
    layer = model.model.layers[0]
    cfg = model.config
    d, rows = cfg.head_dim, -(-VOCAB // size)
    qkv = layer.self_attn.qkv_proj.weight.split(
        [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
    )
    inter = cfg.intermediate_size
    gate, up = layer.mlp.gate_up_proj.weight.split(inter)
    for rank in range(size):
        got = {k: torch.from_numpy(v) for k, v in ranks[rank][f"dummy/{size}"]["weights"].items()}
        embed = model.model.embed_tokens.weight[rank * rows : (rank + 1) * rows]
        assert torch.equal(got["embed"][: embed.shape[0]], embed)
        assert not got["embed"][embed.shape[0] :].any()  # padding rows
        q, kv, i = cfg.num_heads * d // size, cfg.num_kv_heads * d // size, inter // size
        want = torch.cat([t[rank * n : (rank + 1) * n] for t, n in zip(qkv, (q, kv, kv))])
        assert torch.equal(got["qkv"], want)
        assert torch.equal(
            got["o_proj"], layer.self_attn.o_proj.weight[:, rank * q : (rank + 1) * q]
        )
        want = torch.cat([gate[rank * i : (rank + 1) * i], up[rank * i : (rank + 1) * i]])
        assert torch.equal(got["gate_up"], want)
        assert torch.equal(got["down"], layer.mlp.down_proj.weight[:, rank * i : (rank + 1) * i])


def test_shapes_a_group_cannot_split_are_refused(ranks):
    at2, at3, at4 = (ranks[0][f"errors/{s}"] for s in (2, 3, 4))
    assert at2["heads"] == at4["heads"].replace(" 4", " 2")
    assert at2["heads"].startswith("num_heads 9 is not divisible by tensor_parallel_size 2")
    assert at2["kv_heads"] == "" and at2["intermediate"] == ""
    assert at4["kv_heads"].startswith("num_kv_heads 6 is not divisible by tensor_parallel_size 4")
    assert at4["intermediate"].startswith("intermediate_size 90 is not divisible by")
    assert at3["heads"] == at3["kv_heads"] == "" and at3["intermediate"] == ""
    assert at2["kv_replicas"] == at4["kv_replicas"] == ""  # 1 KV head a rank, split/replicated
    assert at3["kv_replicas"].startswith(
        "tensor_parallel_size 3 is not a multiple of num_kv_heads 2"
    )


def test_a_model_config_is_checked_against_a_group_size():
    from specserve.layers.parallel import check_shards
    from tests.support.model_cases import tiny_config

    cfg = tiny_config()  # 4 heads, 2 KV heads, intermediate 96
    for size in (1, 2, 4):  # at 4: one KV head a rank, each a replica
        check_shards(cfg, size, "the model")
    with pytest.raises(ConfigError, match="^the model cannot be split over 3 ranks: num_heads 4"):
        check_shards(cfg, 3, "the model")
    with pytest.raises(ConfigError, match="^the draft cannot be split over 2 ranks: interm"):
        check_shards(tiny_config(intermediate_size=95), 2, "the draft")
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 is not a multiple of num_kv"):
        check_shards(tiny_config(num_heads=12, num_kv_heads=3), 4, "the model")


def test_split_and_group_checks():
    assert split_evenly(12, 3, "num_heads") == 4
    with pytest.raises(ConfigError, match="num_heads 9 is not divisible by tensor_parallel_size 2"):
        split_evenly(9, 2, "num_heads")
    with pytest.raises(ConfigError, match="needs its group"):
        TensorParallel(0, 2)
    with pytest.raises(ConfigError, match="outside"):
        TensorParallel(2, 2, group=object())
    x = torch.ones(3)
    assert SINGLE_RANK.all_reduce(x) is x and SINGLE_RANK.all_gather(x, 0) is x


def test_gguf_parts_equal_the_whole_tensors_parts(cases):
    """Row shards sliced before dequantizing, column shards in the quantized bytes (on block
    boundaries) or after: the same values as the whole tensor dequantized, then sliced."""
    from specserve.core.parallel import TensorSlice
    from specserve.model.gguf_file import _reader

    path = next(c for c in cases if c.name == "gguf").source.path
    tensors = {t.name: t for t in _reader(path).tensors}
    for name, part in [
        ("blk.0.ffn_down.weight", TensorSlice(1, 64, 64, 128)),  # on a block boundary
        ("blk.0.attn_output.weight", TensorSlice(1, 48, 48, 96)),  # inside a block
        ("blk.0.ffn_gate.weight", TensorSlice(0, 32, 32, 128)),
        ("token_embd.weight", TensorSlice(0, 288, 95, VOCAB)),
        ("blk.0.attn_norm.weight", TensorSlice(0, 24, 24, 96)),
    ]:
        entry = GgufTensor(tensors[name])
        assert torch.equal(entry.read(part), part.take(entry.read(None))), name


def test_a_rank_reads_only_its_slices_of_safetensors(cases, unsharded, monkeypatch):
    """Sharded tensors come through `get_slice`, never whole (`get_tensor`); the rank's
    parameters are the unsharded ones' parts. (Loading runs no collective: a stand-in group
    will do.)"""
    import safetensors

    from specserve.model.checkpoint import assign_weights, placements
    from specserve.model.llama import LlamaForCausalLM
    from specserve.model.loader import safetensors_tensors

    whole: list[str] = []
    real_open = safetensors.safe_open

    class Handle:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            whole.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Handle)
    case = next(c for c in cases if c.name == "qwen2")
    ref = unsharded["qwen2"]["model"]
    tp = TensorParallel(1, 3, group=object())
    with torch.device("meta"):
        model = LlamaForCausalLM(ref.config, tp)
    tensors, _ = safetensors_tensors(case.source.path)
    assign_weights(model, tensors, torch.float32, torch.device("cpu"))
    sliced = {k for k, p in placements(model).items() if p.part is not None}
    assert sliced and not sliced & set(whole)
    assert set(whole) == {k for k in placements(model) if k not in sliced}
    layer, ref_layer = model.model.layers[1], ref.model.layers[1]
    q, kv = 12 * 8 // 3, 6 * 8 // 3
    bias = ref_layer.self_attn.qkv_proj.bias.split([96, 48, 48])
    want = torch.cat([bias[0][q : 2 * q], bias[1][kv : 2 * kv], bias[2][kv : 2 * kv]])
    assert torch.equal(layer.self_attn.qkv_proj.bias, want)  # the bias shards with its rows
    rows = -(-VOCAB // 3)
    embed = model.model.embed_tokens.weight
    assert torch.equal(embed, ref.model.embed_tokens.weight[rows : 2 * rows])


def test_a_sharded_eagle3_head_computes_the_whole_heads_outputs(tmp_path):
    """`--speculative-head-parallel sharded`: each of two ranks holds half the head's query
    and KV heads, MLP columns and draft vocabulary (fc whole) and, over a prefill and a decode
    step, gets the whole head's outputs, logits and draft ids; loaded from a checkpoint
    (its slices only) and built as a dummy of the same seed alike."""
    from specserve.core.model_config import load_hf_config
    from specserve.model.dummy import build_dummy_eagle3_head
    from specserve.model.eagle3 import load_eagle3_head
    from tests.support.tiny_models import make_random_eagle3_head
    from tests.support.tp_cases import DUMMY_SEED, head_results, head_steps

    target = make_tiny_model(tmp_path / "target", num_layers=8)  # (the dummy's default aux)
    folder = make_random_eagle3_head(tmp_path / "head", target, draft_vocab=101)  # (odd: padded)
    cfg = load_hf_config(target)
    cpu = torch.device("cpu")
    whole = {
        "loaded": head_steps(load_eagle3_head(folder, cfg, torch.float32, cpu).merge_projections()),
        "dummy": head_steps(
            build_dummy_eagle3_head(cfg, torch.float32, cpu, DUMMY_SEED).merge_projections()
        ),
    }
    ranks = run_ranks(head_results, 2, str(folder), cfg)
    for rank, got in enumerate(ranks):
        for kind, want in whole.items():
            assert got[kind]["heads"] == (want["heads"][0] // 2, want["heads"][1] // 2)
            for key, value in want.items():
                if key == "heads":
                    continue
                if key.startswith("greedy"):
                    assert torch.equal(torch.from_numpy(got[kind][key]), value), (rank, kind, key)
                else:
                    torch.testing.assert_close(
                        torch.from_numpy(got[kind][key]), value, **TOL, msg=f"{rank} {kind} {key}"
                    )
