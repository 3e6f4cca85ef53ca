"""The Triton kernels against the PyTorch reference.

On the CPU every kernel runs through the Triton interpreter in one subprocess (TRITON_INTERPRET
is read when kernels are defined and would leak into other tests otherwise), on small shapes
in fp16/fp32 (bf16 tl.dot is broken in the interpreter). On a GPU (`-m gpu`) the same checks
run compiled, in bf16 and fp16 at Llama-3.1-8B attention shapes.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_cases import (
    attention_error,
    interpreter_cases,
    kv_write_error,
    make_batch,
    mixed_step_error,
)

CASES = interpreter_cases()


# the interpreter run (module, seconds idle) whose results the `interpreter_results` fixture
# gives this file's tests (conftest.py; started in the background: tests/support/interpreter_run.py)
INTERPRETER = ("tests.support.triton_cases", 900)


def _tolerance(name: str) -> float:
    if name.startswith(("kv_write", "warm_up", "invariance")):
        return 0.0  # a copy: exact; the warm-up writes nothing outside page 0; bits equal
    if "fp32" in name or "float32" in name:
        return 1e-5
    return 2e-3  # fp16 operands, fp32 reference


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_matches_reference(name, interpreter_results):
    err = interpreter_results[name]
    assert isinstance(err, float), f"{name} raised {err}"
    assert err <= _tolerance(name), f"{name}: relative error {err:.3g}"


def test_decode_num_splits_keeps_one_wave():
    from specserve.kernels.attention.triton_kernels import decode_num_splits

    assert decode_num_splits(64 * 8, 131072, 132) == 1  # batch 64 x 8 KV heads: a full wave
    assert decode_num_splits(8 * 8, 131072, 132) == 8  # 512 of 528 slots
    assert decode_num_splits(8, 131072, 132) == 32  # capped by the reduce kernel
    assert decode_num_splits(8, 300, 132) == 3  # no chunk under 128 tokens
    assert decode_num_splits(2000, 131072, 132) == 1
    assert decode_num_splits(0, 0, 132) == 1  # nothing to run: no split, no division by zero
    # the backend's choice is this policy (CPU: 4 multiprocessors assumed)
    from specserve.layers.attention import AttentionMetadata
    from specserve.layers.attention.triton_attn import TritonAttentionBackend

    def meta(num_requests, max_seq_len, q_len=1):
        lens = torch.full((num_requests,), max_seq_len)
        return AttentionMetadata(
            None, None, torch.arange(num_requests + 1) * q_len, lens, None, q_len, max_seq_len
        )

    backend, cpu = TritonAttentionBackend(), torch.device("cpu")
    for b, ctx in ((1, 4096), (2, 4096), (3, 300), (16, 4096), (64, 100)):
        want = decode_num_splits(b * 2, ctx, 4)
        assert backend.choose_num_splits(meta(b, ctx), 2, 4, cpu) == want, (b, ctx)
    # prefill rows (32 tokens x 4 > 64): one tile a KV head, two tiles a multiprocessor,
    # chunks of at least 256 keys
    assert backend.choose_num_splits(meta(1, 4096, q_len=32), 2, 4, cpu) == 4
    assert backend.choose_num_splits(meta(1, 600, q_len=32), 2, 4, cpu) == 3
    assert backend.choose_num_splits(meta(4, 4096, q_len=200), 2, 4, cpu) == 1  # 16 tiles
    assert isinstance(backend.choose_num_splits(meta(1, 4096), 2, 4, cpu), int)


def test_backend_fixes_the_chunks_of_decode_and_verify_steps_up_to_16_requests():
    """Batch invariance: decode and verify steps of up to INVARIANT_MAX_REQUESTS requests
    cut every request's keys into MAX_SPLITS chunks whatever the program count; larger
    steps, prefill rows and --disable-batch-invariance keep the chunks of the split count
    (the kernels' bits under both: `invariance-*` interpreter cases)."""
    from types import SimpleNamespace

    from specserve.kernels.gemv_plan import SHARED_ROWS
    from specserve.layers.attention import AttentionMetadata
    from specserve.layers.attention.triton_attn import (
        INVARIANT_MAX_REQUESTS,
        MAX_SPLITS,
        TritonAttentionBackend,
    )

    assert INVARIANT_MAX_REQUESTS == SHARED_ROWS  # the GEMVs' shared buckets: one guarantee
    calls = []
    fake = SimpleNamespace(
        DECODE_MAX_ROWS=64,
        write_kv=lambda *a: None,
        decode_num_splits=lambda *a: 3,
        paged_attention=lambda *a, **kw: calls.append(kw) or a[0],
    )

    def step(backend, num_requests, q_len):
        lens = torch.full((num_requests,), 500)
        meta = AttentionMetadata(
            None, None, torch.arange(num_requests + 1) * q_len, lens, None, q_len, 500
        )
        q = torch.zeros(num_requests * q_len, 8, 4)
        backend.forward(q, q[:, :2], q[:, :2], torch.zeros(1, 1, 2, 4), None, meta, 1.0)
        return calls[-1]["chunk_splits"], calls[-1]["num_splits"]

    backend = TritonAttentionBackend(kernels=fake)
    assert backend.invariant_chunks(torch.device("cuda")) == MAX_SPLITS
    assert step(backend, 1, 1) == (None, 3)  # the CPU's interpreter: off unless asked
    chunks = backend.cpu_invariant_chunks = 4
    assert step(backend, 1, 1) == (chunks, 3)  # decode
    assert step(backend, 16, 4) == (chunks, 3)  # verify of 16 requests at K=3
    assert step(backend, 17, 1) == (None, 3)  # beyond the guarantee: the split count's
    assert step(backend, 2, 32) == (3, 3)  # prefill rows (32 x 4 > 64): chunked by length
    assert calls[-1]["min_chunk"] == backend.prefill_min_chunk
    fake.decode_num_splits = lambda *a: chunks + 2  # more programs than the chunks: capped
    assert step(backend, 2, 1) == (chunks, chunks)
    assert step(backend, 17, 1) == (None, chunks + 2)
    fake.decode_num_splits = lambda *a: 3
    backend.batch_invariant = False  # --disable-batch-invariance
    assert step(backend, 1, 1) == (None, 3)


# ---- GPU: compiled kernels at real shapes ------------------------------------------------
GPU_SHAPE = dict(kv_heads=8, group=4, head_dim=128)  # Llama-3.1-8B attention
GPU_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["decode", "prefetch", "generic"])
def test_gpu_fixed_chunks_keep_a_rows_bits_at_any_program_count(kernel):
    """The interpreter's `invariance-*` cases compiled, at the 8B attention in bf16 with the
    decode launch (key blocks of 32: chunks grow at 1,024 keys): 4 verified rows and each
    decoded alone, under 1, 3 and 32 programs, are bit for bit the same with fixed chunks,
    also across the boundary and with chunks of several key blocks for the decode kernels,
    and not without (the control)."""
    from tests.support.triton_cases import split_invariance_error

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    launch = dict(block_n=32, num_warps=4, num_stages=3, kernel=kernel)
    # 1021 and 3069: across a chunk boundary; 3069: chunks of 3 and 4 key blocks
    cases = [(True, 150), (False, 150)] + [(True, 1021), (True, 3069)] * (kernel != "generic")
    for fixed, first in cases:
        assert (
            split_invariance_error(
                _kernels(), fixed, "cuda", torch.bfloat16, GPU_SHAPE, first=first, **launch
            )
            == 0.0
        ), (fixed, first)
    # chunks of at least 128 keys (the A/B of benchmarks/gpu_engine.py --ab-attn-min-chunk)
    assert (
        split_invariance_error(
            _kernels(), True, "cuda", torch.bfloat16, GPU_SHAPE, first=1021, min_chunk=128, **launch
        )
        == 0.0
    )


def _kernels():
    from specserve.kernels.attention import triton_kernels

    return triton_kernels


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_kv_write_exact(dtype, page_size):
    batch = make_batch(
        [37, 1, 5],
        [36, 900, 40],
        [37, 901, 41],
        page_size,
        dtype=dtype,
        device="cuda",
        seed=page_size,
        **GPU_SHAPE,
    )
    assert kv_write_error(_kernels(), batch) == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_splits", [1, 5, None])
def test_gpu_mixed_prefill_decode_verify(dtype, page_size, num_splits):
    # a chunked prefill after 200 cached tokens, two decodes, verify ending before / at seq_len
    q_lens = [300, 1, 1, 4, 8]
    ends = [499, 2999, 63, 1199, 700]
    seq_lens = [500, 3000, 64, 1203, 701]
    batch = make_batch(
        q_lens,
        ends,
        seq_lens,
        page_size,
        dtype=dtype,
        device="cuda",
        seed=num_splits or 0,
        **GPU_SHAPE,
    )
    err = attention_error(_kernels(), batch, num_splits)
    assert err < GPU_TOL[dtype], err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_mixed_graph_tiles_split_a_short_chunk_over_a_long_context(dtype):
    """A mixed graph's step as the 8B shape runs it at one request: a 64-token question
    after 2,048 cached tokens is 3 tiles a KV head, whose keys the backend splits (and, with
    a decode row before it, leaves that row to the decode launch)."""
    from tests.support.triton_cases import mixed_tiles_error

    for q_lens, ends, seq_lens, short in (
        ([64], [2111], [2112], 0),
        ([1, 64], [700, 2111], [701, 2112], 1),
    ):
        err = mixed_tiles_error(
            _kernels(),
            q_lens,
            ends,
            seq_lens,
            16,
            short,
            seed=3,
            want_splits=True,
            device="cuda",
            dtype=dtype,
            shape=GPU_SHAPE,
            min_chunk=None,
            small=False,
        )
        assert err < GPU_TOL[dtype], (q_lens, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_mixed_step_through_backend(dtype, page_size):
    # decode and verify rows (the scheduler puts them first) launched apart from two
    # prefill chunks, one after 200 cached tokens
    gen = torch.Generator().manual_seed(page_size)
    decode_lens = torch.randint(40, 3000, (40,), generator=gen).tolist()
    q_lens = [1 + 3 * (b % 2) for b in range(40)] + [300, 512]
    seq_lens = decode_lens + [500, 512]
    ends = [s - 1 for s in seq_lens]
    err = mixed_step_error(
        _kernels(),
        q_lens,
        ends,
        seq_lens,
        page_size,
        split_at=40,
        seed=1,
        device="cuda",
        dtype=dtype,
        shape=GPU_SHAPE,
    )
    assert err < GPU_TOL[dtype], err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_len", [1, 2, 4, 8])
@pytest.mark.parametrize("num_splits", [1, None])
@pytest.mark.parametrize("launch", [(64, 4, 2), (128, 8, 3)])
def test_gpu_decode_and_verify_batches(dtype, q_len, num_splits, launch):
    gen = torch.Generator().manual_seed(q_len)
    num_requests = 48
    seq_lens = torch.randint(q_len + 3, 4096, (num_requests,), generator=gen).tolist()
    # every other request has speculative positions laid 3 past its seq_len's end
    ends = [s - 1 - 3 * (b % 2) for b, s in enumerate(seq_lens)]
    batch = make_batch(
        [q_len] * num_requests,
        ends,
        seq_lens,
        16,
        dtype=dtype,
        device="cuda",
        seed=q_len,
        **GPU_SHAPE,
    )
    block_n, warps, stages = launch
    err = attention_error(
        _kernels(), batch, num_splits, block_n, num_warps=warps, num_stages=stages
    )
    assert err < GPU_TOL[dtype], err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fresh_prefill_long(dtype):
    batch = make_batch(
        [1500, 700], [1499, 699], [1500, 700], 16, dtype=dtype, device="cuda", seed=3, **GPU_SHAPE
    )
    err = attention_error(_kernels(), batch, None)
    assert err < GPU_TOL[dtype], err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernel", ["decode", "prefetch", "generic"])
def test_gpu_decode_kernels_at_batch_64(dtype, kernel):
    # the batch-64 grid (64 requests x 8 KV heads of 4 query heads), random lengths; every
    # other request's positions end 3 before its seq_len; decode, verify of 4 and of 16
    # tokens (64 rows), several launches and split counts
    for q_len in (1, 4, 16):
        gen = torch.Generator().manual_seed(q_len)
        seq_lens = torch.randint(q_len + 3, 3000, (64,), generator=gen).tolist()
        ends = [s - 1 - 3 * (b % 2) for b, s in enumerate(seq_lens)]
        batch = make_batch(
            [q_len] * 64, ends, seq_lens, 16, dtype=dtype, device="cuda", seed=q_len, **GPU_SHAPE
        )
        for splits, (block_n, warps, stages) in (
            (1, (64, 4, 3)),
            (None, (32, 4, 4)),
            (7, (16, 4, 1)),
        ):
            err = attention_error(
                _kernels(),
                batch,
                splits,
                block_n,
                num_warps=warps,
                num_stages=stages,
                kernel=kernel,
            )
            assert err < GPU_TOL[dtype], (q_len, splits, block_n, warps, stages, err)
