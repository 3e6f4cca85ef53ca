"""A step's copy into the target graphs' static input buffers (runtime/graph_staging.py,
`CudaGraphRunner.run`): the one-kernel path (runtime/stage_kernel.py, CUDA's) writes what the
torch path writes, and nothing else, through the Triton interpreter on the CPU (decode and
verify steps, batches padded to a bucket or not, page tables wider than a program's block,
a page table whose rows are not back to back, steps packed at any offset of their upload)
and on a GPU (`-m gpu`)."""

from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

PAGE = 4
MAX_BATCH, MAX_Q, MAX_PAGES = 160, 4, 96
CASES = {  # name: (requests, tokens each, bucket, padded tokens: bucket x tokens each)
    "decode-1": (1, 1, 1, 1),
    "decode-5-in-8": (5, 1, 8, 8),
    "verify-3x4-in-4": (3, 4, 4, 16),
    "verify-8x4": (8, 4, 8, 32),
    "decode-13-in-16": (13, 1, 16, 16),
    "verify-130x4-in-160": (130, 4, 160, 640),  # 520 tokens: pack's numpy branch
    "mixed-3x5-in-4-and-32": (3, 5, 4, 32),  # a mixed graph's token bucket
}


def _step(requests: int, tokens: int, seed: int, device: torch.device):
    """A packed step (packing.pack, as the engine uploads it) of `requests` segments of
    `tokens` tokens at random starts, with random page tables."""
    from specserve.runtime.packing import Segment, pack

    rng = random.Random(seed)
    segments = []
    for _ in range(requests):
        start = rng.randint(0, 300)
        pages = -(-(start + tokens) // PAGE)
        table = rng.sample(range(1, 400), pages)
        segments.append(Segment(table, start, [rng.randint(0, 999) for _ in range(tokens)]))
    ids, meta, _ = pack(segments, PAGE, device)
    return ids, meta


def _buffers(device: torch.device):
    """Static buffers as the runner holds them, filled with a marker the copy must keep
    wherever it does not write."""
    i64 = dict(dtype=torch.int64, device=device)
    return SimpleNamespace(
        input_ids=torch.full((MAX_BATCH * MAX_Q,), -7, **i64),
        positions=torch.full((MAX_BATCH * MAX_Q,), -7, **i64),
        slot_mapping=torch.full((MAX_BATCH * MAX_Q,), -7, **i64),
        seq_lens=torch.full((MAX_BATCH,), -7, **i64),
        block_tables=torch.full((MAX_BATCH, MAX_PAGES), -7, **i64),
    )


def _spread_rows(meta):
    """`meta` with its page table's rows apart (a column slice of a wider table)."""
    tables = meta.block_tables
    wide = torch.full(
        (tables.shape[0], tables.shape[1] + 5), 999, dtype=tables.dtype, device=tables.device
    )
    wide[:, : tables.shape[1]] = tables
    return replace(meta, block_tables=wide[:, : tables.shape[1]])


def mismatches(device: str, seed: int = 0) -> list[str]:
    """Cases whose kernel path leaves any static buffer different from the torch path."""
    from specserve.runtime.graph_staging import stage_torch, stageable
    from specserve.runtime.stage_kernel import stage

    dev, out = torch.device(device), []
    cases = [(name, *case, False) for name, case in CASES.items()]
    cases.append(("verify-8x4, rows apart", 8, 4, 8, 32, True))
    for name, requests, tokens, bucket, padded, spread in cases:
        ids, meta = _step(requests, tokens, seed + len(name), dev)
        if spread:
            meta = _spread_rows(meta)
        if not stageable(ids, meta):
            out.append(f"{name}: not stageable")
            continue
        torch_path, kernel_path = _buffers(dev), _buffers(dev)
        stage_torch(torch_path, ids, meta, bucket, padded)
        static = (
            kernel_path.input_ids,
            kernel_path.positions,
            kernel_path.slot_mapping,
            kernel_path.seq_lens,
            kernel_path.block_tables,
        )
        stage(
            ids,
            meta.positions,
            meta.slot_mapping,
            meta.seq_lens,
            meta.block_tables,
            static,
            bucket,
            padded,
        )
        for key in vars(torch_path):
            if not torch.equal(getattr(torch_path, key), getattr(kernel_path, key)):
                out.append(f"{name}: {key}")
    return out


def run_cases() -> dict:
    from specserve.runtime import stage_kernel
    from tests.support.specialization_run import after_start_up

    return after_start_up(
        lambda: stage_kernel.warm_up(torch.device("cpu")), lambda: mismatches("cpu")
    )


# the interpreter run (module, seconds idle) whose results the `interpreter_results` fixture gives
INTERPRETER = ("tests.runtime.test_graph_staging", 300)


def test_interpreter_stage_kernel_writes_what_the_torch_path_writes(interpreter_results):
    assert interpreter_results["mismatches"] == []


def test_interpreter_no_step_compiles_a_variant_start_up_did_not(interpreter_results):
    # the step's tensors are views into one upload at any alignment, and its sizes vary
    assert interpreter_results["new_variants"] == []


def test_the_cases_pad_and_reach_past_one_block():
    # what the kernel must get right: padded requests (length 1, first page 0, zero
    # tokens), page tables of more cells than a program's block, steps packed from numpy
    from specserve.runtime.graph_staging import stage_torch
    from specserve.runtime.stage_kernel import BLOCK

    padded = cells = 0
    for name, (requests, tokens, bucket, padded_tokens) in CASES.items():
        ids, meta = _step(requests, tokens, len(name), torch.device("cpu"))
        bufs = _buffers(torch.device("cpu"))
        stage_torch(bufs, ids, meta, bucket, padded_tokens)
        padded += bucket - requests
        cells = max(cells, requests * meta.block_tables.shape[1])
        if bucket > requests:
            assert torch.all(bufs.seq_lens[requests:bucket] == 1)
            assert torch.all(bufs.block_tables[requests:bucket, 0] == 0)
        assert torch.all(bufs.input_ids[requests * tokens : padded_tokens] == 0)
    assert padded > 0 and cells > 2 * BLOCK


def test_steps_the_kernel_cannot_take_go_through_torch():
    # pack's steps qualify (also with a table's rows apart); a strided or int32 tensor, or
    # a table of no columns, from elsewhere is not read wrongly
    from specserve.runtime.graph_staging import stageable

    ids, meta = _step(3, 4, 0, torch.device("cpu"))
    assert stageable(ids, meta) and stageable(ids, _spread_rows(meta))
    assert not stageable(torch.arange(24)[::2], meta)
    assert not stageable(ids.int(), meta)
    columns = torch.zeros(3, 2 * meta.block_tables.shape[1], dtype=torch.int64)
    assert not stageable(ids, replace(meta, block_tables=columns[:, ::2]))
    assert not stageable(ids, replace(meta, block_tables=columns[:, :0]))


@pytest.mark.gpu
def test_gpu_stage_kernel_writes_what_the_torch_path_writes():
    assert mismatches("cuda") == []


if __name__ == "__main__":  # the interpreter run (TRITON_INTERPRET=1), see the fixture
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.stdout.write("\n" + json.dumps(run_cases()) + "\n")
