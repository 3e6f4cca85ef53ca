"""The policy trace's counters and decisions, and what `Speculator.observe` hands the
acceptance model and the trace, equal the plain rules they were optimized from (written out
here) on random step sequences: the metrics (`engine.stats()` spec_*) and `dump()` readers
see the same values."""

from __future__ import annotations

from dataclasses import asdict

from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.core.batch import ScheduledRequest
from specserve.speculative.acceptance import AcceptanceModel
from specserve.speculative.policy import FixedPolicy
from specserve.speculative.policy_trace import Decision, PolicyTrace
from tests.support.policy_sim import bare_speculator


class PlainTrace:
    """The counters as first written: per-K loops, the decision built from keywords."""

    def __init__(self):
        self.by_len, self.by_step, self.last = [], [], []
        self.probes = self.switches = self.k_changes = self.n = 0
        self.last_k = None
        self.recent = []

    def record(self, draft_lens):
        self.last = list(draft_lens)
        for k in draft_lens:
            while len(self.by_len) <= k:
                self.by_len.append(0)
            self.by_len[k] += 1
        if draft_lens:
            step_k = max(draft_lens)
            while len(self.by_step) <= step_k:
                self.by_step.append(0)
            self.by_step[step_k] += 1

    def decided(self, num_reqs, k, **expected):
        self.n += 1
        if self.last_k is not None and k != self.last_k:
            self.k_changes += 1
            self.switches += (k > 0) != (self.last_k > 0)
        self.last_k = k
        d = Decision(self.n, num_reqs, k, **expected)
        self.probes += d.probe
        self.recent.append(asdict(d))


values = st.lists(st.floats(0, 10), min_size=1, max_size=4)
ops = st.one_of(
    st.tuples(st.just("record"), st.lists(st.integers(0, 5), max_size=9)),
    st.tuples(
        st.just("decided"),
        st.integers(1, 9),
        st.integers(0, 5),
        st.booleans(),
        st.one_of(st.none(), values),
    ),
    st.tuples(st.just("no_decode")),
)


@given(st.lists(ops, max_size=40))
@settings(max_examples=200, deadline=None)
def test_trace_equals_plain_rules(seq):
    trace, plain = PolicyTrace(), PlainTrace()
    for op in seq:
        if op[0] == "record":
            trace.record(list(op[1]))
            plain.record(op[1])
        elif op[0] == "decided":
            _, n, k, probe, xs = op
            expected = (
                {} if xs is None else dict(probe=probe, tokens=xs, period_ms=xs, switch_ms=xs)
            )
            trace.decided(n, k, **expected)
            plain.decided(n, k, **expected)
        else:
            trace.no_decode()
            plain.last_k = None
        assert trace.steps_by_draft_len == plain.by_len
        assert trace.steps_by_step_k == plain.by_step
        assert trace.last_draft_lens == plain.last
        assert (trace.probe_steps, trace.switches, trace.k_changes, trace.num_decisions) == (
            plain.probes,
            plain.switches,
            plain.k_changes,
            plain.n,
        )
        assert type(trace.probe_steps) is int
        assert trace.dump() == plain.recent


step = st.tuples(st.booleans(), st.integers(0, 4), st.integers(1, 5), st.booleans())


@given(st.lists(st.lists(step, max_size=8), min_size=1, max_size=6))
@settings(max_examples=100, deadline=None)
def test_observe_hands_over_the_plain_lists(steps):
    """Per step: (decoding, drafts, committed tokens, committed known) per request."""
    acceptance = AcceptanceModel(4)
    spec = bare_speculator(FixedPolicy(4), acceptance)
    seen = []
    update_many = acceptance.update_many
    acceptance.update_many = lambda items: (seen.append(list(items)), update_many(items))
    verify_steps = 0
    for rows in steps:
        batch = [
            ScheduledRequest(_Req(f"r{j}"), 1, decoding=dec, drafts=[0] * k)
            for j, (dec, k, _, _) in enumerate(rows)
        ]
        committed = {id(s): c for s, (_, _, c, known) in zip(batch, rows) if known}
        spec.observe(batch, committed, 1.0, 1.0)
        decoding = [s for s in batch if s.decoding]
        verified = [
            (s.request.request_id, len(s.drafts), committed.get(id(s), 1) - 1)
            for s in decoding
            if s.drafts
        ]
        if verified:  # (a step without drafts has nothing to tell the acceptance model)
            verify_steps += 1
            assert seen[-1] == verified
        assert spec.policy.trace.last_draft_lens == [len(s.drafts) for s in decoding]
        assert spec._last_committed == sum(committed.values())
    assert len(seen) == verify_steps


class _Req:
    def __init__(self, request_id):
        self.request_id = request_id
