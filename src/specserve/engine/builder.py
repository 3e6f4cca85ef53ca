"""An engine's start-up, in the order it runs: load the target, size its KV cache, set up its
kernels and runner, build the speculator, capture (and tune) CUDA graphs, start the policy.
Each step is one function; LLMEngine.__init__ calls them in turn."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specserve.core.config import EngineConfig
from specserve.core.errors import ConfigError
from specserve.core.kv_cache import KVCache
from specserve.core.model_config import ModelConfig
from specserve.core.parallel import SINGLE_RANK, TensorParallel
from specserve.engine.kv_sizing import kv_cache_pages
from specserve.engine.startup import StartupProgress
from specserve.layers.attention import get_backend
from specserve.model.llama import LlamaForCausalLM
from specserve.model.loader import load_config, load_model, load_tokenizer, resolve_model
from specserve.runtime import packing, verify
from specserve.runtime.model_runner import ModelRunner
from specserve.speculative.registry import check_drafter
from specserve.speculative.speculator import Speculator
from specserve.speculative.target import TargetParts

log = logging.getLogger("specserve")


@dataclass
class LoadedTarget:
    """The target model as loaded (or handed in): where from (None: prebuilt), its config,
    dtype, tokenizer (None: prompts are token ids) and modules."""

    source: object | None
    model_config: ModelConfig
    dtype: torch.dtype
    tokenizer: object | None
    model: LlamaForCausalLM


def load_target(
    config: EngineConfig,
    startup: StartupProgress,
    progress: bool,
    model: LlamaForCausalLM | None,
    tokenizer,
    tp: TensorParallel = SINGLE_RANK,
) -> LoadedTarget:
    """`config.load.model` loaded on its device (under tensor parallelism, this rank's shard
    of it), or the prebuilt `model` as it is; a drafter made for another target is refused
    before the weights load (`check_drafter`)."""
    if model is not None:
        check_drafter(config, model.config, tokenizer)
        return LoadedTarget(None, model.config, model.lm_head_weight.dtype, tokenizer, model)
    device = config.load.torch_device()
    source = resolve_model(config.load.model, config.load.format)
    with startup.phase(f"loading {source.name} on {device}"):
        model_config = load_config(source)
        dtype = config.load.torch_dtype(model_config.dtype)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source)
        if tp.rank == 0:  # (one rank says it)
            check_drafter(config, model_config, tokenizer)
        model = load_model(
            source, dtype, device, progress, model_config, seed=config.load.seed, tp=tp
        )
    return LoadedTarget(source, model_config, dtype, tokenizer, model)


def build_kv_cache(
    config: EngineConfig,
    loaded: LoadedTarget,
    startup: StartupProgress,
    progress: bool,
    parallel=None,
) -> KVCache:
    """The target's paged KV cache, sized by engine/kv_sizing.py (under tensor parallelism
    the same number of pages on every rank: the fewest any rank's memory allows)."""
    device = config.load.torch_device()
    kv_cfg = loaded.model.kv_config  # this rank's KV heads
    num_pages = kv_cache_pages(config, loaded.model_config, loaded.dtype, device, kv_cfg)
    if parallel is not None:
        num_pages = parallel.min_over_ranks(num_pages)
    if num_pages < 2:
        raise ConfigError(
            f"the KV cache holds {num_pages} page(s); it needs at least 2 (page 0 is scratch): "
            "raise kv_cache_bytes or num_kv_pages"
        )
    kv = KVCache(kv_cfg, num_pages, config.cache.page_size, loaded.dtype, device)
    if progress:
        startup.note(
            f"{str(loaded.dtype).removeprefix('torch.')} weights; KV cache: "
            f"{num_pages} pages of {config.cache.page_size} tokens"
        )
    return kv


def context_limit(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest sequence served: --max-model-len within the model's positions."""
    positions = model_config.max_position_embeddings
    asked = config.scheduler.max_model_len
    if asked is not None and asked > positions:
        raise ConfigError(
            f"max_model_len {asked} is past this model's context ({positions} positions)"
        )
    return asked or positions


def set_up_kernels(config: EngineConfig, model: LlamaForCausalLM, startup: StartupProgress):
    """On CUDA with the Triton backend: the fused Triton ops, and decode-sized linears through
    cuBLAS or a Triton GEMV, whichever this GPU runs faster per shape (measured now). Returns
    the GEMV selector (the drafter reuses its measurements), or None."""
    if config.load.torch_device().type != "cuda" or config.backend_name() != "triton":
        return None
    from specserve.layers.triton_ops import use_triton_ops
    from specserve.tuning.gemv_select import GemvSelector, use_gemv

    # fused RMSNorm / rotary / SiLU-and-mul (same rounding); with fusion, SiLU and the
    # down projection's split-K pass also fold into their neighbours (same results)
    use_triton_ops(model, fuse=not config.execution.disable_fusion)
    if config.execution.disable_gemv:
        return None
    k_max = config.speculative.num_steps if config.speculative.algorithm else 0
    batch = min(config.scheduler.max_num_seqs, config.execution.cuda_graph_max_batch)
    selector = GemvSelector(
        max_rows=batch * (k_max + 1),
        max_requests=batch,
        batch_invariant=not config.execution.disable_batch_invariance,
    )
    with startup.phase("choosing GEMV kernels (timed on this GPU)"):
        use_gemv(model, selector)
    return selector


def build_target(
    config: EngineConfig,
    loaded: LoadedTarget,
    kv: KVCache,
    max_model_len: int,
    startup: StartupProgress,
) -> TargetParts:
    """The target's kernels set up (`set_up_kernels`) and its runner over the configured
    attention backend (on CUDA every attention variant compiled now, not mid-serving): the
    parts speculation is built from."""
    selector = set_up_kernels(config, loaded.model, startup)
    runner = ModelRunner(loaded.model, kv, get_backend(config.backend_name()))
    runner.backend.batch_invariant = not config.execution.disable_batch_invariance
    if config.load.torch_device().type == "cuda":
        with startup.phase("compiling attention and sampling kernels"):
            runner.backend.warm_up(loaded.model.num_heads, kv.layers[0])  # (this rank's)
            from specserve.kernels import counter_noise  # (a kernel module: CUDA only)

            counter_noise.warm_up(kv.pool.device, loaded.model_config.vocab_size)
    return TargetParts(
        config, loaded.model_config, loaded.dtype, kv, runner, max_model_len, selector
    )


def build_speculator(target: TargetParts, startup: StartupProgress) -> Speculator | None:
    """The speculator of --speculative-algorithm (its proposer built; its policy starts
    once graphs are captured, `start_speculator`), or None."""
    config = target.config
    if not config.speculative.algorithm:
        return None
    with startup.phase(f"setting up the {config.speculative.algorithm} drafter"):
        spec = Speculator(target)
    device = config.load.torch_device()
    if packing.use_shift_kernel(device):
        from specserve.runtime import shift_kernel

        shift_kernel.warm_up(device)  # (overlapped steps after drafting ones shift)
    if spec.simulate_rate is not None and device.type == "cuda":  # every K's verification
        from specserve.kernels import counter_noise

        vocab = target.model_config.vocab_size
        counter_noise.warm_up(device, vocab, spec.k_max, verify.SIMULATE_OFFSET)
    return spec


def start_speculator(spec: Speculator, target: TargetParts, startup: StartupProgress) -> None:
    """Build the policy now that the target runs as it will serve (goodput times steps)."""
    policy = target.config.speculative.policy
    what = (
        "timing steps for the goodput policy"
        if policy == "goodput"
        else f"setting up the {policy} policy"
    )
    with startup.phase(what):
        spec.start(target)


@dataclass
class CapturedGraphs:
    """The target's CUDA graphs and what start-up tuning changed on the way (None: not run):
    the whole-step GEMV tuning and the verify steps' own tiles."""

    graphs: object
    plan_tuning: object | None = None
    verify_tiles: object | None = None


def capture_target_graphs(
    target: TargetParts, spec: Speculator | None, startup: StartupProgress
) -> CapturedGraphs:
    """On CUDA (unless disabled): decode and verify graphs for every batch bucket and draft
    length, installed in the runner, after the GEMV plan's choices are revised in whole
    steps and verify steps get their own tiles."""
    from specserve.runtime.cuda_graphs import CudaGraphRunner
    from specserve.runtime.graph_shapes import engine_graph_shapes, engine_mixed_shapes

    config, runner, kv = target.config, target.runner, target.kv
    if config.load.torch_device().type != "cuda" or config.execution.disable_cuda_graph:
        return CapturedGraphs(None)
    k_max = config.speculative.num_steps if spec else 0
    buckets, q_lens = engine_graph_shapes(config)  # (KV sizing reserves for them)
    mixed_requests, mixed_tokens = (
        engine_mixed_shapes(config) if runner.backend.mixed_graphs else ((), ())
    )
    graphs = CudaGraphRunner(
        runner.model,
        kv.layers,
        runner.backend,
        buckets,
        q_lens=q_lens,
        max_seq_len=target.max_model_len,
        aux_layer_ids=spec.aux_layer_ids if spec else (),
        # EAGLE-3's feature projection and store write inside each graph: a step that
        # does not draft is one replay, as a plain one.
        feature_writer=spec.feature_writer() if spec else None,
        # the logits and their greedy tokens inside each graph: a greedy decode step
        # launches nothing more to sample (model_runner.sample_async)
        logits_head=lambda hidden: runner.model.compute_logits(hidden, fp32=False),
        # steps carrying prefill chunks: graphs by (requests, tokens)
        mixed_requests=mixed_requests,
        mixed_tokens=mixed_tokens,
    )
    out = CapturedGraphs(graphs)
    plan = getattr(runner.model, "gemv_plan", None)
    # Whole-step tuning decides on each rank's own clock how many steps to time next; under
    # tensor parallelism the ranks' steps (and their collectives) would stop pairing up.
    tunes = not config.execution.disable_gemv_tuning and config.parallel.tensor_parallel_size == 1
    if plan is not None and plan.choices and tunes:
        # the selection's choices revised where the whole step runs faster
        from specserve.tuning.gemv_select import SHARED_ROWS, plan_candidates
        from specserve.tuning.plan_tuning import tune_engine_plan

        candidates = plan_candidates(kv.layers[0][0].device, plan.torch_varies)
        with startup.phase("tuning GEMV kernels in whole steps"):
            out.plan_tuning = tune_engine_plan(
                graphs, plan, candidates, SHARED_ROWS, verify_tokens=k_max + 1
            )
        if k_max and plan.by_requests and not config.execution.disable_verify_tiles:
            # verify steps of up to SHARED_ROWS requests: faster tiles, same bits
            from specserve.tuning.verify_tiles import tune_engine_verify_tiles

            with startup.phase("searching verify-step kernels"):
                out.verify_tiles = tune_engine_verify_tiles(graphs, plan, SHARED_ROWS, k_max + 1)
    with startup.phase("capturing CUDA graphs"):
        report = graphs.capture()
    runner.graphs = graphs
    log.info(
        "captured %d CUDA graphs in %.1f s (warm-up %.1f s, first replays %.2f s), graph "
        "memory %.1f MiB",
        report.num_graphs,
        report.capture_s,
        report.warmup_s,
        report.first_replay_s,
        report.graph_pool_bytes / 2**20,
    )
    return out


def eos_token_ids(model_config: ModelConfig, tokenizer) -> frozenset[int]:
    """The model's EOS ids and the tokenizer's."""
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    extra = [tokenizer_eos] if tokenizer_eos is not None else []
    return frozenset(model_config.eos_token_ids) | frozenset(extra)
