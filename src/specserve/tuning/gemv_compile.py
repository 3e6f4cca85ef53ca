"""Start-up compilation of the GEMV variants selection and the engine will run
(gemv_select.py): which distinct Triton variants the candidates need (`compile_tasks`, keyed
by what decides a compiled variant, `variant_key`), compiled once each on a thread pool
(`compile_variants`; the compiler spends most of its time outside the GIL), so that a cold
start pays compilation about once and no step waits for it.
"""

from __future__ import annotations

import contextvars
import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from specserve.kernels.gemv import GemvConfig, RopeStore, call_prefetch, gemv, rope_fits
from specserve.kernels.gemv_configs import gated_config, row_blocks

log = logging.getLogger(__name__)


def variant_key(
    cfg: GemvConfig,
    rows: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    prefetch: int = 0,
    blocks: int = 1,
) -> tuple:
    """What decides which compiled Triton variant a call uses (tile, path, row block of the
    CUDA-core path, row blocks per program, `gemv_configs.row_blocks`, split or not, whether
    K divides into blocks, weight loads, dtype, and under PDL the lines prefetched,
    `gemv.call_prefetch`, which depend on the shape)."""
    bm = cfg.block_m if cfg.use_dot else max(1, 1 << (rows - 1).bit_length())
    return (
        bm,
        blocks,
        cfg.block_n,
        cfg.block_k,
        cfg.num_warps,
        cfg.num_stages,
        cfg.use_dot,
        cfg.split_k > 1,
        k % cfg.block_k == 0,
        cfg.tma,
        cfg.stream_k,
        dtype,
        prefetch,
    )


def compile_tasks(
    todo: dict,
    shapes: dict,
    gated_jobs: dict | None = None,
    pdl_on: bool = False,
    rope_jobs: dict | None = None,
    biased: frozenset = frozenset(),
) -> dict:
    """{variant: (config, rows, a weight, mode, bias)}: each distinct Triton variant the
    candidates of `todo` ({(N, K, dtype[, fusion]): [(rows, configs)]}) need, mode "silu"
    for a fused down projection's prologue; for `gated_jobs` ({(N, K, dtype) of a merged
    gate/up weight: [(rows, configs)]}) the gated epilogue's variant of each candidate it
    applies to (`gated_config`), mode "gated"; for `rope_jobs` ({(N, K, dtype) of a qkv
    weight: ((q heads, kv heads, head dim), [(rows, configs)])}) the rope epilogue's variant
    of each candidate that fits (`rope_fits`), mode ("rope", heads). `shapes`: (N, K,
    dtype) -> weights of that shape; `pdl_on`: kernels launch under PDL (their prefetch is
    part of the variant); `biased`: shapes whose layers have a bias, whose variants are
    compiled with one too (bias True)."""
    tasks: dict[tuple, tuple] = {}

    def add(cfg, rows, n, k, dtype, mode) -> None:
        out = n // 2 if mode == "gated" else n
        elem = torch.empty(0, dtype=dtype).element_size()
        prefetch = call_prefetch(cfg, out, k, elem, mode == "gated") if pdl_on else 0
        blocks = row_blocks(cfg, rows, elem, mode == "gated", mode == "silu")
        for bias in (False, True) if (n, k, dtype) in biased else (False,):
            key = (*variant_key(cfg, rows, n, k, dtype, prefetch, blocks), mode, bias)
            tasks.setdefault(key, (cfg, rows, shapes[(n, k, dtype)][0], mode, bias))

    for (n, k, dtype), (heads, jobs) in (rope_jobs or {}).items():
        for rows, cands in jobs:
            for cfg in cands:
                if rope_fits(cfg, heads[2], k):
                    add(cfg, rows, n, k, dtype, ("rope", heads))

    for (n, k, dtype, *fusion), jobs in todo.items():
        mode = "silu" if fusion and "silu" in fusion[0] else None  # a variant of its own
        for rows, cands in jobs:
            for cfg in cands:
                add(cfg, rows, n, k, dtype, mode)
    for (n, k, dtype), jobs in (gated_jobs or {}).items():
        for rows, cands in jobs:
            for half in filter(None, map(gated_config, cands)):
                add(half, rows, n, k, dtype, "gated")
    return tasks


def _rope_stand_in(heads: tuple[int, int, int], rows: int, w: torch.Tensor) -> RopeStore:
    """Tensors shaped as a model's rope epilogue gets them (positions, slots, an fp32 cos/sin
    table, caches of 16-slot pages; the page size is not specialized on), to compile that
    variant before the first step needs it."""
    q_heads, kv_heads, head_dim = heads
    idx = torch.zeros(rows, dtype=torch.int64, device=w.device)
    cache = torch.zeros(2, 1, 16, kv_heads, head_dim, dtype=w.dtype, device=w.device)
    cos_sin = torch.zeros(1, head_dim, dtype=torch.float32, device=w.device)
    return RopeStore(idx, idx, cos_sin, q_heads, kv_heads, cache[0], cache[1])


def compile_variants(tasks: dict[tuple, tuple], device: torch.device, workers: int) -> int:
    """Compile each distinct Triton variant of `compile_tasks` once, `workers` at a time;
    returns how many. A variant that fails to compile is measured as failing later."""
    if not tasks:
        return 0

    def build(task) -> None:
        cfg, rows, w, mode, bias = task
        silu = mode == "silu"
        try:
            with torch.cuda.device(device):  # Triton compiles for the current device
                x = torch.zeros(rows, w.shape[1] * (2 if silu else 1), device=device, dtype=w.dtype)
                rope = _rope_stand_in(mode[1], rows, w) if isinstance(mode, tuple) else None
                b = torch.zeros(w.shape[0], device=device, dtype=w.dtype) if bias else None
                gemv(x, w, b, cfg, compile_only=True, silu=silu, gated=mode == "gated", rope=rope)
        except Exception as e:  # measured as failing (inf) later
            log.debug("GEMV candidate %s does not compile: %s", cfg, e)

    first, *rest = tasks.values()
    build(first)  # the kernels' first compilation sets up Triton's per-device state
    # each worker's task under the caller's kernel options (core/kernel_options.py: the
    # engine's PDL choice decides which variant is compiled)
    caller = contextvars.copy_context()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda task: caller.copy().run(build, task), rest))
    return len(tasks)
