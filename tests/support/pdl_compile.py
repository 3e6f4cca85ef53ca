"""Compiles every Triton kernel of the decode path for a Hopper GPU (sm_90) on a machine
without one, with programmatic dependent launch on and off, and reads the PTX: the
interpreter never runs the `if USE_PDL:` branches, so this is where they are checked.

Run as `python -m tests.support.pdl_compile` without TRITON_INTERPRET (tests/kernels/test_pdl.py
does): launches are intercepted instead of run (JITFunction.run records them), PDL is forced on
for the CPU tensors the launchers get, and each recorded launch is compiled through
triton.compile for GPUTarget("cuda", 90, 32). Prints one JSON line: per launch, where in
the PTX the first griddepcontrol.wait, launch_dependents, global load / store / async
copy and L2 prefetch are (line numbers, None when absent), and which loads come before the
wait.
"""

from __future__ import annotations

import json
import re
import sys

import torch

LAUNCHES: list[tuple] = []  # (label, JITFunction, args, kwargs)
_LABEL = ["?"]
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl")
_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int64: "i64",
    torch.int32: "i32",
}
MARKS = {
    "wait": ("griddepcontrol.wait",),
    "launch": ("griddepcontrol.launch_dependents",),
    "load": ("ld.global", "cp.async", "cp.reduce", "atom.global"),
    "store": ("st.global", "red.global"),
    "prefetch": ("prefetch.global",),
}


def compiled_in_subprocess(args: list[str], seconds: float) -> dict:
    """The JSON line `python -m ARGS` prints last, run without TRITON_INTERPRET (so kernels
    compile for the GPU target instead of being interpreted) from the repository root, in
    about `seconds` on an idle machine (interpreter_run.child_timeout)."""
    import os
    import subprocess

    from tests.support.interpreter_run import ROOT, child_timeout

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=child_timeout(seconds),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compile_launch(fn, args, kwargs):
    """The kernel a recorded launch (`LAUNCHES`) compiles to for sm_90: its `asm["ptx"]`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
    source = ASTSource(fn, *_signature(fn, args, kwargs))
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _record() -> None:
    from triton.runtime.jit import JITFunction

    def run(self, *args, grid, warmup, **kwargs):
        LAUNCHES.append((_LABEL[0], self, args, kwargs))

    JITFunction.run = run


def _signature(fn, args, kwargs) -> tuple[dict, dict, dict]:
    """What Triton's JIT would compile the launch under: types, constexprs (integer 1s
    too) and 16-divisibility of aligned pointers and integers, unless not specialized on."""
    bound = dict(zip(fn.arg_names, args)) | {k: v for k, v in kwargs.items() if k not in _OPTIONS}
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = bound[p.name] if p.name in bound else p.default
        specialize = not p.do_not_specialize
        aligned = specialize and not p.do_not_specialize_on_alignment
        if p.is_constexpr or (specialize and type(value) is int and value == 1):
            signature[p.name], constexprs[p.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = "*" + _TYPES[value.dtype]
            if aligned and value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[p.name] = "i1"
        elif isinstance(value, int):
            signature[p.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if aligned and value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[p.name] = "fp32"
    return signature, constexprs, attrs


def _marks(ptx: str) -> dict:
    # instructions, less a guarding predicate ("@%p1 ld.global.b32 ...")
    lines = [re.sub(r"^@!?%p\d+\s+", "", line.strip()) for line in ptx.splitlines()]
    marks = {
        name: next((i for i, line in enumerate(lines) if line.startswith(pats)), None)
        for name, pats in MARKS.items()
    }
    # the distinct loads (opcodes) before the wait, if any
    before = lines[: marks["wait"]] if marks["wait"] is not None else []
    marks["loads_before_wait"] = sorted(
        {line.split()[0] for line in before if line.startswith(MARKS["load"])}
    )
    return marks


def _instructions(ptx: str) -> list[str]:
    """The PTX's instructions with every register written %_ (two kernels that compute
    alike allocate registers differently), labels, directives and comments dropped; what
    is left is the operations, their order, types and immediates (shuffle offsets...)."""
    out = []
    for line in ptx.splitlines():
        line = line.strip()
        if line and not line.startswith(("//", ".", "$", "{", "}")):
            out.append(re.sub(r"%(rd|rs|r|fd|f|p|hh|h)\d+", "%_", line.split("//")[0]).strip())
    return out


def norm_tail_matches(use_pdl: bool, rows: int, n: int) -> bool:
    """Whether the fused split-K + add + RMSNorm kernel, from its barrier on, runs the
    instructions the add + RMSNorm kernel runs from its first load on (same reduction
    order: the same bits on the GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specserve.kernels import pdl
    from specserve.kernels.gemv import GemvConfig, gemv
    from specserve.layers.triton_ops import add_rms_norm, split_k_add_rms_norm

    LAUNCHES.clear()
    pdl.active = lambda device: use_pdl
    bf16 = dict(dtype=torch.bfloat16)
    x, w = torch.zeros(rows, 1024, **bf16), torch.zeros(n, 1024, **bf16)
    r, norm_w, cfg = torch.zeros(rows, n, **bf16), torch.ones(n, **bf16), GemvConfig(64, 128, 4)
    split_k_add_rms_norm(gemv(x, w, None, cfg, defer_reduce=True), r, norm_w, 1e-5)
    add_rms_norm(gemv(x, w, None, cfg), r, norm_w, 1e-5)
    code = {}
    for _, fn, args, kwargs in LAUNCHES:
        signature, constexprs, attrs = _signature(fn, args, kwargs)
        options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
        kernel = triton.compile(
            ASTSource(fn, signature, constexprs, attrs),
            target=GPUTarget("cuda", 90, 32),
            options=options,
        )
        code[fn.__name__] = _instructions(kernel.asm["ptx"])
    fused, plain = code["_split_k_add_rms_norm_kernel"], code["_add_rms_norm_kernel"]
    first_load = next(i for i, ins in enumerate(plain) if "ld.global" in ins)
    barrier = next(i for i, ins in enumerate(fused) if ins.startswith("bar.sync"))
    tail = fused[barrier + 1 :]
    start = next(i for i, ins in enumerate(tail) if "ld.global" in ins)
    return tail[start:] == plain[first_load:]


def _launch_all() -> None:
    """Every launcher of the decode path on small CPU tensors of bf16 (the GPU's dtype)."""
    from specserve.kernels.attention import triton_kernels as attn
    from specserve.kernels.gemv import GemvConfig, RopeStore, gemv
    from specserve.layers.triton_ops import (
        add_rms_norm,
        rms_norm,
        rotary,
        rotary_store_kv,
        silu_and_mul,
        split_k_add_rms_norm,
    )

    bf16, i64 = dict(dtype=torch.bfloat16), dict(dtype=torch.int64)
    x, w = torch.zeros(2, 512, **bf16), torch.zeros(256, 512, **bf16)
    runs = {
        "gemv-dot": lambda: gemv(x, w, None, GemvConfig(32, 128)),
        "gemv-fma-bias": lambda: gemv(x, w, w[0], GemvConfig(8, 256, use_dot=False)),
        "gemv-dot-split-silu": lambda: gemv(
            torch.zeros(2, 1024, **bf16), w, None, GemvConfig(64, 128, split_k=2), silu=True
        ),
        "split-k-add-rms-norm": lambda: split_k_add_rms_norm(
            gemv(x, w, None, GemvConfig(64, 128, split_k=2), defer_reduce=True),
            torch.zeros(2, 256, **bf16),
            torch.ones(256, **bf16),
            1e-5,
        ),
        "rms-norm": lambda: rms_norm(x, torch.ones(512, **bf16), 1e-5),
        "add-rms-norm": lambda: add_rms_norm(x, x, torch.ones(512, **bf16), 1e-5),
        "silu-and-mul": lambda: silu_and_mul(x, x),
    }
    pos, cos_sin = torch.zeros(2, **i64), torch.zeros(16, 64, dtype=torch.float32)
    cache = torch.zeros(4, 16, 2, 64, **bf16)
    runs["rotary"] = lambda: rotary(
        pos, torch.zeros(2, 4, 64, **bf16), torch.zeros(2, 2, 64, **bf16), cos_sin
    )
    runs["rotary-store-kv"] = lambda: rotary_store_kv(
        pos, torch.zeros(2, 512, **bf16), cos_sin, 4, 2, cache, cache, pos
    )
    qkv_w = torch.zeros(512, 512, **bf16)  # 4 q heads and 2 + 2 kv heads of 64
    rope = RopeStore(pos, pos, cos_sin, 4, 2, cache, cache)
    runs["gemv-dot-rope"] = lambda: gemv(x, qkv_w, None, GemvConfig(64, 128), rope=rope)
    runs["gemv-dot-rope-bias"] = lambda: gemv(x, qkv_w, qkv_w[0], GemvConfig(32, 64), rope=rope)
    x64 = torch.zeros(64, 512, **bf16)
    runs["gemv-stream-k-bias"] = lambda: gemv(
        x64, w, w[0], GemvConfig(64, 128, block_m=64, stream_k=True)
    )
    runs["gemv-stream-k-silu"] = lambda: gemv(
        torch.zeros(64, 1024, **bf16),
        w,
        None,
        GemvConfig(32, 64, block_m=64, stream_k=True),
        silu=True,
    )
    runs["gemv-stream-k-gated"] = lambda: gemv(
        x64, w, None, GemvConfig(32, 64, block_m=64, stream_k=True), gated=True
    )
    runs["kv-write"] = lambda: attn.write_kv(
        torch.zeros(2, 2, 64, **bf16), torch.zeros(2, 2, 64, **bf16), cache, cache, pos
    )
    meta = (pos, torch.tensor([0, 1, 2]), torch.ones(2, **i64), torch.zeros(2, 4, **i64))
    q = torch.zeros(2, 4, 64, **bf16)
    for kernel in attn.DECODE_KERNELS:
        runs[f"attention-{kernel}-split"] = lambda kernel=kernel: attn.paged_attention(
            q, cache, cache, *meta, 1, 1.0, num_splits=2, kernel=kernel
        )

    for label, launch in runs.items():
        _LABEL[0] = label
        launch()


def main() -> dict:
    from specserve.kernels import pdl

    _record()
    results: dict = {}
    for mode in ("pdl", "plain"):
        LAUNCHES.clear()
        use_pdl = mode == "pdl"
        pdl.active = lambda device, on=use_pdl: on  # the CPU tensors' launches, as on an H200
        _launch_all()
        for label, fn, args, kwargs in LAUNCHES:
            name = f"{label}/{fn.__name__}/{mode}"
            try:
                kernel = compile_launch(fn, args, kwargs)
                results[name] = {
                    **_marks(kernel.asm["ptx"]),
                    "use_pdl": _signature(fn, args, kwargs)[1]["USE_PDL"],
                    "launch_pdl": kwargs.get("launch_pdl", False),
                }
            except Exception as e:  # reported per launch by the test
                results[name] = f"{type(e).__name__}: {e}"[:2000]
    for use_pdl in (True, False):
        for rows, n in ((1, 4096), (5, 576)):
            name = f"norm-tail/{'pdl' if use_pdl else 'plain'}/m{rows}-n{n}"
            try:
                results[name] = norm_tail_matches(use_pdl, rows, n)
            except Exception as e:
                results[name] = f"{type(e).__name__}: {e}"[:2000]
    return results


if __name__ == "__main__":
    sys.stdout.write("\n" + json.dumps(main()) + "\n")
