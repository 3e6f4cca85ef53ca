"""CPU throughput of specserve against transformers `generate`, side by side in one run.

Both run the embedded SmolLM2-135M-Instruct GGUF (transformers loads the same file with
`gguf_file=`), in fp32, greedy, on the same chat prompts, with the same number of new tokens
and no early stop. Batch 1 runs the prompts one after another; batch 16 runs 16 prompts at
once (transformers with left padding). Measurements alternate between the two engines and
the median of `--repeats` is reported, so load from other processes hits both alike.

    python benchmarks/cpu_engine.py            # writes docs/benchmarks/cpu_engine.{md,json}
    python benchmarks/cpu_engine.py --threads 2 1 --profile  # as committed
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about caches.",
    "Explain speculative decoding in one sentence.",
    "List three uses of a hash table.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What does a CPU cache do?",
    "Summarize the plot of Hamlet.",
    "How do vaccines work?",
    "Write a short poem about the sea.",
    "What is the difference between TCP and UDP?",
    "Describe a cat to someone who has never seen one.",
    "What are prime numbers?",
    "How does a bicycle stay upright?",
    "Suggest a name for a bakery.",
    "What is machine learning?",
]
ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict:
    """The CPU as lscpu describes it, memory, and the software versions."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    pick = ["Model name", "CPU(s)", "Thread(s) per core", "L2 cache", "L3 cache"]
    cpu = {k: fields[k].strip() for k in pick if k in fields}
    flags = fields.get("Flags", "").split()
    cpu["vector extensions"] = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16") if f in flags)
    mem_kb = next(
        (
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        ),
        0,
    )
    return {
        "cpu": cpu,
        "nproc": len(os.sched_getaffinity(0)),
        "memory": f"{mem_kb / 2**20:.0f} GiB RAM",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }


def load_engines():
    import transformers

    from specserve import LLM
    from specserve.model.loader import default_model_path

    llm = LLM(speculative_algorithm="none")  # the plain engine against transformers
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    hf.generation_config.eos_token_id = None
    return llm, hf


def run_specserve(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    from specserve import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return seconds, [o.token_ids for o in outs]


def run_transformers(hf, prompts: list[list[int]], new_tokens: int, pad_id: int):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            pad_token_id=pad_id,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )
    seconds = time.perf_counter() - start
    assert out.shape[1] == width + new_tokens
    return seconds, out[:, width:].tolist()


def measure(llm, hf, prompts, batch, new_tokens, repeats, pad_id) -> dict:
    """Median tokens/s of each engine; batch 1 runs the prompts one at a time."""
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    times = {"specserve": [], "transformers": []}
    tokens = {"specserve": [], "transformers": []}
    for _ in range(repeats):
        for name in ("specserve", "transformers"):
            total, outs = 0.0, []
            for g in groups:
                if name == "specserve":
                    s, o = run_specserve(llm, g, new_tokens)
                else:
                    s, o = run_transformers(hf, g, new_tokens, pad_id)
                total += s
                outs += o
            times[name].append(total)
            tokens[name] = outs
    n = len(prompts) * new_tokens
    result = {"batch": batch, "prompts": len(prompts), "new_tokens": new_tokens, "output_tokens": n}
    for name in times:
        result[f"{name}_s"] = [round(t, 3) for t in times[name]]
        result[f"{name}_tok_s"] = round(n / statistics.median(times[name]), 2)
    result["ratio"] = round(result["specserve_tok_s"] / result["transformers_tok_s"], 3)
    same = sum(a == b for a, b in zip(tokens["specserve"], tokens["transformers"]))
    result["identical_sequences"] = f"{same}/{len(prompts)}"
    return result


CATEGORIES = [  # (label, substrings of aten op names), first match wins
    ("matmul (linear layers, lm head)", ("aten::mm", "aten::addmm", "aten::bmm")),
    ("attention kernel (SDPA)", ("scaled_dot_product",)),
    ("KV cache write, page gather, concat", ("aten::index", "aten::cat")),
    ("other tensor ops", ("",)),
]
OUTSIDE_OPS = "time outside tensor ops (Python, framework)"


def time_breakdown(fn) -> dict:
    """Where one run spends its time: each op category's share of the time spent in tensor
    ops (self CPU time of the calling thread under torch.profiler), and the share of the
    wall time (timed without the profiler) that no op accounts for."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    fn()
    wall_us = (time.perf_counter() - start) * 1e6
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    totals = {label: 0.0 for label, _ in CATEGORIES}
    for evt in prof.key_averages():
        label = next(lab for lab, keys in CATEGORIES if any(k in evt.key for k in keys))
        totals[label] += evt.self_cpu_time_total
    in_ops = sum(totals.values())
    shares = {k: round(100 * v / in_ops, 1) for k, v in totals.items()}
    shares[OUTSIDE_OPS] = round(100 * max(0.0, 1 - in_ops / wall_us), 1)
    return shares


def write_report(report: dict) -> None:
    out = ROOT / "docs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_engine.json").write_text(json.dumps(report, indent=2) + "\n")
    m, cfg = report["machine"], report["setup"]
    lines = [
        "# CPU engine throughput: specserve vs transformers `generate`",
        "",
        f"Measured {report['date']} with `{report['command']}` (repository root).",
        "",
        "SmolLM2-135M-Instruct (the embedded Q4_1 GGUF, dequantized to fp32 by both), greedy, "
        f"chat-templated prompts of {cfg['prompt_tokens']} tokens, {cfg['new_tokens']} new "
        f"tokens per prompt with no early stop. Batch 1 runs {cfg['batch1_prompts']} prompts "
        "one after another; batch 16 runs 16 prompts at once (transformers with left "
        "padding). Output tokens/s = prompts x new tokens / wall time, prefill included; "
        f"median of {cfg['repeats']} runs, the two engines alternating.",
        "",
        "| torch threads | batch | specserve tok/s (range) | transformers tok/s (range) | "
        "specserve / transformers | identical greedy outputs |",
        "|---|---|---|---|---|---|",
    ]

    def spread(r, name):
        rates = sorted(r["output_tokens"] / t for t in r[f"{name}_s"])
        return f"{r[f'{name}_tok_s']:.1f} ({rates[0]:.1f}-{rates[-1]:.1f})"

    for r in report["results"]:
        lines.append(
            f"| {r['threads']} | {r['batch']} | {spread(r, 'specserve')} | "
            f"{spread(r, 'transformers')} | **{r['ratio']:.2f}** | "
            f"{r['identical_sequences']} |"
        )
    cpu = m["cpu"]
    lines += [
        "",
        f"Machine (lscpu): {cpu.get('Model name', '?')}, {cpu.get('CPU(s)', '?')} CPUs, "
        f"{cpu.get('Thread(s) per core', '?')} thread(s) per core, L2 {cpu.get('L2 cache')}, "
        f"L3 {cpu.get('L3 cache')}, {cpu.get('vector extensions')}; nproc {m['nproc']}, "
        f"{m['memory']}; Python {m['python']}, torch {m['torch']}, "
        f"transformers {m['transformers']}. 1-minute load average before / after: "
        f"{report['load_before']} / {report['load_after']}.",
        "",
        "Read the ratios, not the absolute numbers: the machine is shared, and when other "
        "processes keep its cores busy every multi-threaded op waits for its second thread "
        "to be scheduled, which slows both engines by a varying amount (the single-thread "
        "rows are the steadier ones). Per-run times are in cpu_engine.json. Batch-16 "
        "outputs can differ in a few sequences: left padding changes transformers' numerics "
        "slightly, so near-tied argmaxes may flip.",
    ]
    if report.get("breakdown"):
        lines += [
            "",
            "## Where the time goes",
            "",
            "One run of each engine at batch 1 and 16 "
            f"({report['breakdown_new_tokens']} new tokens, {report['breakdown_threads']} "
            "torch thread(s)). The category rows split the time spent inside tensor ops "
            "(torch.profiler self CPU time, so they add up to 100%); the last row is the "
            "share of the wall time, timed without the profiler, that no op accounts for "
            "(the profiler's own cost makes it an underestimate).",
            "",
        ]
        cats = list(next(iter(report["breakdown"].values())))
        names = list(report["breakdown"])
        lines.append("| category | " + " | ".join(names) + " |")
        lines.append("|---|" + "---|" * len(names))
        for c in cats:
            lines.append(
                f"| {c} | " + " | ".join(f"{report['breakdown'][n][c]:.0f}%" for n in names) + " |"
            )
    (out / "cpu_engine.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch1-prompts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[torch.get_num_threads()],
        help="torch thread counts to measure (default: torch's default)",
    )
    ap.add_argument("--profile", action="store_true", help="add the time breakdown")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite cpu_engine.md from cpu_engine.json without measuring",
    )
    args = ap.parse_args()
    if args.render_only:
        write_report(json.loads((ROOT / "docs/benchmarks/cpu_engine.json").read_text()))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load_before = os.getloadavg()[0]
    llm, hf = load_engines()
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    pad_id = llm.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else 0
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        run_specserve(llm, prompts[:2], 4)  # warm-up: first-call allocations, lazy inits
        run_transformers(hf, prompts[:2], 4, pad_id)
        for batch, group in ((1, prompts[: args.batch1_prompts]), (16, prompts[:16])):
            r = measure(llm, hf, group, batch, args.new_tokens, args.repeats, pad_id)
            results.append({"threads": threads, **r})
            print(json.dumps(results[-1]), flush=True)
    report = {
        "command": " ".join(["python", "benchmarks/cpu_engine.py", *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "setup": {
            "new_tokens": args.new_tokens,
            "batch1_prompts": args.batch1_prompts,
            "repeats": args.repeats,
            "prompt_tokens": f"{min(map(len, prompts))}-{max(map(len, prompts))}",
        },
        "results": results,
    }
    if args.profile:
        threads = args.threads[-1]
        torch.set_num_threads(threads)
        few = 16
        report["breakdown_new_tokens"], report["breakdown_threads"] = few, threads
        report["breakdown"] = {}
        for batch in (1, 16):
            group = prompts[:batch]
            report["breakdown"][f"specserve b{batch}"] = time_breakdown(
                lambda g=group: run_specserve(llm, g, few)
            )
            report["breakdown"][f"transformers b{batch}"] = time_breakdown(
                lambda g=group: run_transformers(hf, g, few, pad_id)
            )
        print(json.dumps(report["breakdown"], indent=1))
    report["load_before"] = round(load_before, 2)
    report["load_after"] = round(os.getloadavg()[0], 2)
    if not args.no_write:
        write_report(report)


if __name__ == "__main__":
    main()
