"""What speculation delivered against what the goodput policy expected of it, all costs in,
for the policy's two modes (plain decoding with the drafter dormant, and drafting with it kept
up) by batch bucket, and whether drafting has lost to plain decoding (or the other way round)
once each mode's expectations are corrected by how they turned out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Rate:
    """Decayed means of one mode's steps at one bucket: committed tokens per request and the
    period (ms), and what the policy expected of each (its decision's tokens and period at
    the step's K)."""

    tokens: float = 0.0
    expected_tokens: float = 0.0
    ms: float = 0.0
    expected_ms: float = 0.0
    steps: int = 0
    last: int = 0  # the policy step of the last observation

    @property
    def value(self) -> float:
        """Delivered over expected goodput: (tokens / expected) / (period / expected)."""
        if self.ms <= 0 or self.expected_tokens <= 0:
            return 0.0
        return (self.tokens / self.expected_tokens) * (self.expected_ms / self.ms)


class ModeRates:
    """How each mode's expectations turned out, by batch bucket: for "plain" (the drafter
    dormant, not a probe) and "drafting" (the drafter kept up: every decode-only step, K = 0
    ones included, switches and catch-ups alike; steps carrying prefill follow the load's
    prefill, not the mode, and count for neither), delivered goodput over expected (its
    committed tokens over the decision's expected tokens, times the expected period over
    the measured one). The step cost model prices steady steps of one K; what it leaves out
    (the drafter's catch-up after a stretch of plain decoding, its upkeep while plain steps
    run awake, probes, the host's work of a speculative step) lowers drafting's factor. On
    SmolLM2 on the H200, chat at concurrency 16, plain decoding and fixed K=3 tied (14.0k
    and 14.1k tokens/s) while the goodput policy, switching between them, delivered 12.1k:
    its steady cells never saw what mixing cost.

    Factors, not raw tokens per ms: a mode's tokens per ms follow the acceptance of the
    requests that ran while it was measured, and on chat prompts that varies several-fold
    from one answer to the next; at one request at a time (concurrency 1) drafting measured
    on a hard answer was held back on the easy ones after it (the H200, the default model:
    held back on 60-500 decisions a run where fixed K=3 delivered 1.09x plain decoding).
    The policy's expectations carry each request's own acceptance; the factors carry what
    the expectations miss.

    `holds_back(bucket, step, drafting, plain)`: the decision's expected goodput of drafting
    and of plain decoding (tokens per ms), each times its mode's factor: drafting falls
    short by more than MARGIN, both factors measured over MIN_STEPS steps at least (plain
    decoding's: see below), so the decision to draft is overruled; unless a retrial is due:
    once drafting has not run for `retry` steps at the bucket (RETRY_STEPS, doubled after
    each retrial that lost again, up to MAX_RETRY; back to RETRY_STEPS once drafting wins),
    its factor starts over and decisions to draft go through until it is measured again, so
    that a change of load is found. `favors_drafting(bucket, step, drafting, plain)` is the
    other way round: drafting (the best K > 0) beats plain decoding by more than MARGIN
    after the correction, so a decision for plain decoding is overruled, with retrials of
    plain decoding's factor alike.

    Plain decoding's factor is measured only once the policy goes dormant, which a policy
    that always prefers drafting by a little never does: the default model at concurrency
    64 on the H200 (session 35) expected K=3 to deliver 39 tokens a ms against K = 0's 38
    (its period with the drafter awake, 1.67 ms), while drafting's factor was 0.89 and
    speculation off (1.43 ms a step, session 34) delivered 45. Until measured at a
    bucket of PRIOR_MIN_BATCH requests or more, plain decoding's factor is taken as
    PLAIN_PRIOR where the decision expects drafting to lead by less than PRIOR_GAP: its
    steps are priced at K = 0's period with the drafter kept up, which dormancy can only
    shorten, so a drafting factor that turns such a near tie into a loss holds drafting
    back, the policy goes dormant, and plain decoding is measured (then both factors decide,
    with retrials as above). Not where drafting leads by more: a fixed K pays none of the
    switches, probes and catch-ups that lower the policy's drafting factor, and going
    dormant to find out costs more of them (in the closed-loop simulator, down to 0.94 of
    the best fixed K where it leads by 22%). Nor at fewer requests, whose expectations
    follow a few answers' stretches of easy or hard text and whose period estimates are
    noisier: a near tie there passes. Going dormant on it lost 1-2% at batch 1 in the
    simulator and, at 16 requests, a round on the H200 (0.86 of fixed K=3 with 30% of its
    steps plain, against 0.90 in the round before, at 2% plain); at 64 the two rounds gave
    0.999 and 0.977 of the best of off and fixed K=3, with plain decoding measured at 64."""

    WEIGHT = 1 / 256  # decay per observation of a cell (a plain mean until it spans enough)
    MIN_STEPS = 128  # steps of a mode at a bucket before its factor is trusted
    MARGIN = 0.01  # drafting must deliver at least (1 - MARGIN) of plain decoding's goodput
    RETRY_STEPS = 1024
    MAX_RETRY = 16384
    PLAIN_PRIOR = 1.0
    PRIOR_GAP = 0.1
    PRIOR_MIN_BATCH = 32

    def __init__(self) -> None:
        self._cells: dict[tuple[int, str], _Rate] = {}
        self._retry: dict[int, int] = {}  # bucket -> steps between retrials of drafting
        # buckets whose last decision to draft was overruled: their awake plain steps until
        # dormancy are the holding's, not drafting's, so they are not counted
        self._holding: set[int] = set()
        self.num_held = 0  # decisions to draft overruled (exported as a statistic)
        self._plain_retry: dict[int, int] = {}  # the same for plain decoding's factor
        self.num_favored = 0  # decisions for plain decoding overruled

    def observe(
        self,
        bucket: int,
        mode: str,
        tokens_per_request: float,
        expected_tokens: float,
        period_ms: float,
        expected_ms: float,
        step: int,
    ) -> None:
        """A step of `mode` ("plain" or "drafting") at `bucket` on policy step `step`
        committed this many tokens per decoding request in period_ms, where its decision
        expected `expected_tokens` per request in `expected_ms` (not counted: drafting steps
        at a bucket being held back, plain ones with the drafter still awake)."""
        if mode == "drafting" and bucket in self._holding:
            return
        cell = self._cells.get((bucket, mode))
        if cell is None:
            cell = self._cells[(bucket, mode)] = _Rate()
        cell.steps += 1
        w = max(self.WEIGHT, 1.0 / cell.steps)
        cell.tokens += w * (tokens_per_request - cell.tokens)
        cell.expected_tokens += w * (expected_tokens - cell.expected_tokens)
        cell.ms += w * (period_ms - cell.ms)
        cell.expected_ms += w * (expected_ms - cell.expected_ms)
        cell.last = step

    def rate(self, bucket: int, mode: str) -> float | None:
        """The mode's factor (delivered over expected goodput) at the bucket, None until
        MIN_STEPS."""
        cell = self._cells.get((bucket, mode))
        return cell.value if cell is not None and cell.steps >= self.MIN_STEPS else None

    def holds_back(self, bucket: int, step: int, drafting: float, plain: float) -> bool:
        """Whether a decision to draft at `bucket` on policy step `step` is overruled, where
        the decision expected `drafting` tokens per ms of its K and `plain` of K = 0 (see
        the class)."""
        self._holding.discard(bucket)
        if not self._overrules(bucket, "drafting", step, self._retry, drafting, plain):
            return False
        self._holding.add(bucket)
        self.num_held += 1
        return True

    def favors_drafting(self, bucket: int, step: int, drafting: float, plain: float) -> bool:
        """Whether a decision for plain decoding at `bucket` on policy step `step` is
        overruled the other way: `drafting` (the expected tokens per ms of the best K > 0)
        beats `plain` (K = 0's) by more than MARGIN once each is corrected by its mode's
        factor, both measured over MIN_STEPS steps (where the cost model sees a tie, e.g.
        steps carrying prefill, whose verify rows ride along cheaply). Plain decoding's
        factor gets retrials as drafting's does (see the class), so a change of load is
        found."""
        if not self._overrules(bucket, "plain", step, self._plain_retry, plain, drafting):
            return False
        self.num_favored += 1
        return True

    def _overrules(
        self,
        bucket: int,
        loser: str,
        step: int,
        retries: dict[int, int],
        loser_expected: float,
        winner_expected: float,
    ) -> bool:
        """Whether mode `loser` falls short of the other at `bucket` by more than MARGIN,
        each mode's expected goodput times its factor, both factors measured over
        MIN_STEPS (plain decoding's taken as PLAIN_PRIOR until then, when drafting loses),
        and no retrial of it is due (`retries`: its waits by bucket). A due retrial starts
        its factor over and doubles the next wait unless it wins; a win sets the waits back
        to the start."""
        drafting = self._cells.get((bucket, "drafting"))
        plain = self._cells.get((bucket, "plain"))
        if drafting is None or drafting.steps < self.MIN_STEPS:
            return False  # (a retrial under way, too)
        if plain is not None and plain.steps >= self.MIN_STEPS:
            plain_value = plain.value
        elif (
            loser == "drafting"
            and bucket >= self.PRIOR_MIN_BATCH
            and winner_expected >= (1.0 - self.PRIOR_GAP) * loser_expected
        ):
            plain_value = self.PLAIN_PRIOR  # never dormant long enough here: see the class
        else:
            return False
        lost, lost_value, won_value = (
            (drafting, drafting.value, plain_value)
            if loser == "drafting"
            else (plain, plain_value, drafting.value)
        )
        if loser_expected * lost_value * (1.0 + self.MARGIN) >= winner_expected * won_value:
            retries.pop(bucket, None)  # it holds its own: retrials back to the start
            return False
        retry = retries.get(bucket, self.RETRY_STEPS)
        if step - lost.last >= retry:
            retries[bucket] = min(2 * retry, self.MAX_RETRY)
            self._cells[(bucket, loser)] = _Rate(last=step)
            return False
        return True

    def snapshot(self) -> dict:
        """The factors as plain data (diagnostics, the engine's stats): "bucket:mode" -> its
        factor, and the steps it spans."""
        cells = sorted(self._cells.items())
        return {
            "mode_factor": {f"{b}:{m}": c.value for (b, m), c in cells},
            "mode_steps": {f"{b}:{m}": c.steps for (b, m), c in cells},
        }
