"""A split decode/verify step's merge in the decode kernel (paged_attention's fused_merge: the
last program of each request and KV head merges the splits) against the separate merge
kernel, at the Llama-3.1-8B shape (32 query heads over 8 KV heads of 128, bf16, pages of 16)
for batch 1 and 64, contexts 768 and 4096, decode (1 query token) and verify of 3 drafts
(4), at the split counts the backend chooses eagerly (max_seq_len = the context) and under
CUDA graphs (max_seq_len = the model's context); a step the backend does not split (batch
64) is timed at 2 splits, marked "forced". Per split count: whether the two outputs are
bitwise equal and the arrival counters back at zero (after the graph replays too), the
relative error against an fp32 reference, and the device time per call of each path in
CUDA graphs over enough layers (distinct pages) to read K/V cold, PDL on (as the engine
runs) and off; plus the registers of each compiled decode-kernel variant. Run through
attn_kernel_bench.py:

    PYTHONPATH=src python scripts/attn_kernel_bench.py --merge --out $OUT/attn_merge
    PYTHONPATH=src python scripts/attn_kernel_bench.py --tiny    # CPU smoke (interpreter)

--tiny runs tiny shapes on the CPU through the Triton interpreter: the equality and counter
checks only, wall seconds of the interpreter instead of device times.
"""

from __future__ import annotations

import time

import torch
from attn_kernel_bench import GRAPH_MAX_SEQ_LEN, Case, tk

from specserve.layers import pdl
from specserve.layers.attention.triton_attn import DECODE_LAUNCH, TritonAttentionBackend

FULL = dict(kv_heads=8, group=4, head_dim=128, page=16, batches=(1, 64), contexts=(768, 4096),
            dtype=torch.bfloat16, device="cuda")  # fmt: skip
TINY = dict(kv_heads=2, group=4, head_dim=32, page=16, batches=(1, 3), contexts=(40, 100),
            dtype=torch.float16, device="cpu")  # fmt: skip
Q_LENS = (1, 4)
MIN_LAYERS = 4  # distinct page sets per timed graph at least (more for small steps)


def split_counts(case: Case) -> dict[int, str]:
    """splits -> which policy picks it: "eager" (max_seq_len = the context), "graph"
    (max_seq_len = GRAPH_MAX_SEQ_LEN), or "forced" (2, when neither splits)."""
    backend, chosen = TritonAttentionBackend(), {}
    for policy, max_seq_len in (("eager", case.ctx), ("graph", GRAPH_MAX_SEQ_LEN)):
        splits = backend.choose_num_splits(case.meta(max_seq_len), case.kv_heads, case.group,
                                           case.q.device)  # fmt: skip
        if splits > 1:
            chosen[splits] = "/".join(filter(None, (chosen.get(splits), policy)))
    return chosen or {2: "forced"}


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def merge_entry(case: Case, cfg: tuple, splits: int, policy: str, ref: torch.Tensor,
                reps: int) -> dict:  # fmt: skip
    """Both merges at one split count: equality, counters, error, times."""
    device = case.q.device
    separate = case.call(cfg, splits, fused_merge=False)
    start = time.perf_counter()
    fused = case.call(cfg, splits, fused_merge=True)
    wall_s = time.perf_counter() - start
    counters = tk.split_arrivals(device, 0)
    entry = dict(splits=splits, policy=policy, bitwise_equal=_bitwise_equal(fused, separate),
                 counters_zero=not counters.any().item(),
                 rel_err=float(f"{((fused.float() - ref).norm() / ref.norm()).item():.3g}"))
    if device.type != "cuda":
        entry["interpreter_s"] = round(wall_s, 2)  # not a timing: the smoke run's cost
        return entry
    previous = pdl.is_enabled()
    try:
        for on in (True, False):
            pdl.set_enabled(on)
            us = {mode: case.time_us(cfg, splits, reps, fused_merge=mode == "fused")
                  for mode in ("separate", "fused")}  # fmt: skip
            entry[f"pdl_{'on' if on else 'off'}"] = dict(
                separate_us=round(us["separate"], 2), fused_us=round(us["fused"], 2),
                saved_us=round(us["separate"] - us["fused"], 2))  # fmt: skip
    finally:
        pdl.set_enabled(previous)
    entry["counters_zero_after_graphs"] = not counters.any().item()
    again = case.call(cfg, splits, fused_merge=True)
    entry["bitwise_equal_after_graphs"] = _bitwise_equal(again, separate)
    return entry


def register_use() -> list[dict]:
    """Registers and spills of each decode-kernel variant compiled in this process (best
    effort: reads Triton's JIT cache)."""
    rows = []
    fn = tk._paged_attn_decode_kernel
    try:
        for cache in fn.device_caches.values():
            for kernel in cache[0].values():
                kernel._init_handles()
                consts = {fn.arg_names[k[0]] if isinstance(k, tuple) else k: v
                          for k, v in kernel.src.constants.items()}  # fmt: skip
                rows.append(dict({k: consts.get(k) for k in ("FUSED_MERGE", "PREFETCH",
                                                             "SPLIT", "BLOCK_M", "BLOCK_S")},
                                 n_regs=kernel.n_regs, n_spills=kernel.n_spills))  # fmt: skip
    except Exception as e:  # the cache's layout is Triton's, not ours
        rows.append(dict(error=f"{type(e).__name__}: {e}"[:200]))
    return rows


@torch.inference_mode()
def merge_bench(reps: int = 20, tiny: bool = False) -> dict:
    shape = TINY if tiny else FULL
    device = torch.device(shape["device"])
    cfg = (tk.DECODE_KERNEL, DECODE_LAUNCH.block_n, DECODE_LAUNCH.num_warps,
           DECODE_LAUNCH.num_stages)  # fmt: skip
    page = shape["page"]
    per_call = max(shape["batches"]) * -(-max(shape["contexts"]) // page)
    pool = tuple(torch.randn(MIN_LAYERS * per_call + 1, page, shape["kv_heads"],
                             shape["head_dim"], device=device, dtype=shape["dtype"])
                 for _ in "kv")  # fmt: skip
    min_bytes = 0
    if device.type == "cuda":
        min_bytes = 4 * getattr(torch.cuda.get_device_properties(device), "L2_cache_size",
                                64 << 20)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    result = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  config=f"{cfg[0]} n{cfg[1]} w{cfg[2]} st{cfg[3]}",
                  default_fused=tk.FUSED_SPLIT_MERGE, cases=[])  # fmt: skip
    for q_len in Q_LENS:
        for batch in shape["batches"]:
            for ctx in shape["contexts"]:
                case = Case(pool, batch, ctx, q_len, min_bytes, gen, group=shape["group"])
                ref = case.reference()
                row = dict(batch=batch, ctx=ctx, q_len=q_len, layers=len(case.tables),
                           runs=[merge_entry(case, cfg, s, policy, ref, reps)
                                 for s, policy in sorted(split_counts(case).items())])
                result["cases"].append(row)
                print(row, flush=True)
    result["decode_kernel_registers"] = register_use() if device.type == "cuda" else []
    return result


def merge_markdown(res: dict) -> list[str]:
    lines = ["", f"## Split merge in the decode kernel vs the merge kernel ({res['device']}, "
             f"{res['config']}; default fused: {res['default_fused']})", "",
             "| batch | ctx | q | splits (policy) | bitwise equal | counters 0 | rel err | "
             "PDL on: separate / fused us (saved) | PDL off: separate / fused us (saved) |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def timing(run, key):
        t = run.get(key)
        return f"{t['separate_us']} / {t['fused_us']} ({t['saved_us']:+})" if t else "-"

    for c in res["cases"]:
        for r in c["runs"]:
            equal = r["bitwise_equal"] and r.get("bitwise_equal_after_graphs", True)
            zero = r["counters_zero"] and r.get("counters_zero_after_graphs", True)
            lines.append(f"| {c['batch']} | {c['ctx']} | {c['q_len']} | {r['splits']} "
                         f"({r['policy']}) | {equal} | {zero} | {r['rel_err']} | "
                         f"{timing(r, 'pdl_on')} | {timing(r, 'pdl_off')} |")  # fmt: skip
    if res["decode_kernel_registers"]:
        lines += ["", "Decode kernel variants compiled: " + "; ".join(
            str(v) for v in res["decode_kernel_registers"])]  # fmt: skip
    return lines
