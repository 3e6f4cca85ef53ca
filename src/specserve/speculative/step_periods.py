"""Which step periods the cost model learns from: steady samples of a K, and what a change of
K cost, decided with one step of hindsight."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.speculative.cost_model import StepCostModel
from specserve.speculative.policy_trace import Decision

CHAIN = 5  # steps of a chain kept: a switch sample needs the two before it and two after


@dataclass(slots=True)
class _Step:
    n: int
    k: int
    ms: float | None  # None: the chain's first step (its period spans a step outside it)
    decision: Decision | None
    context: int = 0  # tokens its decoding requests held (StepCostModel.observe)


class PeriodLog:
    """Classifies the periods of consecutive decode-only steps (a chain: a step with prefill,
    after an idle engine, or without decodes ends it) and records them in the cost model.

    A step's period runs from the previous step's tokens reaching the host to its own. Under
    overlap scheduling the next step is launched inside that period, so a step whose
    successor runs another K carries part of the switch: on SmolLM2 on the H200 a
    plain step before drafting resumed took 3.5-6.5 ms more than a plain one (the drafter's
    catch-up, launched before it resolved) and a drafting step before a plain one 0.6 ms
    less; and the last step before the engine idles has nothing launched inside it. So:

    - a step is steady, a sample of its K, only when the steps before and after it in the
      chain run the same K (labelled "steady" in the trace);
    - the step before a change of K ("before_switch") and the first step at the new K
      ("switch") belong to the switch: their excess over the steady steps on either side
      (the one before them at the old K and the one after at the new) is a sample of the
      switch's one-off cost, by batch bucket and direction, which may be negative;
    - the chain's first and last steps are not used ("").

    In the synchronous loop the step before a switch carries nothing of it, and its excess
    is only noise: both loops are measured alike.
    """

    def __init__(self, cost: StepCostModel | None):
        self.cost = cost
        self._chain: list[_Step] = []

    def add(
        self,
        n: int,
        k: int,
        period_ms: float | None,
        decision: Decision | None,
        context: int = 0,
    ) -> None:
        """The next decode-only step of the chain: n decoding requests holding `context`
        tokens, K = k (the largest draft), its period (None: the step before it was outside
        the chain, so its period says nothing of this step; it starts a chain)."""
        if period_ms is None:
            self.stop()
        chain = self._chain
        if chain:
            self._classify(k)
        chain.append(_Step(n, k, period_ms, decision, context))
        if len(chain) > CHAIN:
            del chain[0]

    def stop(self) -> None:
        """The chain ends: its last step's successor is not comparable, so it is not used."""
        self._chain.clear()

    def _classify(self, next_k: int) -> None:
        """The chain's last step, now that the K of the step after it is known."""
        chain, cost = self._chain, self.cost
        b = chain[-1]
        a = chain[-2] if len(chain) >= 2 else None
        label = ""
        if a is not None and a.k != b.k:
            label = "switch"
        elif b.k != next_k:
            label = "before_switch"
        elif a is not None and b.ms is not None:
            label = "steady"
            if cost is not None:
                cost.observe(b.n, b.k, b.ms, b.context)
                self._switch_sample()
        if b.decision is not None:
            b.decision.recorded = label

    def _switch_sample(self) -> None:
        """Chain ... z y | a b (b steady, a the first step at b's K, y the last at the old K
        and z steady before it): the switch cost (y - z) + (a - b)."""
        chain = self._chain
        if len(chain) < 5 or chain[-3].k == chain[-2].k:  # (y.k == a.k: no switch)
            return
        p, z, y, a, b = chain[-5:]
        if not (p.k == z.k == y.k != a.k == b.k):
            return
        if z.ms is None or y.ms is None or a.ms is None:
            return
        excess = (y.ms - z.ms) + (a.ms - b.ms)
        self.cost.observe_switch(a.n, y.k, a.k, excess, b.ms)
