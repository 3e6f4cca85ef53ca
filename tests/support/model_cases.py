"""Model-level checks of the fast path: a tiny random Llama through prefill, decode and verify
steps with a given backend, and the CUDA-graph runner's padding, each against the plain
torch-backend forward. Shared by CPU tests, the interpreter run and the GPU tests."""

from __future__ import annotations

import torch

from specserve.core.kv_cache import KVCache
from specserve.core.model_config import ModelConfig
from specserve.layers.attention import AttentionMetadata, TorchAttentionBackend
from specserve.model.llama import LlamaForCausalLM
from specserve.runtime.cuda_graphs import CudaGraphRunner
from tests.support.spies import spy_on


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        architecture="LlamaForCausalLM",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_model(cfg: ModelConfig, dtype, device, seed=0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # non-trivial norm weights
            p.data = 1 + 0.1 * torch.randn_like(p)
    model = model.to(dtype=dtype, device=device).eval()
    model.rotary.materialize(torch.device(device))
    return model


def build_meta(tables, starts, ends, page_size, device) -> AttentionMetadata:
    """Request b computes positions starts[b]..ends[b]-1 over pages tables[b]."""
    positions, slots, qsl = [], [], [0]
    width = max(len(t) for t in tables)
    for table, start, end in zip(tables, starts, ends):
        for p in range(start, end):
            positions.append(p)
            slots.append(table[p // page_size] * page_size + p % page_size)
        qsl.append(qsl[-1] + end - start)
    padded = [t + [0] * (width - len(t)) for t in tables]

    def dev(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    return AttentionMetadata(
        dev(positions),
        dev(slots),
        dev(qsl),
        dev(ends),
        dev(padded),
        max(e - s for s, e in zip(starts, ends)),
        max(ends),
    )


def _steps(prompt_lens, q_after):
    """(starts, ends) of a prefill step, then one step per entry of q_after."""
    ends = list(prompt_lens)
    steps = [([0] * len(ends), list(ends))]
    for q in q_after:
        steps.append((list(ends), [e + q for e in ends]))
        ends = [e + q for e in ends]
    return steps


def model_error(
    backend, dtype, device, page_size, fused_ops=None, seed=0, prompt_lens=(6, 4, 3), q_after=(1, 3)
) -> float:
    """Largest relative error of the final hidden states, `backend` (with the Triton fused
    ops when `fused_ops`, the triton_ops module, is given) against the torch backend and
    plain modules, over a prefill, decode and verify steps."""
    cfg = tiny_config()
    model = tiny_model(cfg, dtype, device, seed)
    gen = torch.Generator().manual_seed(seed)
    total = max(prompt_lens) + sum(q_after)
    pages = -(-total // page_size)
    kv = [KVCache(cfg, 1 + pages * len(prompt_lens), page_size, dtype, device) for _ in "ab"]
    tables = [kv[0].allocator.allocate(pages) for _ in prompt_lens]
    worst = 0.0
    with torch.inference_mode():
        for starts, ends in _steps(prompt_lens, q_after):
            meta = build_meta(tables, starts, ends, page_size, device)
            ids = torch.randint(cfg.vocab_size, (meta.positions.shape[0],), generator=gen)
            ids = ids.to(device)
            if fused_ops is not None:
                fused_ops.use_triton_ops(model, enable=False)
            ref, _ = model(ids, meta, kv[0].layers, TorchAttentionBackend())
            if fused_ops is not None:
                fused_ops.use_triton_ops(model)
            out, _ = model(ids, meta, kv[1].layers, backend)
            worst = max(worst, _rel(out, ref))
    return worst


def runner_padding_error(backend, dtype, device, page_size=4, use_graphs=False, seed=0) -> float:
    """Run a 3-request decode step and a verify step (3 tokens each) through a
    CudaGraphRunner (padded to bucket 4) and directly; return the largest relative error of
    the hidden states and of the KV pages outside scratch page 0 (padding must write only
    there)."""
    cfg = tiny_config()
    model = tiny_model(cfg, dtype, device, seed)
    prompt_lens = (5, 3, 2)
    pages = -(-(max(prompt_lens) + 8) // page_size)
    kv = [KVCache(cfg, 1 + 3 * pages, page_size, dtype, device) for _ in "ab"]
    tables = [kv[0].allocator.allocate(pages) for _ in prompt_lens]
    runner = CudaGraphRunner(
        model, kv[1].layers, backend, (1, 4), (1, 3), max_seq_len=64, use_graphs=use_graphs
    )
    runner.capture()
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    with torch.inference_mode():
        for i, (starts, ends) in enumerate(_steps(prompt_lens, (1, 3))):
            meta = build_meta(tables, starts, ends, page_size, device)
            ids = torch.randint(cfg.vocab_size, (meta.positions.shape[0],), generator=gen)
            ids = ids.to(device)
            ref, _ = model(ids, meta, kv[0].layers, backend)
            if i == 0:  # prefill is not a graph shape
                model(ids, meta, kv[1].layers, backend)
                continue
            assert runner.can_run(meta, ids.shape[0])
            out, _ = runner.run(ids, meta)
            worst = max(worst, _rel(out, ref))
    return max(worst, _pages_error(kv))


def runner_mixed_error(backend, dtype, device, page_size=4, use_graphs=False, seed=0) -> float:
    """Run steps mixing prefill chunks with decode and verify rows through a
    CudaGraphRunner's mixed graphs (padded to request and token buckets) and directly;
    return the largest relative error of the hidden states and of the KV pages outside
    scratch page 0. The steps: two prompts together (the second short enough to pass for
    a verify row, after a chunk), then decode and verify rows beside a joining prompt, and
    beside one longer than a tile (TILE_ROWS rows: 64 tokens of this model's 2 query heads
    a KV head)."""
    from dataclasses import replace

    cfg = tiny_config()
    model = tiny_model(cfg, dtype, device, seed)
    steps = [  # (request, first position, tokens)
        [(0, 0, 5), (1, 0, 3)],
        [(0, 5, 1), (1, 3, 3), (2, 0, 7)],
        [(0, 6, 3), (1, 6, 1), (2, 7, 1), (3, 0, 70)],
    ]
    pages = -(-96 // page_size)
    kv = [KVCache(cfg, 1 + 4 * pages, page_size, dtype, device) for _ in "ab"]
    tables = [kv[0].allocator.allocate(pages) for _ in range(4)]
    runner = CudaGraphRunner(
        model,
        kv[1].layers,
        backend,
        (1, 4),
        (1, 3),
        max_seq_len=128,
        use_graphs=use_graphs,
        mixed_requests=(4, 8),
        mixed_tokens=(16, 32, 128),
    )
    runner.capture()
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    with torch.inference_mode():
        for step in steps:
            starts = [start for _, start, _ in step]
            ends = [start + n for _, start, n in step]
            meta = build_meta([tables[r] for r, _, _ in step], starts, ends, page_size, device)
            meta = replace(meta, query_lens=[n for *_, n in step], seq_bounds=ends, prefill=True)
            ids = torch.randint(cfg.vocab_size, (meta.positions.shape[0],), generator=gen)
            ids = ids.to(device)
            ref, _ = model(ids, meta, kv[0].layers, backend)
            assert not runner.can_run(meta, ids.shape[0])
            assert runner.can_run_mixed(meta, ids.shape[0])
            out, _ = runner.run_mixed(ids, meta)
            worst = max(worst, _rel(out, ref))
    return max(worst, _pages_error(kv))


def _pages_error(kv) -> float:
    """Largest relative error of the second cache's K/V pages against the first's, outside
    the scratch page 0."""
    worst = 0.0
    for (ka, va), (kb, vb) in zip(kv[0].layers, kv[1].layers):
        worst = max(worst, _rel(kb[1:], ka[1:]), _rel(vb[1:], va[1:]))
    return worst


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def logits_head(model):
    """The engine's in-graph logits head for `model` (engine._capture_graphs)."""
    return lambda hidden: model.compute_logits(hidden, fp32=False)


def install_padded_runner(llm, q_lens, aux_layer_ids=(), in_graph=True, mixed=True) -> dict:
    """Give `llm`'s engine the CUDA-graph runner's padded path, run eagerly (buckets 1-8,
    contexts up to 512; with `mixed`, steps mixing prefill chunks with decode rows up to
    64 tokens too), as on a GPU (with aux layers and `in_graph`, the drafter's feature
    writer runs inside that path, as in a graph; the logits and greedy tokens always do, as
    the engine's graphs take them); returns {"graph": decode and verify steps it served,
    "mixed": mixed steps}."""
    from specserve.runtime.cuda_graphs import CudaGraphRunner

    runner, spec = llm.engine.runner, llm.engine.spec
    writer = spec.proposer.feature_writer() if spec and aux_layer_ids and in_graph else None
    graphs = CudaGraphRunner(
        runner.model,
        runner.kv.layers,
        runner.backend,
        (1, 2, 4, 8),
        q_lens=q_lens,
        max_seq_len=512,
        aux_layer_ids=aux_layer_ids,
        use_graphs=False,
        feature_writer=writer,
        logits_head=logits_head(runner.model),
        mixed_requests=(4, 8, 16) if mixed else (),
        mixed_tokens=(16, 64) if mixed else (),
    )
    graphs.capture()
    runner.graphs = graphs
    calls = {"graph": 0, "mixed": 0}
    run, run_mixed = graphs.run, graphs.run_mixed

    def counting_run(*args):
        calls["graph"] += 1
        return run(*args)

    def counting_run_mixed(*args):
        calls["mixed"] += 1
        return run_mixed(*args)

    spy_on(graphs, "run", counting_run)
    spy_on(graphs, "run_mixed", counting_run_mixed)
    return calls
