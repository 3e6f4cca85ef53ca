"""Host work of one engine step, with the device work replaced by almost nothing (CPU only).

Runs the real engine (the embedded SmolLM2-135M tokenizer, scheduler, step loop, runner's
prepare, detokenizer, outputs) with the model's forward and the sampler replaced: `forward`
returns an empty tensor and `sample_async` hands back the next tokens of a fixed text (a
different offset per request), so every step costs what the host spends on it. Plain
decoding (no speculation), the overlap loop as on CUDA, `ignore_eos`, all requests decoding.

For each batch size it reports milliseconds per step and microseconds per request-step:
`engine.step()` alone, and one engine-process turn (`server/engine_proc.py`: the step, the
per-request deltas, stats and the pickled report). A second pass with timers on the phases
splits the turn: schedule, prepare, launch (the stand-in forward + sample and the
bookkeeping after it), resolve, process (detokenize, the rest of append_token: stop checks,
outputs) and the server message. Timers cost a little, so the phases add up to slightly
more than the clean time.

    python scripts/host_step_bench.py                      # batch 1, 8, 64, 256
    python scripts/host_step_bench.py --batch 64 --profile  # plus a cProfile of batch 64
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import platform
import pstats
import statistics
import time
from collections import defaultdict

import torch

from specserve.config import EngineConfig
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.engine import LLMEngine
from specserve.engine.request import Request
from specserve.runtime.sampled_tokens import SampledTokens
from specserve.sampling_params import SamplingParams
from specserve.server import engine_proc

TEXT = (
    "Sure! Here is a short answer.\n\n1. The quick brown fox jumps over the lazy dog; "
    "it's a pangram (every letter appears).\n2. Caches keep recently used data close to "
    "the CPU, so a hit costs a few cycles instead of hundreds.\n\nCafé, naïve, 你好世界, "
    "🙂 — unicode works too. Let me know if you'd like more details: `x = 3 * (y + 1)`. "
)
PROMPT = "Explain, step by step and with examples, why caches make programs faster. " * 2


class Phases:
    """Exclusive time per phase: a wrapped call's time minus that of wrapped calls inside."""

    def __init__(self):
        self.s: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []

    def wrap(self, owner, attr: str, phase: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self.s[phase] += dt - self._stack.pop()
                if self._stack:
                    self._stack[-1] += dt

        setattr(owner, attr, timed)
        return fn


class FakeDevice:
    """Stand-ins for the runner's forward and sampler: no model, tokens from TEXT."""

    def __init__(self, engine: LLMEngine):
        self.script = engine.tokenizer.encode(TEXT, add_special_tokens=False)
        self.next_index: dict[int, int] = {}
        self.empty = torch.empty(0)
        engine.runner.forward = self.forward
        engine.runner.sample_async = self.sample_async

    def forward(self, step, aux_layer_ids=()):
        return self.empty, []

    def sample_async(self, step, hidden, simulate_rate=None) -> SampledTokens:
        script, index, tokens = self.script, self.next_index, []
        for s in step.sampled:
            key = id(s.request)
            i = index.get(key, 17 * len(index))
            index[key] = i + 1
            tokens.append([script[i % len(script)]])
        want = [s.request.params.logprobs for s in step.sampled]
        return SampledTokens(torch.tensor(tokens, dtype=torch.int64).view(-1, 1), None, want)


class NullConn:
    def send_bytes(self, buf) -> None:
        pass

    def close(self) -> None:
        pass


def start_batch(engine: LLMEngine, batch: int, max_tokens: int) -> None:
    """Add `batch` requests and run their prefills (untimed)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(PROMPT, params)
    while any(r.num_uncached > 1 or r.num_generated == 0 for r in engine.requests.values()):
        engine.step()
    for _ in range(3):
        engine.step()


def drain(engine: LLMEngine) -> None:
    for rid in list(engine.requests):
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()


def run_clean(engine, loop, batch, steps, turn: bool) -> float:
    """Median over blocks of 10 steps of milliseconds per step (or per process turn)."""
    start_batch(engine, batch, steps + 20)
    blocks = []
    for _ in range(steps // 10):
        t0 = time.perf_counter()
        for _ in range(10):
            if turn:
                loop._step()
                loop._send()
            else:
                engine.step()
        blocks.append((time.perf_counter() - t0) * 100)
    drain(engine)
    return statistics.median(blocks)


def instrument(engine: LLMEngine, phases: Phases) -> None:
    runner, step_loop = engine.runner, engine.loop
    phases.wrap(engine.scheduler, "schedule", "schedule")
    phases.wrap(runner, "prepare", "prepare")
    phases.wrap(runner, "forward", "launch: fake forward + sample")
    phases.wrap(runner, "sample_async", "launch: fake forward + sample")
    phases.wrap(step_loop, "_launch", "launch: bookkeeping")
    phases.wrap(step_loop, "_resolve", "resolve")
    phases.wrap(step_loop, "_process", "process: other")
    phases.wrap(Request, "append_token", "process: append + stop checks")
    for name in ("push", "pop_delta"):
        phases.wrap(IncrementalDetokenizer, name, "process: detokenize")
    phases.wrap(engine, "_output", "process: outputs")
    phases.wrap(engine_proc, "_delta", "server message")


def run_phases(engine, loop, batch, steps, phases: Phases) -> dict[str, float]:
    start_batch(engine, batch, steps + 20)
    phases.s.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        loop._step()
        t1 = time.perf_counter()
        loop._send()
        phases.s["server message"] += time.perf_counter() - t1
    total = time.perf_counter() - t0
    drain(engine)
    out = {k: v * 1e3 / steps for k, v in phases.s.items()}
    out["step loop (rest)"] = total * 1e3 / steps - sum(out.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="cProfile the largest batch")
    ap.add_argument("--no-phases", action="store_true", help="only the clean timings")
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = EngineConfig(
        speculative_algorithm=None, overlap_schedule="on", dtype="bfloat16",
        num_kv_pages=max(args.batch) * (-(-(64 + args.steps + 40) // 16) + 1) + 8,
        max_num_seqs=max(256, max(args.batch)),
    )  # fmt: skip
    engine = LLMEngine(config)
    FakeDevice(engine)
    gc.collect()
    gc.freeze()  # as the engine process does after loading (server/engine_proc.py)
    loop = engine_proc.EngineLoop(engine, None, engine_proc.Outbox(NullConn()))
    print(f"# host work per step, fake device; {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, torch {torch.__version__}")
    rows = []
    for batch in args.batch:
        step_ms = run_clean(engine, loop, batch, args.steps, turn=False)
        turn_ms = run_clean(engine, loop, batch, args.steps, turn=True)
        rows.append((batch, step_ms, turn_ms))
    print("\n| batch | engine.step ms | us/request | process turn ms | us/request |")
    print("|---|---|---|---|---|")
    for batch, step_ms, turn_ms in rows:
        print(f"| {batch} | {step_ms:.3f} | {step_ms * 1e3 / batch:.1f} | {turn_ms:.3f} | "
              f"{turn_ms * 1e3 / batch:.1f} |")
    if args.profile:
        profile(engine, loop, max(args.batch), args.steps)
    if not args.no_phases:
        print_phases(engine, loop, args.batch, args.steps)
    gc.unfreeze()  # let interpreter shutdown collect everything (native bindings check)


def print_phases(engine, loop, batches: list[int], steps: int) -> None:
    phases = Phases()
    instrument(engine, phases)
    split = {}
    for b in batches:  # the median of three passes, phase by phase
        passes = [run_phases(engine, loop, b, steps, phases) for _ in range(3)]
        split[b] = {k: statistics.median(p.get(k, 0.0) for p in passes) for k in passes[0]}
    names = sorted({k for s in split.values() for k in s}, key=lambda k: -split[batches[-1]][k])
    print("\nPhases, us per request-step (timers on; a process turn):\n")
    print("| phase | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for name in names:
        cells = [f"{split[b].get(name, 0.0) * 1e3 / b:.2f}" for b in batches]
        print(f"| {name} | " + " | ".join(cells) + " |")
    totals = [f"{sum(split[b].values()) * 1e3 / b:.2f}" for b in batches]
    print("| **total** | " + " | ".join(totals) + " |")


def profile(engine, loop, batch, steps) -> None:
    start_batch(engine, batch, steps + 20)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        loop._step()
        loop._send()
    prof.disable()
    drain(engine)
    print(f"\ncProfile, batch {batch}, {steps} process turns, by own time:\n")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
