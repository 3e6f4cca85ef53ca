"""Print the numbers of a `scripts/gpu_train_head.sh` run as the markdown that
docs/eagle3_training.md ("The head shipped now") wants, from the files it brought back.

    python scripts/summarize_head_run.py FETCHED_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _records(folder: Path) -> list[dict]:
    return [
        json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines() if line.strip()
    ]


def _fmt(xs, digits=2) -> str:
    return " / ".join(f"{x:.{digits}f}" for x in xs)


def summarize(folder: Path) -> str:
    recs = _records(folder)
    by_event = {}
    for r in recs:
        by_event.setdefault(r.get("event", "step"), []).append(r)
    lines = []
    for name in ("engine", "generated", "features", "train_budget"):
        for r in by_event.get(name, []):
            lines.append(
                f"- {name}: " + ", ".join(f"{k}={v}" for k, v in r.items() if k != "event")
            )
    start = (by_event.get("start") or [{}])[-1]
    if start:
        lines.append(
            f"- draft vocabulary {start.get('draft_vocab_size')}, coverage "
            f"{start.get('draft_coverage', 0):.4%}; by size "
            + ", ".join(f"{k}: {v:.4f}" for k, v in start.get("coverage_by_size", {}).items())
        )
        lines.append(
            f"- training tokens {start.get('train_tokens')}, started at "
            f"{start.get('seconds_since_start')} s"
        )
    done = (by_event.get("done") or [{}])[-1]
    for key in ("steps", "train_samples", "train_seconds", "total_seconds", "peak_gpu_gib"):
        if key in done:
            lines.append(f"- {key}: {done[key]}")

    steps = by_event.get("step", [])
    if steps:
        lines += [
            "",
            "| step | loss | step-0 loss | batch acc, step 0 / 1 / 2 | lr | seconds |",
            "|---|---|---|---|---|---|",
        ]
        pick = {max(1, round(len(steps) * f)) - 1 for f in (0.02, 0.1, 0.25, 0.5, 0.75, 1.0)}
        for i in sorted(pick):
            r = steps[i]
            lines.append(
                f"| {r['step']} | {r['loss']:.2f} | {r['step_losses'][0]:.2f} | "
                f"{_fmt(r['acc'][:3])} | {r['lr']:.1e} | {r['seconds']} |"
            )
    evals = by_event.get("eval", [])
    if evals:
        lines += [
            "",
            "| step | step_acc k = 0 / 1 / 2 / 3 | mean acceptance length, K = 1 .. |",
            "|---|---|---|",
        ]
        for r in evals:
            lines.append(
                f"| {r['step']} | {_fmt(r['step_acc'][:4])} | {_fmt(r['mean_accept_len'])} |"
            )
        lines.append(f"(anchors: {evals[-1].get('anchors')})")
    for name, label in (("eval_heldout.json", "held-out"), ("eval_unlike.json", "unlike")):
        path = folder / name
        if not path.is_file():
            lines.append(f"\n{name}: missing")
            continue
        data = json.loads(path.read_text())
        lines += [
            "",
            f"{label}: {data['num_prompts']} prompts, {data['max_tokens']} new tokens",
            "| prompts | K | mean acceptance length | accepted / drafted | "
            "per-position acceptance | seconds |",
            "|---|---|---|---|---|---|",
        ]
        for r in sorted(data["results"], key=lambda r: r["k"]):
            rates = " ".join(f"{x:.2f}" for x in r["position_rates"])
            lines.append(
                f"| {label} | {r['k']} | {r['mean_accept_len']:.2f} | "
                f"{r['accepted']} / {r['drafted']} | {rates} | {r.get('seconds')} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1])))
