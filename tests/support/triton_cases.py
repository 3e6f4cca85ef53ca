"""Checks of the Triton kernels against the PyTorch reference, shared by the CPU interpreter
run and the GPU tests.

Each check draws fresh random inputs, runs a Triton kernel and the reference, and returns
the relative error ||out - ref|| / ||ref|| (inf when the output holds NaN/inf or an element
was left unwritten). Run as a script (`python -m tests.support.triton_cases`, with
TRITON_INTERPRET=1) it runs the small interpreter cases and prints {name: error} as JSON:
test_triton_attention.py does that in a subprocess so the interpreter never leaks into other
tests. Nothing here imports triton at module level.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch

from specserve.layers.attention import AttentionMetadata, TorchAttentionBackend
from specserve.layers.attention.base import write_kv
from tests.support import model_cases


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@dataclass
class Batch:
    """Packed requests over a random paged cache: request b has q_lens[b] new tokens ending at
    position ends[b] and attends over seq_lens[b] positions."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_batch(
    q_lens, ends, seq_lens, page_size, kv_heads, group, head_dim, dtype, device, seed: int
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = [-(-max(s, e + 1) // page_size) for s, e in zip(seq_lens, ends)]
    num_pages = 1 + sum(pages_per_req) + 3
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # scattered pages
    width = max(pages_per_req) + 2
    tables = torch.zeros(len(q_lens), width, dtype=torch.int64)
    positions, slots = [], []
    for b, (q_len, end) in enumerate(zip(q_lens, ends)):
        pages = [order.pop() for _ in range(pages_per_req[b])]
        tables[b, : len(pages)] = torch.tensor(pages)
        for p in range(end - q_len + 1, end + 1):
            positions.append(p)
            slots.append(pages[p // page_size] * page_size + p % page_size)
    total = sum(q_lens)

    data_gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=data_gen, device=device).to(dtype)

    cache_shape = (num_pages, page_size, kv_heads, head_dim)
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    meta = AttentionMetadata(
        positions=torch.tensor(positions, device=device),
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, device=device),
        block_tables=tables.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    return Batch(
        rand(total, kv_heads * group, head_dim),
        rand(total, kv_heads, head_dim),
        rand(total, kv_heads, head_dim),
        rand(*cache_shape),
        rand(*cache_shape),
        meta,
    )


def reference(batch: Batch, scale: float) -> torch.Tensor:
    """The torch backend in fp32 on copies of the caches."""
    kc, vc = batch.k_cache.float(), batch.v_cache.float()
    return TorchAttentionBackend().forward(
        batch.q.float(), batch.k.float(), batch.v.float(), kc, vc, batch.meta, scale
    )


def attention_error(kernels, batch: Batch, num_splits, block_n=None, **launch) -> float:
    """Backend forward (KV write + attention) against the reference; the output is poisoned
    first so unwritten elements show up as NaN."""
    from specserve.layers.attention.triton_attn import TritonAttentionBackend

    scale = batch.q.shape[-1] ** -0.5
    ref = reference(batch, scale)
    backend = TritonAttentionBackend(num_splits=num_splits, kernels=kernels)
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    ops = backend.kernels
    ops.write_kv(batch.k, batch.v, kc, vc, batch.meta.slot_mapping)
    kv_heads = kc.shape[2]
    splits = backend.choose_num_splits(
        batch.meta, kv_heads, batch.q.shape[1] // kv_heads, batch.q.device
    )
    out = torch.full_like(batch.q, float("nan"))
    m = batch.meta
    ops.paged_attention(
        batch.q,
        kc,
        vc,
        m.positions,
        m.query_start_loc,
        m.seq_lens,
        m.block_tables,
        m.max_query_len,
        scale,
        num_splits=splits,
        block_n=block_n,
        out=out,
        **launch,
    )
    return rel_err(out, ref)


def mixed_step_error(
    kernels,
    q_lens,
    ends,
    seq_lens,
    page_size,
    split_at: int,
    seed: int,
    device="cpu",
    dtype=torch.float16,
    shape=None,
) -> float:
    """The backend's forward over a mixed step whose decode/verify requests lead (the
    scheduler's order) against the reference; inf unless it launched the first `split_at`
    requests and the rest apart, each launch over its own requests and tokens (split_at 0:
    one launch, the control where a prefill chunk comes first)."""
    from types import SimpleNamespace

    from specserve.layers.attention.triton_attn import TritonAttentionBackend

    shape = shape or SMALL
    batch = make_batch(
        q_lens, ends, seq_lens, page_size, dtype=dtype, device=device, seed=seed, **shape
    )
    batch.meta.query_lens, batch.meta.seq_bounds = list(q_lens), list(seq_lens)
    launches = []

    def paged_attention(q, *args, **kw):
        launches.append((q.shape[0], args[5].shape[0], args[6]))  # tokens, requests, q_len
        return kernels.paged_attention(q, *args, **kw)

    recorder = SimpleNamespace(
        **{k: getattr(kernels, k) for k in dir(kernels) if not k.startswith("__")}
    )
    recorder.paged_attention = paged_attention
    backend = TritonAttentionBackend(kernels=recorder)
    scale = batch.q.shape[-1] ** -0.5
    ref = reference(batch, scale)
    out = backend.forward(
        batch.q, batch.k, batch.v, batch.k_cache.clone(), batch.v_cache.clone(), batch.meta, scale
    )
    n = split_at
    if n:
        want = [
            (sum(q_lens[:n]), n, max(q_lens[:n])),
            (sum(q_lens[n:]), len(q_lens) - n, max(q_lens[n:])),
        ]
    else:
        want = [(sum(q_lens), len(q_lens), max(q_lens))]
    if launches != want:
        return float("inf")
    return rel_err(out, ref)


def mixed_tiles_error(
    kernels,
    q_lens,
    ends,
    seq_lens,
    page_size,
    short: int,
    seed: int,
    want_splits: bool,
    device="cpu",
    dtype=torch.float16,
    shape=None,
    programs_per_sm: float | None = None,
    min_chunk: int | None = 16,
    small: bool = True,
) -> float:
    """A mixed step as its CUDA graph runs it (`MixedLayout`: the first `short` requests
    through the decode path, the others' row blocks as tiles, padded with an empty tile)
    against the reference; `programs_per_sm` sets how many prefill tiles fit a
    multiprocessor (the split count follows), chunks of at least `min_chunk` keys (None:
    the backend's); `small`: 16-key blocks (the interpreter's cases), else the backend's
    launches. inf unless the tiles' launch split its keys exactly when `want_splits`."""
    from dataclasses import replace
    from types import SimpleNamespace

    from specserve.layers.attention.base import MixedLayout, max_mixed_tiles, mixed_tiles
    from specserve.layers.attention.triton_attn import LaunchConfig, TritonAttentionBackend

    shape = shape or SMALL
    batch = make_batch(
        q_lens, ends, seq_lens, page_size, dtype=dtype, device=device, seed=seed, **shape
    )
    group, n = shape["group"], len(q_lens)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    count = max_mixed_tiles(starts[-1], n, group) + 1  # (one padding tile at least)
    i64 = dict(dtype=torch.int64, device=device)
    layout = MixedLayout(
        torch.tensor(starts[: short + 1] + [starts[short]] * (n - short), **i64),
        max(q_lens[:short], default=1),
        starts[short],
        torch.tensor(mixed_tiles(q_lens, short, group, count), **i64).view(count, 2),
    )
    meta = replace(batch.meta, max_query_len=starts[-1], mixed=layout)
    launches = []

    def paged_attention(q, *args, **kw):
        launches.append(kw)
        return kernels.paged_attention(q, *args, **kw)

    recorder = SimpleNamespace(
        **{k: getattr(kernels, k) for k in dir(kernels) if not k.startswith("__")}
    )
    recorder.paged_attention = paged_attention
    backend = TritonAttentionBackend(kernels=recorder)
    if small:  # several key blocks a chunk
        backend.decode = backend.prefill = LaunchConfig(block_n=16, num_warps=4, num_stages=2)
    if programs_per_sm is not None:
        backend.prefill_programs_per_sm = programs_per_sm
    if min_chunk is not None:
        backend.prefill_min_chunk = min_chunk
    scale = batch.q.shape[-1] ** -0.5
    ref = reference(batch, scale)
    out = backend.forward(
        batch.q, batch.k, batch.v, batch.k_cache.clone(), batch.v_cache.clone(), meta, scale
    )
    tiles = [kw for kw in launches if kw.get("tiles") is not None]
    if len(tiles) != 1 or (tiles[0]["num_splits"] > 1) != want_splits:
        return float("inf")
    return rel_err(out, ref)


def kv_write_error(kernels, batch: Batch) -> float:
    """0.0 when the Triton KV write stores exactly what the reference stores (a slot of -1
    must be skipped)."""
    slots = batch.meta.slot_mapping.clone()
    slots[0] = -1
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    kernels.write_kv(batch.k, batch.v, kc, vc, slots)
    rk, rv = batch.k_cache.clone(), batch.v_cache.clone()
    write_kv(batch.k[1:], batch.v[1:], rk, rv, slots[1:])
    return float(not (torch.equal(kc, rk) and torch.equal(vc, rv)))


def split_invariance_error(
    kernels, fixed_chunks: bool, device="cpu", dtype=torch.float32, shape=None, first=150, **launch
) -> float:
    """A request verifying 4 tokens at positions first..first+3 among 6 requests, and each
    of those 4 rows decoded alone (the request's length then ends at the row), each step
    under 1, 3 and 32 programs per (request, KV head) (32: one chunk each, no loop). By
    default fp32, 2 KV heads of 2 query heads, pages of 16, key blocks of 16, so chunks of 32
    chunk_splits grow at 512 keys: first=509 crosses that boundary inside the verify step.
    With `fixed_chunks` (the backend's batch invariance: chunk_splits = MAX_SPLITS) 0.0 when
    each row has the same bits in all six steps and is right (the torch reference, fp32);
    without, 0.0 when the program count changes some row's bits (the control: the test sees
    what it guards)."""
    from specserve.layers.attention.triton_attn import MAX_SPLITS

    others = [(40, 1), (90, 1), (7, 1), (130, 1), (60, 1)]  # (position, q_len)
    shape = shape or dict(kv_heads=2, group=2, head_dim=32)
    batch = make_batch(
        [4] + [q for _, q in others],
        [first + 3] + [e for e, _ in others],
        [first + 4] + [e + 1 for e, _ in others],
        16,
        dtype=dtype,
        device=device,
        seed=3,
        **shape,
    )
    m = batch.meta
    kernels.write_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, m.slot_mapping)
    scale = 0.125
    ref = reference(batch, scale)[:4]
    chunks = MAX_SPLITS if fixed_chunks else None
    launch = launch or dict(block_n=16)

    def attend(q, meta, splits):
        return kernels.paged_attention(
            q,
            batch.k_cache,
            batch.v_cache,
            meta.positions,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            scale,
            num_splits=splits,
            chunk_splits=chunks,
            **launch,
        )

    counts = (1, 3, 32)
    verified = [attend(batch.q, m, splits) for splits in counts]
    same, right = True, True
    for i in range(4):
        alone = AttentionMetadata(
            positions=m.positions[i : i + 1],
            slot_mapping=m.slot_mapping[i : i + 1],
            query_start_loc=torch.tensor([0, 1], device=device),
            seq_lens=torch.tensor([first + i + 1], device=device),
            block_tables=m.block_tables[:1],
            max_query_len=1,
            max_seq_len=first + i + 1,
        )
        rows = [attend(batch.q[i : i + 1], alone, splits)[0] for splits in counts]
        rows += [out[i] for out in verified]
        same &= all(torch.equal(r, rows[0]) for r in rows[1:])
        right &= rel_err(rows[0].float(), ref[i]) < (1e-5 if dtype == torch.float32 else 2e-2)
    if not right:
        return float("inf")
    return float(not same) if fixed_chunks else float(same)


# ---- fused ops -----------------------------------------------------------------------------
def rms_norm_error(ops, dtype, device, rows=5, dim=96, seed=0) -> float:
    from specserve.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype=dtype, device=device)
    norm = RMSNorm(dim, 1e-6).to(dtype=dtype, device=device)
    norm.weight.data = torch.randn(dim, generator=gen).to(dtype=dtype, device=device)
    return rel_err(ops.rms_norm(x, norm.weight, norm.eps), norm(x))


def add_rms_norm_error(ops, dtype, device, rows=5, dim=96, seed=0) -> float:
    from specserve.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(seed)
    x, r = (
        (torch.randn(rows, dim, generator=gen) * 3).to(dtype=dtype, device=device) for _ in "xr"
    )
    norm = RMSNorm(dim, 1e-6).to(dtype=dtype, device=device)
    norm.weight.data = torch.randn(dim, generator=gen).to(dtype=dtype, device=device)
    total, out = ops.add_rms_norm(x, r, norm.weight, norm.eps)
    return max(rel_err(total, x + r), rel_err(out, norm(x + r)))


def rotary_error(ops, dtype, device, tokens=7, q_heads=4, k_heads=2, head_dim=32, seed=0):
    from specserve.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(head_dim, 10000.0, 512)
    rope.materialize(torch.device(device))
    pos = torch.randint(0, 512, (tokens,), generator=gen).to(device)
    q = torch.randn(tokens, q_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    k = torch.randn(tokens, k_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    rq, rk = rope(pos, q, k)
    oq, ok = ops.rotary(pos, q, k, rope.cos_sin)
    return max(rel_err(oq, rq), rel_err(ok, rk))


def silu_and_mul_error(ops, dtype, device, rows=3, dim=300, seed=0) -> float:
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(rows, dim, generator=gen) * 4).to(dtype=dtype, device=device)
    u = torch.randn(rows, dim, generator=gen).to(dtype=dtype, device=device)
    return rel_err(ops.silu_and_mul(g, u), torch.nn.functional.silu(g) * u)


# ---- the small cases the CPU interpreter runs ---------------------------------------------
SMALL = dict(kv_heads=2, group=2, head_dim=32)


def _small(q_lens, ends, seq_lens, page_size, dtype=torch.float16, seed=0):
    return make_batch(
        q_lens, ends, seq_lens, page_size, dtype=dtype, device="cpu", seed=seed, **SMALL
    )


def warm_up_error(backend, dtype) -> float:
    """The backend's start-up warm-up runs its 13 variants (3 query heights x unsplit, split,
    and the batch invariance's chunks with fewer and with as many programs; prefill) for 6
    query heads over 2 KV heads, and writes nothing outside page 0: the error is the largest
    change of pages 1.. (inf when the variant count is wrong)."""
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(3, 4, 2, 16, generator=gen).to(dtype)
    v_cache = torch.randn(3, 4, 2, 16, generator=gen).to(dtype)
    before = (k_cache[1:].clone(), v_cache[1:].clone())
    if backend.warm_up(6, (k_cache, v_cache)) != 14:
        return float("inf")
    return max(
        (k_cache[1:] - before[0]).abs().max().item(), (v_cache[1:] - before[1]).abs().max().item()
    )


def interpreter_cases() -> dict[str, tuple]:
    """name -> (check kind, builder args); every name is one CPU test."""
    cases: dict[str, tuple] = {}
    for ps in (1, 16):
        cases[f"kv_write-page{ps}"] = ("kv_write", ([3, 1, 4], [2, 20, 9], [3, 21, 10], ps), {})
        # fresh prompts: positions 0..L-1, no cached prefix
        cases[f"prefill-page{ps}"] = ("attn", ([19, 33], [18, 32], [19, 33], ps), dict(ns=1))
        # a chunk of 12 after 21 cached tokens, next to a fresh prompt
        cases[f"extend-page{ps}"] = ("attn", ([12, 5], [32, 4], [33, 5], ps), dict(ns=1))
        for ns in (1, 3, None):
            name = f"decode-page{ps}-split{ns or 'auto'}"
            cases[name] = ("attn", ([1] * 4, [0, 16, 39, 63], [1, 17, 40, 64], ps), dict(ns=ns))
        for q in range(2, 9):
            # request 0 ends at its seq_len; request 1's positions end 3 before it
            args = ([q, q], [20 + q, 30 + q], [21 + q, 34 + q], ps)
            for ns in (1, 2):
                cases[f"verify-q{q}-page{ps}-split{ns}"] = ("attn", args, dict(ns=ns))
        cases[f"mixed-page{ps}"] = (
            "attn",
            ([9, 1, 4, 1], [40, 50, 30, 0], [41, 51, 32, 1], ps),
            dict(ns=None),
        )
    # mixed steps through the backend: decode/verify rows first, then prefill chunks of more
    # than DECODE_MAX_ROWS rows (the short rows and the chunks launched apart); a chunk first
    # (one launch for all)
    # (2 query heads a KV head: requests of up to 32 tokens are short)
    cases["split-mixed-step"] = (
        "mixed",
        ([1, 4, 1, 40, 70], [30, 60, 9, 79, 69], [31, 63, 10, 80, 70], 16, 3),
        {},
    )
    cases["split-mixed-step-page1"] = ("mixed", ([3, 1, 33], [20, 70, 40], [21, 71, 41], 1, 2), {})
    cases["split-mixed-chunk-first"] = ("mixed", ([40, 1, 2], [45, 30, 8], [46, 31, 9], 16, 0), {})
    # a mixed graph's step: a decode and a verify row, then a chunk of 40 tokens after 60
    # cached and one of 3 tokens (short, but after the chunk: a tile) after 20; the tiles'
    # keys in chunks of one 16-key block or more, and unsplit (the tiles fill the "GPU")
    tiles = ([1, 3, 40, 3], [30, 20, 99, 22], [31, 21, 100, 23], 16, 2)
    cases["mixed-tiles-split"] = ("tiles", tiles, dict(want_splits=True, programs_per_sm=64))
    cases["mixed-tiles-split-min48"] = (
        "tiles",
        tiles,
        dict(want_splits=True, programs_per_sm=64, min_chunk=48),
    )
    cases["mixed-tiles-unsplit"] = ("tiles", tiles, dict(want_splits=False, programs_per_sm=1))
    # GQA decode/verify through each decode-path kernel: 3 KV heads of 4 query heads (a wrong
    # head grouping reads another head's K/V), 2 of 3 (a group that is no power of two), MHA
    gqa = dict(kv_heads=3, group=4, head_dim=32)
    for kernel in ("decode", "prefetch", "generic"):
        cases[f"gqa4-decode-{kernel}-split3"] = (
            "attn",
            ([1] * 3, [9, 40, 70], [10, 41, 71], 16),
            dict(ns=3, shape=gqa, kernel=kernel),
        )
        cases[f"gqa4-verify-q4-{kernel}"] = (
            "attn",
            ([4, 4], [20, 35], [21, 38], 4),
            dict(ns=2, shape=gqa, kernel=kernel),
        )
    cases["gqa4-decode-split1"] = (
        "attn",
        ([1] * 3, [0, 16, 40], [1, 17, 41], 16),
        dict(ns=1, shape=gqa),
    )
    cases["gqa4-verify-q16-rows64-split2"] = (
        "attn",
        ([16], [40], [43], 16),
        dict(ns=2, shape=gqa),
    )
    for kernel, q in (("decode", 1), ("decode", 5), ("prefetch", 5)):
        cases[f"gqa3-q{q}-{kernel}-split2"] = (
            "attn",
            ([q] * 2, [30, 47], [31, 50], 16),
            dict(ns=2, shape=dict(kv_heads=2, group=3, head_dim=32), kernel=kernel),
        )
    cases["mha-verify-q3-split2"] = (
        "attn",
        ([3, 1], [25, 33], [26, 34], 16),
        dict(ns=2, shape=dict(SMALL, group=1)),
    )
    cases["prefill-fp32-page16"] = (
        "attn",
        ([17, 3], [16, 25], [17, 26], 16),
        dict(ns=2, dtype=torch.float32),
    )
    for dtype, ps in (("float32", 1), ("float16", 16)):
        cases[f"model-{dtype}-page{ps}"] = ("model", (dtype, ps), {})
    cases["graph_runner_padding-float32"] = ("runner", ("float32",), {})
    # mixed steps' graphs: the short rows unsplit and split in two (their merge reads the
    # chunk counts the launch cleared for the chunks' rows among its tokens)
    cases["graph_runner_mixed-float32"] = ("runner_mixed", ("float32", 1), {})
    cases["graph_runner_mixed_split2-float32"] = ("runner_mixed", ("float32", 2), {})
    cases["drafter_graphs_padding-float32"] = ("drafter", ("float32",), {})
    cases["warm_up-float16"] = ("warm_up", ("float16",), {})
    # 509: the verified rows cross a chunk boundary (512 keys); chunks of several key blocks
    # in one loop (triton_decode._flat_chunks): the min64 case below, and on the GPU 3069
    for first in (150, 509):
        cases[f"invariance-fixed-chunks-at{first}"] = ("invariance", (True, first), {})
    cases["invariance-fixed-chunks-at509-prefetch"] = (
        "invariance",
        (True, 509),
        dict(kernel="prefetch"),
    )
    # chunks of at least 4 blocks (64 keys, where 509 keys would give one-block chunks)
    cases["invariance-fixed-chunks-at509-min64"] = ("invariance", (True, 509), dict(min_chunk=64))
    # the generic kernel chunks by the request's length: exact away from a chunk boundary
    cases["invariance-fixed-chunks-at150-generic"] = (
        "invariance",
        (True, 150),
        dict(kernel="generic"),
    )
    cases["invariance-control-free-splits"] = ("invariance", (False, 150), {})
    for dtype in ("float16", "float32"):
        for op in ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul"):
            cases[f"{op}-{dtype}"] = (op, (dtype,), {})
    return cases


def run_case(name: str, spec: tuple, kernels, ops) -> float:
    kind, args, kw = spec
    if kind == "kv_write":
        return kv_write_error(kernels, _small(*args, seed=len(name)))
    if kind == "mixed":
        return mixed_step_error(kernels, *args, seed=len(name))
    if kind == "tiles":
        return mixed_tiles_error(kernels, *args, seed=len(name), **kw)
    if kind == "invariance":
        return split_invariance_error(kernels, args[0], first=args[1], block_n=16, **kw)
    if kind == "attn":
        q_lens, ends, seq_lens, ps = args
        batch = make_batch(
            q_lens,
            ends,
            seq_lens,
            ps,
            dtype=kw.get("dtype", torch.float16),
            device="cpu",
            seed=len(name),
            **kw.get("shape", SMALL),
        )
        launch = {"kernel": kw["kernel"]} if "kernel" in kw else {}
        return attention_error(kernels, batch, kw["ns"], block_n=16, **launch)
    dtype = getattr(torch, args[0])
    from specserve.layers.attention.triton_attn import LaunchConfig, TritonAttentionBackend

    small = LaunchConfig(block_n=16, num_warps=4, num_stages=2)  # several loop iterations
    splits = args[1] if kind == "runner_mixed" else None
    backend = TritonAttentionBackend(splits, decode=small, prefill=small, kernels=kernels)
    if kind == "model":
        return model_cases.model_error(backend, dtype, "cpu", args[1], fused_ops=ops)
    if kind == "runner":
        return model_cases.runner_padding_error(backend, dtype, "cpu")
    if kind == "runner_mixed":
        return model_cases.runner_mixed_error(backend, dtype, "cpu")
    if kind == "drafter":
        from tests.support.drafter_cases import drafter_graph_error

        return drafter_graph_error(backend, dtype, "cpu", fused_ops=ops)
    if kind == "warm_up":
        return warm_up_error(backend, dtype)
    return globals()[f"{kind}_error"](ops, dtype, "cpu", seed=len(name))


def main() -> None:
    import os

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from specserve.kernels.attention import triton_kernels as kernels
    from specserve.layers import triton_ops as ops

    results = {}
    for name, spec in interpreter_cases().items():
        try:
            results[name] = run_case(name, spec, kernels, ops)
        except Exception as e:  # reported per case by the test
            results[name] = f"{type(e).__name__}: {e}"
    sys.stdout.write("\n" + json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
