"""Host microseconds per step of the speculation policy's own work (CPU only).

The engines of host_step_eagle3.py (free graph replays, simulated acceptance 0.7), with a
timer (`time.perf_counter`, inclusive) around each part of the policy's per-step work:

- choose: `SpeculationPolicy.choose` (the scheduler asks it once per decode step);
- observe: `Speculator.observe` (acceptance updates, the trace's counters);
- observe_period: `Speculator.observe_period` (the trace's join with the step's period, the
  period log and the cost model's updates);
- ask policy: `Scheduler._draft_lens`, which picks the decoding requests, stores their caps
  (`Request.max_useful_drafts`) and calls `choose` (included: not added to the policy work);

and with --detail, inside them, the pieces they spend most on (acceptance reads and updates,
the cost model's reads, the probe search, the decision trace; those a version of the code
lacks are left out). Each timer adds ~0.2 us per call: compare versions without --detail.
Fixed K=3 runs alongside: what its policy work costs is what goodput's is compared with. The
best of --repeats runs (interleaved) is kept.

    python scripts/host_step_policy.py                 # batch 1 and 8
    python scripts/host_step_policy.py --batch 8 --detail
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.host_step_bench import drain, start_batch  # noqa: E402
from scripts.host_step_eagle3 import build, cheap_simulated_acceptance, make_models  # noqa: E402

TOP = ("choose", "observe", "observe_period")
ASK = "ask policy (choose incl.)"


def parts(engine, detail: bool) -> list[tuple[str, object, str]]:
    """(label, owner, attribute) of each timed part; the owners are the engine's objects."""
    spec = engine.spec
    policy, acc, cost = spec.policy, spec.acceptance, spec.cost
    out = [("choose", policy, "choose"), ("observe", spec, "observe"),
           ("observe_period", spec, "observe_period"),
           (ASK, engine.scheduler, "_draft_lens")]  # fmt: skip
    if not detail:
        return out
    out += [("  acceptance.update_many", acc, "update_many"),
            ("  acceptance.cumulative", acc, "cumulative"),
            ("  acceptance.cumulatives", acc, "cumulatives"),
            ("  trace.decided", policy.trace, "decided"),
            ("  trace.record", policy.trace, "record"),
            ("  trace.processed", policy.trace, "processed"),
            ("  periods.add", spec.periods, "add")]  # fmt: skip
    if cost is not None:
        out += [("  cost.periods_ms", cost, "periods_ms"),
                ("  cost.period_table", cost, "period_table"),
                ("  cost.switch_costs", cost, "switch_costs"),
                ("  cost.cells", cost, "cells"),
                ("  cost.observe", cost, "observe"),
                ("  policy._preferred_k", policy, "_preferred_k"),
                ("  policy._probe_k", policy, "_probe_k")]  # fmt: skip
    return [(label, owner, attr) for label, owner, attr in out if hasattr(owner, attr)]


def timed_run(engine, batch: int, steps: int, detail: bool) -> dict[str, float]:
    """Microseconds per step of each part over `steps` steps of a batch started together."""
    start_batch(engine, batch, 4 * steps + 64)
    totals: dict[str, float] = defaultdict(float)
    saved = []
    for label, owner, attr in parts(engine, detail):
        fn = getattr(owner, attr)

        def timed(*a, _fn=fn, _label=label, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                totals[_label] += time.perf_counter() - t0

        saved.append((owner, attr))
        setattr(owner, attr, timed)  # an instance attribute shadows the method
    try:
        for _ in range(steps):
            engine.step()
    finally:
        for owner, attr in saved:
            delattr(owner, attr)
    drain(engine)
    out = {label: totals[label] * 1e6 / steps for label, _, _ in parts(engine, detail)}
    out["policy work"] = sum(out[t] for t in TOP)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5, help="runs per cell (the best kept)")
    ap.add_argument("--configs", nargs="+", default=["K=3", "goodput"])
    ap.add_argument("--detail", action="store_true", help="time the parts' pieces too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cheap_simulated_acceptance()
    with tempfile.TemporaryDirectory() as tmp:
        target, head = make_models(Path(tmp))
        engines = {name: build(target, head, name, max(args.batch)) for name in args.configs}
        gc.collect()
        gc.freeze()
        for batch in args.batch:
            runs: dict = {name: [] for name in engines}
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    runs[name].append(timed_run(engine, batch, args.steps, args.detail))
            for name, cells in runs.items():
                best = min(cells, key=lambda c: c["policy work"])
                print(f"{name} batch {batch}: policy work {best['policy work']:.1f} us/step")
                for label, us in best.items():
                    if label != "policy work" and us:
                        print(f"    {label:28s} {us:7.2f}")
        gc.unfreeze()


if __name__ == "__main__":
    main()
