"""Spies on an engine's parts (`runner.prepare = spy`) for the length of one test.

A spy that calls the method it replaces holds that method's object, which holds the spy:
a reference cycle, and an engine caught in one keeps its KV cache (256 MiB on the CPU, a
drafter's pool besides) until a full collection of the cyclic garbage collector, which may
not come for many tests (the CPU suite's memory grew by gigabytes that way). A spy set
with `spy_on` is taken off when the test ends (tests/conftest.py), so the engine is freed
as soon as the test drops it; pytest's `monkeypatch` does the same for tests that take it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

_spies = pytest.MonkeyPatch()


def spy_on(obj: object, name: str, spy: Callable) -> None:
    """Sets `obj.<name>` to `spy` until the running test ends."""
    _spies.setattr(obj, name, spy)


def remove_spies() -> None:
    """Puts back what every `spy_on` replaced (tests/conftest.py, after each test)."""
    _spies.undo()
