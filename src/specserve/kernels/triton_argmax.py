"""Row-wise argmax in two Triton kernels, equal to `torch.argmax(x, dim=-1)` index for index.

Greedy decoding takes the argmax of one 128k-wide logits row per request. torch's reduce
kernel gives a single row one block, about 27 us on an H200 for one fp32 row of 128,256
(the drafter's 32,000 bf16 logits: about 10 us); spread over many programs it takes a few.

Stage 1, grid (rows, chunks): each program reduces one BLOCK of one row to the column of
its largest value, the first among equals. Stage 2, grid (rows,): each program reduces its
row's partials alike, so among equal maxima the first column wins.

Both reduce one int64 per column with a plain `tl.min`: the value's rank in the high 32 bits,
the column in the low ones, so the smallest pair is the largest value at its first column
(no tie-break flag to trust: the Triton interpreter always breaks ties left, whatever the
flag says, so a test there could not tell). The rank orders values exactly as
torch.argmax compares them, NaN included: a value's fp32 bits (exact for fp16 and bf16)
give minus its magnitude bits for a positive value, its magnitude bits for a negative one
(so -0.0 and +0.0 share rank 0 and tie, as they compare equal); every NaN, whatever its
sign or payload, ranks first, so the first NaN wins as in torch. A row of -inf ties
throughout and gives index 0. Columns past the row's end rank after every value.

Launches follow the PDL convention (kernels/pdl.py): both kernels run `pdl_enter` first.
Nothing syncs with the host and the partials come from `torch.empty`, so the call can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.core.kernel_options import ARGMAX_MODES, KernelOptions, current, set_default
from specserve.kernels import pdl
from specserve.kernels.pdl_kernel import pdl_enter

# When argmax_rows takes the kernels (`KernelOptions.argmax`, the process default by
# `set_mode`): "graphs" (the default) only while a CUDA graph is being captured, "always",
# or "off". On the H200 the two kernels replay in 2-3 us against torch's 27 us for a 128k
# row inside a graph, but launched eagerly their two Python launches take 66 us against
# torch's 35.
MODES = ARGMAX_MODES
MIN_TRITON_VOCAB = 4096  # below this, one torch reduce block is about as fast
BLOCK_BYTES = 8192  # stage 1 reads this much of a row per program (fp32: 2048 columns)
MAX_CHUNKS = 1024  # stage 2 reduces at most this many partials per row in one block


@triton.jit
def _rank(x):
    """Values -> int32 ranks, smaller for larger values (NaN smallest, -0 == +0), through
    their fp32 bits (bf16's are its own shifted: the interpreter's bf16 -> fp32 conversion
    gets subnormals wrong)."""
    if x.dtype == tl.bfloat16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) << 16
    else:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    rank = tl.where(bits < 0, magnitude, -magnitude)
    return tl.where(magnitude > 0x7F800000, -2147483647, rank)  # NaN: any sign, any payload


@triton.jit
def _argmax_chunk_kernel(
    x_ptr, best_ptr, stride_x, n_cols, n_chunks, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False
):
    if USE_PDL:
        pdl_enter()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=ok, other=0.0)
    rank = tl.where(ok, _rank(x), 2147483647)  # past the end: after every value
    tl.store(best_ptr + row * n_chunks + chunk, tl.min((rank.to(tl.int64) << 32) + cols, 0))


@triton.jit
def _argmax_partials_kernel(
    best_ptr, out_ptr, n_chunks, CHUNKS: tl.constexpr, USE_PDL: tl.constexpr = False
):
    if USE_PDL:
        pdl_enter()
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS)
    best = tl.load(
        best_ptr + row * n_chunks + chunks, mask=chunks < n_chunks, other=9223372036854775807
    )
    best = tl.min(best, 0)
    tl.store(out_ptr + row, best - ((best >> 32) << 32))  # the low 32 bits: the column


def chunk_block(n_cols: int, element_size: int, block: int | None = None) -> int:
    """Stage 1's columns per program: `block` (a power of two) or BLOCK_BYTES' worth, grown
    so that a row has at most MAX_CHUNKS chunks."""
    block = block or BLOCK_BYTES // element_size
    return max(block, triton.next_power_of_2(triton.cdiv(n_cols, MAX_CHUNKS)))


def triton_argmax(x: torch.Tensor, block: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """argmax over the columns of x [rows, V] (rows of unit column stride), int64 [rows],
    by the two kernels (on the CPU: through the Triton interpreter)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        raise ValueError(
            f"need [rows, V > 0] with contiguous rows, got {tuple(x.shape)} "
            f"with strides {x.stride()}"
        )
    rows, n_cols = x.shape
    block = chunk_block(n_cols, x.element_size(), block)
    n_chunks = triton.cdiv(n_cols, block)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    best = torch.empty(rows, n_chunks, dtype=torch.int64, device=x.device)  # (rank, column)
    options = pdl.launch_options(x.device)
    _argmax_chunk_kernel[(rows, n_chunks)](
        x,
        best,
        x.stride(0),
        n_cols,
        n_chunks,
        BLOCK=block,
        num_warps=num_warps,
        **options,
    )
    _argmax_partials_kernel[(rows,)](
        best,
        out,
        n_chunks,
        CHUNKS=triton.next_power_of_2(n_chunks),
        num_warps=4 if n_chunks > 256 else 1,
        **options,
    )
    return out


def set_mode(mode: str) -> str:
    """When argmax_rows may use the kernels outside engines (the process default; one of
    MODES; `uses_triton` says where); returns the previous mode."""
    KernelOptions(argmax=mode)  # (refuses an unknown mode before anything changes)
    return set_default(argmax=mode).argmax


def uses_triton(x: torch.Tensor) -> bool:
    """Whether argmax_rows takes the Triton path for x: allowed by the mode (`set_mode`: in
    "graphs", only during a CUDA graph's capture), on CUDA, at least MIN_TRITON_VOCAB
    columns, some rows, and rows of unit column stride that one row stride walks."""
    mode = current().argmax
    if mode == "off" or not x.is_cuda or x.dim() == 0 or x.numel() == 0:
        return False
    if mode == "graphs" and not torch.cuda.is_current_stream_capturing():
        return False
    if x.shape[-1] < MIN_TRITON_VOCAB:
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    return x.stride(-1) == 1 and (x.dim() <= 2 or x.is_contiguous())


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for x [..., V]: int64 [...], the first index of each row's
    maximum (NaN counts as the maximum). Two Triton kernels where `uses_triton(x)`, else
    torch."""
    if not uses_triton(x):
        return x.argmax(dim=-1)
    return triton_argmax(x.reshape(-1, x.shape[-1])).view(x.shape[:-1])
