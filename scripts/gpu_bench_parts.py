"""Measurements gpu_bench.py takes besides the decode runs: HBM copy bandwidth, the
weights-only GEMM chain under a CUDA graph, the step time of every captured graph at a given
context, and a per-category kernel-time profile of one eager decode step."""

from __future__ import annotations

import functools
import itertools
import statistics
from collections import defaultdict

import torch

from specserve.layers.attention import AttentionMetadata


def _event_ms(fn, iters: int) -> float:
    """Median over `iters` of fn's device time (CUDA events), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = _event_ms(lambda: dst.copy_(src), 10)
    return 2 * num_bytes / (ms / 1e3)


@torch.inference_mode()
def gemm_chain_ms(model, m: int) -> float:
    """One step's weight GEMMs alone (qkv, o, gate_up, down per layer, then lm_head) for M
    tokens, replayed from a CUDA graph: the floor for a step at that M."""
    cfg = model.config
    p = next(model.parameters())
    x = torch.randn(m, cfg.hidden_size, dtype=p.dtype, device=p.device)
    xi = torch.randn(m, cfg.intermediate_size, dtype=p.dtype, device=p.device)
    xo = torch.randn(m, cfg.num_heads * cfg.head_dim, dtype=p.dtype, device=p.device)
    linear = torch.nn.functional.linear
    layers = model.model.layers

    def chain():
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj(x), attn.o_proj(xo), mlp.gate_up_proj(x), mlp.down_proj(xi)
        linear(x, model.lm_head_weight)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    ms = _event_ms(graph.replay, 20)
    del graph
    return ms


@torch.inference_mode()
def sample_ms(model, batch: int) -> float:
    """lm_head + fp32 logits + argmax for `batch` hidden states: the part of a decode step
    the benchmark runs outside the forward graph."""
    p = next(model.parameters())
    hidden = torch.randn(batch, model.config.hidden_size, dtype=p.dtype, device=p.device)
    if getattr(model, "gemv_plan", None) is not None:  # as the decode step's forward sets it
        model.gemv_plan.step_requests = batch
    return _graph_ms(lambda: model.compute_logits(hidden).argmax(-1), calls=5)


def _decode_meta(kv, batch: int, q: int, ctx: int, max_seq_len: int | None = None):
    """Pages for `batch` requests whose q new tokens end at position ctx + q - 1."""
    ps, device = kv.page_size, kv.pool.device
    pages = -(-(ctx + q) // ps)
    owned = [kv.allocator.allocate(pages) for _ in range(batch)]
    tables = torch.tensor(owned, dtype=torch.int64, device=device)
    pos = torch.arange(ctx, ctx + q, device=device).repeat(batch)
    req = torch.arange(batch, device=device).repeat_interleave(q)
    meta = AttentionMetadata(
        positions=pos, slot_mapping=tables[req, pos // ps] * ps + pos % ps,
        query_start_loc=torch.arange(batch + 1, device=device) * q,
        seq_lens=torch.full((batch,), ctx + q, device=device), block_tables=tables,
        max_query_len=q, max_seq_len=max_seq_len or ctx + q,
    )  # fmt: skip
    ids = torch.randint(1000, (batch * q,), device=device)
    return ids, meta, owned


@torch.inference_mode()
def graph_step_ms(runner, kv, ctx: int) -> dict[str, float]:
    """Median step time (input copies + replay) of every captured (batch, q) graph, with
    each request at context `ctx`; keyed 'B=..,q=..'."""
    out = {}
    for batch, q in sorted(runner.keys()):
        ids, meta, owned = _decode_meta(kv, batch, q, ctx)
        try:
            def three_steps():
                for _ in range(3):  # back to back: the CPU runs ahead of the first
                    runner.run(ids, meta)  # noqa: B023

            out[f"B={batch},q={q}"] = _event_ms(three_steps, 10) / 3
        finally:
            for pages in owned:
                kv.allocator.free(pages)
    return out


CATEGORIES = [
    ("paged_attn", "attention"), ("split_reduce", "attention"), ("kv_write", "kv_write"),
    ("rms_norm", "rmsnorm"), ("rotary", "rotary"), ("silu", "silu_mul"), ("gemm", "gemm"),
    ("gemv", "gemm"), ("nvjet", "gemm"), ("cutlass", "gemm"), ("xmma", "gemm"),
    ("splitk", "gemm"), ("memcpy", "memcpy"), ("argmax", "sampling"),
]  # fmt: skip


def _category(name: str) -> str:
    low = name.lower()
    return next((cat for key, cat in CATEGORIES if key in low), "other")


@torch.inference_mode()
def kernel_profile(model, kv, backend, batch: int, ctx: int, steps: int = 3) -> dict:
    """Device time per step by kernel category (microseconds) for an eager decode step at
    context `ctx`, plus the kernel count; the eager kernels are the ones a graph replays."""
    ids, meta, owned = _decode_meta(kv, batch, 1, ctx)
    try:
        model(ids, meta, kv.layers, backend)
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                model(ids, meta, kv.layers, backend)
            torch.cuda.synchronize()
        totals: dict[str, float] = defaultdict(float)
        examples: dict[str, str] = {}
        count = 0
        for evt in prof.events():
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            cat = _category(evt.name)
            totals[cat] += evt.time_range.elapsed_us() / steps
            examples.setdefault(cat, evt.name[:80])
            count += 1
        result = {k: round(v, 1) for k, v in sorted(totals.items(), key=lambda kv_: -kv_[1])}
        result["total"] = round(sum(totals.values()), 1)
        result["kernels_per_step"] = count / steps
        result["other_example"] = examples.get("other", "")
        return result
    except Exception as e:  # the profiler is optional: report, keep the benchmark
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        for pages in owned:
            kv.allocator.free(pages)


def _graph_ms(fn, calls: int = 10) -> float:
    """Device time of one fn() call, from a CUDA graph of `calls` back-to-back calls (no
    launch overhead in the number)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return _event_ms(graph.replay, 10) / calls


@torch.inference_mode()
def attention_sweep(kv, num_heads: int, ctx: int, max_seq_len: int, cases) -> dict:
    """Time the decode attention kernel alone (graph replays) over the split policy
    (programs per SM), keys per iteration, warps and stages, for each (batch, q) case at
    context ctx with the graphs' max_seq_len; pick the variant with the lowest sum of
    time / best time over the cases. Each variant's output is checked against the default's."""
    from specserve.layers.attention import triton_kernels as tk
    from specserve.layers.attention.triton_attn import LaunchConfig, TritonAttentionBackend

    k_cache, v_cache = kv.layers[0]
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    variants = list(itertools.product((0.25, 1, 2, 4, 8), (64, 128), (4, 8), (2, 3)))
    times: dict[tuple, dict[str, float]] = {v: {} for v in variants}
    table: dict[str, list] = {}
    for batch, q in cases:
        case = f"B={batch},q={q}"
        ids, meta, owned = _decode_meta(kv, batch, q, ctx, max_seq_len)
        try:
            qt = torch.randn(ids.shape[0], num_heads, head_dim, dtype=k_cache.dtype,
                             device=k_cache.device)  # fmt: skip
            args = (qt, k_cache, v_cache, meta.positions, meta.query_start_loc, meta.seq_lens,
                    meta.block_tables, q, head_dim**-0.5)  # fmt: skip
            ref = tk.paged_attention(*args, num_splits=1)
            kv_bytes = 2 * batch * (ctx + q) * kv_heads * head_dim * k_cache.element_size()
            rows = []
            for v in variants:
                pps, block_n, warps, stages = v
                backend = TritonAttentionBackend(programs_per_sm=pps)
                splits = backend.choose_num_splits(meta, kv_heads, num_heads // kv_heads,
                                                   qt.device)  # fmt: skip
                call = functools.partial(
                    tk.paged_attention, *args, num_splits=splits, block_n=block_n,
                    num_warps=warps, num_stages=stages,
                )  # fmt: skip
                row = dict(pps=pps, block_n=block_n, warps=warps, stages=stages, splits=splits)
                try:
                    err = ((call().float() - ref.float()).norm() / ref.float().norm()).item()
                    us = 1e3 * _graph_ms(call)
                except Exception as e:  # e.g. out of shared memory
                    rows.append({**row, "error": str(e)[:120]})
                    times[v][case] = float("inf")
                    continue
                times[v][case] = us
                rows.append({**row, "us": round(us, 2), "gbps": round(kv_bytes / us / 1e3),
                             "err_vs_unsplit": float(f"{err:.2g}")})  # fmt: skip
            table[case] = sorted(rows, key=lambda r: r.get("us", 1e9))
        finally:
            for pages in owned:
                kv.allocator.free(pages)
    best_per_case = {c: min(times[v][c] for v in variants) for c in table}

    def score(v):
        return sum(times[v][c] / best_per_case[c] for c in table) / len(table)

    ranked = sorted(variants, key=score)
    default = TritonAttentionBackend()
    d = default.decode
    default_v = (default.programs_per_sm, d.block_n, d.num_warps, d.num_stages)
    best = ranked[0]
    return dict(
        table={c: rows[:6] for c, rows in table.items()},
        best=dict(zip(("pps", "block_n", "warps", "stages"), best)),
        best_score=round(score(best), 3), default_score=round(score(default_v), 3),
        best_us=times[best], default_us=times[default_v],
        chosen_backend=TritonAttentionBackend(
            programs_per_sm=best[0], decode=LaunchConfig(best[1], best[2], best[3])
        ),
    )  # fmt: skip
