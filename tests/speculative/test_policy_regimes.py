"""The goodput policy against every fixed K in the closed-loop simulator (policy_sim.py):
host-bound and GPU-bound engines, batches where speculation pays and where plain decoding
wins, switches that cost a step and switches that cost fifteen."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.support.policy_sim import K_MAX, LARGE, MEASURED, SMALL, Noise, Workload, compare

# The regimes: (regime, workload, what the best fixed K beats plain decoding by, at
# least (> 1) or loses to it by (< 1)[, simulation options: period noise, seeds]).
COSTLY_SWITCHES = replace(SMALL, name="costly switches", eager_ms=15.0, stall_share=1.0)
# Its periods vary by about 5% (2% are outliers). Answers open with a hard stretch (up to
# 16 tokens) after which drafts are accepted at the usual rates (on the H200, requests whose
# first drafts failed accepted 80-90% once drafted again). Fixed K=3 beats plain decoding by
# 1.26x at batch 1 and 1.05x at 8 here (1.32x and 1.10x measured). Eight requests of such
# varied acceptance make one seed's result vary a lot: eight seeds.
MEASURED_RUN = {"noise": Noise(sigma=0.05), "seeds": tuple(range(8))}
MEASURED_LOAD = Workload(1, 8, hard_start=16)
CASES = {
    "host-bound batch 1": (SMALL, Workload(1, 8), 1.15),
    "host-bound batch 8": (SMALL, Workload(8, 3), 1.1),
    "host-bound batch 64, plain best": (SMALL, Workload(64, 2), 1.0, {"seeds": tuple(range(16))}),
    "GPU-bound batch 1": (LARGE, Workload(1, 8), 1.8),
    "GPU-bound batch 64": (LARGE, Workload(64, 2), 1.1),
    "GPU-bound batch 256, plain best": (LARGE, Workload(256, 1), 1.0),
    "costly switches batch 1": (COSTLY_SWITCHES, Workload(1, 8), 1.15),
    "costly switches batch 8": (COSTLY_SWITCHES, Workload(8, 3), 1.05),
    # SmolLM2 + its head as measured on the H200
    "measured batch 1": (MEASURED, MEASURED_LOAD, 1.2, MEASURED_RUN),
    "measured batch 8": (MEASURED, replace(MEASURED_LOAD, batch=8, rounds=3), 1.03, MEASURED_RUN),
    "measured batch 64, plain best": (
        MEASURED,
        replace(MEASURED_LOAD, batch=64, rounds=2),
        1.0,
        MEASURED_RUN,
    ),
    "measured batch 64, plain best, no hard opening": (
        MEASURED,
        replace(MEASURED_LOAD, batch=64, rounds=2, hard_start=0),
        1.0,
        MEASURED_RUN,
    ),
}


# Where goodput is known to fall short (strict: a fix makes the case fail until it is moved).
# (The default model at 64 requests was one, at 0.94 of plain decoding, until holds decided
# on a seed period were checked against the first measurement: GoodputPolicy._disproved.)
# So was the default model without a hard opening at 64 (0.934 over 8 seeds, session 57)
# until a K=0 decision held from 32 requests where drafting missed it by 5% (0.963).
KNOWN_GAPS = {
    "host-bound batch 64, plain best": (
        "0.93 of plain decoding over 16 seeds (0.92 over 32; 0.95 over the first 4): two "
        "noisy early samples of plain decoding's period (20% noise a step, outliers) can "
        "keep goodput drafting for most of a run, K=0 being probed within its budget only "
        "(docs/performance.md, 'Holds decided on seed periods')"
    ),
}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[c]))
        if c in KNOWN_GAPS
        else c
        for c in CASES
    ],
)
def test_goodput_matches_the_best_fixed_k(case):
    """Over four seeds (or the case's), goodput's realized throughput is within 5% of the
    best fixed K's (chosen with hindsight, per regime), with few switches between plain
    decoding and drafting and few probe steps."""
    regime, workload, gain, *options = CASES[case]
    r = compare(regime, workload, **{"seeds": (0, 1, 2, 3), **(options[0] if options else {})})
    speculating = max(r[k] for k in range(1, K_MAX + 1))
    if gain > 1:  # the regime is what its name says
        assert speculating >= gain * r[0], r
    else:
        assert r[0] == r["best_fixed"], r
    assert r["goodput"] >= 0.95 * r["best_fixed"], r
    assert r["switch_share"] <= 0.04, r
    assert r["probe_share"] <= 0.08, r


def test_slow_stretches_scale_whole_runs_of_steps():
    """The simulator's slow stretches (Noise.stretch_*): without them the draws are those the
    recorded decisions were made with (the formula before stretches, rebuilt here); every
    step of a stretch is that draw times stretch_x, and stretches come about as often and
    last about as long as asked."""
    import math
    import random

    from tests.support.policy_sim_workload import noise_factors

    base = noise_factors(Noise(sigma=0.05), 3)
    rng, sigma = random.Random(3 + 7919), 0.05  # the draws before stretches existed
    for x in base:
        want = math.exp(rng.gauss(0.0, sigma) - sigma**2 / 2)
        assert x == (want * 3.0 if rng.random() < 0.02 else want)
    slow = noise_factors(Noise(sigma=0.05, stretch_p=1 / 150, stretch_len=40, stretch_x=1.75), 3)
    marks = []
    for a, b in zip(base, slow):
        assert b == a or abs(b - 1.75 * a) < 1e-12
        marks.append(b != a)
    runs = [len(r) for r in "".join("s" if m else "." for m in marks).split(".") if r]
    assert 10 <= len(runs) <= 80  # 8192 steps: about 8192 / (150 + 40) stretches
    assert 25 <= sum(runs) / len(runs) <= 60
    assert 0.1 <= sum(marks) / len(marks) <= 0.35


def test_goodput_under_slow_stretches():
    """Stretches of steps 1.75x slower at every K (as the default model's batch-1 steps ran on
    the H200): goodput stays within 10% of the best fixed K on
    the measured engine at batch 1 and within 6% on the GPU-bound one (these seeds: 0.934
    and 0.943 of it; over 24 seeds on the GPU-bound one 0.956, and 0.951 before the settled
    decisions to draft, against 0.974 without stretches: four seeds spread it by about 1.5%
    either way)."""
    stretches = {"stretch_p": 1 / 150, "stretch_len": 40, "stretch_x": 1.75}
    r = compare(
        MEASURED, MEASURED_LOAD, seeds=tuple(range(8)), noise=Noise(sigma=0.05, **stretches)
    )
    assert r["goodput"] >= 0.9 * r["best_fixed"], r
    r = compare(LARGE, Workload(1, 8), seeds=(0, 1, 2, 3), noise=Noise(**stretches))
    assert r["goodput"] >= 0.94 * r["best_fixed"], r
