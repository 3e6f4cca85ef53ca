"""Which Triton kernel variants serving would compile after start-up, found on the CPU.

Run as `python -m tests.support.specialization_run` with TRITON_INTERPRET=1
(tests/support/interpreter_run.py does): every kernel launch records the key Triton's JIT
would compile it under (kernel, constexpr values, warps and stages, and for each argument: an
integer's type, i32 or i64, and where it is specialized on its class, 1 / multiple of 16 /
other; a tensor's dtype and, where it is specialized on, whether its address is 16-byte
aligned). A tiny Llama with a random EAGLE-3 head is set up as the
GPU start-up sets it up (fused ops, attention warm-up for target and head), warmed up like
the benchmarks, then serves batch-1 requests of varied prompt lengths at fixed K, a request
that runs plain for longer than the drafter's catch-up bound before drafting again, and a
batch of 8. Prints one JSON line: the keys first seen after start-up, each with its call
site.
"""

from __future__ import annotations

import inspect
import json
import random
import tempfile
import traceback
from pathlib import Path

import torch

KEYS: dict[tuple, str] = {}


def _int_type(value: int) -> str:
    """Triton's type of an integer argument: i64 past the 32-bit range (part of the key even
    where the value is not specialized on)."""
    return "i32" if -(2**31) <= value < 2**31 else "i64"


def _arg_class(value, align_matters: bool, specialized: bool = True):
    if isinstance(value, torch.Tensor):
        aligned = value.data_ptr() % 16 == 0 if align_matters and specialized else None
        return (str(value.dtype), aligned)
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not specialized:
            return _int_type(value)
        return 1 if value == 1 else (_int_type(value), 16 if value % 16 == 0 else "int")
    return type(value).__name__


def _call_site() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "specserve" in f.filename]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-3:][::-1])


def install() -> None:
    """Record every interpreted kernel launch's compile key in KEYS."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        params = list(inspect.signature(self.fn).parameters.values())
        dns = set(self.kwargs.get("do_not_specialize") or ())
        dns_align = set(self.kwargs.get("do_not_specialize_on_alignment") or ())
        bound = dict(zip([p.name for p in params], args)) | kwargs
        parts = []
        for i, p in enumerate(params):
            value = bound.get(p.name, p.default)
            if "constexpr" in str(p.annotation):
                parts.append((p.name, value))
            else:  # (not specialized on: still its type, an integer's width included)
                specialized = p.name not in dns and i not in dns
                align = p.name not in dns_align and i not in dns_align
                parts.append((p.name, _arg_class(value, align, specialized)))
        launch = (kwargs.get("num_warps", 4), kwargs.get("num_stages", 3))
        key = (self.fn.__name__, tuple(parts), launch)
        KEYS.setdefault(key, _call_site())
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


def after_start_up(warm_up, mismatches) -> dict:
    """A host-side kernel's interpreter run (TRITON_INTERPRET=1): `warm_up()` as engine
    start-up calls it, then `mismatches()` (its cases against the torch path, a list of
    names). Returns {"mismatches": ..., "new_variants": the compile keys the cases needed
    that start-up did not compile}; an exception's text as the mismatches."""
    install()  # records each launch's compile key (what Triton's JIT would compile)
    try:
        warm_up()
        startup = set(KEYS)
        found = mismatches()
        return {"mismatches": found, "new_variants": [repr(k) for k in KEYS if k not in startup]}
    except Exception as e:  # reported by the test
        return {"mismatches": f"{type(e).__name__}: {e}", "new_variants": []}


def _prompt(rng, n):
    return [rng.randrange(3, 384) for _ in range(n)]


def _start(folder: Path, policy: str):
    """An engine set up as on the GPU, minus CUDA graphs and GEMV selection."""
    from specserve import LLM
    from specserve.layers.triton_ops import use_triton_ops
    from tests.support.tiny_models import make_random_eagle3_head, make_tiny_model

    target = make_tiny_model(folder / "target", "llama", num_layers=4)
    head = make_random_eagle3_head(folder / "head", target, 200)
    llm = LLM(
        str(target),
        attention_backend="triton",
        speculative_algorithm="eagle3",
        speculative_draft_model_path=str(head),
        speculative_policy=policy,
        speculative_num_steps=3,
        max_num_seqs=8,
        dtype="float32",
    )
    engine = llm.engine
    proposer = engine.spec.proposer
    use_triton_ops(engine.runner.model)
    use_triton_ops(proposer.head)
    engine.runner.backend.warm_up(engine.model_config.num_heads, engine.kv.layers[0])
    proposer.backend.warm_up(proposer.head.config.layer.num_heads, proposer.kv.layers[0])
    return llm


def main(full: bool = False) -> None:
    """Start up, serve the workload (`full`: longer prompts and plain stretches, like the GPU
    runs; the test's is shorter but meets the same parities of token and request counts)."""
    from specserve import SamplingParams
    from specserve.speculative.policy import SpeculationPolicy

    install()
    rng = random.Random(0)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        llm = _start(Path(tmp), "fixed")
        llm.generate([_prompt(rng, 64)], greedy)  # the benchmarks' warm-up request
        startup = set(KEYS)

        lengths = (5, 17, 33, 130, 251, 480) if full else (5, 17, 130)
        plain = 140 if full else 20  # full: longer than the catch-up bound (CATCH_UP_STEPS)
        for n in lengths:  # batch 1, one after another, fixed K=3
            llm.generate([_prompt(rng, n)], greedy)

        class PlainThenDraft(SpeculationPolicy):
            """K=0 for longer than the catch-up bound, then K=3 (as goodput switches)."""

            steps = 0

            def choose(self, reqs, load=None):
                self.steps += 1
                return [0 if self.steps <= plain else 3] * len(reqs)

        engine = llm.engine
        engine.spec.policy = PlainThenDraft(engine.spec.k_max)
        llm.generate(
            [_prompt(rng, 40)],
            SamplingParams(max_tokens=plain + 10, temperature=0.0, ignore_eos=True),
        )
        engine.spec.policy = PlainThenDraft(engine.spec.k_max)
        engine.spec.policy.steps = plain + 1
        llm.generate([_prompt(rng, n) for n in (3, 9, 16, 31, 47, 64, 77, 100)], greedy)
    new = [
        {"kernel": k[0], "key": repr(k[1:]), "site": site}
        for k, site in KEYS.items()
        if k not in startup
    ]
    print(json.dumps({"startup": len(startup), "new": new}))


if __name__ == "__main__":
    import sys

    main(full="--full" in sys.argv)
