"""The adaptive-speculation matrix of `specserve bench sweep --matrix adaptive`: which servers
to start (a configuration at a simulated acceptance each) and which load points each serves.

Configurations: `off` (plain decoding), `fixed-kK` for every K asked for, and `goodput` with
K_max chosen per acceptance. An acceptance L > 1 is a mean acceptance length at the goodput
policy's K_max (a value <= 1 is a per-token acceptance rate). By default every configuration
at that acceptance gets the same per-token rate (`simulate_as="rate"`): the same drafter
quality for every K, so the configurations differ only in how they use it. With
`simulate_as="length"` each server gets L itself (the engine turns it into a rate at its own
K), and a fixed K the engine refuses (L > K + 1) is skipped. `off` never drafts, so one `off`
server serves every acceptance. Poisson request rates are requests per second, or fractions
("0.5x") of the highest request throughput the `off` server reached in the closed loop.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

POLICIES = ("off", "fixed", "goodput")
ARRIVALS = ("closed", "poisson")
SIMULATE_AS = ("rate", "length")
MIN_REQUESTS = 8  # a point never measures fewer requests than this


@dataclass
class MatrixSpec:
    """What the matrix covers; `matrix_spec` fills it from defaults, a JSON file and flags
    (the keys of the file are these field names)."""

    acceptance: list[float] = field(default_factory=lambda: [1.5, 3.0, 4.5])
    fixed_k: list[int] = field(default_factory=lambda: [1, 2, 3, 5])
    policies: list[str] = field(default_factory=lambda: list(POLICIES))
    goodput_k_max: dict[float, int] = field(default_factory=dict)  # default: k_max_for
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 64, 128, 256, 512])
    arrival: list[str] = field(default_factory=lambda: list(ARRIVALS))
    request_rates: list[float] = field(default_factory=list)  # requests per second
    relative_rates: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75, 0.9])
    simulate_as: str = "rate"
    requests_per_concurrency: float = 2.0  # closed loop: requests per point >= this * c
    poisson_seconds: float = 20.0  # open loop: requests per point >= rate * this

    def __post_init__(self) -> None:
        for name in ("acceptance", "fixed_k", "policies", "arrival", "concurrency"):
            if not isinstance(getattr(self, name), list):
                raise ValueError(f"{name} must be a list; got {getattr(self, name)!r}")
        numbers = {"acceptance": (int, float), "fixed_k": (int,), "concurrency": (int,)}
        for name, kinds in numbers.items():
            values = getattr(self, name)
            bad = [v for v in values if isinstance(v, bool) or not isinstance(v, kinds)]
            if bad:
                raise ValueError(f"{name} must hold numbers ({kinds[-1].__name__}); got {bad}")
        self.goodput_k_max = {float(a): int(k) for a, k in self.goodput_k_max.items()}
        if not self.acceptance or min(self.acceptance) <= 0:
            raise ValueError(f"acceptance needs positive values; got {self.acceptance}")
        if any(not 1 <= k <= 16 for k in self.fixed_k):
            raise ValueError(f"fixed K must be in [1, 16]; got {self.fixed_k}")
        _check_subset("policies", self.policies, POLICIES)
        _check_subset("arrival", self.arrival, ARRIVALS)
        if self.simulate_as not in SIMULATE_AS:
            raise ValueError(f"simulate_as must be rate or length; got {self.simulate_as!r}")
        if "closed" in self.arrival and (not self.concurrency or min(self.concurrency) < 1):
            raise ValueError(f"concurrency needs positive integers; got {self.concurrency}")
        if min(self.request_rates + self.relative_rates, default=1) <= 0:
            raise ValueError("request rates must be positive")
        if "poisson" in self.arrival and not (self.request_rates or self.relative_rates):
            raise ValueError("Poisson arrivals need request rates (e.g. 2,8 or 0.5x)")
        if (
            "poisson" in self.arrival
            and self.relative_rates
            and not ("off" in self.policies and "closed" in self.arrival)
        ):
            raise ValueError(
                "relative request rates (0.5x) are fractions of the off "
                "configuration's highest closed-loop request throughput: run off "
                "with closed arrivals, or give rates in requests/s"
            )
        if self.requests_per_concurrency <= 0 or self.poisson_seconds <= 0:
            raise ValueError("requests_per_concurrency and poisson_seconds must be positive")
        for a in self.acceptance:
            if self.simulate_as == "rate" and a > self.k_max_for(a) + 1:
                raise ValueError(
                    f"acceptance length {a} is more than K_max + 1 tokens a step "
                    f"(K_max {self.k_max_for(a)}); raise goodput_k_max for it"
                )

    def k_max_for(self, acceptance: float) -> int:
        """The goodput policy's K_max at an acceptance: as given, else 3 up to L = 3 and 5
        (or more where L needs it) above."""
        if acceptance in self.goodput_k_max:
            return self.goodput_k_max[acceptance]
        return 3 if acceptance <= 3.0 else max(5, math.ceil(acceptance) - 1)

    def simulate_value(self, acceptance: float) -> float:
        """What every server at this acceptance gets as --speculative-simulate-acceptance
        under simulate_as="rate": the per-token rate whose mean acceptance length at K_max
        is `acceptance` (a rate <= 1 as it is)."""
        if acceptance <= 1.0:
            return acceptance
        from specserve.runtime.verify import rate_for_mean_accept_len  # the engine's conversion

        return round(rate_for_mean_accept_len(acceptance, self.k_max_for(acceptance)), 6)


def _check_subset(what: str, values: list[str], allowed: tuple[str, ...]) -> None:
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ValueError(f"{what} must be among {', '.join(allowed)}; got {values}")


@dataclass
class ServerRun:
    """One server of the matrix: a configuration at one simulated acceptance (None for off,
    which never drafts and serves every acceptance), with the flags it adds."""

    config: str  # "off", "fixed-k2", "goodput"
    policy: str
    k: int | None  # drafts per step (fixed) or K_max (goodput); None for off
    acceptance: float | None
    flags: list[str]

    @property
    def name(self) -> str:
        """Unique among the matrix's servers (log file names, progress lines)."""
        return self.config if self.acceptance is None else f"{self.config}@L{self.acceptance:g}"


@dataclass
class Point:
    """One load point: a closed loop at `level` requests in flight, or Poisson arrivals at
    `level` requests per second (`fraction`: the rate as a fraction of off's peak, if so)."""

    arrival: str
    level: float
    fraction: float | None = None

    @property
    def label(self) -> str:
        """How tables and progress lines name the point."""
        if self.arrival == "closed":
            return f"c={self.level:g}"
        return f"{self.level:.3g} req/s" + (f" ({self.fraction:g}x)" if self.fraction else "")


def servers(spec: MatrixSpec) -> tuple[list[ServerRun], list[dict]]:
    """The servers to start, in run order (off first, then each acceptance's fixed Ks and
    goodput), and the combinations skipped because the server would refuse them."""
    runs: list[ServerRun] = []
    skipped: list[dict] = []
    if "off" in spec.policies:
        runs.append(ServerRun("off", "off", None, None, ["--speculative-policy", "off"]))
    for acceptance in spec.acceptance:
        sim = spec.simulate_value(acceptance) if spec.simulate_as == "rate" else acceptance
        candidates = []
        if "fixed" in spec.policies:
            candidates += [("fixed", k) for k in sorted(set(spec.fixed_k))]
        if "goodput" in spec.policies:
            candidates.append(("goodput", spec.k_max_for(acceptance)))
        for policy, k in candidates:
            config = f"fixed-k{k}" if policy == "fixed" else "goodput"
            if sim > k + 1:  # the engine's check: a mean length is at most K + 1 tokens
                skipped.append(
                    {
                        "config": config,
                        "acceptance": acceptance,
                        "reason": (
                            f"the server refuses a mean acceptance length {sim:g} at K={k} "
                            f"(at most K+1 = {k + 1})"
                        ),
                    }
                )
                continue
            flags = [
                "--speculative-policy",
                policy,
                "--speculative-num-steps",
                str(k),
                "--speculative-simulate-acceptance",
                f"{sim:g}",
            ]
            runs.append(ServerRun(config, policy, k, acceptance, flags))
    return runs, skipped


def closed_points(spec: MatrixSpec) -> list[Point]:
    """The closed-loop points, lowest concurrency first."""
    if "closed" not in spec.arrival:
        return []
    return [Point("closed", c) for c in sorted(set(spec.concurrency))]


def poisson_points(spec: MatrixSpec, off_peak_rps: float | None) -> list[Point]:
    """The open-loop points, slowest first, each rate once; relative rates need off's peak
    request rate (without it, e.g. off did not start, they are left out)."""
    if "poisson" not in spec.arrival:
        return []
    points = [Point("poisson", r) for r in spec.request_rates]
    if spec.relative_rates and off_peak_rps:
        points += [Point("poisson", round(f * off_peak_rps, 4), f) for f in spec.relative_rates]
    unique = {p.level: p for p in reversed(points)}  # (a rate given twice: the first kept)
    return sorted(unique.values(), key=lambda p: p.level)


def requests_for(spec: MatrixSpec, point: Point, num_prompts: int) -> int:
    """Requests to send at a point: enough for a steady state, never fewer than num_prompts
    or MIN_REQUESTS."""
    if point.arrival == "closed":
        steady = math.ceil(spec.requests_per_concurrency * point.level)
    else:
        steady = math.ceil(point.level * spec.poisson_seconds)
    return max(num_prompts, steady, MIN_REQUESTS)


# ---- from the command line and a JSON file ----------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _words(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _k_max_map(text: str) -> dict[float, int]:
    out = {}
    for item in _words(text):
        acceptance, sep, k = item.partition(":")
        if not sep:
            raise ValueError(f"--k-max takes L:K pairs (e.g. 1.5:3,4.5:5); got {text!r}")
        out[float(acceptance)] = int(k)
    return out


def _rates(items: list) -> tuple[list[float], list[float]]:
    """Rates in requests/s and fractions of off's peak ("0.5x")."""
    absolute, relative = [], []
    for item in items:
        text = str(item).strip()
        if text.endswith("x"):
            relative.append(float(text[:-1]))
        else:
            absolute.append(float(text))
    return absolute, relative


# flag attribute -> (MatrixSpec field, parser of the flag's text)
_FLAGS = {
    "acceptance": ("acceptance", _floats),
    "k": ("fixed_k", _ints),
    "policies": ("policies", _words),
    "k_max": ("goodput_k_max", _k_max_map),
    "concurrency": ("concurrency", _ints),
    "arrival": ("arrival", _words),
    "simulate_as": ("simulate_as", str),
    "requests_per_concurrency": ("requests_per_concurrency", float),
    "poisson_seconds": ("poisson_seconds", float),
}
MATRIX_ONLY_FLAGS = [f for f in _FLAGS if f not in ("concurrency", "requests_per_concurrency")] + [
    "request_rates"
]


def read_matrix_file(path: str | Path) -> dict:
    """A matrix file: a JSON object of MatrixSpec fields; request_rates may mix numbers
    (requests/s) and strings like "0.5x" (fractions of off's peak)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read --matrix-file {str(path)!r}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"--matrix-file {str(path)!r} must hold a JSON object")
    known = {f.name for f in fields(MatrixSpec)} - {"relative_rates"}
    unknown = set(data) - known
    if unknown:
        raise ValueError(
            f"--matrix-file has unknown key(s) {sorted(unknown)}; known: {sorted(known)}"
        )
    if "request_rates" in data:
        data["request_rates"], data["relative_rates"] = _rates(data["request_rates"])
    return data


def matrix_spec(file_path: str | None, args) -> MatrixSpec:
    """The defaults, overridden by the matrix file, overridden by the flags given."""
    values: dict = read_matrix_file(file_path) if file_path else {}
    for flag, (name, parse) in _FLAGS.items():
        text = getattr(args, flag, None)
        if text is not None:
            values[name] = parse(text)
    if getattr(args, "request_rates", None) is not None:
        values["request_rates"], values["relative_rates"] = _rates(_words(args.request_rates))
    return MatrixSpec(**values)


def add_matrix_args(p) -> None:
    """The matrix flags of `bench sweep` (None when not given: the file or default rules)."""
    g = p.add_argument_group("adaptive-speculation matrix (with --matrix or --matrix-file)")
    g.add_argument(
        "--matrix",
        choices=["adaptive"],
        help="run the adaptive-speculation matrix: off, fixed K, goodput at each "
        "simulated acceptance, closed-loop and Poisson points, with ratios",
    )
    g.add_argument(
        "--matrix-file",
        help="JSON object of matrix settings (keys: acceptance, "
        "fixed_k, policies, goodput_k_max, concurrency, "
        "arrival, request_rates, simulate_as, "
        "requests_per_concurrency, poisson_seconds)",
    )
    g.add_argument(
        "--acceptance",
        help="simulated mean acceptance lengths at K_max "
        "(default 1.5,3.0,4.5; <= 1: per-token rates)",
    )
    g.add_argument("--k", help="fixed draft lengths K (default 1,2,3,5)")
    g.add_argument("--policies", help="configurations among off,fixed,goodput (default all)")
    g.add_argument(
        "--k-max", help="goodput K_max per acceptance, L:K pairs (default 3 up to L=3, else 5)"
    )
    g.add_argument("--arrival", help="closed and/or poisson (default closed,poisson)")
    g.add_argument(
        "--request-rates",
        help="Poisson rates: requests/s, or fractions of off's "
        "peak closed-loop request rate like 0.5x "
        "(default 0.25x,0.5x,0.75x,0.9x)",
    )
    g.add_argument(
        "--simulate-as",
        choices=SIMULATE_AS,
        help="rate (default): every configuration gets the per-token rate of L at "
        "K_max; length: each gets L (fixed K < L-1 skipped)",
    )
    g.add_argument(
        "--requests-per-concurrency",
        help="closed loop: at least this many requests per request in flight (2: the "
        "concurrency is held for a wave and more, not only reached)",
    )
    g.add_argument("--poisson-seconds", help="Poisson: at least rate * this many requests (20)")
