"""The speculation policy's decision trace: counters exported as metrics and a bounded ring
of per-step decisions, each joined with the step's measured period once it is processed."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

from specserve.speculative.buckets import batch_bucket

TRACE_STEPS = 4096


@dataclass(slots=True)
class Decision:
    """One step's draft-length decision and, once the step is processed, what it cost.

    `tokens[k]`, `period_ms[k]`, `switch_ms[k]`: what the goodput policy expected of the step
    at each uniform K (committed tokens; steady period; the one-off cost of switching to K
    from the previous step's K); None for the other policies. `observed_ms`: the step's
    measured period (the previous step's tokens on the host to its own). `recorded`: what the
    cost model made of it: "steady" (same K as the step before), "switch" (the first step at
    a new K), "before_switch" (a plain step followed by a drafting one: resolved early, so
    its period is short; not used), "" (not used: prefill in the step or just before it, or
    the first step after an idle engine). `step_ms`: where the goodput policy deliberated a
    step carrying prefill, the period its cost model predicted for the step as decided (what
    drafting there costs beyond it is measured against this: `DraftingSurcharge`).
    `device_ms`: the step's device span (CUDA; None elsewhere); `parts`: what the step
    carried beside its decodes, "+"-joined: "prefill", "dormant" (the drafter's upkeep
    stopped), "awake" (decode-only with it kept up); `held`: the goodput policy repeated a
    settled decision without deliberating. `upkeep_ms`, `wait_ms`: in a step carrying
    prefill with the drafter kept up, the host time of the drafter's upkeep and the host's
    wait for the step's tokens (`DrafterUpkeep`)."""

    step: int
    num_reqs: int
    k: int
    probe: bool = False
    tokens: list[float] | None = None
    period_ms: list[float] | None = None
    switch_ms: list[float] | None = None
    observed_ms: float | None = None
    recorded: str = ""
    step_ms: float | None = None
    device_ms: float | None = None
    parts: str = ""
    held: bool = False
    upkeep_ms: float | None = None
    wait_ms: float | None = None


@dataclass
class PolicyTrace:
    """What the policy decided and how it turned out: counters (exported as metrics) and the
    last TRACE_STEPS decisions (`recent`; `dump()` as plain dicts) for diagnostics."""

    steps_by_draft_len: list[int] = field(default_factory=list)  # request-steps per K
    steps_by_step_k: list[int] = field(default_factory=list)  # steps per step K (max of K)
    probe_steps: int = 0  # steps the goodput policy spent measuring a K it did not prefer
    switches: int = 0  # steps whose K crossed between 0 and > 0 from the step before
    k_changes: int = 0  # steps whose K differs from the step before
    last_draft_lens: list[int] = field(default_factory=list)
    predicted_goodput: float = 0.0  # tokens/s the policy expected of the last step
    observed_goodput: float = 0.0  # tokens/s the last step delivered
    num_decisions: int = 0
    # Wall-clock periods of processed steps by the step's K (the previous step's tokens on
    # the host to its own; steps after an idle engine are not timed): their sum (ms) and
    # count, so that a K's mean step under this policy is seen next to another policy's
    period_ms_by_step_k: list[float] = field(default_factory=list)
    timed_steps_by_step_k: list[int] = field(default_factory=list)
    # the device's span of those steps (CUDA events; not on the CPU): beside the periods, it
    # says whether a K's steps are long on the device or wait for the host
    device_ms_by_step_k: list[float] = field(default_factory=list)
    dormant_steps: int = 0  # processed steps during which the drafter's upkeep was stopped
    settled_steps: int = 0  # decisions repeated without deliberating (goodput's held ones)
    # Plain (K=0) steps by part: "dormant" (the drafter's upkeep stopped), "prefill" (a
    # prompt chunk in the step) and "awake" (decode-only, the drafter kept up: its
    # ride-alongs): their periods and device spans (ms, summed) and counts, so that what a
    # plain step costs with and without upkeep or prefill is seen apart
    plain_ms_by_part: dict[str, float] = field(default_factory=dict)
    plain_device_ms_by_part: dict[str, float] = field(default_factory=dict)
    plain_steps_by_part: dict[str, int] = field(default_factory=dict)
    # Decisions that woke a dormant drafter (goodput), by cause: "prefill" (a step carrying
    # prefill, ranked by its marginal tokens), "decode" (the model's choice at a decode-only
    # step) or "favored" (the mode check overruled plain decoding): each wake costs the
    # batch's catch-up, so where plain decoding is best they say what keeps it awake
    wakes: dict[str, int] = field(default_factory=dict)
    # The goodput policy's last decision at each batch bucket that weighed more than one K
    # at a decode-only step (not a probe; a held decision repeats its expectations): its
    # requests, and what it expected at each K (committed tokens; period ms, as ranked), so
    # that what the policy believed is seen beside what the steps delivered (`expectations`)
    last_expected: dict[int, tuple[int, list[float], list[float]]] = field(default_factory=dict)
    recent: deque = field(default_factory=lambda: deque(maxlen=TRACE_STEPS))
    _pending: deque = field(default_factory=lambda: deque(maxlen=4))  # decided, not processed
    _last_k: int | None = None  # K of the last decision; None after a step without decodes

    def record(self, draft_lens: list[int]) -> None:
        """A processed step's draft lengths, one per decoding request; the trace keeps the
        list (`last_draft_lens`): the caller hands over a fresh one."""
        self.last_draft_lens = draft_lens
        if not draft_lens:
            return
        by_len, by_step = self.steps_by_draft_len, self.steps_by_step_k
        max_draft_len = max(draft_lens)
        if len(by_len) <= max_draft_len:
            by_len.extend([0] * (max_draft_len + 1 - len(by_len)))
        if min(draft_lens) == max_draft_len:  # one draft length (the usual case)
            by_len[max_draft_len] += len(draft_lens)
        else:
            for k in draft_lens:
                by_len[k] += 1
        if len(by_step) <= max_draft_len:
            by_step.extend([0] * (max_draft_len + 1 - len(by_step)))
        by_step[max_draft_len] += 1

    def timed(
        self,
        max_draft_len: int,
        period_ms: float,
        device_ms: float | None = None,
        parts: tuple[str, ...] = (),
    ) -> None:
        """A processed step's measured period (and device span, if timed), by its K; a plain
        step's also under each of its `parts` ("dormant", "prefill", "awake")."""
        sums, counts = self.period_ms_by_step_k, self.timed_steps_by_step_k
        device = self.device_ms_by_step_k
        if len(sums) <= max_draft_len:
            more = max_draft_len + 1 - len(sums)
            sums.extend([0.0] * more)
            counts.extend([0] * more)
            device.extend([0.0] * more)
        sums[max_draft_len] += period_ms
        counts[max_draft_len] += 1
        if device_ms is not None:
            device[max_draft_len] += device_ms
        if max_draft_len == 0:
            for part in parts:
                self.plain_ms_by_part[part] = self.plain_ms_by_part.get(part, 0.0) + period_ms
                self.plain_steps_by_part[part] = self.plain_steps_by_part.get(part, 0) + 1
                if device_ms is not None:
                    spans = self.plain_device_ms_by_part
                    spans[part] = spans.get(part, 0.0) + device_ms

    def decided(
        self,
        num_reqs: int,
        k: int,
        probe: bool = False,
        tokens: list[float] | None = None,
        period_ms: list[float] | None = None,
        switch_ms: list[float] | None = None,
        step_ms: float | None = None,
        held: bool = False,
    ) -> None:
        """A step with decoding requests was given draft lengths, `k` the largest; the rest
        as in `Decision`."""
        n = self.num_decisions = self.num_decisions + 1
        last = self._last_k
        if last is not None and k != last:
            self.k_changes += 1
            self.switches += (k > 0) != (last > 0)
        self._last_k = k
        if probe:
            self.probe_steps += 1
        d = Decision(n, num_reqs, k, probe, tokens, period_ms, switch_ms)  # positional: cheaper
        if held:
            d.held = True
        if step_ms is not None:
            d.step_ms = step_ms
        elif tokens is not None and period_ms is not None and len(tokens) > 1 and not probe:
            self.last_expected[batch_bucket(num_reqs)] = (num_reqs, tokens, period_ms)
        self.recent.append(d)
        self._pending.append(d)

    def no_decode(self) -> None:
        """A step without decoding requests (prefill only): the next step switches nothing."""
        self._last_k = None

    def processed(self, num_reqs: int, k: int) -> tuple[Decision | None, int | None]:
        """The decision of the step being processed (steps are processed in launch order:
        the oldest pending decision of at least this shape, as settling only shrinks a step)
        and the K already chosen for the step after it (overlap loop), else None."""
        while self._pending:
            d = self._pending.popleft()
            if d.num_reqs >= num_reqs and d.k >= k:
                return d, (self._pending[0].k if self._pending else None)
        return None, None

    def expectations(self) -> dict:
        """The last deliberated decode-only decision at each bucket as plain data (the
        engine's stats): "expected_tokens" -> "bucket:K" -> committed tokens per request it
        expected at K, "expected_period_ms" -> the period (ms) it ranked K by (decode
        attention at the requests' context included; a dormant drafter's wake not)."""
        tokens, periods = {}, {}
        for bucket, (n, expected, ms) in sorted(self.last_expected.items()):
            for k, (t, p) in enumerate(zip(expected, ms)):
                tokens[f"{bucket}:{k}"] = t / n
                periods[f"{bucket}:{k}"] = p
        return {"expected_tokens": tokens, "expected_period_ms": periods}

    def dump(self) -> list[dict]:
        """The recent decisions as plain dicts, oldest first."""
        return [asdict(d) for d in self.recent]
