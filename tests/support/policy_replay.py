"""A recorded-style sequence of steps driven through the goodput policy without an engine:
requests arrive and finish (batch 1 to 24), prefill shares some steps, drafts are accepted
at random, periods are a noisy function of the step (so new cost cells and switch costs
appear along the way). Same seed, same inputs: what the policy decides is a function of its
code only (test_policy_memo.py, test_policy_decisions.py)."""

from __future__ import annotations

import random

from specserve.speculative.acceptance import AcceptanceModel
from specserve.speculative.cost_model import CurveModel, StepCostModel
from specserve.speculative.policy import GoodputPolicy, StepLoad
from specserve.speculative.step_periods import PeriodLog


class ReplayRequest:
    """What the policy reads of a request: its id, how many drafts it can still use and
    (while dormant) its drafter's backlog, none here (decode-only: the drafter keeps up)."""

    drafter_backlog = 0

    def __init__(self, request_id: str, left: int):
        self.request_id, self.left = request_id, left

    @property
    def max_useful_drafts(self) -> int:
        return max(0, self.left - 1)


def replay(padded: bool, seed: int, steps: int = 1500) -> tuple[list[tuple], GoodputPolicy]:
    """(draft lengths, predicted tokens, predicted ms) of every step, and the policy."""
    rng = random.Random(seed)
    target = CurveModel({1: 1.0, 16: 1.1, 64: 1.4, 256: 3.0})
    cost = StepCostModel(target, CurveModel({1: 0.2, 64: 0.3}), padded=padded)
    acceptance = AcceptanceModel(3)
    policy = GoodputPolicy(3, cost, acceptance)
    periods = PeriodLog(cost)
    live: list[ReplayRequest] = []
    next_id, out = 0, []
    for _ in range(steps):
        while len(live) < rng.choice((1, 2, 8, 24)):
            live.append(ReplayRequest(f"r{next_id}", rng.randint(2, 120)))
            next_id += 1
        extra = rng.choice((0, 0, 0, 0, 37, 256))
        draft_lens = policy.choose(live, StepLoad(extra))
        out.append((tuple(draft_lens), policy.predicted_tokens, policy.predicted_ms))
        acceptance.update_many(
            [
                (r.request_id, k, min(k, int(rng.expovariate(0.7))))
                for r, k in zip(live, draft_lens)
                if k
            ]
        )
        k = max(draft_lens)
        ms = cost.seed_ms(len(live), k) * (1.6 + 0.3 * (k > 0)) * rng.lognormvariate(0, 0.1)
        periods.add(len(live), k, None if extra else ms, None)
        for r, kr in zip(live, draft_lens):
            r.left -= 1 + (kr and rng.randint(0, kr))
        done = [r for r in live if r.left <= 0]
        live = [r for r in live if r.left > 0]
        if rng.random() < 0.02:
            done += live[len(live) // 2 :]
            live = live[: len(live) // 2]  # aborts
        for r in done:
            acceptance.forget(r.request_id)
    return out, policy
