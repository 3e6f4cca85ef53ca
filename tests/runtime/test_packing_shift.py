"""A shifted step's positions, KV slots and lengths (runtime/packing.py `pack` with `shift`,
the step in flight's accept lengths on the device): the one-kernel path
(runtime/shift_kernel.py, CUDA's) gives the torch path's integers, through the Triton
interpreter on the CPU (small and vectorized steps, padding, shifts across page ends) and
on a GPU (`-m gpu`)."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch

PAGE = 4


def _case(num_segments: int, tokens: int, pad: bool, seed: int):
    """Segments of a verify-like step: `tokens` tokens each (fewer for some, padded when
    `pad`), random page tables and starts, and accept lengths 0..tokens-1 to shift by."""
    from specserve.runtime.packing import Segment

    rng = random.Random(seed)
    segments = []
    for _ in range(num_segments):
        n = tokens if not pad else rng.randint(1, tokens)
        start = rng.randint(0, 30)
        pages = -(-(start + n + tokens) // PAGE)
        table = rng.sample(range(1, 200), pages)
        seg = Segment(table, start, [rng.randint(0, 99) for _ in range(n)], max_shift=tokens)
        seg.pad = tokens - n
        segments.append(seg)
    shift = torch.tensor([rng.randint(0, tokens - 1) for _ in segments], dtype=torch.int64)
    return segments, shift


CASES = {  # name: (segments, tokens each, padded)
    "verify-8x4": (8, 4, False),
    "verify-padded-16x4": (16, 4, True),
    "one-request": (1, 4, False),
    "vectorized-130x4": (130, 4, False),  # 520 tokens: pack's numpy branch
    "vectorized-padded-150x4": (150, 4, True),
}


def mismatches(device: str, seed: int = 0) -> list[str]:
    """Cases whose kernel path differs from the torch path in any integer pack returns."""
    import copy

    from specserve.runtime import packing

    out, chooser = [], packing.use_shift_kernel
    try:
        for name, (n, tokens, pad) in CASES.items():
            segments, shift = _case(n, tokens, pad, seed + len(name))
            dev = torch.device(device)
            results = []
            for kernel in (False, True):
                packing.use_shift_kernel = lambda _device, _k=kernel: _k
                ids, meta, last = packing.pack(copy.deepcopy(segments), PAGE, dev, shift.to(dev))
                tensors = (
                    ids,
                    meta.positions,
                    meta.slot_mapping,
                    meta.seq_lens,
                    meta.query_start_loc,
                    meta.block_tables,
                )
                results.append([t.cpu().tolist() for t in tensors] + [last])
            if results[0] != results[1]:
                out.append(name)
    finally:
        packing.use_shift_kernel = chooser
    return out


def run_cases() -> dict:
    from specserve.runtime import shift_kernel
    from tests.support.specialization_run import after_start_up

    # steps of 1-600 tokens, views at any offset
    return after_start_up(
        lambda: shift_kernel.warm_up(torch.device("cpu")), lambda: mismatches("cpu")
    )


# the interpreter run (module, seconds idle) whose results the `interpreter_results` fixture gives
INTERPRETER = ("tests.runtime.test_packing_shift", 300)


def test_interpreter_shift_kernel_gives_the_torch_path_integers(interpreter_results):
    assert interpreter_results["mismatches"] == []


def test_interpreter_no_step_compiles_a_variant_start_up_did_not(interpreter_results):
    # the step's tensors are views into one upload at any alignment, and its sizes vary
    assert interpreter_results["new_variants"] == []


def test_the_cases_shift_across_page_ends_and_pad():
    # the cases exercise what the kernel must get right: a position moved onto another
    # page, padding (slot 0, its segment's last position), and nonzero shifts
    from specserve.runtime.packing import pack

    crossed = padded = 0
    for name, (n, tokens, pad) in CASES.items():
        segments, shift = _case(n, tokens, pad, len(name))
        _, meta, last_rows = pack(segments, PAGE, torch.device("cpu"), shift)
        _, base, _ = pack(segments, PAGE, torch.device("cpu"), None)
        crossed += int(((meta.positions // PAGE) != (base.positions // PAGE)).sum())
        padded += sum(s.pad for s in segments)
        assert torch.equal(meta.seq_lens, base.seq_lens + shift)
        # padding repeats its own segment's last position, moved by that segment's shift
        for s, last in zip(segments, last_rows):
            rows = meta.positions[last + 1 : last + 1 + s.pad]
            assert torch.equal(rows, meta.positions[last].expand(s.pad))
            assert torch.all(meta.slot_mapping[last + 1 : last + 1 + s.pad] == 0)
    assert crossed > 0 and padded > 0


@pytest.mark.gpu
def test_gpu_shift_kernel_gives_the_torch_path_integers():
    assert mismatches("cuda") == []


if __name__ == "__main__":  # the interpreter run (TRITON_INTERPRET=1), see the fixture
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    sys.stdout.write("\n" + json.dumps(run_cases()) + "\n")
