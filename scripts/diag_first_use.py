"""Where one-off stalls come from: the default model with its shipped head at batch 1 (the
prompts of gpu_default_bench.py, one after another), the same run three times in one engine,
each step's wall time recorded; the first run under cProfile, with the callers of Triton's
compiler and the slowest functions written out.

    PYTHONPATH=src python scripts/diag_first_use.py --out $OUT/first_use
    PYTHONPATH=src python scripts/diag_first_use.py --smoke --out /tmp/first_use   # CPU
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_default_bench import UNLIKE, read_conversations, run_batch  # noqa: E402

from specserve.llm import LLM  # noqa: E402
from specserve.model.eagle3 import shipped_head_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="first_use")
    ap.add_argument("--policy", default="fixed")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head = shipped_head_path()
    convs = read_conversations(Path(head) / "heldout_prompts.jsonl") + read_conversations(UNLIKE)
    device, n_prompts, max_tokens = ("cpu", 1, 8) if args.smoke else ("auto", 8, 256)
    llm = LLM(None, device=device, max_num_seqs=64, cuda_graph_max_batch=64,
              kv_cache_bytes=4 * 2**30, speculative_algorithm="eagle3",
              speculative_draft_model_path=str(head), speculative_num_steps=3,
              speculative_policy=args.policy)  # fmt: skip
    prompts = [llm.apply_chat_template(c) for c in convs]
    for b in (1, 8, 64):  # the bench's warm-up
        run_batch(llm, [prompts[i % len(prompts)] for i in range(b)], 16)
    engine, walls = llm.engine, []
    step = engine.step

    def timed_step():
        t = time.perf_counter()
        result = step()
        walls.append((time.perf_counter() - t) * 1e3)
        return result

    engine.step = timed_step
    report = {}
    for rep in range(3):
        walls.clear()
        prof = cProfile.Profile() if rep == 0 else None
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        tokens = sum(len(run_batch(llm, [p], max_tokens)[0][0]) for p in prompts[:n_prompts])
        seconds = time.perf_counter() - t0
        if prof:
            prof.disable()
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text).sort_stats("cumulative")
            stats.print_stats(40)
            stats.print_callers("compile")
            (out / "profile_rep0.txt").write_text(text.getvalue())
        slow = sorted(((ms, i) for i, ms in enumerate(walls)), reverse=True)[:8]
        report[f"rep{rep}"] = {"tok_s": round(tokens / seconds, 1), "steps": len(walls),
                               "median_ms": round(sorted(walls)[len(walls) // 2], 3),
                               "slowest_ms_at_step": [(round(ms, 1), i) for ms, i in slow],
                               "profiled": prof is not None}  # fmt: skip
        print(rep, json.dumps(report[f"rep{rep}"]), flush=True)
    # The steady speculative step at batch 8 (3.08 ms in run 4 against 2.25 in run 3): step
    # walls without a profiler, then the host's time per function under cProfile.
    batch = [prompts[i % len(prompts)] for i in range(8)]
    for profiled in (False, True):
        walls.clear()
        prof = cProfile.Profile() if profiled else None
        if prof:
            prof.enable()
        toks, seconds = run_batch(llm, batch, max_tokens)
        if prof:
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(45)
            (out / "profile_batch8.txt").write_text(text.getvalue())
        steady = sorted(walls[2:]) or [0.0]
        row = {"tok_s": round(sum(map(len, toks)) / seconds, 1), "steps": len(walls),
               "median_ms": round(steady[len(steady) // 2], 3),
               "p90_ms": round(steady[int(len(steady) * 0.9)], 3), "profiled": profiled,
               "stats": {k: v for k, v in llm.engine.stats().items()
                         if isinstance(v, (int, float))}}  # fmt: skip
        report[f"batch8_{'profiled' if profiled else 'plain'}"] = row
        print("batch8", json.dumps(row)[:400], flush=True)
    (out / "first_use.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
