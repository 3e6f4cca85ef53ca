"""The out-of-the-box configuration on a GPU: the embedded SmolLM2-135M-Instruct with its
shipped EAGLE-3 head and REAL acceptance (no simulation), side by side in one run.

Configurations: no speculation; EAGLE-3 fixed K=3; EAGLE-3 under the goodput policy (what
`specserve serve` does by default); EAGLE-3 loaded with the policy off. Workload: the shipped
head's held-out prompts (training kinds) and the prompts unlike its training data
(docs/benchmarks/eagle3_unlike_prompts.jsonl), chat template applied, greedy, up to
--max-tokens new tokens (stopping at EOS like a real client). At batch b the first b prompts
(cycled) are submitted together and run to completion; batch 1 runs --batch1-prompts prompts
one after another (larger batches run --repeats times: the median run reported, and beside
it the median over repeats of each run's rate over the plain run of the same repeat,
`x_plain_paired`, which a slow stretch of the host skews less). Throughput
counts output tokens over wall time, prefill included. Every
configuration is warmed up first (Triton compiles each new shape once; every timed prompt is
prefilled once, as the first prefill of a length is slower), then the garbage collector is
frozen as the server's engine process does (`--no-gc-freeze`: not; each row reports the
collector's pauses); `--again` builds the first configuration once more, last. Every engine
stays alive and their runs are interleaved (at each batch size, repeat by repeat, one run of
each configuration in turn): these steps are paced by the host, whose CPU runs identical
steps up to 60% slower for stretches on the lent machines, so
a stretch falls on every configuration's runs rather than on one engine's.
`--sequential`: each engine built, measured and let go in turn (the runs up to session 15). Each
engine's entry holds the target's GEMV plan and what whole-step tuning changed, and its
speculation counters (which include the warm-up's requests). Also reports how many
outputs equal the no-speculation outputs token for token (greedy speculation is lossless in
exact arithmetic; bf16 kernels of different shapes may round differently, so this is
reported, not asserted), and at batch 1 how many equal the same engine's outputs with
every step at K=0 (`identical_to_own_k0`: its own plain decoding, same kernels; at every
batch up to 16 whose verify steps stay within 64 rows, 16 at K=3). Each row
also gives the steps the overlap loop launched only after waiting for the previous step's
tokens, by reason (`loop_wait_reasons`), and the timeline
(mean and median device span, idle gap and host wait per step); `<out>_steps.json`
holds those per step for every configuration at batch 1 and, above it, for the last run of
each batch size, with the policy's K and period (the whole trace so far).

    PYTHONPATH=src python benchmarks/gpu_default_model.py --out $OUT/default_model
    PYTHONPATH=src python benchmarks/gpu_default_model.py --smoke --out /tmp/default_model  # CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import GC_PAUSES, tuning_reports  # noqa: E402
from gpu_engine import add_run_args  # noqa: E402 (options shared with it)

from specserve.core.config import shipped_head_path  # noqa: E402
from specserve.core.sampling_params import SamplingParams  # noqa: E402
from specserve.kernels.gemv_configs import MAX_ROWS  # noqa: E402
from specserve.llm import LLM  # noqa: E402
from specserve.tuning.gemv_select import SHARED_ROWS  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
UNLIKE = REPO / "docs" / "benchmarks" / "eagle3_unlike_prompts.jsonl"


def read_conversations(path: Path) -> list[list[dict]]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            out.append(item.get("messages") or [{"role": "user", "content": item["prompt"]}])
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_batch(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync()
    return [o.token_ids for o in outs], time.perf_counter() - t0


def counter_delta(before: dict, after: dict) -> dict:
    """What a counter of the engine's stats() gained between two readings."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def timeline(times) -> dict:
    """Means and medians of the steps' device spans and idle gaps (CUDA events) and of the
    host's waits for tokens: a device-bound loop waits and leaves no gap, a host-bound
    one leaves gaps and does not wait."""
    out = {}
    for name in ("step_ms", "gap_ms", "wait_ms"):
        values = sorted(getattr(times, name))
        if values:
            out[name] = [round(sum(values) / len(values), 3), round(values[len(values) // 2], 3)]
    return out


def series(engine, since: int = 0) -> dict:
    """Per-step series of the run just measured: device span, idle gap and host wait of each
    step (prefill steps too), and the policy's K and measured period of each step with
    decoding requests, from its `since`-th decision on (the decisions the run made)."""
    times = engine.loop.times
    out = {
        name: [round(v, 3) for v in getattr(times, name)]
        for name in ("step_ms", "gap_ms", "wait_ms")
    }
    spec = engine.spec
    if spec is not None:
        trace = spec.policy.trace
        decisions = trace.dump()  # the last TRACE_STEPS of them
        decisions = decisions[max(0, len(decisions) - (trace.num_decisions - since)) :]
        out["k"] = [d["k"] for d in decisions]
        out["period_ms"] = [d["observed_ms"] and round(d["observed_ms"], 3) for d in decisions]
    return out


def own_k0_tokens(llm: LLM, prompts: list[list[int]], batch: int, args) -> list[list[int]]:
    """The prompts of `batch` (as `measure` runs them) once more on the same engine with
    every step at K=0: plain decode steps through its own graphs and GEMV plan, which its
    speculation must reproduce token for token where its verify steps stay within the rows
    whose kernels round alike (another engine's plan may choose other kernels)."""
    policy = llm.engine.spec.policy
    policy.choose = lambda reqs, *_: [0] * len(reqs)  # this instance only, until deleted
    try:
        if batch == 1:
            return [
                run_batch(llm, [p], args.max_tokens)[0][0] for p in prompts[: args.batch1_prompts]
            ]
        return run_batch(llm, [prompts[i % len(prompts)] for i in range(batch)], args.max_tokens)[0]
    finally:
        del policy.choose


def measure(llm: LLM, prompts: list[list[int]], batch: int, args) -> tuple:
    """Output tok/s at one batch size; the token ids of every request; the run's per-step
    series (`series`)."""
    engine = llm.engine
    stats0 = engine.stats()
    decisions0 = engine.spec.policy.trace.num_decisions if engine.spec is not None else 0
    engine.loop.times.clear()
    if batch == 1:
        chosen = prompts[: args.batch1_prompts]
        results = [run_batch(llm, [p], args.max_tokens) for p in chosen]
        tokens = [t for r in results for t in r[0]]
        seconds = sum(r[1] for r in results)
    else:
        chosen = [prompts[i % len(prompts)] for i in range(batch)]
        tokens, seconds = run_batch(llm, chosen, args.max_tokens)
    stats = engine.stats()
    num_out = sum(len(t) for t in tokens)
    row = {
        "batch": batch,
        "requests": len(chosen),
        "output_tokens": num_out,
        "seconds": round(seconds, 3),
        "output_tok_s": round(num_out / seconds, 1),
        "steps": stats["steps"] - stats0["steps"],
        "loop_waits": stats["loop_waits"] - stats0["loop_waits"],
        "loop_wait_reasons": counter_delta(stats0["loop_wait_reasons"], stats["loop_wait_reasons"]),
    }
    row["timeline"] = timeline(engine.loop.times)
    if "spec_position_drafted" in stats:
        drafted = [
            a - b for a, b in zip(stats["spec_position_drafted"], stats0["spec_position_drafted"])
        ]
        accepted = [
            a - b for a, b in zip(stats["spec_position_accepted"], stats0["spec_position_accepted"])
        ]
        row["draft_tokens"] = sum(drafted)
        row["accepted_tokens"] = sum(accepted)
        row["per_position_acceptance"] = [
            round(a / d, 3) if d else None for a, d in zip(accepted, drafted)
        ]
    return row, tokens, series(engine, decisions0)


def build(base: dict, extra: dict, convs: list, args) -> tuple[LLM, list, float]:
    """An engine of one configuration, warmed up: (the LLM, the chat prompts as token ids,
    start-up seconds)."""
    t0 = time.perf_counter()
    llm = LLM(None, **base, **extra)
    startup = time.perf_counter() - t0
    prompts = [llm.apply_chat_template(c) for c in convs]
    # Warm-up: Triton compiles each new shape once, and the first prefill of each prompt
    # length in the process is slower (~2x in the first engine: library set-up per
    # shape): every prompt the timed runs use is prefilled once first.
    for b in args.batches:
        run_batch(llm, [prompts[i % len(prompts)] for i in range(b)], 16)
    for p in prompts[: max(args.batch1_prompts, max(args.batches))]:
        run_batch(llm, [p], 2)
    return llm, prompts, startup


def freeze(args) -> None:
    if not args.no_gc_freeze:  # as server/engine_proc.py does after loading
        gc.collect()
        gc.freeze()


def release() -> None:
    """After the caller dropped an engine: its cycles collected and its memory freed."""
    gc.unfreeze()  # the engine's cycles must be collectable to free its memory
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


START = time.perf_counter()  # the runs' start times count from here


def timed(llm: LLM, prompts: list, batch: int, args) -> tuple:
    """One `measure` run, with when it started and the collector's pauses during it."""
    GC_PAUSES.clear()
    started = time.perf_counter() - START
    row, tokens, steps = measure(llm, prompts, batch, args)
    row["started_s"] = round(started, 3)
    return row, tokens, steps, GC_PAUSES.summary()


def run_interleaved(built: dict, args) -> dict:
    """The engines' timed runs (name -> batch -> runs): at each batch size, repeat by
    repeat, one run of each engine in turn."""
    runs = {name: {b: [] for b in args.batches} for name in built}
    for b in args.batches:
        for _ in range(1 if b == 1 else args.repeats):
            for name, (llm, prompts, _) in built.items():
                runs[name][b].append(timed(llm, prompts, b, args))
    return runs


def paired_ratio(row: dict, plain_row: dict) -> float | None:
    """The median over repeats of a run's rate over the plain engine's run of the same
    repeat (None with one run): interleaved, the two ran seconds apart, so a slow stretch of
    the host falls on both, where the ratio of the two medians can pair a slow run with a
    fast one."""
    runs = [t for _, t in sorted(row["runs_started_s_tok_s"])]
    base = [t for _, t in sorted(plain_row["runs_started_s_tok_s"])]
    if len(runs) < 2 or len(runs) != len(base):
        return None
    ratios = sorted(a / b for a, b in zip(runs, base))
    return round(statistics.median(ratios), 3)


def finish(
    name, extra, llm, prompts, startup, runs, args, results, plain_tokens, step_series
) -> None:
    """One configuration's rows from its runs (by batch size: the median run, every run's
    rate, the collector's pauses summed), its greedy identities, plan and tuning reports,
    and the goodput policy's trace, into results / plain_tokens / step_series."""
    rows, row_tokens = [], {}
    for b in args.batches:
        done = runs[b]
        last_series = done[-1][2]  # the last run's steps (after an idle engine, too)
        # (start second, tok/s) of each run in run order: a slow stretch of the host shows
        # as runs of every configuration slow at the same time
        started = [[run[0]["started_s"], run[0]["output_tok_s"]] for run in done]
        done = sorted(done, key=lambda run: run[0]["output_tok_s"])
        row, tokens, _, _ = done[len(done) // 2]
        row["tok_s_of_runs"] = [run[0]["output_tok_s"] for run in done]
        row["runs_started_s_tok_s"] = started
        pauses = [run[3] for run in done]
        row["gc"] = {k: (max if k == "max_ms" else sum)(p[k] for p in pauses) for k in pauses[0]}
        if name == "plain":
            plain_tokens[b] = tokens
        row["identical_to_plain"] = sum(t == p for t, p in zip(tokens, plain_tokens[b]))
        print(name, json.dumps(row), flush=True)
        rows.append(row)
        if b == 1:  # the median run is the only run at batch 1
            step_series[name] = last_series
        else:
            step_series[f"{name}, batch {b}, last run"] = last_series
        row_tokens[b] = tokens
    spec_stats = {k: v for k, v in llm.engine.stats().items() if k.startswith("spec_")}
    results[name] = {"startup_s": round(startup, 2), "rows": rows, "spec": spec_stats}
    for row in rows if llm.engine.spec is not None else ():
        # up to SHARED_ROWS requests and MAX_ROWS rows a step, a verify row rounds as
        # the request's decode row (GemvPlan.step_requests)
        k_max = llm.engine.spec.k_max
        if row["batch"] <= SHARED_ROWS and row["batch"] * (k_max + 1) <= MAX_ROWS:
            own = own_k0_tokens(llm, prompts, row["batch"], args)
            row["identical_to_own_k0"] = sum(t == p for t, p in zip(row_tokens[row["batch"]], own))
            print(
                name,
                f"batch {row['batch']} identical to its own K=0:",
                row["identical_to_own_k0"],
                "of",
                len(own),
                flush=True,
            )
    # which kernel serves each of the target's decode-sized linears: where the buckets up to
    # SHARED_ROWS meet torch (cuBLAS picks kernels by row count), a verify row may round
    # apart from a decode row, and greedy speculation from plain decoding
    plan = getattr(llm.engine.runner.model, "gemv_plan", None)
    results[name]["gemv_plan"] = plan.summary() if plan is not None else None
    # what start-up tuning changed: the plan, and the verify steps' own tiles
    results[name].update(tuning_reports(llm.engine))
    if extra.get("speculative_policy") == "goodput":  # the policy's own account
        spec = llm.engine.spec
        trace = {"decisions": spec.policy.trace.dump(), "cost": spec.cost.snapshot()}
        trace_path = Path(args.out).with_name(Path(args.out).name + "_goodput_trace.json")
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        trace_path.write_text(json.dumps(trace))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="default_model")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the engines' per-step token budget (default: the engine's); a "
        "batch whose prompts exceed it runs a step mixing its last prefill "
        "chunk with the others' decode or verify rows, outside batch "
        "invariance",
    )
    ap.add_argument("--batch1-prompts", type=int, default=8)
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per batch size above 1 (short runs); the median is reported",
    )
    ap.add_argument("--smoke", action="store_true", help="CPU, 2 prompts, a few tokens")
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="plain and the configurations whose names contain one of these",
    )
    ap.add_argument(
        "--sequential",
        action="store_true",
        help="build, measure and let go each engine in turn (sessions 4-15's "
        "runs) instead of keeping every engine and interleaving their runs",
    )
    add_run_args(ap)
    ap.add_argument(
        "--ab-invariance",
        action="store_true",
        help="also plain and fixed K=3 with --disable-batch-invariance (cuBLAS "
        "where it rounds rows apart; verify steps by row count)",
    )
    args = ap.parse_args()
    device = "auto"
    if args.smoke:
        args.max_tokens, args.batches, args.batch1_prompts, device = 8, [1, 2], 1, "cpu"
        args.repeats = min(args.repeats, 2)
    head = shipped_head_path()
    convs = read_conversations(Path(head) / "heldout_prompts.jsonl") + read_conversations(UNLIKE)
    spec = dict(
        speculative_algorithm="eagle3",
        speculative_draft_model_path=str(head),
        speculative_num_steps=3,
    )
    configs = {
        "plain": {"speculative_algorithm": "none"},
        "eagle3 K=3 fixed": {**spec, "speculative_policy": "fixed"},
        "eagle3 goodput (default)": {**spec, "speculative_policy": "goodput"},
        "eagle3 policy off": {**spec, "speculative_policy": "off"},
    }
    if args.ab_invariance:
        variant = {"disable_batch_invariance": True}
        configs["plain, batch variant"] = {**configs["plain"], **variant}
        configs["eagle3 K=3 fixed, batch variant"] = {**configs["eagle3 K=3 fixed"], **variant}
    if args.again:  # what the order alone changes
        configs["plain (again, last)"] = configs["plain"]
    if args.only:
        keep = [k for k in configs if k == "plain" or any(o in k for o in args.only)]
        configs = {k: configs[k] for k in keep}
    kv_bytes = 2**26 if args.smoke else 4 * 2**30  # per engine: all of them stay alive
    base = dict(
        device=device,
        max_num_seqs=max(args.batches),
        cuda_graph_max_batch=max(args.batches),
        kv_cache_bytes=kv_bytes,
    )
    if args.max_num_batched_tokens:
        base["max_num_batched_tokens"] = args.max_num_batched_tokens
    results, plain_tokens, step_series = {}, {}, {}
    start = time.perf_counter()
    # --sequential: each engine built, measured and let go in turn; else every engine alive
    # and their runs interleaved, so that the host's pace falls on all of them alike
    groups = [[name] for name in configs] if args.sequential else [list(configs)]
    for group in groups:
        built = {name: build(base, configs[name], convs, args) for name in group}
        freeze(args)
        runs = run_interleaved(built, args)
        for name in group:
            llm, prompts, startup = built.pop(name)
            finish(
                name,
                configs[name],
                llm,
                prompts,
                startup,
                runs[name],
                args,
                results,
                plain_tokens,
                step_series,
            )
            del llm
            release()
    plain = {r["batch"]: r for r in results["plain"]["rows"]}
    lines = [
        "| config | "
        + " | ".join(f"batch {b} tok/s (x plain)" for b in args.batches)
        + f" | tokens per step (batch {args.batches[0]}) |",
        "|---|" + "---|" * (len(args.batches) + 1),
    ]
    for name, res in results.items():
        cells = []
        for r in res["rows"]:
            base = plain[r["batch"]]
            cell = f"{r['output_tok_s']} ({r['output_tok_s'] / base['output_tok_s']:.2f}x"
            # (one engine after another, --sequential: a pair's runs are minutes apart)
            paired = None if args.sequential else paired_ratio(r, base)
            if paired is not None:
                r["x_plain_paired"] = paired
                cell += f"; paired {paired:.2f}x"
            cells.append(cell + ")")
        r1 = res["rows"][0]
        steps_len = f"{r1['output_tokens'] / r1['steps']:.2f}"  # prefill steps included
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {steps_len} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "max_tokens": args.max_tokens,
        "total_s": round(time.perf_counter() - start, 1),
        "results": results,
    }
    out.with_suffix(".json").write_text(json.dumps(payload, indent=2))
    out.with_name(out.name + "_steps.json").write_text(json.dumps(step_series))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
