"""A closed-loop serving simulator: the real Scheduler, KVCache, Requests, policies, acceptance
and cost models, and the speculator's bookkeeping, on a synthetic clock of the 8B shape on an
H200 (test_policy_serving.py holds the goodput policy against plain decoding and every fixed
K in it), or of the default model's host-bound engine (`ServingRegime.clock`,
serving_clock.py; test_policy_serving_host_bound.py).

Unlike policy_sim.py (decode-only steps of a fixed batch), steps here are what the scheduler
makes of a saturated server: C clients each send their next request the moment the last one
finishes, prompts are chunked into the step's token budget next to the running requests'
decode and verify rows, the KV cache holds exactly C x (P + O) tokens (KV-limited at C), and
speculation takes what committed tokens, prefill and admissions leave of budget and pages.

One step, synchronously: `schedule(policy)`; every scheduled chunk is cached; each request
whose chunk reaches its committed end samples: a decode row with d drafts accepts each in
turn with probability alpha (seeded; alpha gives mean acceptance length L at K_max,
`rate_for_mean_accept_len`) and commits the accepted ones plus one; then the speculator
observes the step and its period, and finished requests leave and are replaced at once.

The step's true cost is `step_ms`: the target's forward over every token of the step (decode
rows padded to the step's K + 1, prefill tokens), K drafter passes, the decode rows' KV reads
(attention, memory-bound; `ATTN_MS_PER_CONTEXT_TOKEN`) and a small host term. The goodput
policy's start-up seeds are the target and drafter curves alone, as the real start-up
measures them: no attention of long contexts, no host work (the online table learns those
from decode-only steps, and only from them).

The code is the same for the scheduler and policies before the StepLoad change (8853f33:
the policy was asked inside `schedule` with the old signature): point PYTHONPATH at the old
tree's src and its tests/ (with this file copied there) to run it against them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from specserve import SamplingParams
from specserve.core.kv_cache import KVCache
from specserve.core.request import Request
from specserve.engine.scheduler import Scheduler
from specserve.runtime.verify import rate_for_mean_accept_len
from specserve.speculative.acceptance import AcceptanceModel
from specserve.speculative.cost_model import CurveModel, StepCostModel
from specserve.speculative.policy import (
    FixedPolicy,
    GoodputPolicy,
    OffPolicy,
    SchedulePolicy,
    SpeculationPolicy,
)
from tests.core.test_kv_cache import tiny_config
from tests.support.policy_sim import bare_speculator
from tests.support.policy_sim_engines import H200_8B, HEAD_8B
from tests.support.policy_sim_workload import Noise, noise_factors
from tests.support.serving_clock import HostBoundClock

K_MAX = 3
PAGE_SIZE = 16
BUDGET = 2048  # max_num_batched_tokens (the server's default)
MAX_NUM_SEQS = 256  # the server's default: at C = 256 the KV cache and this bind together

# Decode attention reads every context token's K and V of every layer once a step, whatever
# the row's query length (memory-bound): Llama-3.1-8B keeps 32 layers x (K, V) x 8 KV heads x
# 128 dims x 2 bytes = 128 KiB per token, so 256 requests x 768 tokens of context are
# 25.8 GB, about 6.4 ms at 4.0 TB/s (the H200's 4.27 TB/s copy bandwidth, less the kernel's
# own overhead). Prefill chunks' attention is compute-bound and small next to their GEMMs.
KV_BYTES_PER_TOKEN_8B = 32 * 2 * 8 * 128 * 2
ATTN_BYTES_PER_MS = 4.0e12 / 1e3
ATTN_MS_PER_CONTEXT_TOKEN = KV_BYTES_PER_TOKEN_8B / ATTN_BYTES_PER_MS
# Host work the overlapped loop does not hide (launch, sampling bookkeeping): small next to
# a 5-50 ms GPU step, but it grows with the rows.
HOST_MS = 0.2
HOST_MS_PER_ROW = 0.002

# The drafter's upkeep while speculation is on (any policy but off): the EAGLE-3 head takes
# every prompt token in the steps that prefill it (`catch_up_prefill`) and every token
# decoded without drafts sooner or later (ride-alongs every CATCH_UP_STEPS tokens, or the
# catch-up when drafting resumes), and its fc projects every token's auxiliary hidden states
# into the feature store. One head layer costs ~2.6% of the 8B target per token (0.60 ms at
# 1,024 tokens against the target's 45.98 ms at 2,048), its fc about a fifth of that. At
# C=512, L=1.5 on the H200 goodput ran 91% of its steps at K=0 and reached 0.948 of plain
# decoding: this upkeep is most of what it paid there.
HEAD_MS_PER_TOKEN = HEAD_8B[1024] / 1024
FEATURE_MS_PER_TOKEN = HEAD_MS_PER_TOKEN / 5

TARGET = CurveModel(H200_8B)
DRAFTER = CurveModel(HEAD_8B)


@dataclass(frozen=True)
class ServingRegime:
    """C closed-loop clients (or, with `rate_per_ms`, Poisson arrivals), prompts of P and
    outputs of O tokens, mean acceptance length L at K_max; the KV cache holds exactly
    C x (P + O) tokens (or `room` x (P + O))."""

    concurrency: int
    prompt: int
    output: int
    accept_len: float
    measure: int = 2  # requests measured: this many times the concurrency
    # Every client's first request of O tokens, all sent at once, as `bench sweep` starts a
    # point: the clients then turn over in waves (every prompt of a wave prefilled, then
    # decode-only steps) instead of spread out as in a long steady run.
    lockstep: bool = False
    # Measured from the first step, the warm-up requests included, as a `bench sweep` point
    # is (its first wave prefilled with the drafter as it starts, awake)
    cold: bool = False
    # Open loop instead (`bench sweep --arrival poisson`): requests of O tokens arrive at
    # this many per ms, exponential gaps (seeded), whatever the server's pace; the KV cache
    # is still sized for C requests, so past saturation they queue. The first C requests
    # warm up, the next `measure` x C are measured by their end-to-end latency.
    rate_per_ms: float | None = None
    # What drafting adds to a step carrying prefill beyond `step_ms` (ms): the H100 measured
    # about 6 in one process and 11 through the server at 18 requests/s (session 49), which
    # start-up's timings of padded decode steps never see
    prefill_draft_ms: float = 0.0
    # (steps, ms): the first `steps` drafting steps carrying prefill cost `ms` more each,
    # a transient (through the server on an H100, session 60, a fresh point's first five
    # such steps of the default model spanned 7.4 ms on the device against 2.6 for its
    # decode-only ones)
    prefill_draft_first: tuple[int, float] = (0, 0.0)
    # What every step carrying prefill costs beyond `step_ms` at any K (ms): eager steps'
    # launches and allocations, which the start-up model (padded decode steps) never times;
    # on the H100 such steps spanned 18-53 ms on the device for one 512-token chunk and a
    # few decode rows (session 50)
    prefill_step_ms: float = 0.0
    # (ms) that cost swings with this period, from 0 to twice its mean (0: steady): the H100's
    # spans moved between levels over seconds, unexplained by the steps' composition
    prefill_swing_ms: float = 0.0
    # Decode attention's bandwidth (TB/s), in the steps and in what start-up measures: the
    # H200's 4.0 by default; about 3.1 on an H100 (3.35 TB/s, less the kernel's overhead),
    # where the longer attention of a decode step spreads over K=1's extra tokens too
    attention_tb_s: float = ATTN_BYTES_PER_MS * 1e3 / 1e12
    # Multiplicative noise of every step's time (seeded, the same step by step for every
    # policy; None: none): the H100's periods of one kind of step spread by 10-20%
    noise: Noise | None = None
    # The longest draft: goodput's K_max, the fixed Ks compared are 1..k_max
    k_max: int = K_MAX
    # Requests of P + O tokens the KV cache holds (None: the concurrency): a server with
    # room for more than its clients (`StepLoad.occupancy` below 1 in a closed loop)
    room: int | None = None
    # A host-bound engine's clock instead of the 8B shape's (serving_clock.py), its start-up
    # seeds and no decode attention term
    clock: HostBoundClock | None = None

    @property
    def policies(self) -> tuple:
        """What `compare` runs: plain decoding, every fixed K and goodput."""
        return ("off", *range(1, self.k_max + 1), "goodput")

    @property
    def num_pages(self) -> int:
        tokens = (self.room or self.concurrency) * (self.prompt + self.output)
        return -(-tokens // PAGE_SIZE) + 1  # page 0 is the allocator's scratch page

    @property
    def attn_ms_per_token(self) -> float:
        if self.clock is not None:
            return 0.0
        return KV_BYTES_PER_TOKEN_8B / (self.attention_tb_s * 1e12 / 1e3)

    @property
    def alpha(self) -> float:
        return rate_for_mean_accept_len(self.accept_len, self.k_max)


def step_ms(
    decode_rows: int,
    k: int,
    prefill_tokens: int,
    context_tokens: int,
    catch_up_tokens: int = 0,
    features: bool = False,
    attn_ms_per_token: float = ATTN_MS_PER_CONTEXT_TOKEN,
) -> float:
    """The true cost of a step: `decode_rows` rows padded to K drafts (CUDA graphs verify a
    step at its longest draft), `prefill_tokens` of prompt chunks, `context_tokens` the decode
    rows' summed context (their KV read by attention); with speculation on, the tokens the
    drafter catches up on beyond its draft passes' own and (`features`) every token's
    features."""
    tokens = decode_rows * (k + 1) + prefill_tokens
    ms = TARGET(tokens)
    if k:
        ms += k * DRAFTER(decode_rows)
    ms += HEAD_MS_PER_TOKEN * catch_up_tokens
    if features:
        ms += FEATURE_MS_PER_TOKEN * tokens
    rows = decode_rows + (1 if prefill_tokens else 0)  # prefill chunks: one launch
    return ms + attn_ms_per_token * context_tokens + HOST_MS + HOST_MS_PER_ROW * rows


def _swing(clock_ms: float, period_ms: float) -> float:
    """A slow swing from 0 to 2 (mean 1) at the clock, of `period_ms` (1 where 0)."""
    return 1.0 - math.cos(2 * math.pi * clock_ms / period_ms) if period_ms else 1.0


def startup_costs(attn_ms_per_token: float = ATTN_MS_PER_CONTEXT_TOKEN) -> StepCostModel:
    """What start-up measures: the target by tokens and the drafter by batch, no attention of
    long contexts, no host work; padded (CUDA graphs); and the decode attention's cost per
    context token, from the KV's bytes per token and the memory bandwidth."""
    cost = StepCostModel(CurveModel(H200_8B), CurveModel(HEAD_8B), padded=True)
    cost.context_ms_per_token = attn_ms_per_token
    return cost


def make_policy(
    name: str | int,
    acceptance: AcceptanceModel,
    attn_ms_per_token: float = ATTN_MS_PER_CONTEXT_TOKEN,
    k_max: int = K_MAX,
    clock: HostBoundClock | None = None,
) -> SpeculationPolicy:
    """The policy called `name`: "goodput" (on the start-up seeds: the 8B shape's, or
    `clock`'s), "off" (or 0), or a fixed K (FixedPolicy for K_max, else a schedule of that K
    from batch 1; both within the step's draft budget where the scheduler hands them one)."""
    if name == "goodput":
        seeds = clock.seeds() if clock is not None else startup_costs(attn_ms_per_token)
        return GoodputPolicy(k_max, seeds, acceptance)
    if name in ("off", 0):
        return OffPolicy(k_max)
    if name == k_max:
        return FixedPolicy(k_max)
    return SchedulePolicy(k_max, f"1:{name}")


@dataclass
class ServingResult:
    """The measured window (tokens, ms, steps and their K) and the whole run's requests and
    pages (for the invariants)."""

    tokens: int = 0
    ms: float = 0.0
    latencies: list[float] = field(default_factory=list)  # open loop: measured requests' ms
    steps: int = 0
    mixed_steps: int = 0  # steps of the window with prefill tokens in them
    waiting_steps: int = 0  # steps of the window that left a request waiting
    decided_ks: list[int] = field(default_factory=lambda: [0] * (K_MAX + 1))  # the policy's
    step_ks: list[int] = field(default_factory=lambda: [0] * (K_MAX + 1))  # after the caps
    preemptions: int = 0
    requests: list[Request] = field(default_factory=list)
    free_pages: int = 0
    usable_pages: int = 0
    policy: SpeculationPolicy | None = None

    @property
    def goodput(self) -> float:
        """Output tokens per ms over the window."""
        return self.tokens / self.ms


def k_mix(counts: list[int]) -> str:
    """Steps per K as shares, e.g. "K0:3% K3:97%"."""
    total = sum(counts) or 1
    return " ".join(f"K{k}:{c / total:.0%}" for k, c in enumerate(counts) if c)


def _request(i: int, regime: ServingRegime, max_tokens: int) -> Request:
    return Request(
        f"r{i}",
        [1 + (i + j) % 1000 for j in range(regime.prompt)],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        arrival=i,
        seed=0,
        max_len=8192,
        eos_token_ids=frozenset(),
    )


def _check_step(sched: Scheduler, batch: list) -> None:
    """What the scheduler promises of a step: the token budget, each chunk and its drafts
    within the request's pages, every page owned by one live request or free."""
    kv = sched.kv
    assert sum(s.num_tokens + s.draft_len for s in batch) <= BUDGET
    assert len({id(s.request) for s in batch}) == len(batch)
    for s in batch:
        req = s.request
        assert len(req.page_table) * kv.page_size >= req.cached_len + s.num_tokens + s.draft_len
    held = [p for r in (*sched.running, *sched.waiting) for p in r.page_table]
    assert len(held) == len(set(held)) == kv.allocator.num_used


def simulate(
    name: str | int, regime: ServingRegime, seed: int = 0, drain: bool = False, check: bool = False
) -> ServingResult:
    """Run `regime` under policy `name` ("off", "goodput" or a fixed K) to the end of its
    measured window; `drain`: then stop sending and run every request to its end; `check`:
    assert the scheduler's promises every step (`_check_step`).

    Warm-up: the first C requests (one per client) have outputs spread evenly over 1..O (the
    same for every policy given the seed), so the clients' turnovers are spread as in a long
    steady run instead of marching in lockstep from a cold start; the window opens once
    all of them have finished and closes when `measure` x C requests more have. Each request
    draws its acceptance from its own seeded stream, so that every policy meets the same
    luck request by request (the ratios between policies vary less)."""
    c, out, alpha = regime.concurrency, regime.output, regime.alpha
    kv = KVCache(tiny_config(1), regime.num_pages, PAGE_SIZE, torch.float32, torch.device("cpu"))
    sched = Scheduler(kv, MAX_NUM_SEQS, BUDGET)
    acceptance = AcceptanceModel(regime.k_max)
    policy = make_policy(name, acceptance, regime.attn_ms_per_token, regime.k_max, regime.clock)
    spec = bare_speculator(policy, acceptance)
    # The engine asks no policy under "off" (`Speculator.scheduling_policy`).
    asked = None if isinstance(policy, OffPolicy) else policy
    res = ServingResult(
        policy=policy,
        usable_pages=kv.allocator.num_usable,
        decided_ks=[0] * (regime.k_max + 1),
        step_ks=[0] * (regime.k_max + 1),
    )
    draws: dict[int, random.Random] = {}  # id(request) -> its acceptance stream
    noise = noise_factors(regime.noise, seed) if regime.noise is not None else None
    steps_run = drafted_prefill = 0
    prev_k: int | None = None  # K of the last step with decode rows

    def send(max_tokens: int) -> None:
        i = len(res.requests)
        req = _request(i, regime, max_tokens)
        draws[id(req)] = random.Random(seed * 1_000_003 + i)
        res.requests.append(req)
        sched.add(req)

    open_loop = regime.rate_per_ms is not None
    if open_loop and (regime.lockstep or regime.cold):
        raise ValueError("lockstep and cold are closed-loop settings")
    arrivals: list[float] = []  # open loop: when each request arrives (ms), in order
    if open_loop:
        gaps = random.Random(seed + 7_777)
        at = 0.0
        for _ in range((1 + regime.measure) * c):
            at += gaps.expovariate(regime.rate_per_ms)
            arrivals.append(at)
    else:
        warm_lengths = [1 + (i * out) // c for i in range(c)]
        random.Random(seed).shuffle(warm_lengths)
        if regime.lockstep:
            warm_lengths = [out] * c
        for length in warm_lengths:
            send(length)
    warm_left, measured_left = c, regime.measure * c
    clock, window, trace = 0.0, regime.cold, policy.trace
    idle = False  # open loop: the server waited for an arrival before this step
    while measured_left > 0 or (drain and sched.has_work):
        if open_loop:
            if not sched.has_work and len(res.requests) < len(arrivals):
                arrived = arrivals[len(res.requests)]
                idle = idle or arrived > clock
                clock = max(clock, arrived)
            while len(res.requests) < len(arrivals) and arrivals[len(res.requests)] <= clock:
                send(out)
        decided, settled = trace.num_decisions, trace.settled_steps
        batch = sched.schedule(asked)
        if not batch:
            raise RuntimeError("nothing scheduled while requests wait")
        if check:
            _check_step(sched, batch)
        rows = prefill = context = k = 0
        for s in batch:
            if s.decoding:
                rows += 1
                context += s.request.cached_len + 1
                if s.draft_len > k:
                    k = s.draft_len
            else:
                prefill += s.num_tokens
        # The drafter's upkeep, as the step loop keeps it (`Speculator.keeps_drafter`):
        # while kept, every request's new tokens (prompt chunks, tokens decoded without
        # drafts: ride-alongs, amortized); a drafting request catches up on what it has
        # not seen beyond its draft pass's own K + 1 tokens.
        keeps = asked is not None and not getattr(policy, "dormant", False)
        catch_up = 0
        for s in batch if asked is not None else ():
            req = s.request
            if keeps or s.draft_len:
                seen_to = req.cached_len + s.num_tokens - 1
                extra = seen_to - req.draft_cached_len - (s.draft_len + 1 if s.draft_len else 0)
                catch_up += max(0, extra)
                req.draft_cached_len = max(req.draft_cached_len, seen_to)
        if regime.clock is not None:
            deliberated = isinstance(policy, GoodputPolicy) and trace.settled_steps == settled
            ms = regime.clock.step_ms(
                rows, k, prefill, catch_up, keeps, prev_k == 0, deliberated and rows > 0
            )
        else:
            ms = step_ms(
                rows, k, prefill, context, catch_up, asked is not None, regime.attn_ms_per_token
            )
        if rows:
            prev_k = k
        if prefill:
            ms += regime.prefill_step_ms * _swing(clock, regime.prefill_swing_ms)
            ms += regime.prefill_draft_ms if k else 0.0
            if k and drafted_prefill < regime.prefill_draft_first[0]:
                ms += regime.prefill_draft_first[1]
                drafted_prefill += 1
        if noise is not None:
            ms *= noise[steps_run % len(noise)]
        steps_run += 1
        clock += ms
        sampling = [s for s in batch if s.samples]  # (before the chunks are cached)
        for s in batch:
            s.request.cached_len += s.num_tokens
        committed, tokens, done = {}, 0, []
        for s in sampling:
            req, drafts = s.request, s.draft_len
            accepted = 0
            if drafts:
                s.drafts = [0] * drafts  # observe() counts the drafts by their number
                draw = draws[id(req)].random
                while accepted < drafts and draw() < alpha:
                    accepted += 1
            req.cached_len += accepted  # the accepted drafts' KV is valid
            committed[id(s)] = accepted + 1
            before = len(req.output_token_ids)
            for _ in range(accepted + 1):
                req.append_token(7)
                if req.finish_reason is not None:
                    break  # tokens past max_tokens are dropped
            tokens += len(req.output_token_ids) - before
            if req.finish_reason is not None:
                done.append(req)
        spec.observe(batch, committed, 0.0, 0.0)
        # the drafter's upkeep beside prefill as the step loop measures it (host-bound:
        # the host never waits for the device)
        upkeep = None
        if regime.clock is not None and keeps and prefill and rows:
            upkeep = (regime.clock.upkeep_ms(k), 0.0)
        # (a wait for arrivals is no period)
        spec.observe_period(batch, clock / 1e3, idle, upkeep=upkeep)
        idle = False
        if window and measured_left > 0:
            res.tokens += tokens
            res.ms += ms
            res.steps += 1
            res.mixed_steps += prefill > 0
            res.waiting_steps += bool(sched.waiting)
            if rows:
                res.step_ks[k] += 1
                if trace.num_decisions > decided:
                    res.decided_ks[trace.recent[-1].k] += 1
        for req in done:  # observed first: a finished request's estimates go with it
            acceptance.forget(req.request_id)
            sched.finish(req)
            del draws[id(req)]
            index = int(req.request_id[1:])
            if index < c:  # one of the warm-up requests
                warm_left -= 1
            elif window or open_loop:
                measured_left -= 1
                if open_loop:
                    res.latencies.append(clock - arrivals[index])
            if not open_loop and (measured_left > 0 or not drain):
                send(out)  # closed loop: the client sends its next request at once
        window = window or warm_left == 0
    res.preemptions = sched.num_preemptions
    for req in (*sched.running, *sched.waiting):  # the run ends: the rest are dropped
        sched.finish(req)
    res.free_pages = kv.allocator.num_free
    return res


def compare(
    regime: ServingRegime,
    seeds: tuple[int, ...] = (0,),
    baseline_seeds: tuple[int, ...] | None = None,
) -> dict:
    """Tokens per ms of every policy (summed over its seeds), goodput's two ratios and its K
    mix. Goodput runs `seeds`; plain decoding and the fixed Ks `baseline_seeds` (default: the
    same): their rates vary little by seed, goodput's path (which K its hysteresis settles
    on, where its probes fall) much more. Open loop (`rate_per_ms`): each policy's mean
    end-to-end latency (ms) of the measured requests instead, and the ratios are the best's
    (the lowest) and plain decoding's over goodput's, as `bench sweep` compares Poisson
    points: above 1 goodput is faster."""
    out: dict = {}
    results: dict = {}
    open_loop = regime.rate_per_ms is not None
    for name in regime.policies:
        tokens = ms = 0.0
        latencies: list[float] = []
        for seed in seeds if name == "goodput" or baseline_seeds is None else baseline_seeds:
            r = simulate(name, regime, seed)
            tokens, ms = tokens + r.tokens, ms + r.ms
            latencies += r.latencies
            results.setdefault(name, []).append(r)
        out[name] = sum(latencies) / len(latencies) if open_loop else tokens / ms
    out["metric"] = "mean latency ms" if open_loop else "tokens/ms"
    out["policies"] = regime.policies
    baselines = [out[p] for p in regime.policies if p != "goodput"]
    if open_loop:
        out["best"] = min(baselines)
        out["vs_best"] = out["best"] / out["goodput"]
        out["vs_off"] = out["off"] / out["goodput"]
    else:
        out["best"] = max(baselines)
        out["vs_best"] = out["goodput"] / out["best"]
        out["vs_off"] = out["goodput"] / out["off"]
    g = results["goodput"]
    out["decided"] = k_mix([sum(x) for x in zip(*(r.decided_ks for r in g))])
    out["step_k"] = k_mix([sum(x) for x in zip(*(r.step_ks for r in g))])
    out["results"] = results
    return out
