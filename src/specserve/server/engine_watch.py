"""When the engine process was last heard from, and what its silence says about it."""

from __future__ import annotations

import time


class EngineWatch:
    """When the engine was last heard from, and what that says about it.

    The reader thread stamps every message (`heard`). A step report is sent as the loop
    finishes a turn; a heartbeat (an empty report the engine's outbox thread sends after a
    second without one) carries when the loop last began a turn. So a process silent for
    `silent_s` is stopped or hung, not busy (its heartbeat comes from a thread of its own,
    which a long step does not hold up); a loop in one turn for `step_s` runs a step that
    does not end (a device or a collective hung, a deadlock) or an extraordinary one.
    """

    def __init__(self, silent_s: float, step_s: float):
        self.silent_s = silent_s
        self.step_s = step_s
        now = time.monotonic()
        self.heard_at = now  # when the last message arrived (time.monotonic: every process's)
        self.loop_at = now  # when the engine's loop last began or ended a turn
        self.resumed_at = now  # when this process last resumed from a stall of its own

    def heard(self, loop_at: float) -> None:
        """A message arrived (the reader thread); `loop_at`: its loop's last turn."""
        self.loop_at = loop_at
        self.heard_at = time.monotonic()

    def silent_s_at(self, now: float) -> float:
        """How long the engine process has said nothing (this process's own stalls, in
        which its reader could not read, not counted)."""
        return now - max(self.heard_at, self.resumed_at)

    def silent(self, now: float) -> bool:
        return self.silent_s_at(now) > self.silent_s

    def problem(self, now: float) -> str | None:
        """Why the engine is not serving, or None."""
        silent_s = self.silent_s_at(now)
        if silent_s > self.silent_s:
            return (
                f"the engine process has not answered for {silent_s:.0f} s (it reports "
                "every second): it is stopped or hung"
            )
        busy_s = now - max(self.loop_at, self.resumed_at)
        if busy_s > self.step_s:
            return (
                f"the engine has been in one step for {busy_s:.0f} s (hung on the device or "
                "in a collective?)"
            )
        return None
