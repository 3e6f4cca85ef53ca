"""The Triton kernels against the PyTorch reference.

On the CPU every kernel runs through the Triton interpreter in one subprocess (TRITON_INTERPRET
is read when kernels are defined and would leak into other tests otherwise), on small shapes
in fp16/fp32 (bf16 tl.dot is broken in the interpreter). On a GPU (`-m gpu`) the same checks
run compiled, in bf16 and fp16 at Llama-3.1-8B attention shapes.
"""

from __future__ import annotations

import pytest
import torch

from tests import rope_attention_cases
from tests.interpreter_run import interpreter_results as run_interpreter
from tests.triton_cases import attention_error, interpreter_cases, kv_write_error, make_batch

CASES = interpreter_cases()
ROPE_CASES = rope_attention_cases.interpreter_cases()


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_interpreter("tests.triton_cases", timeout=900)


@pytest.fixture(scope="module")
def rope_results() -> dict:
    return run_interpreter("tests.rope_attention_cases", timeout=600)


def _tolerance(name: str) -> float:
    if name.startswith(("kv_write", "warm_up")):
        return 0.0  # a copy: exact; the warm-up writes nothing outside page 0
    if "fp32" in name or "float32" in name:
        return 1e-5
    return 2e-3  # fp16 operands, fp32 reference


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreter_matches_reference(name, interpreter_results):
    err = interpreter_results[name]
    assert isinstance(err, float), f"{name} raised {err}"
    assert err <= _tolerance(name), f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("name", sorted(ROPE_CASES))
def test_interpreter_rope_in_decode_kernel_is_bitwise_the_two_kernel_path(name, rope_results):
    # rotary + K/V store inside the decode kernel: output and caches equal bit for bit to
    # rotary_store_kv + paged_attention (decode, verify straddling chunks, unstored slots)
    assert rope_results[name] is None, f"{name}: {rope_results[name]}"


def test_rope_launch_refuses_steps_the_decode_kernel_does_not_serve():
    from specserve.layers.attention import triton_kernels as tk

    gqa4 = rope_attention_cases.GQA4
    case = rope_attention_cases.rope_case([1, 4], [9, 20], [10, 21], 4, dtype=torch.float16,
                                          device="cpu", seed=0, **gqa4)  # fmt: skip
    m, b = case.batch.meta, case.batch
    rope = tk.Rope(case.cos_sin, case.slots, case.q_heads)

    def launch(qkv=case.qkv, max_query_len=4, kernel=None, rope=rope):
        tk.paged_attention(qkv, b.k_cache, b.v_cache, m.positions, m.query_start_loc,
                           m.seq_lens, m.block_tables, max_query_len, 1.0, kernel=kernel,
                           rope=rope)  # fmt: skip

    with pytest.raises(ValueError, match="decode kernel serves"):
        launch(kernel="generic")
    with pytest.raises(ValueError, match="decode kernel serves"):
        launch(max_query_len=17)  # 17 tokens x 4 query heads per KV head: prefill-like
    with pytest.raises(ValueError, match="qkv rows"):
        launch(qkv=case.qkv[:, :-1])
    with pytest.raises(ValueError, match="cos_sin"):
        launch(rope=rope._replace(cos_sin=case.cos_sin[:, :16]))


def test_backend_takes_qkv_for_the_steps_the_decode_kernel_serves(monkeypatch):
    from types import SimpleNamespace

    from specserve.layers.attention import AttentionMetadata
    from specserve.layers.attention.triton_attn import TritonAttentionBackend

    ops = SimpleNamespace(FUSED_ROPE=True, DECODE_KERNEL="decode", DECODE_MAX_ROWS=64)
    backend = TritonAttentionBackend(kernels=ops)

    def meta(q_len):
        return AttentionMetadata(None, None, None, torch.ones(1), None, q_len, 100)

    assert backend.takes_qkv(meta(1), 32, 8) and backend.takes_qkv(meta(16), 32, 8)
    assert not backend.takes_qkv(meta(17), 32, 8)  # 68 rows: the generic kernel's
    ops.DECODE_KERNEL = "prefetch"
    assert backend.takes_qkv(meta(4), 32, 8)
    ops.DECODE_KERNEL = "generic"
    assert not backend.takes_qkv(meta(1), 32, 8)
    ops.DECODE_KERNEL, ops.FUSED_ROPE = "decode", False  # the A/B switch, read per call
    assert not backend.takes_qkv(meta(1), 32, 8)


def test_attend_qkv_takes_one_path():
    from specserve.model.llama import attend_qkv

    calls = []

    class Backend:
        name = "triton"

        def __init__(self, takes):
            self.takes = takes

        def takes_qkv(self, meta, num_heads, num_kv_heads):
            return self.takes

        def forward_qkv(self, qkv, cos_sin, num_heads, k_cache, v_cache, meta, scale):
            calls.append(("forward_qkv", qkv, cos_sin, num_heads, k_cache, scale))
            return "fused"

        def forward(self, q, k, v, k_cache, v_cache, meta, scale):
            calls.append(("forward", q, k, v, k_cache, scale))
            return "attended"

    class Rotary:
        cos_sin = "table"

        def rotate_and_store(self, positions, qkv, q_heads, kv_heads, k_cache, v_cache,
                             slot_mapping):  # fmt: skip
            calls.append(("rotate_and_store", qkv, q_heads, kv_heads, slot_mapping))
            return "q"

    meta = type("Meta", (), {"positions": "pos", "slot_mapping": "slots"})()
    assert attend_qkv("qkv", Rotary(), Backend(True), ("k", "v"), meta, 8, 2, 0.5) == "fused"
    assert calls == [("forward_qkv", "qkv", "table", 8, "k", 0.5)]
    calls.clear()
    assert attend_qkv("qkv", Rotary(), Backend(False), ("k", "v"), meta, 8, 2, 0.5) == "attended"
    assert calls == [("rotate_and_store", "qkv", 8, 2, "slots"), ("forward", "q", None, None,
                                                                    "k", 0.5)]  # fmt: skip


def test_decode_num_splits_keeps_one_wave():
    from specserve.layers.attention.triton_kernels import decode_num_splits

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
        return AttentionMetadata(None, None, torch.arange(num_requests + 1) * q_len, lens,
                                 None, q_len, max_seq_len)  # fmt: skip

    backend, cpu = TritonAttentionBackend(), torch.device("cpu")
    for b, ctx in ((1, 4096), (2, 4096), (3, 300), (16, 4096), (64, 100)):
        want = decode_num_splits(b * 2, ctx, 4)
        assert backend.choose_num_splits(meta(b, ctx), 2, 4, cpu) == want, (b, ctx)
    assert backend.choose_num_splits(meta(1, 4096, q_len=32), 2, 4, cpu) == 1  # prefill rows
    assert isinstance(backend.choose_num_splits(meta(1, 4096), 2, 4, cpu), int)


# ---- GPU: compiled kernels at real shapes ------------------------------------------------
GPU_SHAPE = dict(kv_heads=8, group=4, head_dim=128)  # Llama-3.1-8B attention
GPU_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3}


def _kernels():
    from specserve.layers.attention import triton_kernels

    return triton_kernels


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_kv_write_exact(dtype, page_size):
    batch = make_batch([37, 1, 5], [36, 900, 40], [37, 901, 41], page_size, dtype=dtype,
                       device="cuda", seed=page_size, **GPU_SHAPE)  # fmt: skip
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
    batch = make_batch(q_lens, ends, seq_lens, page_size, dtype=dtype, device="cuda",
                       seed=num_splits or 0, **GPU_SHAPE)  # fmt: skip
    err = attention_error(_kernels(), batch, num_splits)
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
    batch = make_batch([q_len] * num_requests, ends, seq_lens, 16, dtype=dtype, device="cuda",
                       seed=q_len, **GPU_SHAPE)  # fmt: skip
    block_n, warps, stages = launch
    err = attention_error(_kernels(), batch, num_splits, block_n, num_warps=warps,
                          num_stages=stages)  # fmt: skip
    assert err < GPU_TOL[dtype], err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fresh_prefill_long(dtype):
    batch = make_batch([1500, 700], [1499, 699], [1500, 700], 16, dtype=dtype, device="cuda",
                       seed=3, **GPU_SHAPE)  # fmt: skip
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
        batch = make_batch([q_len] * 64, ends, seq_lens, 16, dtype=dtype, device="cuda",
                           seed=q_len, **GPU_SHAPE)  # fmt: skip
        for splits, (block_n, warps, stages) in ((1, (64, 4, 3)), (None, (32, 4, 4)),
                                                 (7, (16, 4, 1))):  # fmt: skip
            err = attention_error(_kernels(), batch, splits, block_n, num_warps=warps,
                                  num_stages=stages, kernel=kernel)  # fmt: skip
            assert err < GPU_TOL[dtype], (q_len, splits, block_n, warps, stages, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("num_splits", [6, 32])
@pytest.mark.parametrize("kernel", ["decode", "prefetch"])
@pytest.mark.parametrize("num_requests", [1, 3])
def test_gpu_rope_in_decode_kernel_is_bitwise(dtype, q_len, num_splits, kernel, num_requests):
    # contexts about 768; the second request's positions end 3 before its length, and one
    # token's slot is -1; the backend's decode launch (32 keys, 4 warps, 3 stages)
    seq_lens = [768, 811, 700][:num_requests]
    ends = [s - 1 - 3 * (b == 1) for b, s in enumerate(seq_lens)]
    case = rope_attention_cases.rope_case(
        [q_len] * num_requests, ends, seq_lens, 16, dtype=dtype, device="cuda",
        seed=q_len + num_splits, unstored=q_len * num_requests - 1, **GPU_SHAPE,
    )  # fmt: skip
    problem = rope_attention_cases.rope_mismatch(_kernels(), case, num_splits, kernel,
                                                 block_n=32)  # fmt: skip
    assert problem is None, problem


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("num_splits", [6, 32])
@pytest.mark.parametrize("kernel", ["decode", "prefetch"])
def test_gpu_rope_in_decode_kernel_under_cuda_graphs(dtype, q_len, num_splits, kernel):
    problems = rope_attention_cases.graph_mismatches(_kernels(), dtype, q_len, num_splits,
                                                     kernel)  # fmt: skip
    assert not problems, problems
