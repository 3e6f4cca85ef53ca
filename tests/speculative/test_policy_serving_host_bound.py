"""The goodput policy on the default model's engine in a closed loop (serving_sim.py with
`serving_clock.SMOLLM2_H100`: SmolLM2-135M + its EAGLE-3 head on an H100, host-bound, as
session 58 measured it through the server; chat-like requests of 48 prompt tokens and 240
output tokens at the acceptance measured there, 2.25 tokens a step at K=3): within 2% of the
best of plain decoding and every fixed K, and 1% of plain decoding.

The clock reproduces what the server measured at 1 and 8 clients in session 58 (fixed K=3
1.46x and 1.12x plain decoding here, 1.49x and 1.14x there; goodput 0.985 and 0.972 of the
best here then, 0.954 and 0.973 there) and plain decoding ahead at 64 (by 9% here, 4%
there). At 64 every step
deliberated (drafting within 10% of plain decoding kept the K=0 decision from holding), each
deliberation ~8% of a plain step: 0.935 of plain decoding, 1.003 since a K=0 decision holds
there when drafting misses it by 5% (`GoodputPolicy.SETTLE_MARGIN_MANY`)."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from tests.support.serving_clock import SMOLLM2_H100, SMOLLM2_H100_B
from tests.support.serving_sim import ServingRegime, compare

VS_BEST, VS_OFF = 0.98, 0.99

# Where goodput falls short on this clock (strict: a fix makes the case fail until moved).
# At 8 and 16 clients goodput drafted K=3 on ~93% of the steps but deliberated on every one
# (plain decoding within DRAFT_SETTLE_MARGIN) and priced its probes of plain decoding at
# two thirds of the way back to drafting (~4.3 ms: the drafter's eager catch-up), its switch
# cells averaging their first samples with a prior of half a plain step: 0.972 and 0.954;
# with the fast hold (`GoodputPolicy.DRAFT_SETTLE_MARGIN_FAST`) and the samples' own mean,
# 0.981 and 0.978. At 32 plain decoding leads fixed K=3 by 2.5% while K=3 leads on
# decode-only steps by 5.6% (it loses beside prefill, a third of its time): goodput drafts
# K=3 on 88% of the steps and pays probes and deliberations on top.
KNOWN_GAPS = {
    16: "0.978 of fixed K=3",
    32: "0.909 of plain decoding (fixed K=3 within 3% of it)",
}


@functools.cache
def _compare(concurrency: int) -> dict:
    # (at least 64 requests measured: a batch of one runs few steps a request)
    measure = max(2, 64 // concurrency)
    regime = ServingRegime(concurrency, 48, 240, 2.25, measure=measure, clock=SMOLLM2_H100)
    return compare(regime, (0, 1))


@pytest.mark.parametrize(
    "concurrency",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[c]))
        if c in KNOWN_GAPS
        else c
        for c in (1, 8, 16, 32, 64)
    ],
)
def test_goodput_near_the_best_policy_on_a_host_bound_engine(concurrency):
    r = _compare(concurrency)
    rates = " ".join(f"{p}={r[p]:.2f}" for p in r["policies"])
    msg = f"{rates} vs_best={r['vs_best']:.3f} vs_off={r['vs_off']:.3f} K [{r['decided']}]"
    assert r["vs_best"] >= VS_BEST, msg
    assert r["vs_off"] >= VS_OFF, msg


def test_the_clock_is_the_measured_engine():
    """The clock's regimes as measured through the server: fixed K=3 well ahead of plain
    decoding at 1 and 8 clients, plain decoding ahead at 64."""
    one, eight, many = _compare(1), _compare(8), _compare(64)
    assert 1.35 <= one[3] / one["off"] <= 1.6
    assert 1.05 <= eight[3] / eight["off"] <= 1.2
    assert many["off"] == many["best"] and many[3] < many["off"] <= 1.15 * many[3]


def test_switching_up_costs_the_drafters_catch_up():
    """The first drafting step after plain ones waits for them and catches the drafter up
    eagerly (the cost model at 64 requests read 5.6-6.9 ms for it on the H100); a goodput
    deliberation costs the host its time."""
    clock = SMOLLM2_H100
    steady = clock.step_ms(64, 3, 0, 0, True, False, False)
    switch = clock.step_ms(64, 3, 0, 128, True, True, False)
    assert 4.0 <= switch - steady <= 7.0
    assert clock.step_ms(64, 0, 0, 0, False, False, True) > clock.step_ms(
        64, 0, 0, 0, False, False, False
    )


def test_a_transient_surcharge_beside_prefill_is_forgotten():
    """Through the server on an H100 (session 60), a point's first few drafting steps
    beside prefill spanned 7.4 ms on the device against 2.6 for decode-only ones, and the
    surcharge they made kept every later step carrying prefill plain (648 of 654): probed
    every 256th such step, each probe weighing 1/8, it outlived the point. Here the first
    five such steps cost 8 ms more (8 clients, where fixed K=3 is best): goodput fell to
    0.811 of the best (0.978 without them; the surcharge still 7.6 ms at the end); a new
    surcharge probed soon, each observation standing for the deliberations since its kind
    was last seen (`DraftingSurcharge`): 0.962, nothing left of it."""
    base = ServingRegime(8, 48, 240, 2.25, measure=16, clock=SMOLLM2_H100)
    steady = compare(base, (0,))
    r = compare(dataclasses.replace(base, prefill_draft_first=(5, 8.0)), (0,))
    assert r["goodput"] >= 0.97 * steady["goodput"], (r["vs_best"], steady["vs_best"])
    assert r["results"]["goodput"][0].policy.surcharge.ms == 0.0


def test_goodput_goes_dormant_where_the_drafters_upkeep_beside_prefill_decides():
    """Machine B's clock (session 60's per-step record at 64 clients): every K ties on
    decode-only steps, while beside prefill a plain step with the drafter kept up costs
    1.45 ms more than a dormant one (the drafter's eager pass over each new prompt), a
    third of the steps. Plain decoding with the drafter dormant is best; goodput, whose
    modes' factors leave steps carrying prefill out and which sleeps only after 64
    decisions for K=0 in a row, ran awake for long stretches (one seed never slept, the
    other after a third of its steps): 0.899 of plain decoding here, 0.875 through the
    server in that round (fixed K=3 0.945 and 0.923). With the upkeep measured
    (`DrafterUpkeep`: the host time of the drafter's passes beside prefill) and charged to
    drafting, K=0 from the start: 0.996. (At 32 clients on this clock, not asserted: 0.895
    before, 0.963 now, fixed K=3 0.938; one seed drafts its first ~250 steps.)"""
    regime = ServingRegime(64, 48, 240, 2.25, measure=2, clock=SMOLLM2_H100_B)
    r = compare(regime, (0, 1))
    msg = f"vs_best={r['vs_best']:.3f} vs_off={r['vs_off']:.3f} K [{r['decided']}]"
    assert r["vs_best"] >= VS_BEST, msg
    assert r["vs_off"] >= VS_OFF, msg
