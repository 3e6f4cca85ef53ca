"""Programmatic dependent launch (kernels/pdl.py) on the CPU: the switch and where it holds,
the engine and CLI options, the GEMV's prefetch sizing, and (tests/support/pdl_compile.py, in a
subprocess without the interpreter) every decode-path kernel compiled for sm_90 with PDL
on and off: on, each program waits before its first global load, store or async copy and
signals its dependents after the wait, the GEMV prefetching weight lines before it and the
decode attention kernel reading its metadata before it (kernels/pdl.py: only torch ops and
copies write that); off,
no grid-dependency instruction at all. The fused split-K + add + RMSNorm kernel's norm
compiles to the add + RMSNorm kernel's instructions (the same reduction order, hence the
same bits on the GPU). GPU checks: tests/kernels/test_pdl_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch

from specserve.kernels import pdl


@pytest.fixture
def restore_pdl():
    previous = pdl.is_enabled()
    yield
    pdl.set_enabled(previous)


def test_switch_applies_only_where_supported(restore_pdl, monkeypatch):
    assert pdl.set_enabled(True) in (True, False)
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "_device_capable", lambda device: True)  # an H200, as it were
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl.launch_options(cuda) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs no PDL
    assert not pdl.active(cuda)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert pdl.set_enabled(False) is True
    assert not pdl.active(cuda) and pdl.launch_options(cuda) == {"USE_PDL": False}
    assert pdl.is_enabled() is False


def test_engine_and_cli_carry_the_switches(restore_pdl, tiny_llama):
    from specserve.cli import build_parser, engine_config
    from specserve.engine.engine import LLMEngine

    args = build_parser().parse_args(["generate", "hi", "--disable-pdl", "--disable-fusion"])
    cfg = engine_config(args)
    assert cfg.execution.disable_pdl and cfg.execution.disable_fusion
    defaults = engine_config(build_parser().parse_args(["generate", "hi"]))
    assert not defaults.execution.disable_pdl and not defaults.execution.disable_fusion
    pdl.set_enabled(True)
    engine = LLMEngine(
        type(cfg).from_flags(model=str(tiny_llama), device="cpu", disable_pdl=True, num_kv_pages=16)
    )
    # the engine's own switch, in force while its start-up and steps run; not the process's
    assert not engine.kernel_options.pdl and pdl.is_enabled() is True
    assert engine.runner.backend.batch_invariant  # by default (attention's fixed chunks)
    args = build_parser().parse_args(["generate", "hi", "--disable-batch-invariance"])
    engine = LLMEngine(
        type(cfg).from_flags(
            **{
                **engine_config(args).flags(),
                "model": str(tiny_llama),
                "device": "cpu",
                "speculative_algorithm": "none",
                "num_kv_pages": 16,
            }
        )
    )
    assert engine.runner.backend.batch_invariant is False


def test_gemv_prefetch_sizing():
    from specserve.kernels.gemv import PDL_PREFETCH_MAX_LINES, GemvConfig, prefetch_lines

    cfg = GemvConfig(block_n=32, block_k=256)
    # Llama-3.1-8B qkv at batch 1: 192 tiles of 32 rows, 8 MiB over them = 10.7 lines a row
    assert prefetch_lines(cfg, 192, 16, 2) == 8
    assert prefetch_lines(cfg, 192, 1, 2) == 4  # at most the program's own K slice
    assert prefetch_lines(GemvConfig(64, 128), 2004, 32, 2) == 0  # lm_head: too many tiles
    for programs in (1, 7, 100, 1000):
        lines = prefetch_lines(GemvConfig(16, 64), programs, 64, 2)
        assert lines == 0 or (lines & (lines - 1) == 0 and lines <= PDL_PREFETCH_MAX_LINES)


@pytest.fixture(scope="module")
def compiled() -> dict:
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("this triton has no CUDA backend to compile with")
    from tests.support.pdl_compile import compiled_in_subprocess

    return compiled_in_subprocess(["tests.support.pdl_compile"], 600)


def _launches(compiled: dict, mode: str) -> dict:
    return {
        k: v
        for k, v in compiled.items()
        if k.endswith("/" + mode) and "/" in k[:-5] and not k.startswith("norm-tail")
    }


def test_pdl_kernels_wait_before_touching_memory(compiled):
    launches = _launches(compiled, "pdl")
    kernels = {name.split("/")[1] for name in launches}
    assert kernels >= {
        "_gemv_kernel",
        "_gemv_split_k_reduce_kernel",
        "_rms_norm_kernel",
        "_add_rms_norm_kernel",
        "_split_k_add_rms_norm_kernel",
        "_silu_and_mul_kernel",
        "_rotary_kernel",
        "_rotary_store_kv_kernel",
        "_kv_write_kernel",
        "_paged_attn_decode_kernel",
        "_paged_attn_kernel",
        "_split_reduce_kernel",
        "_gemv_stream_k_kernel",
    }, kernels
    for name, marks in launches.items():
        assert isinstance(marks, dict), f"{name} did not compile: {marks}"
        assert marks["use_pdl"] and marks["launch_pdl"], name
        wait = marks["wait"]
        assert wait is not None and marks["launch"] is not None and marks["launch"] > wait, name
        assert marks["store"] is not None and marks["store"] > wait, (name, marks)
        if "_paged_attn_decode_kernel" in name:  # its metadata (no PDL kernel writes it):
            # 64-bit integers only, never q (16/32-bit) nor K/V (async copies)
            assert marks["load"] is not None and marks["load"] < wait, (name, marks)
            early = marks["loads_before_wait"]
            assert early and all(
                re.fullmatch(r"ld\.global(\.nc)?(\.v[24])?\.[bus]64", op) for op in early
            ), (name, early)
        else:
            assert marks["load"] is not None and marks["load"] > wait, (name, marks)
        if "_gemv_kernel" in name or "_gemv_stream_k_kernel" in name:
            # weight lines requested while the previous kernel ends
            assert marks["prefetch"] is not None and marks["prefetch"] < wait, (name, marks)
        else:
            assert marks["prefetch"] is None, name


def test_plain_kernels_have_no_grid_dependency_code(compiled):
    launches = _launches(compiled, "plain")
    assert len(launches) == len(_launches(compiled, "pdl"))
    for name, marks in launches.items():
        assert isinstance(marks, dict), f"{name} did not compile: {marks}"
        assert not marks["use_pdl"] and not marks["launch_pdl"], name
        assert marks["wait"] is marks["launch"] is marks["prefetch"] is None, (name, marks)


def test_fused_split_k_norm_reduces_as_the_add_rms_norm_kernel(compiled):
    tails = {k: v for k, v in compiled.items() if k.startswith("norm-tail")}
    assert len(tails) == 4 and all(v is True for v in tails.values()), tails
