"""The goodput policy decides, step by step, what it decided when policy_decisions.json was
recorded: the same draft lengths and probes on every step of closed-loop simulations (every
regime of test_policy_regimes.py, the speculator's bookkeeping included) and of recorded-style
step sequences (policy_replay.py: prefill sharing steps, batches changing size, unpadded
steps with per-request trimming), and the same expectations (tokens, periods, switch costs,
predictions; to 6 significant digits).

It pins host-work optimizations of the policy, the acceptance and cost models and the period
log, which must not change a decision. A change meant to change decisions re-records the
file (`python -m tests.speculative.test_policy_decisions --write`) and says why in its commit.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from specserve.speculative.policy import NO_LOAD, GoodputPolicy
from tests.speculative.test_policy_regimes import CASES as REGIMES
from tests.support.policy_replay import replay
from tests.support.policy_sim import simulate

RECORD = Path(__file__).with_name("policy_decisions.json")
REPLAYS = {
    "replay padded": (True, 11),
    "replay unpadded": (False, 11),
    "replay padded, seed 5": (True, 5),
}


def _values(*xs) -> str:
    return ",".join("None" if x is None else f"{x:.6g}" for x in xs)


def _fingerprint(steps: list[tuple]) -> dict:
    """steps: (draft lengths, probe, values) per decision."""
    draft_lens = hashlib.sha256(repr([s[0] for s in steps]).encode()).hexdigest()[:16]
    values = hashlib.sha256("|".join(s[2] for s in steps).encode()).hexdigest()[:16]
    return {
        "k": "".join(str(max(s[0], default=0)) if s[0] else "-" for s in steps),
        "probe": "".join("p" if s[1] else "." for s in steps),
        "draft_lens": draft_lens,
        "values": values,
    }


def _record_choices(monkeypatch) -> list[tuple]:
    steps: list[tuple] = []
    choose = GoodputPolicy.choose

    def recorded(self, reqs, load=NO_LOAD):
        draft_lens = choose(self, reqs, load)
        d = self.trace.recent[-1] if draft_lens else None
        values = (
            ""
            if d is None
            else "/".join(
                [
                    _values(*d.tokens),
                    _values(*d.period_ms),
                    _values(*d.switch_ms),
                    _values(self.predicted_tokens, self.predicted_ms),
                ]
            )
        )
        steps.append((tuple(draft_lens), d is not None and d.probe, values))
        return draft_lens

    monkeypatch.setattr(GoodputPolicy, "choose", recorded)
    return steps


def run_case(name: str, monkeypatch) -> dict:
    steps = _record_choices(monkeypatch)
    if name in REPLAYS:
        replay(*REPLAYS[name])
    else:
        regime, workload, _, *options = REGIMES[name]
        noise = options[0].get("noise") if options else None
        simulate("goodput", regime, workload, 0, *([noise] if noise is not None else []))
    return _fingerprint(steps)


CASE_NAMES = [*REPLAYS, *REGIMES]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_decisions_match_the_record(name, monkeypatch):
    recorded = json.loads(RECORD.read_text())[name]
    now = run_case(name, monkeypatch)
    assert len(now["k"]) == len(recorded["k"])
    first = next((i for i, (a, b) in enumerate(zip(now["k"], recorded["k"])) if a != b), None)
    assert first is None, f"step {first}: K {now['k'][first]}, recorded {recorded['k'][first]}"
    assert now == recorded


def _write() -> None:
    mp = pytest.MonkeyPatch()
    out = {}
    for name in CASE_NAMES:
        out[name] = run_case(name, mp)
        mp.undo()
        print(name, len(out[name]["k"]), "steps")
    RECORD.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__" and "--write" in sys.argv:
    _write()
