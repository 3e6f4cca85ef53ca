"""The counter-based noise kernels (kernels/counter_noise.py) against the torch path bit for
bit: uniforms for any seed, counter and width, and greedy verification under simulated
acceptance (accept lengths and tokens) for uniform and short drafts. Under the Triton
interpreter on the CPU (a subprocess, tests/support/interpreter_run.py) and, on a GPU, through
the dispatchers (`hash_uniform`, `verify_greedy`) as the engine calls them."""

from __future__ import annotations

import pytest
import torch

from specserve.layers.sampler import hash_uniform, hash_uniform_torch
from specserve.runtime.verify import SIMULATE_OFFSET


def _seeds_and_counters(rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=gen, dtype=torch.int64)
    seeds[:1] = 0
    seeds[1:2] = -1  # all bits set
    counters = torch.randint(0, 1 << 20, (rows,), generator=gen, dtype=torch.int64)
    return seeds, counters


def _verify_case(rows: int, k: int, rate: float, short: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    seeds, positions = _seeds_and_counters(rows, seed)
    drafts = torch.randint(0, 1000, (rows, k), generator=gen, dtype=torch.int64)
    choice = torch.randint(0, 1000, (rows, k + 1), generator=gen, dtype=torch.int64)
    lens = torch.randint(0, k + 1, (rows,), generator=gen, dtype=torch.int64) if short else None
    return seeds, positions, lens, drafts, choice


def _reference_verify(seeds, positions, lens, drafts, choice, rate):
    """verify_greedy's torch path (the CPU's) with these greedy choices."""
    from specserve.runtime.verify import verify_greedy

    logits = torch.zeros(*choice.shape, 1)  # (only its shape is read: the choice is given)
    out = verify_greedy(logits, drafts, lens, seeds, positions, rate, choice)
    return out.tokens, out.accept_len


VERIFY_CASES = [
    (rows, k, rate, short)
    for rows, k in ((1, 1), (5, 3), (33, 5), (4, 16))
    for rate in (0.0, 0.55, 0.9, 1.0)
    for short in (False, True)
]


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> str | None:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype}{tuple(a.shape)} against {b.dtype}{tuple(b.shape)}"
    if not torch.equal(a, b):
        return f"{int((a != b).sum())} of {a.numel()} differ"
    return None


VOCAB, K_MAX = 4100, 3  # (what start-up warms: the vocabulary's width, every K to K_MAX)


def _view(values: torch.Tensor, offset: int) -> torch.Tensor:
    """`values` as a view `offset` elements into a larger buffer (as a step's inputs are
    views into its uploads): at offset 1 not 16-byte aligned."""
    buffer = torch.zeros(values.numel() + offset, dtype=values.dtype)
    buffer[offset:] = values.reshape(-1)
    return buffer[offset:].view(values.shape)


def serving_mismatches() -> list[str]:
    """Calls as serving makes them after start-up, each against the torch path: rows of
    any count, inputs at any alignment, every K up to K_MAX with and without draft lengths,
    uniforms of one column and of the vocabulary. Returns the calls that differed."""
    from specserve.kernels.counter_noise import simulated_verify, uniform_noise

    out = []
    for offset in (0, 1, 3):
        for rows, width in ((1, 1), (6, 1), (3, VOCAB), (8, VOCAB)):
            seeds, counters = _seeds_and_counters(rows, width + offset)
            got = uniform_noise(_view(seeds, offset), _view(counters, offset), width)
            if _mismatch(got, hash_uniform_torch(seeds, counters, width)):
                out.append(f"uniform-{rows}x{width}@{offset}")
        for rows in (1, 5):
            for k in range(1, K_MAX + 1):
                for short in (False, True):
                    rate = 1 if offset == 3 else 0.6  # (an int rate: the same variant)
                    case = _verify_case(rows, k, rate, short, rows * 10 + k + offset)
                    views = [None if x is None else _view(x, offset) for x in case]
                    tokens, accept = simulated_verify(*views, rate, SIMULATE_OFFSET)
                    ref_tokens, ref_accept = _reference_verify(*case, rate)
                    if _mismatch(accept, ref_accept) or _mismatch(tokens, ref_tokens):
                        out.append(f"verify-{rows}x{k}-{short}@{offset}")
    return out


def run_cases() -> dict:
    """Under the interpreter: {case: None, or what differed}, and "serving": start-up's
    warm-up, then serving's calls (`serving_mismatches`, the variants they compiled)."""
    from specserve.kernels import counter_noise
    from specserve.kernels.counter_noise import simulated_verify, uniform_noise
    from tests.support.specialization_run import after_start_up

    results = {
        "serving": after_start_up(
            lambda: counter_noise.warm_up(torch.device("cpu"), VOCAB, K_MAX, SIMULATE_OFFSET),
            serving_mismatches,
        )
    }
    for rows, width in ((1, 1), (7, 5), (3, 2048), (2, 4100), (0, 9)):
        seeds, counters = _seeds_and_counters(rows, width)
        results[f"uniform-{rows}x{width}"] = _mismatch(
            uniform_noise(seeds, counters, width), hash_uniform_torch(seeds, counters, width)
        )
    for rows, k, rate, short in VERIFY_CASES:
        case = _verify_case(rows, k, rate, short, rows * 100 + k)
        tokens, accept = simulated_verify(*case, rate, SIMULATE_OFFSET)
        ref_tokens, ref_accept = _reference_verify(*case, rate)
        name = f"verify-{rows}x{k}-{rate}-{'short' if short else 'uniform'}"
        results[name] = _mismatch(accept, ref_accept) or _mismatch(tokens, ref_tokens)
    return results


def compile_cases() -> dict:
    """{kernel: its sm_90 PTX's 64-bit shifts and multiplies}, or why it did not compile
    (tests/support/pdl_compile.py's machinery: launches recorded, then compiled)."""
    import re

    from specserve.kernels.counter_noise import simulated_verify, uniform_noise
    from tests.support import pdl_compile as pc

    pc._record()  # launches recorded, not run
    seeds, counters = _seeds_and_counters(4, 0)
    uniform_noise(seeds, counters, 4100)
    for short in (True, False):
        simulated_verify(*_verify_case(4, 3, 0.5, short, 0), 0.5, SIMULATE_OFFSET)
    results = {}
    for i, (_, fn, args, kwargs) in enumerate(pc.LAUNCHES):
        try:
            ptx = pc.compile_launch(fn, args, kwargs).asm["ptx"]
            ops = {line.split()[0] for line in pc._instructions(ptx)}
            results[f"{fn.__name__}/{i}"] = sorted(
                op for op in ops if re.match(r"(shr|mul\.lo)\.", op)
            )
        except Exception as e:  # reported per kernel by the test
            results[f"{fn.__name__}/{i}"] = f"{type(e).__name__}: {e}"[:2000]
    return results


def test_kernels_compile_for_sm90_with_unsigned_shifts():
    """Compiled for sm_90 in a subprocess (the interpreter computes in numpy): the hash's
    right shifts are logical (shr.u64, not the arithmetic shr.s64 a signed value gets) and
    its 64-bit multiplies keep the low bits (wrapping, as torch's int64 products)."""
    from tests.support.pdl_compile import compiled_in_subprocess

    pytest.importorskip("triton")
    compiled = compiled_in_subprocess(["tests.kernels.test_counter_noise", "compile"], 120)
    # the uniforms, then simulated verification with draft lengths and without
    names = ["_uniform_kernel/0", "_simulated_verify_kernel/1", "_simulated_verify_kernel/2"]
    assert list(compiled) == names, compiled
    for name, ops in compiled.items():
        assert isinstance(ops, list), f"{name} did not compile: {ops}"
        assert "shr.u64" in ops and "shr.s64" not in ops, (name, ops)
        assert any(op.startswith("mul.lo.") and op.endswith("64") for op in ops), (name, ops)


INTERPRETER = ("tests.kernels.test_counter_noise", 30)


@pytest.mark.parametrize(
    "name",
    ["uniform-1x1", "uniform-7x5", "uniform-3x2048", "uniform-2x4100", "uniform-0x9"]
    + [
        f"verify-{rows}x{k}-{rate}-{'short' if short else 'uniform'}"
        for rows, k, rate, short in VERIFY_CASES
    ],
)
def test_interpreter_equals_torch(name, interpreter_results):
    assert interpreter_results[name] is None, interpreter_results[name]


def test_interpreter_serving_compiles_no_variant_start_up_did_not(interpreter_results):
    """After `warm_up` (engine start-up: the vocabulary's uniforms, simulated verification
    at every K), serving's calls (inputs that are views at any alignment, any row count)
    compile no new variant and give the torch path's results."""
    serving = interpreter_results["serving"]
    assert serving["mismatches"] == [], serving["mismatches"]
    assert serving["new_variants"] == [], serving["new_variants"]


def test_simulated_acceptance_reaches_every_length():
    """The reference the kernel is held to draws accept lengths over 0..K at a middle rate,
    none at rate 0 and all at rate 1 (so equal results above are not trivially equal)."""
    case = _verify_case(256, 3, 0.6, False, 1)
    _, accept = _reference_verify(*case, 0.6)
    assert set(accept.tolist()) == {0, 1, 2, 3}
    assert _reference_verify(*case, 0.0)[1].eq(0).all()
    assert _reference_verify(*case, 1.0)[1].eq(3).all()


@pytest.mark.gpu
def test_gpu_dispatchers_equal_torch():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from specserve.runtime.verify import verify_greedy

    seeds, counters = _seeds_and_counters(64, 3)
    for width in (1, 3, 49152):
        got = hash_uniform(seeds.cuda(), counters.cuda(), width).cpu()
        assert _mismatch(got, hash_uniform_torch(seeds, counters, width)) is None
    for rows, k, rate, short in VERIFY_CASES:
        case = _verify_case(rows, k, rate, short, rows + k)
        seeds, positions, lens, drafts, choice = case
        logits = torch.zeros(*choice.shape, 1, device="cuda")
        out = verify_greedy(
            logits,
            drafts.cuda(),
            None if lens is None else lens.cuda(),
            seeds.cuda(),
            positions.cuda(),
            rate,
            choice.cuda(),
        )
        ref_tokens, ref_accept = _reference_verify(*case, rate)
        assert _mismatch(out.accept_len.cpu(), ref_accept) is None
        assert _mismatch(out.tokens.cpu(), ref_tokens) is None


if __name__ == "__main__":  # the interpreter run (TRITON_INTERPRET=1) or the sm_90 compile
    from tests.support.interpreter_run import module_main

    module_main(run_cases, compile_cases)
