"""The goodput policy in a saturated server (serving_sim.py: the real scheduler, KV cache,
requests and policies on the 8B shape's H200 clock, closed loop, KV-limited): at every
concurrency and acceptance it delivers within 2% of the best of plain decoding and every
fixed K, and never 1% below plain decoding; every request ends with exactly its tokens and
no KV page leaks."""

from __future__ import annotations

import functools
import statistics
from dataclasses import replace

import pytest

from tests.support.policy_sim_workload import Noise
from tests.support.serving_sim import K_MAX, ServingRegime, compare, simulate

PROMPT, OUTPUT = 512, 256  # the H200 runs' shape, unscaled: a step costs the same CPU time
# whatever the lengths, and the attention term follows the context
CONCURRENCY = (16, 64, 128, 256, 512)  # (512: 256 run, 256 always wait)
ACCEPT_LENS = (1.5, 3.0)
# Seeds per concurrency, for goodput and for the others: goodput's path (which K its
# hysteresis settles on first, where its probes fall) varies by seed far more than plain
# decoding's and the fixed Ks' rates do (about 1%), and small batches vary most while they
# cost the least CPU time (a step of the real scheduler and policy costs about 35 us per
# request here). At 256, seeds 0-3 spread goodput's ratios by about 0.5%.
FOUR = (0, 1, 2, 3)
SEEDS = {
    16: (FOUR, FOUR),
    64: (FOUR, FOUR),
    128: ((0, 1), (0,)),
    256: ((0,), (0,)),
    512: (FOUR, (0,)),
}
VS_BEST, VS_OFF = 0.98, 0.99

# What these regimes caught (seeds as below): at 8853f33 (drafts took the budget before
# admissions) goodput reached 0.973 of plain decoding at C=256, L=1.5; with drafts after
# admissions but K still ranked by each step's own tokens per ms, 0.979 of fixed K=1 at C=64,
# L=1.5 and 0.988 of plain decoding at C=256, L=1.5 (a mixed step's prefill, the same cost at
# every K, diluted their differences, and probes in mixed steps measured nothing). Ranking a
# mixed step's K by tokens - running rate x (ms + the prefill its extra commits bring), and
# probing only in decode-only steps, gave 0.986-1.000 of the best at every point.


@functools.cache
def _compare(concurrency: int, accept_len: float) -> dict:
    """Every policy at one regime point (computed once per test session)."""
    regime = ServingRegime(concurrency, PROMPT, OUTPUT, accept_len)
    return compare(regime, *SEEDS[concurrency])


def _table(r: dict) -> str:
    """Tokens per ms (open loop: mean latency) of each policy, goodput's ratios and K mix,
    for assertion messages."""
    rates = " ".join(f"{p}={r[p]:.3f}" for p in r["policies"])
    return (
        f"{r['metric']}: {rates} vs_best={r['vs_best']:.3f} vs_off={r['vs_off']:.3f} "
        f"goodput K decided [{r['decided']}] run [{r['step_k']}]"
    )


# The drafter's upkeep while it does not draft (its head takes every prompt and
# plain-decoded token, its fc projects every token's features; serving_sim's
# HEAD_MS_PER_TOKEN) cost goodput 2.8% and 3.1% of plain decoding at C=256 and 512, L=1.5;
# dormancy (GoodputPolicy.DORMANT_AFTER) stops the head's part once plain decoding has been
# chosen for long. Probes while dormant then cost 2-3% (every K probed, each priced as if
# every request drafted, where a dormant probe drafts on 16): priced by their rows' tokens
# and of K_max only, goodput reached 0.996 of plain decoding at both.
# C=512, L=3.0 runs four goodput seeds: there plain decoding and K=1 tie in the policy's
# model of a decode step while K=1 delivers 8% more (steps carrying prefill), and one seed
# in about eight falls asleep for good (0.92-0.95 of the best; seed 6 before the dormant
# probes changed, seed 0 after).
CASES = [
    pytest.param(c, accept_len, id=f"C{c}-L{accept_len}")
    for c in CONCURRENCY
    for accept_len in ACCEPT_LENS
]


@pytest.mark.parametrize(("concurrency", "accept_len"), CASES)
def test_goodput_near_the_best_policy_under_load(concurrency, accept_len):
    """Output tokens per ms over the steady window: goodput within 2% of the best of plain
    decoding and fixed K = 1..K_max, and within 1% of plain decoding."""
    r = _compare(concurrency, accept_len)
    assert r["goodput"] >= VS_BEST * r["best"], _table(r)
    assert r["goodput"] >= VS_OFF * r["off"], _table(r)


# A closed loop in a server with room for 256 (the default sequence slots) holds a quarter
# of it at 64 clients: the charge for the prefill its commits bring counts half
# (`GoodputPolicy.FULL_CHARGE_OCCUPANCY`), where every finished request does admit the
# next. Session 54: 0.999 and 0.987 of the best (L = 1.5, 3.0), 0.996 and 0.990 with the
# whole charge.
@pytest.mark.parametrize("accept_len", ACCEPT_LENS)
def test_goodput_near_the_best_policy_below_the_servers_room(accept_len):
    r = compare(ServingRegime(64, PROMPT, OUTPUT, accept_len, room=256), *SEEDS[64])
    assert r["vs_best"] >= VS_BEST, _table(r)
    assert r["vs_off"] >= VS_OFF, _table(r)


@pytest.mark.parametrize("policy", ["goodput", K_MAX])
def test_every_request_ends_whole_and_no_page_leaks(policy):
    """Run to the end (no new requests once the window closes) with the scheduler's promises
    checked every step (token budget, chunk and drafts within the request's pages, every
    page owned once or free): every request finishes by length with exactly its max_tokens
    (O for all but the warm-up cohort), and every page is free again."""
    regime = ServingRegime(64, PROMPT, OUTPUT, 3.0, measure=1)
    res = simulate(policy, regime, seed=5, drain=True, check=True)
    assert len(res.requests) > 2 * regime.concurrency
    for i, req in enumerate(res.requests):
        assert req.finish_reason == "length", req.request_id
        assert len(req.output_token_ids) == req.params.max_tokens, req.request_id
        if i >= regime.concurrency:
            assert req.params.max_tokens == OUTPUT
    assert res.free_pages == res.usable_pages
    assert sum(res.step_ks[1:]) > 0  # the drafts' lookahead was exercised


def test_open_loop_overload_ends_every_request_whole_and_leaks_no_page():
    """Poisson arrivals past plain decoding's peak (a queue builds: requests wait for slots
    and pages while others draft), run to the end with the scheduler's promises checked
    every step: every request arrives, finishes by length with O tokens, and every page is
    free again."""
    regime = ServingRegime(64, PROMPT, OUTPUT, 3.0, measure=2, rate_per_ms=0.05)
    res = simulate("goodput", regime, seed=3, drain=True, check=True)
    light = simulate("goodput", replace(regime, rate_per_ms=0.005), seed=3)
    mean = statistics.mean
    assert mean(res.latencies) > 3 * mean(light.latencies)  # requests queued
    assert res.waiting_steps > 0
    for req in res.requests:
        assert req.finish_reason == "length", req.request_id
        assert len(req.output_token_ids) == OUTPUT, req.request_id
    assert res.free_pages == res.usable_pages
    assert sum(res.step_ks[1:]) > 0


# Lockstep (ServingRegime.lockstep): every client's first request sent at once and every
# output of one length, as `bench sweep` runs a point, so the clients turn over in waves: a
# wave's prompts prefilled, then only decode steps. What it caught (f1698bd): at L = 1.5
# goodput reached 0.978 and 0.971 of plain decoding at 256 and 512 (spread out: 0.996; the
# H200 gave 0.935 and 0.951), waking its dormant drafter 3-6 times: (a) the cost table's
# cells were measured at different contexts (a wave's decode steps grow from 512 to 768
# tokens a request, their attention from 4.3 to 6.4 ms of a ~13 ms step), so plain
# decoding's cell, read late, looked dearer than K=1's, read early; (b) a step carrying
# prefill priced a millisecond at the server's running rate, low while a wave prefills,
# where the tokens drafts save come off the requests' last steps, decode steps at the full
# batch. The cells now learn without the context's attention and predictions add it back
# at the step's context (StepCostModel), and steps carrying prefill price time at the
# running rate weighted by each step's decoding rows (ServingRate.per_row): 1.003 and
# 0.994, without a wake.
LOCKSTEP_CASES = [
    pytest.param(256, 1.5, id="C256-L1.5"),
    pytest.param(512, 1.5, id="C512-L1.5"),
    pytest.param(256, 3.0, id="C256-L3.0"),
]


@pytest.mark.parametrize(("concurrency", "accept_len"), LOCKSTEP_CASES)
def test_goodput_near_the_best_policy_in_lockstep_waves(concurrency, accept_len):
    regime = ServingRegime(concurrency, PROMPT, OUTPUT, accept_len, lockstep=True)
    r = compare(regime, (0,), (0,))
    assert r["goodput"] >= VS_BEST * r["best"], _table(r)
    assert r["goodput"] >= VS_OFF * r["off"], _table(r)


# From a cold start (ServingRegime.cold): measured from the first step, the first wave's
# prefill included, two waves in all, as a `bench sweep` point (2 x C requests). Starting
# awake, with the acceptance prior (0.6 a draft), the drafter took the first wave's prompts
# and the end of the wave's prefill drafted K = 3, probes of K = 1..3 on every row followed,
# the drafter caught up on the whole batch (156k tokens) and stayed awake 150 steps before
# it slept: 0.984 and 0.989 of plain decoding at 256 and 512 requests, L = 1.5 (an H100 at
# a769fb4: 0.967 and 0.981; strict expected failures here until session 47). A burst now
# starts the policy dormant, and it wakes only once nothing waits for admission and, for
# this many requests, drafts have been verified (GoodputPolicy's docstring): 0.996 and
# 0.994, L = 3.0 0.990 of fixed K = 3.
COLD_CASES = [
    pytest.param(256, 1.5, id="C256-L1.5"),
    pytest.param(512, 1.5, id="C512-L1.5"),
    pytest.param(256, 3.0, id="C256-L3.0"),
]


@pytest.mark.parametrize(("concurrency", "accept_len"), COLD_CASES)
def test_goodput_near_the_best_policy_from_a_cold_start(concurrency, accept_len):
    regime = ServingRegime(
        concurrency, PROMPT, OUTPUT, accept_len, measure=1, lockstep=True, cold=True
    )
    r = compare(regime, (0,), (0,))
    assert r["goodput"] >= VS_BEST * r["best"], _table(r)
    assert r["goodput"] >= VS_OFF * r["off"], _table(r)


# The H100's step (ServingRegime.attention_tb_s, .noise): decode attention at about 3.1 TB/s
# (3.35 less the kernel's overhead) makes K = 1 at 256 requests, L = 1.5, nearly tie plain
# decoding in decode-only steps (on the H100 18.4 against 18.2 tokens a ms), so that the
# drafter's upkeep on prompts decides, and periods spread by 20% a step. The H100 in one
# closed-loop point from a cold start (session 51, servers at 5fd612f and at 0fd1b39, one
# run each): goodput woke on a decode-only step and drafted K = 1 on 30-40% of its steps,
# 0.94-0.96 of plain decoding (fixed K = 1: 0.966). Here, with the start-up curves of the
# H200, it stays dormant (0.992 of plain decoding; 0.990-0.992 over seeds 0-2): what woke it
# on the H100 is for its exported expectations (`spec_policy_expected_*`) to say. A guard.
def test_goodput_near_the_best_policy_from_a_cold_start_on_an_h100_like_step():
    regime = ServingRegime(
        256,
        PROMPT,
        OUTPUT,
        1.5,
        measure=1,
        lockstep=True,
        cold=True,
        attention_tb_s=3.1,
        noise=Noise(sigma=0.2),
    )
    r = compare(regime, (0,), (0,))
    assert r["goodput"] >= VS_BEST * r["best"], _table(r)
    assert r["goodput"] >= VS_OFF * r["off"], _table(r)


@functools.cache
def _off_peak_per_ms() -> float:
    """Plain decoding's request rate at 256 clients in a closed loop (requests a ms)."""
    r = simulate("off", ServingRegime(256, PROMPT, OUTPUT, 1.5), 0)
    return r.tokens / r.ms / OUTPUT


def _open_loop(accept_len: float, share: float, seed: int = 0, **regime) -> dict:
    """Every policy under Poisson arrivals at `share` of plain decoding's peak (256 clients'
    KV cache), goodput's ratios asserted (VS_BEST, VS_OFF); the comparison, for more."""
    rate = share * _off_peak_per_ms()
    r = compare(ServingRegime(256, PROMPT, OUTPUT, accept_len, rate_per_ms=rate, **regime), (seed,))
    assert r["vs_best"] >= VS_BEST, _table(r)
    assert r["vs_off"] >= VS_OFF, _table(r)
    return r


# Open loop (ServingRegime.rate_per_ms), as `bench sweep --arrival poisson` runs its points:
# requests arrive at a share of plain decoding's peak request rate at 256 clients (the
# matrix's default shares: 0.25, 0.5, 0.75, 0.9), the KV cache sized for 256, and every
# policy is judged by its measured requests' mean end-to-end latency (the best's over
# goodput's: above 1 goodput is faster). Session 48, seeds 0-2: goodput 0.987-1.015 of the
# best and 1.10-1.31x plain decoding at L = 1.5 (K = 1 or 2 best: small batches leave the
# GPU compute to spare), 2.6-2.8x at L = 3.0.
POISSON_CASES = [
    pytest.param(1.5, 0.25, id="L1.5-0.25"),
    pytest.param(1.5, 0.9, id="L1.5-0.9"),
    pytest.param(3.0, 0.5, id="L3.0-0.5"),
]


@pytest.mark.parametrize(("accept_len", "share"), POISSON_CASES)
def test_goodput_near_the_best_policy_under_poisson_arrivals(accept_len, share):
    _open_loop(accept_len, share)


# The same with every step's time noisy (ServingRegime.noise: lognormal, 20% a step, and 2%
# of steps 3x as long, the host-bound default model's noise on the H200), L = 1.5 at 0.9 of
# plain decoding's peak, where fixed K = 1 is best by 8%. The noise reaches the cost model's
# cells, the switch costs and the modes' factors alike. Until the modes counted only
# decode-only steps between decode-only ones (`Speculator._observe_mode`), goodput made
# 0.935 of fixed K = 1 at seed 0, switching between plain decoding and drafting several
# times as often as without noise; then 1.045. At seed 1 it stayed plain on 94% of its
# steps, 0.949 either way: its K = 1 cell at 140-190 requests read 13-18 ms for a true
# ~11.5, and a dormant policy probes only K_max there, so the cell was not measured again.
# Since a switch cell's first samples are averaged without the prior (`SwitchCosts`,
# session 59): 1.058 and 0.985 (plain on 87% of the steps). At 0.5 of the peak, 0.918 /
# 0.921 before and
# 0.941 / 0.931 after (seeds 0 / 1); without noise 0.98-1.02. The H100's L = 1.5 Poisson
# points fell to 0.70-0.95 of the best in session 51, and made 0.982-1.024 with this (and
# mixed-step graphs to 1,024 tokens) in session 52.
@pytest.mark.parametrize("seed", [0, 1])
def test_goodput_near_the_best_policy_under_poisson_arrivals_with_noisy_steps(seed):
    _open_loop(1.5, 0.9, seed, noise=Noise())


# Under Poisson arrivals at 0.9 of plain decoding's peak where a long draft is best, goodput
# drafted shorter beside prefill than the best fixed K while each step carrying prefill was
# charged in full for the prefill its commits bring (`queued_prefill_ms`: in a full server a
# request finished admits the next), which open-loop arrivals bring whatever K does: L = 3.0
# with the H100's attention bandwidth (fixed K = 3 best) 0.978, 122 prefill steps at K = 2;
# L = 4.5 with K_max 5 (fixed K = 5 best) 0.959, and 0.973 with the H100's bandwidth; the
# H100 through the server 0.926 at L = 4.5 (session 53, 113 of 470 prefill steps plain).
# The charge now counts in full from half the server's room up and in proportion below
# (`GoodputPolicy.FULL_CHARGE_OCCUPANCY`; these populations hold 40-60 of 256): 0.987,
# 0.986 and 0.986. (L = 1.5 at 0.9x, above, holds about 130 of 256 and keeps the charge.)
OPEN_LOOP_PREFILL_CASES = [
    pytest.param(3.0, 3, 3.1, id="L3.0-H100"),
    pytest.param(4.5, 5, 4.0, id="L4.5-H200"),
    pytest.param(4.5, 5, 3.1, id="L4.5-H100"),
]


@pytest.mark.parametrize(("accept_len", "k_max", "attention_tb_s"), OPEN_LOOP_PREFILL_CASES)
def test_goodput_drafts_beside_prefill_under_poisson_arrivals(accept_len, k_max, attention_tb_s):
    _open_loop(accept_len, 0.9, attention_tb_s=attention_tb_s, k_max=k_max)


# Drafting's surcharge in steps carrying prefill (ServingRegime.prefill_draft_ms): what the
# H100 measured beyond the start-up model, about 6 ms a step in one process and 11 through
# the server at 18 requests/s, L = 1.5 (session 49), where fixed K = 1 fell below plain
# decoding and goodput, ranking such steps by the model alone, to 0.62-0.77 of the best.
# Here, before the policy measured it (`DraftingSurcharge`): 0.757 of plain decoding at
# 0.5 of its peak with 12 ms, 0.628 at 0.9 with 6 ms and 0.462 with 12; measured and priced:
# 1.21, 1.11 and 1.11 (it drafts in decode-only steps and mostly not beside prefill, which
# no fixed K can do). A review found that a prefill step the surcharge alone made plain
# started a hold of plain decoding over the decode-only steps after it: 0.973 at 0.9 with
# 12 ms until the holds compared the model's periods. In a closed loop with 12 ms: 1.27 of
# the best at C = 64, L = 3.0 (0.973 before) and 0.999 of plain decoding at C = 256 (0.926
# before; 0.980 while drafting beside prefill was probed every 16th such step, whatever
# it cost: `DraftingSurcharge.PROBE_BUDGET`).
SURCHARGE_CASES = [
    pytest.param(1.5, 0.5, 12.0, id="L1.5-0.5-12ms"),
    pytest.param(1.5, 0.9, 6.0, id="L1.5-0.9-6ms"),
    pytest.param(1.5, 0.9, 12.0, id="L1.5-0.9-12ms"),
]


@pytest.mark.parametrize(("accept_len", "share", "surcharge"), SURCHARGE_CASES)
def test_goodput_prices_what_drafting_adds_to_prefill_steps(accept_len, share, surcharge):
    r = _open_loop(accept_len, share, prefill_draft_ms=surcharge)
    measured = r["results"]["goodput"][0].policy.surcharge.ms
    assert measured == pytest.approx(surcharge, rel=0.15)  # what the policy found


@pytest.mark.parametrize("seed", [0, 2])
def test_no_surcharge_from_the_catch_up_of_a_wake(seed):
    """Without any surcharge (64 clients, L = 1.5: the drafter sleeps and wakes), the steps
    that wake it or switch to drafting carry the rows' catch-up, which the wake and the
    switch price: counted as drafting's surcharge they made a false one (4.5 and 1.4 ms for
    these seeds, goodput 0.978 and 0.975 of the best) until drafting prefill steps counted
    only after drafting steps."""
    r = compare(ServingRegime(64, PROMPT, OUTPUT, 1.5), (seed,), (0,))
    assert r["results"]["goodput"][0].policy.surcharge.ms < 0.5
    assert r["vs_best"] >= VS_BEST, _table(r)


# What every step carrying prefill costs beyond the model at any K
# (ServingRegime.prefill_step_ms), swinging slowly between nothing and twice its mean as the
# H100's eager prefill steps did (session 50: 18-53 ms spans for one 512-token chunk). It is
# no drafting surcharge: L = 3.0, where fixed K = 3 wins every prefill step. Goodput
# measures it apart only if plain prefill steps keep their residual as current as drafting's
# (`DraftingSurcharge.WEIGHT`): observed between drafting steps (by device span) but weighed
# 1/32 against drafting's 1/8, each swing up showed as a surcharge, prefill steps went
# plain, and goodput fell to 0.967 of fixed K = 3 at 0.25 of the peak (0.986 weighed alike;
# 0.989 with plain prefill steps observed only between plain ones, as before session 50).
SWING_CASES = [
    pytest.param(3.0, 0.25, id="L3.0-0.25"),
    pytest.param(3.0, 0.9, id="L3.0-0.9"),
]


@pytest.mark.parametrize(("accept_len", "share"), SWING_CASES)
def test_goodput_tells_prefill_steps_cost_from_drafting_surcharge(accept_len, share):
    _open_loop(accept_len, share, prefill_step_ms=8.0, prefill_swing_ms=3000.0)


# At 256 clients with 12 ms, goodput's 12 seeds averaged 0.984 of plain decoding (0.968-0.999;
# seed 0's 0.999 was among its best) while the marginal ranking priced a ms at the rows'
# running rate alone, over a request's life: it climbed from 6 to 10.4 tokens/ms over the
# run (plain decoding makes 10.7) and goodput drafted beside prefill while it was low.
# Priced at the higher of that and the server's average over ~64 steps
# (`ServingRate.price`): 1.036 over the same seeds (1.032-1.040), as never drafting there.
CLOSED_SURCHARGE_SEEDS = {64: (0,), 256: (0, 1, 2, 3)}


@pytest.mark.parametrize("concurrency", [64, 256])
def test_goodput_prices_drafting_beside_prefill_in_a_closed_loop(concurrency):
    """With the surcharge, at L = 3.0, 64 clients (most steps carry prefill) and 256 (nearly
    all do; fixed K below plain decoding), goodput holds the best: it drafts in decode-only
    steps and prices the prefill steps' drafts, probing them within a budget."""
    regime = ServingRegime(concurrency, PROMPT, OUTPUT, 3.0, prefill_draft_ms=12.0)
    r = compare(regime, CLOSED_SURCHARGE_SEEDS[concurrency], (0,))
    assert r["goodput"] >= VS_BEST * r["best"], _table(r)
    assert r["goodput"] >= VS_OFF * r["off"], _table(r)
