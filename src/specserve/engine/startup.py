"""What the engine is doing while it starts, with timings: on stderr for a person waiting
(`specserve generate`, `LLM(progress=True)`), as log records otherwise (the server's log).

Start-up takes from seconds (a tiny model on the CPU) to minutes (an 8B model on a GPU:
kernel selection, whole-step tuning, CUDA graph capture), and a silent terminal for a
minute reads as a hang.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("specserve")


class StartupProgress:
    """Start-up phases as lines "specserve: <what>... <seconds> s": on stderr when `show`,
    else as INFO records of the "specserve" logger."""

    def __init__(self, show: bool):
        self.show = show
        self.t0 = time.perf_counter()

    def note(self, message: str) -> None:
        """One line about the start-up (a size, a choice)."""
        if self.show:
            print(f"specserve: {message}", file=sys.stderr, flush=True)
        else:
            log.info("%s", message)

    @contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """Announce `what`, run the block, say how long it took. A block that raises says
        nothing more: its error speaks for it."""
        if self.show:
            print(f"specserve: {what}...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        yield
        self.note(f"{what}: {time.perf_counter() - t0:.1f} s")

    def ready(self) -> None:
        """The engine is ready: the whole start-up's time."""
        self.note(f"ready in {time.perf_counter() - self.t0:.1f} s")
