"""GPU benchmark of the paged attention kernels at decode and verify shapes (Llama-3.1-8B:
32 query heads over 8 KV heads of 128, bf16, pages of 16 tokens): the generic kernel at the
backend's current launch against the decode kernel (with and without register prefetch) over
launch configurations and split counts. Part of gpu_kernel_bench.py; runs alone too:

    PYTHONPATH=src python scripts/attn_kernel_bench.py --out $OUT/attn

Every case (batch 1/8/64 x context 512/2048/8192, 1 or 4 query tokens per request) times
each kernel configuration in CUDA graphs that call it once per "layer", each layer with its
own scattered pages, enough of them that the K/V read exceeds the L2 cache several times
over (the engine's 32 layers read cold K/V too). Reported per call: microseconds, achieved
GB/s of K/V read, max abs / relative error against a float32 PyTorch reference; the split
counts chosen by the backend's current policy and by triton_kernels.decode_num_splits.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from specserve.layers.attention import AttentionMetadata
from specserve.layers.attention import triton_kernels as tk
from specserve.layers.attention.triton_attn import TritonAttentionBackend
from specserve.layers.gemv_select import time_in_graph_us

KV_HEADS, GROUP, HEAD_DIM, PAGE = 8, 4, 128, 16
BATCHES, CONTEXTS, Q_LENS = (1, 8, 64), (512, 2048, 8192), (1, 4)
GRAPH_MAX_SEQ_LEN = 131072  # what the engine passes under CUDA graphs (the model's context)
SPLITS = (1, 2, 4, 8, 16, 32)
BASELINE = ("generic", 64, 4, 2)  # the backend's decode launch before this work
MAIN = [BASELINE, ("decode", 64, 4, 3), ("decode", 32, 4, 3)]  # swept over every split
OTHERS = [  # (kernel, block_n, warps, stages), timed at split 1 and at the best split of MAIN
    ("generic", 64, 4, 3), ("generic", 32, 4, 2), ("generic", 128, 8, 3), ("decode", 32, 4, 4),
    ("decode", 64, 4, 4), ("decode", 16, 4, 4), ("decode", 64, 8, 3),
    ("prefetch", 32, 4, 1), ("prefetch", 64, 4, 1), ("prefetch", 64, 8, 1),
]  # fmt: skip


def config_name(cfg) -> str:
    kernel, block_n, warps, stages = cfg
    return f"{kernel} n{block_n} w{warps} st{stages}"


class Case:
    """One (batch, context, query tokens) shape over `layers` distinct page sets."""

    def __init__(self, pool: tuple[torch.Tensor, torch.Tensor], batch: int, ctx: int,
                 q_len: int, min_bytes: int, gen: torch.Generator):  # fmt: skip
        self.batch, self.ctx, self.q_len = batch, ctx, q_len
        k_cache = pool[0]
        dev = k_cache.device
        self.kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * k_cache.element_size()
        pages_per_req = -(-ctx // PAGE)
        per_call = batch * pages_per_req
        layers = max(4, min(128, math.ceil(min_bytes / self.kv_bytes)))
        layers = max(1, min(layers, (k_cache.shape[0] - 1) // per_call))
        order = torch.randperm(k_cache.shape[0] - 1, generator=gen)[: layers * per_call] + 1
        self.tables = list(order.view(layers, batch, pages_per_req).to(dev))
        i64 = dict(dtype=torch.int64, device=dev)
        self.positions = (torch.arange(ctx - q_len, ctx, **i64)).repeat(batch)
        self.query_start_loc = torch.arange(batch + 1, **i64) * q_len
        self.seq_lens = torch.full((batch,), ctx, **i64)
        self.q = torch.randn(batch * q_len, KV_HEADS * GROUP, HEAD_DIM, generator=None,
                             device=dev, dtype=k_cache.dtype)  # fmt: skip
        self.pool = pool

    def meta(self, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(self.positions, self.positions, self.query_start_loc,
                                 self.seq_lens, self.tables[0], self.q_len,
                                 max_seq_len)  # fmt: skip

    def call(self, cfg, splits: int, layer: int = 0) -> torch.Tensor:
        kernel, block_n, warps, stages = cfg
        return tk.paged_attention(
            self.q, *self.pool, self.positions, self.query_start_loc, self.seq_lens,
            self.tables[layer], self.q_len, HEAD_DIM**-0.5, num_splits=splits,
            block_n=block_n, num_warps=warps, num_stages=stages, kernel=kernel,
        )  # fmt: skip

    def reference(self) -> torch.Tensor:
        """float32 attention of layer 0's queries over its pages, causal among the new
        tokens."""
        k_cache, v_cache = self.pool
        out = torch.empty(self.q.shape, dtype=torch.float32, device=self.q.device)
        keys = torch.arange(self.ctx, device=self.q.device)
        pos = torch.arange(self.ctx - self.q_len, self.ctx, device=self.q.device)
        hidden = (keys[None, :] > pos[:, None])[:, None, None, :]  # [t, 1, 1, L]
        for b in range(self.batch):
            pages = self.tables[0][b]
            k = k_cache[pages].reshape(-1, KV_HEADS, HEAD_DIM)[: self.ctx].float()
            v = v_cache[pages].reshape(-1, KV_HEADS, HEAD_DIM)[: self.ctx].float()
            rows = slice(b * self.q_len, (b + 1) * self.q_len)
            q = self.q[rows].float().view(self.q_len, KV_HEADS, GROUP, HEAD_DIM)
            s = torch.einsum("tkgd,lkd->tkgl", q, k) * HEAD_DIM**-0.5
            p = torch.softmax(s.masked_fill(hidden, float("-inf")), -1)
            out[rows] = torch.einsum("tkgl,lkd->tkgd", p, v).reshape(self.q_len, -1, HEAD_DIM)
        return out

    def time_us(self, cfg, splits: int, reps: int) -> float:
        self.call(cfg, splits)
        torch.cuda.synchronize()
        return time_in_graph_us(lambda _x, i: self.call(cfg, splits, i), None,
                                list(range(len(self.tables))), reps)  # fmt: skip


def compile_all(case_shapes, pool, workers: int) -> float:
    """Compile every (kernel config, split or not, row block) variant up front, in threads."""
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    jobs = [(Case(pool, 1, 64, q, 0, gen), cfg, s)
            for q in sorted({q for _, _, q in case_shapes})
            for cfg in [*MAIN, *OTHERS] for s in (1, 2)]  # fmt: skip
    device = pool[0].device

    def build(job):
        case, (kernel, block_n, warps, stages), splits = job
        try:  # a tiny launch: what matters is that the variant gets compiled
            with torch.cuda.device(device):
                tk.paged_attention(
                    case.q, *pool, case.positions, case.query_start_loc, case.seq_lens,
                    case.tables[0], case.q_len, 1.0, num_splits=splits, block_n=block_n,
                    num_warps=warps, num_stages=stages, kernel=kernel,
                )  # fmt: skip
        except Exception:  # reported when the case runs it
            pass

    build(jobs[0])
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(build, jobs[1:]))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_case(case: Case, reps: int, sms: int, deadline: float) -> dict:
    ref = case.reference()
    programs = case.batch * KV_HEADS
    current = TritonAttentionBackend().choose_num_splits(case.meta(GRAPH_MAX_SEQ_LEN),
                                                         KV_HEADS, GROUP, ref.device)  # fmt: skip
    wave = tk.decode_num_splits(programs, GRAPH_MAX_SEQ_LEN, sms)
    row = dict(batch=case.batch, ctx=case.ctx, q_len=case.q_len, layers=len(case.tables),
               kv_mb_per_call=round(case.kv_bytes / 1e6, 1), current_policy_splits=current,
               wave_policy_splits=wave, runs=[])  # fmt: skip
    done: set = set()

    def measure(cfg, splits):
        if (cfg, splits) in done or time.perf_counter() > deadline:
            return
        done.add((cfg, splits))
        entry = dict(config=config_name(cfg), splits=splits)
        try:
            out = case.call(cfg, splits).float()
            diff = (out - ref).abs()
            entry.update(max_abs_err=float(f"{diff.max().item():.3g}"),
                         rel_err=float(f"{(diff.norm() / ref.norm()).item():.3g}"))  # fmt: skip
            us = case.time_us(cfg, splits, reps)
            entry.update(us=round(us, 2), gbps=round(case.kv_bytes / us / 1e3, 1))
        except Exception as e:  # e.g. out of shared memory
            entry["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        row["runs"].append(entry)

    for cfg in MAIN:
        for s in sorted({*SPLITS, current, wave}):
            measure(cfg, s)
    timed = [r for r in row["runs"] if "us" in r]
    best_split = min(timed, key=lambda r: r["us"])["splits"] if timed else 1
    for cfg in OTHERS:
        for s in (1, best_split):
            measure(cfg, s)
    timed = [r for r in row["runs"] if "us" in r]
    if timed:
        base = next((r for r in timed if r["config"] == config_name(BASELINE)
                     and r["splits"] == current), None)  # fmt: skip
        best = min(timed, key=lambda r: r["us"])
        row.update(baseline_us=base and base["us"], baseline_gbps=base and base["gbps"],
                   best=f"{best['config']} s{best['splits']}", best_us=best["us"],
                   best_gbps=best["gbps"],
                   speedup=base and round(base["us"] / best["us"], 3),
                   max_rel_err=max(r["rel_err"] for r in timed))  # fmt: skip
    return row


@torch.inference_mode()
def attention_bench(deadline: float, reps: int = 5, workers: int = 8) -> dict:
    """Every case until `deadline` (perf_counter seconds); the rest is listed as skipped."""
    props = torch.cuda.get_device_properties(0)
    min_bytes = 4 * getattr(props, "L2_cache_size", 64 << 20)
    shapes = [(b, c, q) for q in Q_LENS for b in BATCHES for c in CONTEXTS]
    pages = max(b * -(-c // PAGE) for b, c, _ in shapes) + 1
    gen = torch.Generator().manual_seed(0)
    pool = tuple(torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda",
                             dtype=torch.bfloat16) for _ in "kv")  # fmt: skip
    result = dict(compile_s=round(compile_all(shapes, pool, workers), 1), cases=[], skipped=[])
    for b, c, q in shapes:
        if time.perf_counter() > deadline:
            result["skipped"].append(f"B{b}-ctx{c}-q{q}")
            continue
        case = Case(pool, b, c, q, min_bytes, gen)
        result["cases"].append(run_case(case, reps, props.multi_processor_count, deadline))
        del case
    return result


def markdown(res: dict) -> list[str]:
    lines = ["", f"## Paged attention (8B shape, bf16, page 16; variants compiled in "
             f"{res['compile_s']} s)", "",
             "| batch | ctx | q | splits now / wave | baseline us | GB/s | best | us | GB/s | "
             "x baseline | max rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in res["cases"]:
        lines.append(f"| {r['batch']} | {r['ctx']} | {r['q_len']} | {r['current_policy_splits']}"
                     f" / {r['wave_policy_splits']} | {r.get('baseline_us')} | "
                     f"{r.get('baseline_gbps')} | {r.get('best')} | {r.get('best_us')} | "
                     f"{r.get('best_gbps')} | {r.get('speedup')} | "
                     f"{r.get('max_rel_err')} |")  # fmt: skip
    lines += ["", "Per configuration, us at split 1 / at the current policy's split / best "
              "split (split):", ""]  # fmt: skip
    for r in res["cases"]:
        by_cfg: dict[str, list] = {}
        for run in r["runs"]:
            if "us" in run:
                by_cfg.setdefault(run["config"], []).append(run)
        cells = []
        for name, runs in by_cfg.items():
            one = next((x["us"] for x in runs if x["splits"] == 1), "-")
            now = next((x["us"] for x in runs if x["splits"] == r["current_policy_splits"]), "-")
            best = min(runs, key=lambda x: x["us"])
            cells.append(f"{name}: {one} / {now} / {best['us']} ({best['splits']})")
        lines.append(f"- B{r['batch']} ctx{r['ctx']} q{r['q_len']}: " + "; ".join(cells))
    if res["skipped"]:
        lines += ["", f"Attention cases skipped past the deadline: {', '.join(res['skipped'])}"]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--budget-s", type=float, default=150.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = attention_bench(time.perf_counter() + args.budget_s)
    (args.out / "attention.json").write_text(json.dumps(res, indent=1))
    (args.out / "attention.md").write_text("\n".join(markdown(res)) + "\n")
    print("\n".join(markdown(res)))


if __name__ == "__main__":
    main()
