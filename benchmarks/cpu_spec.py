"""CPU benchmark of speculative decoding on the embedded SmolLM2-135M-Instruct.

One run, one machine, side by side: plain decoding; n-gram, a draft model that is a copy of
the target (the upper bound of acceptance) and EAGLE-3 (when a head is given) at fixed K;
the goodput policy; and the cost of a loaded-but-idle drafter (policy off) against no
drafter at all. Reports output tok/s, time per output token, mean acceptance length and
target forwards per generated token, as ratios to plain decoding.

    python benchmarks/cpu_spec.py --out docs/benchmarks/cpu_spec [--eagle3-head DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from specserve import LLM, SamplingParams
from specserve.model.loader import default_model_path

PROMPTS = [
    "List the days of the week, one per line, then list them again in reverse order.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain what a hash table is in three sentences.",
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Give five tips for writing clear code.",
    "Translate 'good morning, how are you?' into French, Spanish and German.",
    "What is the difference between a list and a tuple in Python?",
]


def run(llm: LLM, prompts: list, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    steps_before = llm.engine.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    result = {
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "output_tok_s": round(tokens / seconds, 2),
        "tpot_ms": round(seconds / max_tokens * 1e3, 2),
        "target_forwards": llm.engine.num_steps - steps_before,
    }
    stats = [o.spec_stats for o in outs if o.spec_stats is not None]
    if stats:
        verify = sum(s.verify_steps for s in stats)
        accepted = sum(s.accepted for s in stats)
        drafted = sum(s.drafted for s in stats)
        result["mean_accept_len"] = round((accepted + verify) / verify, 3) if verify else 1.0
        result["draft_acceptance_rate"] = round(accepted / drafted, 3) if drafted else 0.0
    result["forwards_per_token_per_request"] = round(
        result["target_forwards"] * len(prompts) / tokens, 3
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/benchmarks/cpu_spec")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--eagle3-head", default=None)
    ap.add_argument("--k", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    model = str(default_model_path())
    common = dict(max_num_seqs=64, max_num_batched_tokens=2048)

    configs = {
        "none": dict(speculative_algorithm="none"),
        "ngram K=fixed": dict(speculative_algorithm="ngram", speculative_policy="fixed"),
        "draft=copy K=fixed": dict(
            speculative_algorithm="draft",
            speculative_draft_model_path=model,
            speculative_policy="fixed",
        ),
        "draft=copy policy=off": dict(
            speculative_algorithm="draft",
            speculative_draft_model_path=model,
            speculative_policy="off",
        ),
        "draft=copy goodput": dict(
            speculative_algorithm="draft", speculative_draft_model_path=model
        ),
        "ngram goodput": dict(speculative_algorithm="ngram"),
    }
    if args.eagle3_head:
        for policy in ("fixed", "goodput"):
            configs[f"eagle3 {policy}"] = dict(
                speculative_algorithm="eagle3",
                speculative_draft_model_path=args.eagle3_head,
                speculative_policy=policy,
            )

    results: dict = {}
    for name, kw in configs.items():
        llm = LLM(None, speculative_num_steps=args.k, **common, **kw)
        chat = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        for batch in (1, 16):
            prompts = (chat * 2)[:batch]
            res = run(llm, prompts, args.max_tokens)
            results.setdefault(str(batch), {})[name] = res
            print(f"batch {batch:>2} {name:<24} {res}", flush=True)
        del llm

    for rows in results.values():
        base = rows["none"]["output_tok_s"]
        for r in rows.values():
            r["speedup_vs_none"] = round(r["output_tok_s"] / base, 3)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    meta = {
        "command": f"python benchmarks/cpu_spec.py --out {args.out}"
        + (f" --eagle3-head {args.eagle3_head}" if args.eagle3_head else ""),
        "machine": machine,
        "model": "SmolLM2-135M-Instruct (embedded GGUF, fp32 on CPU)",
        "k": args.k,
        "max_tokens": args.max_tokens,
        "date": time.strftime("%Y-%m-%d"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = [
        "# Speculative decoding on CPU: SmolLM2-135M-Instruct",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {machine}; greedy, {args.max_tokens} new tokens per request (ignore_eos), "
        f"K={args.k}; date {meta['date']}.",
        "",
    ]
    for batch, rows in results.items():
        lines += [
            f"## Batch {batch}",
            "",
            "| config | output tok/s | vs none | TPOT ms | mean accept len | "
            "target forwards / token / request |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in rows.items():
            lines.append(
                f"| {name} | {r['output_tok_s']} | {r['speedup_vs_none']}x | {r['tpot_ms']} | "
                f"{r.get('mean_accept_len', '-')} | {r['forwards_per_token_per_request']} |"
            )
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
