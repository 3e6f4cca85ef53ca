"""What the GPU benches report besides their runs (gpu_engine.py,
gpu_default_model.py): the collector's pauses, one row from repeated runs, what start-up
tuning did to an engine's GEMV plan, and the markdown tables."""

from __future__ import annotations

import gc
import time

from specserve.engine.engine import LLMEngine


class GcPauses:
    """The garbage collector's pauses (gc.callbacks): (generation, seconds) of each
    collection since the last clear()."""

    def __init__(self):
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def clear(self) -> None:
        self.pauses.clear()

    def summary(self) -> dict:
        return {
            "collections": len(self.pauses),
            "full": sum(g == 2 for g, _ in self.pauses),
            "ms": round(sum(s for _, s in self.pauses) * 1e3, 2),
            "max_ms": round(max((s for _, s in self.pauses), default=0.0) * 1e3, 2),
        }


GC_PAUSES = GcPauses()
gc.callbacks.append(GC_PAUSES)


def combine(runs: list[dict]) -> dict:
    """One row from repeated runs of a batch size: tokens, seconds and steps summed, rates
    from the sums, step-time percentiles of the median run; each run's rate kept."""
    if len(runs) == 1:  # the digests a list whatever the repeats
        return {**runs[0], "tokens_sha256": [runs[0]["tokens_sha256"]]}
    row = dict(sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2])
    tokens = sum(r["decode_tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    full = [round(sum(r["full_batch"][0] for r in runs), 4), sum(r["full_batch"][1] for r in runs)]
    row.update(
        decode_tokens=tokens,
        seconds=round(seconds, 4),
        steps=steps,
        output_tok_s=round(tokens / seconds, 1),
        full_batch=full,
        full_batch_tok_s=round(full[1] / full[0], 1),
        ms_per_step=round(seconds / steps * 1e3, 3),
        device_ms_per_step=round(
            sum(r["device_ms_per_step"] * r["steps"] for r in runs) / steps, 3
        ),
        draft_device_ms_per_step=round(
            sum(r["draft_device_ms_per_step"] * r["steps"] for r in runs) / steps, 3
        ),
        gap_ms_per_step=round(sum(r["gap_ms_per_step"] * r["steps"] for r in runs) / steps, 4),
        tokens_per_request_step=round(tokens / row["batch"] / steps, 3),
        loop_waits=sum(r["loop_waits"] for r in runs),
        loop_wait_reasons={
            k: sum(r["loop_wait_reasons"].get(k, 0) for r in runs)
            for k in {k for r in runs for k in r["loop_wait_reasons"]}
        },
        gc={k: (max if k == "max_ms" else sum)(r["gc"][k] for r in runs) for k in runs[0]["gc"]},
        repeats=[r["output_tok_s"] for r in runs],
        tokens_sha256=[r["tokens_sha256"] for r in runs],
    )
    return row


def tuning_reports(engine: LLMEngine) -> dict:
    """What start-up tuning did to an engine's GEMV plan: the whole-step tuning (step ms
    before/after per group, the changes) and the verify steps' own tiles (kept: key, shared
    tile, verify tile; candidates whose bits differed; time). None where it did not run."""
    t, v = engine.plan_tuning, engine.verify_tiles
    return {
        "plan_tuning": {
            "steps_ms": t.steps_ms,
            "evaluations": t.evaluations,
            "seconds": round(t.seconds, 2),
            "changes": [(str(k), a, b) for k, a, b in t.changes],
        }
        if t
        else None,
        "verify_tiles": {
            "steps_ms": v.steps_ms,
            "changes": [(str(k), a, b) for k, a, b in v.changes],
            "rejected": len(v.rejected),
            "skipped": v.skipped,
            "evaluations": v.evaluations,
            "seconds": round(v.seconds, 2),
            "compiled": v.compiled,
            "compile_s": round(v.compile_s, 2),
        }
        if v
        else None,
    }


def table(results: dict, batches: list[int], key: str) -> list[str]:
    """A markdown table of each configuration's `key` per batch size, with its ratio to
    plain where --only kept plain."""
    plain = {r["batch"]: r[key] for r in results.get("plain", {}).get("rows", [])}
    lines = [
        "| config | " + " | ".join(f"batch {b} tok/s (x plain)" for b in batches) + " |",
        "|---|" + "---|" * len(batches),
    ]
    for name, res in results.items():
        cells = [
            f"{r[key]}" + (f" ({r[key] / plain[r['batch']]:.2f}x)" if r["batch"] in plain else "")
            for r in res["rows"]
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines
