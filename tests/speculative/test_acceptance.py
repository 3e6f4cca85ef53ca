"""The acceptance model's estimates (speculative/acceptance.py), read lazily after a verify
step: what a read returns is what the estimate was when the step was recorded."""

from __future__ import annotations

from specserve.speculative.acceptance import AcceptanceModel, cumulative_tokens


def _expected(model: AcceptanceModel, request_id: str, prior: list[float]) -> list[float]:
    m = model.REQUEST_PRIOR_WEIGHT
    hits, seen = model._per_request[request_id]
    return [(h + m * g) / (n + m) for h, n, g in zip(hits, seen, prior)]


def test_an_estimate_read_after_later_steps_keeps_the_prior_of_its_own_step():
    """A request's estimate after its verify step takes the global estimate from before that
    step as its prior, even when it is first read after other requests' steps moved the
    global estimate; a later verify step of its own takes the newer prior."""
    model = AcceptanceModel(3)
    model.update_many([("a", 3, 3), ("b", 3, 0)])
    prior = list(model.global_alpha)  # before the next step
    model.tick()
    model.update_many([("a", 3, 1)])
    for _ in range(3):  # others' steps: the global estimate moves, a's is not read
        model.tick()
        model.update_many([("b", 3, 0), ("c", 2, 2)])
    assert model.global_alpha != prior
    alpha = _expected(model, "a", prior)
    assert model.alpha("a") == alpha
    assert model.cumulative("a") == cumulative_tokens(alpha)
    assert model.cumulatives(["a", "b"])[0] == cumulative_tokens(alpha)
    prior = list(model.global_alpha)
    model.tick()
    model.update_many([("a", 3, 2)])
    assert model.cumulatives(["a"]) == [cumulative_tokens(_expected(model, "a", prior))]


def test_an_idle_request_fades_to_the_global_estimate():
    """Steps without drafting fade a request's own evidence (after IDLE_GRACE steps), so its
    estimate approaches the global one whichever way it was first read."""
    model = AcceptanceModel(2)
    model.update_many([("a", 2, 0)] + [("b", 2, 2)] * 4)
    first = model.alpha("a")[0]
    for _ in range(400):
        model.tick()
    faded = model.alpha("a")[0]
    assert first < faded
    assert abs(faded - model.global_alpha[0]) < 0.01


def test_every_read_gives_what_its_counts_and_the_global_estimate_give():
    """`cumulatives` over requests with and without evidence of their own, at every stage of
    fading: each is the cumulative tokens of its counts over the prior (faded by
    IDLE_DECAY for each idle quantum past IDLE_GRACE), and a request without evidence (one
    admitted while nothing drafted) has the global estimate's."""
    model = AcceptanceModel(3)
    model.update_many([("a", 3, 1), ("b", 3, 3), ("b", 2, 2)])
    model.tick()
    before = list(model.global_alpha)  # a's prior until its estimate is next computed
    model.update_many([("a", 3, 0)])
    after = list(model.global_alpha)
    m = model.REQUEST_PRIOR_WEIGHT
    for step in range(1, 40):
        model.tick()
        idle = step - model.IDLE_GRACE
        faded = 0 if idle < model.IDLE_QUANTUM else idle - idle % model.IDLE_QUANTUM
        f = model.IDLE_DECAY**faded
        prior = before if idle < model.IDLE_QUANTUM else after
        hits, seen = model._per_request["a"]
        a = [(h * f + m * g) / (n * f + m) for h, n, g in zip(hits, seen, prior)]
        got = model.cumulatives(["new", "a", "other"])
        assert got[1] == cumulative_tokens(a)
        assert got[0] == got[2] == cumulative_tokens(model.global_alpha)
