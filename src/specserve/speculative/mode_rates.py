"""What speculation delivered, all costs in: the realized throughput of the goodput policy's
two modes (plain decoding with the drafter dormant, and drafting with it kept up) by batch
bucket, and whether drafting has lost to plain decoding where both were measured."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Rate:
    """Decayed sums of one mode's committed tokens per request and periods at one bucket."""

    tokens: float = 0.0
    ms: float = 0.0
    steps: int = 0
    last: int = 0  # the policy step of the last observation

    @property
    def value(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else 0.0


class ModeRates:
    """Committed tokens per request per ms over the steps of each mode at each batch bucket:
    "plain" (the drafter dormant, not a probe) and "drafting" (the drafter kept up: every
    decode-only step, K = 0 ones included, switches and catch-ups alike; steps carrying
    prefill follow the load's prefill, not the mode, and count for neither). The step cost model
    prices steady steps of one K; what it leaves out (the drafter's catch-up after a stretch
    of plain decoding, its upkeep while plain steps run awake, probes, the host's work of a
    speculative step) is in these rates. On SmolLM2 on the H200, chat at concurrency 16,
    plain decoding and fixed K=3 tied (14.0k and 14.1k tokens/s) while the goodput policy,
    switching between them, delivered 12.1k: its steady cells never saw what mixing cost.

    `holds_back(bucket, step)`: drafting lost to plain decoding at this bucket by more than
    MARGIN, both measured over MIN_STEPS steps at least, so a decision to draft is
    overruled; unless a retrial is due: once drafting has not run for `retry` steps at the
    bucket (RETRY_STEPS, doubled after each retrial that lost again, up to MAX_RETRY; back
    to RETRY_STEPS once drafting wins), its rate starts over and decisions to draft go
    through until it is measured again, so that a change of load or acceptance is found.
    `favors_drafting(bucket, step)` is the other way round: drafting delivered more than
    plain decoding by more than MARGIN, so a decision for plain decoding is overruled, with
    retrials of plain decoding's rate alike."""

    WEIGHT = 1 / 256  # decay per observation of a cell (a plain mean until it spans enough)
    MIN_STEPS = 128  # steps of a mode at a bucket before its rate is trusted
    MARGIN = 0.01  # drafting must deliver at least (1 - MARGIN) of plain decoding's rate
    RETRY_STEPS = 1024
    MAX_RETRY = 16384

    def __init__(self) -> None:
        self._cells: dict[tuple[int, str], _Rate] = {}
        self._retry: dict[int, int] = {}  # bucket -> steps between retrials of drafting
        # buckets whose last decision to draft was overruled: their awake plain steps until
        # dormancy are the holding's, not drafting's, so they are not counted
        self._holding: set[int] = set()
        self.num_held = 0  # decisions to draft overruled (exported as a statistic)
        self._plain_retry: dict[int, int] = {}  # the same for plain decoding's rate
        self.num_favored = 0  # decisions for plain decoding overruled

    def observe(
        self, bucket: int, mode: str, tokens_per_request: float, period_ms: float, step: int
    ) -> None:
        """A step of `mode` ("plain" or "drafting") at `bucket` on policy step `step`
        committed this many tokens per decoding request in period_ms (not counted: drafting
        steps at a bucket being held back, plain ones with the drafter still awake)."""
        if mode == "drafting" and bucket in self._holding:
            return
        cell = self._cells.get((bucket, mode))
        if cell is None:
            cell = self._cells[(bucket, mode)] = _Rate()
        cell.steps += 1
        w = max(self.WEIGHT, 1.0 / cell.steps)
        cell.tokens += w * (tokens_per_request - cell.tokens)
        cell.ms += w * (period_ms - cell.ms)
        cell.last = step

    def rate(self, bucket: int, mode: str) -> float | None:
        """The mode's tokens per request per ms at the bucket, None until MIN_STEPS."""
        cell = self._cells.get((bucket, mode))
        return cell.value if cell is not None and cell.steps >= self.MIN_STEPS else None

    def holds_back(self, bucket: int, step: int) -> bool:
        """Whether a decision to draft at `bucket` on policy step `step` is overruled (see
        the class)."""
        self._holding.discard(bucket)
        if not self._overrules(bucket, "drafting", step, self._retry):
            return False
        self._holding.add(bucket)
        self.num_held += 1
        return True

    def favors_drafting(self, bucket: int, step: int) -> bool:
        """Whether a decision for plain decoding at `bucket` on policy step `step` is
        overruled the other way: drafting delivered more than plain decoding there by more
        than MARGIN, both measured over MIN_STEPS steps (where the cost model sees a tie,
        e.g. steps carrying prefill, whose verify rows ride along cheaply). Plain
        decoding's rate gets retrials as drafting's does (see the class), so a change of
        load is found."""
        if not self._overrules(bucket, "plain", step, self._plain_retry):
            return False
        self.num_favored += 1
        return True

    def _overrules(self, bucket: int, loser: str, step: int, retries: dict[int, int]) -> bool:
        """Whether mode `loser` delivered less than the other at `bucket` by more than
        MARGIN, both measured over MIN_STEPS, and no retrial of it is due (`retries`: its
        waits by bucket). A due retrial starts its rate over and doubles the next wait
        unless it wins; a win sets the waits back to the start."""
        drafting = self._cells.get((bucket, "drafting"))
        plain = self._cells.get((bucket, "plain"))
        if drafting is None or plain is None:
            return False
        if drafting.steps < self.MIN_STEPS or plain.steps < self.MIN_STEPS:
            return False  # (a retrial under way, too)
        lost, won = (drafting, plain) if loser == "drafting" else (plain, drafting)
        if lost.value * (1.0 + self.MARGIN) >= won.value:
            retries.pop(bucket, None)  # it holds its own: retrials back to the start
            return False
        retry = retries.get(bucket, self.RETRY_STEPS)
        if step - lost.last >= retry:
            retries[bucket] = min(2 * retry, self.MAX_RETRY)
            self._cells[(bucket, loser)] = _Rate(last=step)
            return False
        return True

    def snapshot(self) -> dict:
        """The rates as plain data (diagnostics): "bucket:mode" -> (rate, steps)."""
        return {
            f"{b}:{m}": (round(c.value, 5), c.steps) for (b, m), c in sorted(self._cells.items())
        }
