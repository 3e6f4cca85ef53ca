"""Counter-based uniform noise in one kernel, and simulated acceptance decided in one.

The sampler's uniforms are a hash of (seed, counter, column) (layers/sampler.py:
`hash_uniform`, splitmix64's finalizer). Written in torch the hash is ~20 elementwise
kernels over int64 temporaries of the noise's full size: for a sampled step of 256 rows of a
128k vocabulary that is ~5 GB of memory traffic, and for a small one ~20 launches of host
time. `uniform_noise` computes the same bits in one launch. `simulated_verify` is greedy
verification under simulated acceptance (runtime/verify.py: `verify_greedy` with a rate),
which benchmarks of random-weight models run every step: the acceptance draws, the accept
lengths and the committed tokens in one launch, where torch took ~30 (about 0.4 ms of host
time a step on the H200's host, as much as a small model's whole step).

Both give the torch path's results bit for bit (unsigned 64-bit arithmetic wraps as the
signed torch ops do; the 23-bit draw converts exactly). Neither waits for the host, so both
can be captured in a CUDA graph; they are launched without PDL (kernels/pdl.py: a plain
launch after a PDL kernel waits for it as always).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# splitmix64's constants (layers/sampler.py holds them as signed int64 for torch)
_M1 = tl.constexpr(0x9E3779B97F4A7C15)
_M2 = tl.constexpr(0xBF58476D1CE4E5B9)
_M3 = tl.constexpr(0x94D049BB133111EB)


@triton.jit
def _uniform(seed, counter, col):
    """The sampler's uniform in (0, 1) for (seed, counter, column), int64 arguments."""
    x = seed.to(tl.uint64) * _M1 + counter.to(tl.uint64) * _M3 + col.to(tl.uint64) * _M2
    x = x + _M1
    x = (x ^ (x >> 30)) * _M2
    x = (x ^ (x >> 27)) * _M3
    x = x ^ (x >> 31)
    return ((x >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # (sampler.UNIFORM_BITS)


# (the row inputs are views into a step's uploads at any alignment: one variant serves all)
@triton.jit(do_not_specialize=["seeds_ptr", "counters_ptr"])
def _uniform_kernel(seeds_ptr, counters_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seeds_ptr + row)
    counter = tl.load(counters_ptr + row)
    u = _uniform(seed, counter, cols.to(tl.int64))
    tl.store(out_ptr + row.to(tl.int64) * width + cols, u, mask=cols < width)


def _check(*tensors: torch.Tensor) -> None:
    """The kernels read int64 from one device (other integers would hash differently)."""
    first = tensors[0]
    for t in tensors:
        if t.dtype != torch.int64 or t.device != first.device:
            raise ValueError(f"need int64 tensors on {first.device}, got {t.dtype} on {t.device}")


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """`hash_uniform(seeds, counters, width)`: float32 [B, width] from int64 seeds and
    counters [B]."""
    _check(seeds, counters)
    rows = seeds.shape[0]
    out = torch.empty(rows, width, dtype=torch.float32, device=seeds.device)
    if rows == 0 or width == 0:
        return out
    block = min(2048, triton.next_power_of_2(width))
    grid = (rows, triton.cdiv(width, block))
    _uniform_kernel[grid](
        seeds.contiguous(), counters.contiguous(), out, width, BLOCK=block, num_warps=4
    )
    return out


@triton.jit(
    do_not_specialize=[
        "seeds_ptr",
        "positions_ptr",
        "draft_lens_ptr",
        "drafts_ptr",
        "choice_ptr",
        "stream_offset",
    ]
)
def _simulated_verify_kernel(
    seeds_ptr,
    positions_ptr,
    draft_lens_ptr,
    drafts_ptr,
    choice_ptr,
    tokens_ptr,
    accept_ptr,
    rate,
    stream_offset,
    K: tl.constexpr,
    HAS_LENS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    seed = tl.load(seeds_ptr + row) + stream_offset
    position = tl.load(positions_ptr + row)
    ok = _uniform(seed, position + j, tl.zeros_like(j).to(tl.int64)) < rate
    limit = K
    if HAS_LENS:
        limit = tl.load(draft_lens_ptr + row)
    ok = ok & (j < limit) & (j < K)
    accept = tl.min(tl.where(ok, K, j), 0)  # the first draft not accepted (K: none)
    base = row.to(tl.int64) * (K + 1)
    drafts = tl.load(drafts_ptr + row.to(tl.int64) * K + j, mask=j < K, other=0)
    bonus = tl.load(choice_ptr + base + accept)
    tokens = tl.where(j == accept, bonus, drafts)
    tl.store(tokens_ptr + base + j, tokens, mask=j <= K)
    tl.store(accept_ptr + row, accept.to(tl.int64))


def simulated_verify(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    draft_lens: torch.Tensor | None,
    drafts: torch.Tensor,
    choice: torch.Tensor,
    rate: float,
    stream_offset: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [R, K+1], accept_len [R]) of greedy verification whose acceptance decisions
    are seeded draws: draft j of row r is accepted when the uniform of (seeds[r] +
    stream_offset, positions[r] + j) is below `rate` and j < draft_lens[r] (None: K), up to
    the first refusal; the tokens are the drafts [R, K] and a 0, the target's greedy choice
    [R, K+1] put at the accept length (as `verify_greedy` assembles them)."""
    _check(seeds, positions, drafts, choice, *([] if draft_lens is None else [draft_lens]))
    rows, k = drafts.shape
    tokens = torch.empty(rows, k + 1, dtype=torch.int64, device=drafts.device)
    accept = torch.empty(rows, dtype=torch.int64, device=drafts.device)
    if rows == 0:
        return tokens, accept
    lens = draft_lens if draft_lens is not None else accept  # (not read)
    _simulated_verify_kernel[(rows,)](
        seeds.contiguous(),
        positions.contiguous(),
        lens.contiguous(),
        drafts.contiguous(),
        choice.contiguous(),
        tokens,
        accept,
        float(rate),  # (an int would be a constexpr or an i32: another variant)
        stream_offset,
        K=k,
        HAS_LENS=draft_lens is not None,
        BLOCK=triton.next_power_of_2(k + 1),
        num_warps=1,
    )
    return tokens, accept


def warm_up(device: torch.device, vocab_size: int, k_max: int = 0, stream_offset: int = 0) -> None:
    """Compile now (engine start-up), not at the first step that needs them, every variant
    serving launches: the uniforms of one column (sampled verification) and of the
    vocabulary (sampling), and, for `k_max` > 0 (simulated acceptance), verification at
    every draft length 1..k_max with and without per-row draft lengths, at the
    `stream_offset` serving passes (not specialized on its value, but an offset past 32 bits
    is an i64 argument: another variant than a small one). A variant first compiled while
    serving stalls a step for about half a second on a GPU."""
    i64 = dict(dtype=torch.int64, device=device)
    one = torch.zeros(1, **i64)
    for width in sorted({1, vocab_size}):
        uniform_noise(one, one, width)
    for k in range(1, k_max + 1):
        drafts, choice = torch.zeros(1, k, **i64), torch.zeros(1, k + 1, **i64)
        for lens in (None, one):
            simulated_verify(one, one, lens, drafts, choice, 0.5, stream_offset)
