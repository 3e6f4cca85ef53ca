"""What the goodput policy weighs when a step carries more than decode rows: the server's
running tokens per ms (the price of a millisecond), and the prefill that extra commits bring
in a loaded server."""

from __future__ import annotations

from collections.abc import Callable


class ServingRate:
    """The server's committed tokens per ms over recent steps: EWMAs of each step's
    committed tokens and period, over every step (prefill-only and mixed ones included:
    they take time too). `ready` once MIN_STEPS steps were seen and something committed.

    `per_row` weighs each step by its decoding rows, over about a request's life
    (ROW_WEIGHT): the price of a millisecond in a step carrying prefill. Tokens that drafts
    add there come off the ends of their requests' lives, so what they save is steps where
    the requests decode, not the server's average step: in waves (requests sent together,
    of one length) a wave's prefill runs with few decode rows and drags the running rate to
    a third of what its decode steps make, and drafts priced at it (steps of prefill, K=1 at
    acceptance 1.5 on the 8B shape) cost more than they saved (serving simulator, lockstep).
    Where every step carries prefill and decode rows alike, the two agree."""

    WEIGHT = 1 / 64  # EWMA weight per step
    ROW_WEIGHT = 1 / 256  # about a request's life in steps (lockstep needs it: 1/192 woke)
    MIN_STEPS = 16

    def __init__(self) -> None:
        self.steps = 0
        self._tokens = self._ms = 0.0
        self._row_tokens = self._row_ms = 0.0

    def observe(self, committed: int, period_ms: float, rows: int = 0) -> None:
        """A step committed this many tokens in period_ms, with `rows` decoding requests."""
        self.steps += 1
        w = max(self.WEIGHT, 1.0 / self.steps)  # (a plain mean until the EWMA spans enough)
        self._tokens += w * (committed - self._tokens)
        self._ms += w * (period_ms - self._ms)
        w = max(self.ROW_WEIGHT, 1.0 / self.steps)
        self._row_tokens += w * (rows * committed - self._row_tokens)
        self._row_ms += w * (rows * period_ms - self._row_ms)

    @property
    def value(self) -> float:
        """Tokens per ms (0 before any step)."""
        return self._tokens / self._ms if self._ms > 0 else 0.0

    @property
    def per_row(self) -> float:
        """Tokens per ms weighted by the steps' decoding rows (`value` until a step had
        any)."""
        return self._row_tokens / self._row_ms if self._row_ms > 0 else self.value

    @property
    def ready(self) -> bool:
        return self.steps >= self.MIN_STEPS and self.value > 0


def queued_prefill_ms(
    target: Callable[[float], float],
    n: int,
    tokens: list[float],
    extra_tokens: int,
    per_token: float,
) -> list[float]:
    """What each K's commits bring in prefill, priced on the target's curve at the step's
    size: a loaded server prefills `per_token` prompt tokens for every token it generates (a
    request finished admits the next), so a step committing t tokens brings per_token x t
    prompt tokens into the steps after it, whatever K was. Whole tokens (the curve memoizes
    by size)."""
    out = []
    for k, t in enumerate(tokens):
        size = n * (k + 1) + extra_tokens
        more = round(per_token * t)
        out.append(target(size + more) - target(size) if more > 0 else 0.0)
    return out


def marginal_k(
    tokens: list[float], costs: list[float], switch: list[float], rate: float, dwell_steps: int
) -> int:
    """The K whose tokens beyond their cost at the server's running rate are the most
    (tokens - rate x ms), a switch there and back spread over `dwell_steps`. For a step that
    carries prefill, the step's own tokens per ms would rank K wrong: its prefill costs the
    same at every K, so the ratio spreads that cost over more tokens at a larger K and drafts
    where the extra verify rows, at the full GEMM slope once prefill fills the step, earn
    less than the server earns on average."""
    scores = [t - rate * (ms + sw / dwell_steps) for t, ms, sw in zip(tokens, costs, switch)]
    return scores.index(max(scores))  # the first of equals: the fewer drafts
