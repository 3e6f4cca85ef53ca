"""GPU timing of the row argmax: torch.argmax against the two Triton kernels
(layers/triton_argmax.py) at the greedy-decoding shapes: R in 1, 4, 64 rows of 128,256 fp32
or bf16 logits (the target) and of 32,000 bf16 (the EAGLE-3 drafter), with ties planted.

Per shape and method: the median per-call time of a CUDA graph of 20 back-to-back calls
(launch overhead excluded; with PDL on, the Triton calls chain under programmatic dependent
launch), and the median of single eager calls between CUDA events (launch overhead
included). Methods: torch on the logits as they are, torch on an fp32 copy (bf16 only: the
sampler's former path), argmax_rows with PDL off and on, and a sweep of stage-1 blocks and
warps (graph, PDL off) to choose the defaults from. Every method's indices are compared
with torch.argmax before timing. Writes argmax_bench.json and argmax_bench.md to --out.

    PYTHONPATH=src python scripts/argmax_bench.py --out $OUT/argmax
    PYTHONPATH=src python scripts/argmax_bench.py --tiny --out /tmp/argmax   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

GRAPH_CALLS = 20
SHAPES = [(128256, "float32"), (128256, "bfloat16"), (32000, "bfloat16")]
ROWS = (1, 4, 64)
SWEEP = [(block, warps) for block in (1024, 2048, 4096, 8192) for warps in (4, 8)]


def logits(rows: int, n_cols: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random logits, each row's maximum planted twice (two chunks apart, or adjacent)."""
    x = torch.randn(rows, n_cols, device=device).to(dtype)
    for r in range(rows):
        first = (r * 7919) % (n_cols // 2)
        x[r, [first, first + (1 if r % 2 else n_cols // 3)]] = 30.0
    return x


def graph_us(fn, reps: int) -> float:
    """Median per call of a CUDA graph replaying GRAPH_CALLS calls of fn."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    for _ in range(3):
        graph.replay()
    return replay_us(graph, GRAPH_CALLS, reps)


def replay_us(graph, calls: int, reps: int) -> float:
    """Median over `reps` replays of `graph` (which makes `calls` calls) of the us per call,
    between CUDA events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def eager_us(fn, reps: int) -> float:
    """Median of single calls between CUDA events (on the CPU: wall clock)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def with_pdl(on: bool, fn):
    """fn with the PDL switch held at `on` while it is called (and captured)."""
    from specserve.layers import pdl

    def call():
        previous = pdl.set_enabled(on)
        try:
            return fn()
        finally:
            pdl.set_enabled(previous)

    return call


def shape_case(rows: int, n_cols: int, dtype_name: str, reps: int, device: str) -> dict:
    from specserve.layers import pdl
    from specserve.layers.triton_argmax import argmax_rows, triton_argmax

    x = logits(rows, n_cols, getattr(torch, dtype_name), device)
    ref = x.argmax(-1)
    # argmax_rows takes torch on the CPU: the smoke run calls the kernels directly
    ours = argmax_rows if device == "cuda" else triton_argmax
    methods = {"torch": lambda: x.argmax(-1)}
    if x.dtype != torch.float32:
        methods["torch_fp32_copy"] = lambda: x.float().argmax(-1)
    methods["triton_pdl_off"] = with_pdl(False, lambda: ours(x))
    methods["triton_pdl_on"] = with_pdl(True, lambda: ours(x))
    for block, warps in SWEEP:
        methods[f"b{block}_w{warps}"] = with_pdl(
            False, lambda block=block, warps=warps: triton_argmax(x, block, warps))
    case = dict(rows=rows, n_cols=n_cols, dtype=dtype_name, mismatches={}, graph_us={},
                eager_us={}, pdl_active=pdl.active(x.device))  # fmt: skip
    for name, fn in methods.items():
        bad = (fn() != ref).sum().item()
        if bad:
            case["mismatches"][name] = bad
        if device == "cuda":
            case["graph_us"][name] = round(graph_us(fn, reps), 2)
        if device == "cuda" or not name.startswith("b"):
            case["eager_us"][name] = round(eager_us(fn, reps), 2)
    return case


def markdown(cases: list[dict]) -> list[str]:
    cols = ["torch", "torch_fp32_copy", "triton_pdl_off", "triton_pdl_on"]
    lines = [f"| shape | mode | {' | '.join(cols)} | speed-up (PDL off) |",
             "|---|---|" + "---|" * (len(cols) + 1)]  # fmt: skip
    for c in cases:
        shape = f"{c['rows']} x {c['n_cols']} {c['dtype']}"
        for mode in ("graph_us", "eager_us"):
            us = c[mode]
            if not us:
                continue
            cells = [str(us.get(name, "")) for name in cols]
            gain = us["torch"] / us["triton_pdl_off"] if us.get("triton_pdl_off") else 0
            lines.append(f"| {shape} | {mode[:-3]} | {' | '.join(cells)} | {gain:.2f}x |")
    sweep = [name for name in cases[0]["graph_us"] if name.startswith("b")]
    if sweep:
        lines += ["", "Stage-1 block and warps, graph us, PDL off:", "",
                  f"| shape | {' | '.join(sweep)} |", "|---|" + "---|" * len(sweep)]
        for c in cases:
            cells = [str(c["graph_us"][name]) for name in sweep]
            lines.append(f"| {c['rows']} x {c['n_cols']} {c['dtype']} | {' | '.join(cells)} |")
    wrong = {f"{c['rows']}x{c['n_cols']}-{c['dtype']}": c["mismatches"]
             for c in cases if c["mismatches"]}  # fmt: skip
    lines += ["", f"Rows differing from torch.argmax: {wrong or 'none'}"]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="argmax_bench")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run through the interpreter")
    args = ap.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
        global SWEEP
        SWEEP = [(64, 4)]
        shapes, rows, device, reps = [(300, "float32"), (300, "bfloat16")], (1, 3), "cpu", 3
    else:
        from specserve.layers import triton_argmax

        triton_argmax.set_mode("always")  # the dispatcher's kernels for eager calls too
        shapes, rows, device, reps = SHAPES, ROWS, "cuda", args.reps
    cases = [shape_case(r, n, dt, reps, device) for n, dt in shapes for r in rows]
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  torch=torch.__version__, graph_calls=GRAPH_CALLS, reps=reps,
                  cases=cases)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "argmax_bench.json").write_text(json.dumps(result, indent=1))
    table = "\n".join(markdown(cases))
    (out / "argmax_bench.md").write_text(f"# argmax on {result['device']}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
