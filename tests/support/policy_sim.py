"""A closed-loop simulator of the speculation policies on a synthetic engine clock
(test_policy_regimes.py holds the goodput policy against every fixed K in it).

The engine is replaced by a clock (policy_sim_engines.py: the engines' true costs). A steady
step of n decoding requests at draft length K takes max(host(n, K), device(n, K)) (overlap
scheduling hides the shorter one). The first step at a new K pays for the switch: after
plain steps, the wait for the previous step's tokens and the drafter's catch-up (eager, so
dearer, once it spans more than a few plain steps); after speculative ones, a plain step
that the loop could not overlap. Where the next step is launched before a step resolves,
part of a switch lands in the step before it (as measured on the H200). A request's first
drafting step catches its drafter up over the prompt. A goodput decision that deliberated
(not one repeated from a settled decision) adds the host's time for it where the host paces
the step (Regime.deliberation_ms, as measured on the H200). Periods carry lognormal noise and
occasional outliers. Requests arrive one after another (batch 1, an idle engine between them)
or in rounds of b submitted together (policy_sim_workload.py: the requests and the noise).
The policy, the acceptance and cost models and the speculator's bookkeeping
are the real ones, fed one step late as under overlap (step N+1 is scheduled before step N
is processed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.core.batch import ScheduledRequest
from specserve.speculative.acceptance import AcceptanceModel
from specserve.speculative.policy import (
    FixedPolicy,
    GoodputPolicy,
    OffPolicy,
    SchedulePolicy,
    SpeculationPolicy,
    StepLoad,
)
from specserve.speculative.speculator import Speculator
from specserve.speculative.step_periods import PeriodLog
from tests.support.policy_sim_engines import LARGE, MEASURED, SMALL, Regime
from tests.support.policy_sim_workload import (
    Noise,
    SimRequest,
    Workload,
    make_requests,
    noise_factors,
)

__all__ = [
    "K_MAX",
    "LARGE",
    "MEASURED",
    "SMALL",
    "Noise",
    "Regime",
    "SimRequest",
    "SimResult",
    "Simulator",
    "Workload",
    "compare",
    "make_requests",
    "noise_factors",
    "simulate",
]

K_MAX = 3
NOISE = Noise()  # the default (frozen)


@dataclass
class SimResult:
    """What a simulated run delivered, and what the policy spent on switches and probes."""

    tokens: int = 0
    ms: float = 0.0
    steps: int = 0
    switches: int = 0  # decode steps whose K crossed between 0 and > 0
    probes: int = 0  # decode steps the policy spent probing
    step_ks: list[int] = field(default_factory=list)


def bare_speculator(policy: SpeculationPolicy, acceptance: AcceptanceModel) -> Speculator:
    """The engine's Speculator without an engine: its observe / observe_period bookkeeping."""
    spec = Speculator.__new__(Speculator)
    spec.k_max, spec.policy, spec.acceptance = policy.k_max, policy, acceptance
    spec.cost = getattr(policy, "cost", None)
    spec.simulate_rate = None
    spec.periods = PeriodLog(spec.cost)
    spec.clear_step_history()
    return spec


class Simulator:
    """One policy against one regime: the clock, the requests, one-step-late observations."""

    def __init__(
        self,
        policy: SpeculationPolicy,
        acceptance: AcceptanceModel,
        regime: Regime,
        noise: Noise,
        seed: int,
    ):
        self.policy, self.acceptance, self.regime = policy, acceptance, regime
        self.spec = bare_speculator(policy, acceptance)
        self.noise_at = noise_factors(noise, seed)  # by step: the same for every policy
        self.clock_ms = 0.0
        self.prev_k: int | None = None  # K of the last step if it was a decode step
        self.plain_run = 0  # consecutive plain decode steps
        self.pending = None  # the last step's observations, applied after the next choice
        self.steps = 0

    def _noisy(self, ms: float) -> float:
        self.steps += 1
        return ms * self.noise_at[self.steps % len(self.noise_at)]

    def _flush(self) -> None:
        if self.pending is not None:
            batch, committed, resolved_s, after_idle = self.pending
            if committed is not None:
                self.spec.observe(batch, committed, 0.0, 0.0)
            self.spec.observe_period(batch, resolved_s, after_idle)
            self.pending = None

    def prefill(self, reqs: list[SimRequest], after_idle: bool) -> None:
        """A prefill-only step (no decoding request: the policy is asked for nothing)."""
        self.policy.choose([], StepLoad(64 * len(reqs)))
        self._flush()
        self.clock_ms += self._noisy(self.regime.prefill_ms + 0.05 * len(reqs))
        batch = [ScheduledRequest(r, 64) for r in reqs]
        self.pending = (batch, None, self.clock_ms / 1e3, after_idle)
        self.prev_k = None

    def decode(self, reqs: list[SimRequest], wl: Workload, result: SimResult) -> None:
        n, regime = len(reqs), self.regime
        # the scheduler's cap
        settled = self.policy.trace.settled_steps
        draft_lens = [min(k, r.max_useful_drafts) for k, r in zip(self.policy.choose(reqs), reqs)]
        deliberated = (  # (its host time is charged: Regime.deliberation_ms)
            isinstance(self.policy, GoodputPolicy) and self.policy.trace.settled_steps == settled
        )
        k = max(draft_lens)
        if k and self.prev_k == 0 and self.pending is not None and regime.early_share:
            # The drafter needs the last plain step's tokens: it is resolved before this
            # launch, so the host work of the launch falls in this step's period, not in it.
            batch, committed, resolved_s, idle = self.pending
            shift = regime.early_share * regime.host(n, 0) / 1e3
            self.pending = (batch, committed, resolved_s - shift, idle)
        ms = regime.period(n, k, deliberated)
        first = regime.prompt_catch_up and any(
            kr and not r.drafted for kr, r in zip(draft_lens, reqs)
        )
        eager = first
        before_ms = 0.0  # lands in the last step's period (launched before it resolved)
        if self.prev_k is not None and self.prev_k != k:
            before_ms = regime.next_launch_share * (ms - regime.period(n, self.prev_k))
        if self.prev_k is not None and (self.prev_k > 0) != (k > 0):
            result.switches += 1
            if k:
                ms += regime.stall_share * regime.host(n, 0)
                if self.plain_run > regime.eager_after and regime.catch_up_before:
                    before_ms += regime.eager_ms
                else:
                    eager = eager or self.plain_run > regime.eager_after
            else:
                ms += regime.down_share * regime.host(n, 0)
        if before_ms and self.pending is not None:
            batch, committed, resolved_s, idle = self.pending
            self.pending = (batch, committed, resolved_s + before_ms / 1e3, idle)
            self.clock_ms += before_ms
            result.ms += before_ms
        self._flush()
        if not k and self.plain_run % 128 == 127:
            eager = True  # the drafter rides along after 128 plain steps
        if eager:
            ms += regime.eager_ms
        ms = self._noisy(ms)
        self.clock_ms += ms
        self.plain_run = 0 if k else self.plain_run + 1
        self.prev_k = k
        batch, committed = [], {}
        for r, kr in zip(reqs, draft_lens):
            s = ScheduledRequest(r, 1, kr, decoding=True)
            s.drafts = [0] * kr
            accepted = r.accept(kr, wl) if kr else 0
            r.drafted = r.drafted or kr > 0
            gained = min(accepted + 1, r.length - r.generated)
            r.generated += gained
            result.tokens += gained
            committed[id(s)] = accepted + 1
            batch.append(s)
        result.ms += ms
        result.steps += 1
        result.step_ks.append(k)
        self.pending = (batch, committed, self.clock_ms / 1e3, False)

    def run_round(self, reqs: list[SimRequest], wl: Workload, result: SimResult) -> None:
        """Requests submitted together after an idle engine, run to completion."""
        start = self.clock_ms
        self.prefill(reqs, after_idle=True)
        result.ms += self.clock_ms - start
        live = list(reqs)
        while live:
            self.decode(live, wl, result)
            for r in live:
                if r.generated >= r.length:
                    self.acceptance.forget(r.request_id)
            live = [r for r in live if r.generated < r.length]
        self._flush()
        self.prev_k = None


def simulate(
    policy_name: str | int, regime: Regime, wl: Workload, seed: int = 0, noise: Noise = NOISE
) -> tuple[SimResult, SpeculationPolicy]:
    """Run the workload under "goodput" or a fixed K (int); returns the measured part."""
    acceptance = AcceptanceModel(K_MAX)
    policy: SpeculationPolicy
    if policy_name == "goodput":
        policy = GoodputPolicy(K_MAX, regime.seeds(), acceptance)
    elif policy_name == 0:
        policy = OffPolicy(K_MAX)
    elif policy_name == K_MAX:
        policy = FixedPolicy(K_MAX)
    else:
        policy = SchedulePolicy(K_MAX, f"1:{policy_name}")
    sim = Simulator(policy, acceptance, regime, noise, seed)
    warm = SimResult()
    for i, b in enumerate(wl.warmup):
        warm_wl = Workload(b, 1)
        sim.run_round(make_requests(warm_wl, 1000 + seed * 10 + i, tokens=16), warm_wl, warm)
    result = SimResult()
    reqs = make_requests(wl, seed)
    probes = policy.trace.probe_steps
    for i in range(wl.rounds):
        sim.run_round(reqs[i * wl.batch : (i + 1) * wl.batch], wl, result)
    result.probes = policy.trace.probe_steps - probes
    return result, policy


def compare(regime: Regime, wl: Workload, seeds=(0, 1), noise: Noise = NOISE) -> dict:
    """Tokens per ms of goodput and of every fixed K, summed over seeds; goodput's switch and
    probe shares."""
    out: dict = {}
    for name in ("goodput", *range(K_MAX + 1)):
        tokens = ms = steps = switches = probes = 0
        for seed in seeds:
            res, policy = simulate(name, regime, wl, seed, noise)
            tokens, ms = tokens + res.tokens, ms + res.ms
            steps, switches = steps + res.steps, switches + res.switches
            probes += res.probes
        out[name] = tokens / ms
        if name == "goodput":
            out["switch_share"], out["probe_share"] = switches / steps, probes / steps
    out["best_fixed"] = max(out[k] for k in range(K_MAX + 1))
    out["ratio"] = out["goodput"] / out["best_fixed"]
    return out
