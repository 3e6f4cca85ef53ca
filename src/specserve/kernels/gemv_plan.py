"""The GEMV plan the linear layers consult per call: (row bucket, N, K, dtype) -> the Triton
GEMV configuration that serves it, or torch (cuBLAS). Start-up selection fills it
(`gemv_select.GemvSelector`, where the buckets up to SHARED_ROWS get one shared choice);
tests build plans by hand or force the Triton path with `default`."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels.gemv import MAX_ROWS, GemvConfig, gemv

PlanKey = tuple  # (row bucket, N, K, dtype), and + (fusion,) for a fused projection
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SHARED_ROWS = 16  # row buckets up to this share one implementation per shape (gemv_select.py)


@dataclass(frozen=True)
class GemvChoice:
    """What start-up measured for one plan key: the choice (None: torch), its time and
    torch's in microseconds per call at this bucket, and how many candidates were timed.
    Buckets up to SHARED_ROWS share one choice, so at one of them it may be the slower."""

    config: GemvConfig | None
    torch_us: float
    best_us: float
    tried: int
    tuned: bool = False  # changed by whole-step tuning (tuning/plan_tuning.py)


class GemvPlan:
    """(row bucket, N, K, dtype) -> the GEMV configuration that serves it. Rows are rounded up
    to the next bucket; keys absent, measured slower than torch, or beyond the largest
    bucket go to torch (`default`, when given, serves every absent key: tests force the
    Triton path with it). A projection that fuses its neighbours into the GEMV (a merged
    MLP's down projection, triton_ops.py; attention's o_proj, llama.py) asks with its
    `fusion`: the key + (fusion,), measured with them (`gemv_timing.down_and_norm`), when
    there is one; else the shape's plain choice. `torch_varies`: the (N, K, dtype) shapes
    where cuBLAS gives a row different bits at different row counts, which selection keeps
    torch away from in the buckets up to SHARED_ROWS (gemv_select.py, batch invariance).

    `step_requests`, set by the model for each forward to its step's request count (None
    for a step carrying a prefill chunk, which goes by its rows: batch invariance covers
    decode and verify steps, and a short prompt's 64 rows on the decode steps' 16-row tile
    took the 8B shape's prefill step from ~6 to ~8 ms on the H200): a decode or verify step
    of at most SHARED_ROWS requests looks its calls up in the bucket of its request count
    whatever their row count (up to the largest bucket), so a verify step's K + 1 rows per
    request run the shared choice that the same requests' decode step runs, and round
    alike (greedy speculation stays token for token plain decoding up to SHARED_ROWS
    requests and the largest bucket's rows: batch 16 at K=3); with `by_requests` False
    (`--disable-batch-invariance`) calls go by their row count alone. `verify`: {(row bucket
    above SHARED_ROWS, N, K, dtype[, fusion]): configuration} that such a step runs at that
    many rows instead of the shared choice, one found at start-up to give the step's rows the
    same bits and a faster step (tuning/verify_tiles.py)."""

    def __init__(
        self,
        choices: dict[PlanKey, GemvChoice] | None = None,
        row_buckets: tuple[int, ...] = ROW_BUCKETS,
        default: GemvConfig | None = None,
        torch_varies: frozenset[tuple] = frozenset(),
        by_requests: bool = True,
    ):
        self.row_buckets = tuple(sorted(row_buckets))
        if self.row_buckets[0] < 1 or self.row_buckets[-1] > MAX_ROWS:
            raise ValueError(f"row buckets must lie in 1..{MAX_ROWS}")
        self.max_rows = self.row_buckets[-1]
        self._bucket = [0] + [
            self.row_buckets[bisect.bisect_left(self.row_buckets, r)]
            for r in range(1, self.max_rows + 1)
        ]
        self.choices = dict(choices or {})
        self._configs = {k: c.config for k, c in self.choices.items() if c.config is not None}
        self.default = default
        self.torch_varies = frozenset(torch_varies)
        self.step_requests: int | None = None  # see above; None: by row count
        self.by_requests = by_requests
        self.asked: set[PlanKey] | None = None  # when a set: every key config_for looks up
        self.verify: dict[PlanKey, GemvConfig] = {}

    def config_for(
        self, rows: int, n: int, k: int, dtype: torch.dtype, fusion: str | None = None
    ) -> GemvConfig | None:
        """The configuration for `rows` rows of a weight [n, k] (with `fusion`'s neighbours
        fused in, if that was measured); None: torch."""
        if rows < 1 or rows > self.max_rows:
            return None
        reqs = self.step_requests if self.by_requests else None
        shared = reqs is not None and 1 <= reqs <= min(rows, SHARED_ROWS)
        key = (self._bucket[reqs if shared else rows], n, k, dtype)
        if fusion is not None and (*key, fusion) in self.choices:
            key = (*key, fusion)
            cfg = self._configs.get(key)
        else:
            cfg = self._configs.get(key, self.default)
        if self.asked is not None:
            self.asked.add(key)
        if shared and rows > SHARED_ROWS and self.verify:
            cfg = self.verify.get((self._bucket[rows], *key[1:]), cfg)
        return cfg if cfg is None or rows <= cfg.max_rows else None

    def set_config(
        self, keys: list[PlanKey], config: GemvConfig | None, tuned: bool = True
    ) -> None:
        """Serve measured `keys` with `config` (None: torch) from now on, keeping what was
        measured for them; `tuned`: marked as changed by tuning (tuning/plan_tuning.py,
        which also puts choices back, unmarked, after trying others)."""
        for key in keys:
            if key[0] <= SHARED_ROWS and self.choices[key].config != config:
                # a verify tile matched the bits of the old choice
                self.verify = {v: c for v, c in self.verify.items() if v[1:] != key[1:]}
            old = self.choices[key]
            self.choices[key] = GemvChoice(config, old.torch_us, old.best_us, old.tried, tuned)
            if config is None:
                self._configs.pop(key, None)
            else:
                self._configs[key] = config

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        defer_reduce: bool = False,
    ):
        """F.linear(x, weight, bias) through the planned kernel (defer_reduce: a split-K
        GEMV's output unreduced, a `SplitKSum`, as `gemv` returns it)."""
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        cfg = self.config_for(rows, weight.shape[0], k, weight.dtype)
        if cfg is None:
            return F.linear(x, weight, bias)
        return gemv(x, weight, bias, cfg, defer_reduce=defer_reduce)

    def summary(self) -> list[dict]:
        """One JSON-ready row per measured key."""
        return [
            dict(
                rows=b,
                n=n,
                k=k,
                dtype=str(dt).removeprefix("torch."),
                kernel=str(c.config) if c.config else "torch",
                torch_us=round(c.torch_us, 2),
                best_us=round(c.best_us, 2),
                speedup=_ratio(c.torch_us, c.best_us),
                tried=c.tried,
                **({"fusion": fused[0]} if fused else {}),
                **({"tuned": True} if c.tuned else {}),
                **({"torch_varies": True} if (n, k, dt) in self.torch_varies else {}),
            )
            for (b, n, k, dt, *fused), c in sorted(
                self.choices.items(), key=lambda i: (*i[0][:3], i[0][4:])
            )
        ]


def _ratio(a: float, b: float) -> float | None:
    """a / b rounded for a JSON report; None where either is not a finite time."""
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return round(a / b, 3)
