"""The simulated workload of policy_sim.py: the requests of a run (lengths, per-position
acceptance rates from a profile, some requests much lower, hard phases where drafts mostly
fail, a hard opening) and the noise of step periods, the same for every policy given a seed."""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

# SmolLM2 + shipped head on the H200 measured 0.68 / 0.67 / 0.75 per position (conditional);
# outside hard phases (about 9% of steps) a typical request accepts a little more.
PROFILE = (0.73, 0.72, 0.80)


@dataclass(frozen=True)
class Workload:
    """Requests of the run: batch 1 runs `rounds` requests one after another, batch b runs
    `rounds` rounds of b requests submitted together (run to completion, like the bench)."""

    batch: int
    rounds: int
    min_tokens: int = 128
    max_tokens: int = 256
    low_share: float = 0.15  # requests unlike the drafter's training (rates x low_scale)
    low_scale: float = 0.6
    hard_enter: float = 0.01  # per step: a request enters a hard phase ...
    hard_leave: float = 0.1  # ... and leaves it (rates x hard_scale meanwhile)
    hard_scale: float = 0.3
    hard_start: int = 0  # a request's first tokens, up to this many, are a hard phase too
    warmup: tuple[int, ...] = (1, 8, 64)  # 16 tokens at each batch size first, not counted


@dataclass(frozen=True)
class Noise:
    sigma: float = 0.2  # lognormal
    outlier_p: float = 0.02
    outlier_x: float = 3.0
    # Slow stretches: from a step, with probability stretch_p, every step at every K takes
    # stretch_x times as long, for a run of about stretch_len steps (geometric). On the H200
    # the default model's batch-1 steps ran 1.7-2x slower at every K in seven stretches of
    # 11-37 steps out of 730 (contention on the lent machine's host).
    stretch_p: float = 0.0
    stretch_len: float = 40.0
    stretch_x: float = 1.75


@dataclass
class SimRequest:
    """What the policy reads of a request (`request_id`, `max_useful_drafts`,
    `drafter_backlog`: none in decode-only steps, the drafter keeps up) and its truth."""

    request_id: str
    length: int
    rates: tuple[float, ...]
    rng: random.Random
    generated: int = 0
    hard: bool = False
    drafted: bool = False
    hard_until: int = 0  # tokens: a hard start (the opening of an answer)
    drafter_backlog: int = 0

    @property
    def max_useful_drafts(self) -> int:
        return max(0, self.length - self.generated - 1)

    def accept(self, k: int, wl: Workload) -> int:
        if self.hard:
            self.hard = self.rng.random() >= wl.hard_leave
        else:
            self.hard = self.rng.random() < wl.hard_enter
        scale = wl.hard_scale if self.hard or self.generated < self.hard_until else 1.0
        accepted = 0
        while accepted < k and self.rng.random() < self.rates[accepted] * scale:
            accepted += 1
        return accepted


@functools.lru_cache(maxsize=16)
def noise_factors(noise: Noise, seed: int, steps: int = 8192) -> tuple[float, ...]:
    """Multiplicative noise of the periods step by step: lognormal (mean 1), outliers and
    slow stretches."""
    rng = random.Random(seed + 7919)
    slow = random.Random(seed + 104729)  # its own stream: without stretches, the same draws
    out, left = [], 0
    for _ in range(steps):
        x = math.exp(rng.gauss(0.0, noise.sigma) - noise.sigma**2 / 2)
        x = x * noise.outlier_x if rng.random() < noise.outlier_p else x
        if noise.stretch_p:
            if left == 0 and slow.random() < noise.stretch_p:
                left = 1 + int(slow.expovariate(1.0 / noise.stretch_len))
            if left:
                x, left = x * noise.stretch_x, left - 1
        out.append(x)
    return tuple(out)


def make_requests(wl: Workload, seed: int, tokens: int | None = None) -> list[SimRequest]:
    """The run's requests, the same for every policy given the seed."""
    rng = random.Random(seed)
    count = wl.rounds * wl.batch
    out = []
    for i in range(count):
        low = rng.random() < wl.low_share
        jitter = rng.uniform(0.85, 1.1)
        rates = tuple(min(0.97, a * jitter * (wl.low_scale if low else 1.0)) for a in PROFILE)
        length = tokens or rng.randint(wl.min_tokens, wl.max_tokens)
        req = SimRequest(f"s{seed}-{i}", length, rates, random.Random(rng.random()))
        if wl.hard_start:
            req.hard_until = rng.randint(0, wl.hard_start)
        out.append(req)
    return out
