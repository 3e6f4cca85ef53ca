"""The whole-engine GPU bench's A/B engines (benchmarks/gpu_engine.py): what each
`--ab-FLAG` changes in its engines, and `--ab-plan`'s forcing of GEMV plan choices."""

from __future__ import annotations

import torch

# --ab-FLAG: (the configuration's label, what changes in it, the help text's "with ...")
AB_VARIANTS = {
    "argmax": (
        "torch argmax",
        {"argmax": "off"},
        "with the Triton row argmax switched off (kernels/triton_argmax.py: torch's)",
    ),
    "tuning": (
        "GEMV plan untuned",
        {"disable_gemv_tuning": True},
        "with the selection's GEMV plan as measured (no whole-step tuning)",
    ),
    "head": (
        "logits after the graph",
        {"head": False},
        "with the target's graphs recaptured without the logits head",
    ),
    "gate": (
        "SiLU-and-mul kernel",
        {"gate": False},
        "with SiLU-and-mul kept out of the gate/up GEMV's epilogue",
    ),
    "rope": (
        "rotary kernel",
        {"rope": False},
        "with rotary and the K/V store kept out of the qkv GEMV's epilogue",
    ),
    "rope64": (
        "rope epilogue at 64 rows",
        {"rope_max_block_m": 64},
        "with the rope epilogue offered to 32- and 64-row qkv tiles too",
    ),
    "late_metadata": (
        "metadata after the wait",
        {"early_metadata": False},
        "with decode attention reading its metadata only after its PDL wait",
    ),
    "invariance": (
        "batch variant",
        {"disable_batch_invariance": True},
        "with --disable-batch-invariance (cuBLAS where it rounds rows apart, "
        "verify steps by row count, attention chunks by program count)",
    ),
    "attn_chunks": (
        "attention chunks by program count",
        {"attn_chunks": False},
        "with attention's fixed chunks off alone (the GEMV rule kept)",
    ),
    "attn_min_chunk": (
        "attention chunks of 128+ keys",
        {"attn_min_chunk": 128},
        "with batch-invariant attention chunks of at least 128 keys (4 blocks) "
        "instead of one block",
    ),
    "verify_tiles": (
        "verify tiles off",
        {"disable_verify_tiles": True},
        "with verify steps of up to 16 requests on their decode tiles at every "
        "row count (--disable-verify-tiles)",
    ),
    "norm_after": (
        "GEMV keys timed alone",
        {"norm_after": False},
        "with the plain GEMV keys of norm-feeding projections timed without the "
        "norm after them (gemv_select.NORM_AFTER off, as before session 18)",
    ),
    "stream_k": (
        "stream-K candidates",
        {"gemv_stream_k": True},
        "with the stream-K GEMV tiles among the candidates above 16 rows "
        "(--gemv-stream-k, experimental)",
    ),
}


def force_plan(specs) -> callable:
    """Until the returned function is called: every engine built serves the GEMV plan keys
    in `specs` ("rows,n,k:bn,bk,split,warps,stages", bf16 matrix-unit tiles of the rows'
    block) with those tiles, set once whole-step tuning has revised the plan start-up
    selected (each engine selects its own plan; its graphs are captured after)."""
    if not specs:
        return lambda: None
    from specserve.kernels.gemv import GemvConfig, row_block
    from specserve.kernels.gemv_plan import SHARED_ROWS
    from specserve.tuning import plan_tuning

    forced = []
    for spec in specs:
        shape, tile = spec.split(":")
        rows, n, k = map(int, shape.split(","))
        if rows <= SHARED_ROWS:  # one choice serves those buckets together
            raise SystemExit(f"--ab-plan forces row buckets above {SHARED_ROWS} only: {spec}")
        bn, bk, split, warps, stages = map(int, tile.split(","))
        cfg = GemvConfig(bn, bk, split, warps, stages, True, row_block(rows))
        forced.append(((rows, n, k, torch.bfloat16), cfg))
    tune = plan_tuning.tune_engine_plan

    def tune_then_force(graphs, plan, *args, **kwargs):
        report = tune(graphs, plan, *args, **kwargs)
        for key, cfg in forced:
            if key not in plan.choices:
                raise SystemExit(f"--ab-plan: the plan has no key {key}")
            plan.set_config([key], cfg, tuned=False)
        return report

    plan_tuning.tune_engine_plan = tune_then_force

    def restore() -> None:
        plan_tuning.tune_engine_plan = tune

    return restore
