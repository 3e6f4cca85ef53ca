"""The GEMV's launch configurations (`GemvConfig`) and the candidates start-up selection
times for a weight shape (`candidate_configs`); the kernels are in gemv.py. Plain Python:
importing this module defines no kernel."""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton

from specserve.core.kernel_options import current, set_default

MAX_ROWS = 64  # the tallest row block; more rows go to torch
FMA_MAX_ROWS = 8


@dataclass(frozen=True)
class GemvConfig:
    """One launch configuration of the GEMV kernel (block_m: rows per program of the
    matrix-unit path; the CUDA-core path uses next_power_of_2(M))."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True
    block_m: int = 16
    tma: bool = False  # weight tiles through a tensor descriptor (matrix-unit path only)
    stream_k: bool = False  # one program per multiprocessor (gemv_stream_k.py)

    def __str__(self) -> str:
        kind = f"dot m{self.block_m}" if self.use_dot else "fma"
        return (
            f"{kind} n{self.block_n} k{self.block_k} s{self.split_k} "
            f"w{self.num_warps} st{self.num_stages}"
            + (" tma" if self.tma else "")
            + (" sk" if self.stream_k else "")
        )

    @property
    def max_rows(self) -> int:
        """The most rows of x a call with this configuration takes."""
        return MAX_ROWS if self.use_dot else FMA_MAX_ROWS

    def supports(self, rows: int, n: int, k: int) -> bool:
        """Whether this configuration can serve a [rows, k] x [n, k]^T product sensibly:
        every K slice at least one block long, and few enough rows for its path; with `tma`,
        the matrix-unit path and weight rows a multiple of 16 bytes (k % 8 == 0 for any
        dtype: a tensor descriptor's row stride must be)."""
        if rows > self.max_rows or (self.tma and (not self.use_dot or k % 8)):
            return False
        if self.stream_k and (not self.use_dot or self.tma or self.split_k > 1):
            return False
        return self.split_k == 1 or triton.cdiv(k, self.split_k) >= self.block_k


# Shared memory one GEMV program may fill with its pipelined tiles (the H200 has 227 KB a
# block; the rest for Triton's own scratch)
SMEM_BUDGET = 192 << 10


def row_blocks(
    cfg: GemvConfig, rows: int, elem_bytes: int, gated: bool = False, silu: bool = False
) -> int:
    """Row blocks of cfg.block_m rows each program of a matrix-unit call on `rows` rows
    takes (1, 2 or 4; gemv.py ROW_BLOCKS): every weight tile is loaded once for all of them,
    and each block's sums are those of a program of one block, so a tile shared by the row
    buckets up to 16 serves a verify step's 32 or 64 rows without re-reading its weight and
    with the bits of the same rows run alone. Fewer where the pipeline's tiles would not fit
    in SMEM_BUDGET, and at most 2 with the `silu` prologue (4 spill registers on sm_90)."""
    if not cfg.use_dot or cfg.stream_k or rows <= cfg.block_m:
        return 1
    blocks = min(2 if silu else 4, triton.next_power_of_2(triton.cdiv(rows, cfg.block_m)))
    w_bytes = cfg.block_n * cfg.block_k * elem_bytes * (2 if gated else 1)
    x_bytes = cfg.block_m * cfg.block_k * elem_bytes * (2 if silu else 1)
    while blocks > 1 and cfg.num_stages * (w_bytes + blocks * x_bytes) > SMEM_BUDGET:
        blocks //= 2
    return blocks


def row_block(rows: int) -> int:
    """The matrix-unit row block that serves `rows` rows in one pass: 16, 32 or 64."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


# The tiles that won somewhere in the H200 sweep of the earlier, larger candidate set (bf16
# and fp16, M 1..8, Llama-3.1-8B / EAGLE-3 / SmolLM2 shapes), per row block; the taller row
# blocks carry the same tile family plus wider ones (every program re-reads its rows of x
# from L2: 512 KB per program at M = 64, K = 4096).
_TILES = {
    16: [
        GemvConfig(32, 256, num_warps=4, num_stages=4),
        GemvConfig(64, 128, num_stages=4),
        GemvConfig(128, 128, num_stages=3),
        GemvConfig(16, 256, num_warps=2, num_stages=5),
    ],
    32: [
        GemvConfig(32, 256, num_stages=4),
        GemvConfig(64, 128, num_stages=4),
        GemvConfig(128, 128, num_stages=3),
        GemvConfig(16, 256, num_warps=2, num_stages=4),
    ],
    64: [
        GemvConfig(32, 256, num_stages=3),
        GemvConfig(64, 128, num_stages=4),
        GemvConfig(128, 64, num_stages=4),
        GemvConfig(128, 128, num_warps=8, num_stages=3),
        GemvConfig(256, 64, num_warps=8, num_stages=3),  # fewer re-reads of x from L2
        # the 64-row sweep's winners on the H200: qkv 16.6 us against 17.9 for the
        # w4 st4 tile, o 12.2 against 13.3 for the st3 tile
        GemvConfig(64, 128, num_warps=8, num_stages=5),
        GemvConfig(32, 256, num_stages=4),
    ],
}
_FMA = GemvConfig(8, 512, num_warps=4, num_stages=2, use_dot=False)
_SPLIT_TILE = GemvConfig(64, 128, num_stages=4)
# Splits that won a wide sweep of tiles and splits on the H200 where the
# one-wave split above does not reach, for K >= N: at up to 16 rows three slices of narrow
# tiles (o, down, the EAGLE-3 fc), at 64 rows two slices with a deeper pipeline (down, fc;
# o_proj, whose split's second pass runs inside the next norm when timed fused with it).
_SPLIT_EXTRA = {
    16: GemvConfig(32, 128, split_k=3, num_warps=2, num_stages=4),
    64: GemvConfig(64, 128, split_k=2, num_stages=5),
}
# Stream-K tiles (gemv_stream_k.py) for the row blocks above the shared buckets: candidates
# only under `KernelOptions.stream_k` (EngineConfig.execution.gemv_stream_k, or the process
# default by `set_stream_k`; on the H200 selection took none for the 8B shape).
_STREAM_K = {
    32: [GemvConfig(64, 128, num_stages=4)],
    64: [GemvConfig(64, 128, num_stages=4), GemvConfig(128, 64, num_stages=4)],
}


def set_stream_k(on: bool) -> None:
    """Propose the stream-K tiles to selection from now on outside engines (or stop)."""
    set_default(stream_k=bool(on))


def stream_k_enabled() -> bool:
    return current().stream_k


def candidate_configs(rows: int, n: int, k: int, num_sms: int) -> list[GemvConfig]:
    """The configurations start-up selection times for `rows` rows of a weight [n, k], in
    order of preference on a tie: the CUDA-core product for one or two rows, the unsplit
    tiles of the row block, and, for a long K (K > N: few output tiles, long rows), one
    K split that brings the program count to about one wave of `num_sms`; then the sweep's
    split for the row block (`_SPLIT_EXTRA`: K >= N at up to 16 rows and at 64); and the
    stream-K tiles of the row blocks of 32 and 64 while they are switched on."""
    bm = row_block(rows)
    tiles = ([_FMA] if rows <= 2 else []) + [replace(t, block_m=bm) for t in _TILES[bm]]
    if k > n:
        programs = triton.cdiv(n, _SPLIT_TILE.block_n)
        want = triton.next_power_of_2(triton.cdiv(num_sms, programs))
        split = min(want, 16, k // _SPLIT_TILE.block_k)
        if split > 1:
            tiles.append(replace(_SPLIT_TILE, block_m=bm, split_k=split))
    extra = _SPLIT_EXTRA.get(bm)
    if extra is not None and k >= n:
        tiles.append(replace(extra, block_m=bm))
    if current().stream_k:
        tiles += [replace(t, block_m=bm, stream_k=True) for t in _STREAM_K.get(bm, ())]
    return [t for t in tiles if t.supports(rows, n, k)]


def verify_candidates(
    shared: GemvConfig, rows: int, n: int, k: int, num_sms: int
) -> list[GemvConfig]:
    """Tiles that may serve `rows` rows (a verify step of up to 16 requests) of a weight
    [n, k] where `shared`, a 16-row tile, serves the decode rows: the tiles proposed for that
    many rows, as 16-row tiles (several row blocks per program, `row_blocks`) with shared's
    K slices (`k_slices`), since a row's sums can depend on where they are split. Whether
    one gives a row the same bits as `shared` is for the device to say
    (tuning/verify_tiles.py)."""
    out: list[GemvConfig] = []
    for t in candidate_configs(rows, n, k, num_sms):
        if not t.use_dot or t.stream_k or t.tma:
            continue
        t = replace(t, block_m=16, split_k=shared.split_k)
        if (
            t != shared
            and t not in out
            and t.supports(rows, n, k)
            and k_slices(t, k) == k_slices(shared, k)
        ):
            out.append(t)
    return out


def k_slices(cfg: GemvConfig, k: int) -> tuple[int, int]:
    """(K slices, columns per slice) of a call with `cfg` on K columns, as gemv.py cuts them
    (a slice is a whole number of blocks, so the slices are not always K / split_k)."""
    per = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    return triton.cdiv(k, per), per


def gated_config(cfg: GemvConfig | None) -> GemvConfig | None:
    """The configuration a gated GEMV (SiLU-and-mul in a merged gate/up projection's
    epilogue) runs where `cfg` is the plain choice for that projection: the tile of half
    its width, whose programs stream it from both halves (cfg's program count and bytes
    per stage). None where the epilogue does not apply: torch, a K split (the epilogue
    needs whole sums), the CUDA-core path, or a tile narrower than 32."""
    if cfg is None or cfg.split_k > 1 or not cfg.use_dot or cfg.block_n < 32:
        return None
    return replace(cfg, block_n=cfg.block_n // 2)
