"""The step loop: schedule, prepare, forward + sample, process."""

from __future__ import annotations

import itertools
import logging
import random

from specserve.core.config import EngineConfig
from specserve.core.detokenizer import IncrementalDetokenizer, TokenDecoder
from specserve.core.errors import InvalidRequestError, RequestTooLargeError
from specserve.core.kv_cache import KVCache
from specserve.core.request import Request
from specserve.core.sampling_params import SamplingParams
from specserve.engine.kv_sizing import kv_cache_pages
from specserve.engine.outputs import RequestOutput, RequestSink
from specserve.engine.scheduler import Scheduler
from specserve.engine.startup import StartupProgress
from specserve.engine.step_loop import StepLoop
from specserve.layers import pdl
from specserve.layers.attention import get_backend
from specserve.model.llama import LlamaForCausalLM
from specserve.model.loader import load_config, load_model, load_tokenizer, resolve_model
from specserve.runtime import packing
from specserve.runtime.model_runner import ModelRunner
from specserve.speculative.speculator import Speculator
from specserve.speculative.target import TargetParts

log = logging.getLogger("specserve")


class LLMEngine:
    """Loads a model and runs continuous-batching steps over the requests added to it."""

    def __init__(
        self,
        config: EngineConfig,
        progress: bool = False,
        tokenizer=None,
        model: LlamaForCausalLM | None = None,
    ):
        """Load `config.model`, or serve a prebuilt `model` (benchmarks build random-weight
        models of real shapes on the GPU; without a tokenizer, prompts are token ids and
        outputs carry no text). `progress`: the start-up phases and their timings on stderr
        (engine/startup.py), else in the log."""
        self.config = config
        config.check_device()  # a missing GPU in one line, not deep inside the loading
        device = config.torch_device()
        startup = StartupProgress(progress)
        # Process-wide: every Triton launch from now on (warm-up, graph capture, eager steps).
        pdl.set_enabled(not config.disable_pdl)
        if model is None:
            self.source = resolve_model(config.model, config.load_format)
            with startup.phase(f"loading {self.source.name} on {device}"):
                self.model_config = load_config(self.source)
                self.dtype = config.torch_dtype(self.model_config.dtype)
                self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.source)
                model = load_model(
                    self.source, self.dtype, device, progress, self.model_config, seed=config.seed
                )
        else:
            self.source, self.model_config = None, model.config
            self.dtype = model.lm_head_weight.dtype
            self.tokenizer = tokenizer
        num_pages = kv_cache_pages(config, self.model_config, self.dtype, device)
        self.kv = KVCache(self.model_config, num_pages, config.page_size, self.dtype, device)
        if progress:
            startup.note(
                f"{str(self.dtype).removeprefix('torch.')} weights; KV cache: "
                f"{num_pages} pages of {config.page_size} tokens"
            )
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        if device.type == "cuda" and config.backend_name() == "triton":
            from specserve.layers.gemv_select import GemvSelector
            from specserve.layers.linear import use_gemv
            from specserve.layers.triton_ops import use_triton_ops

            # fused RMSNorm / rotary / SiLU-and-mul (same rounding); with fusion, SiLU and the
            # down projection's split-K pass also fold into their neighbours (same results)
            use_triton_ops(model, fuse=not config.disable_fusion)
            # Decode-sized linears: cuBLAS or a Triton GEMV, whichever this GPU runs faster
            # per shape (measured now; the drafter shares the selector's measurements).
            if not config.disable_gemv:
                from specserve.layers.gemv_configs import set_stream_k

                set_stream_k(config.gemv_stream_k)  # for this engine's selection and tuning
                k_max = config.speculative_num_steps if config.speculative_algorithm else 0
                batch = min(config.max_num_seqs, config.cuda_graph_max_batch)
                self.gemv_selector = GemvSelector(
                    max_rows=batch * (k_max + 1),
                    max_requests=batch,
                    batch_invariant=not config.disable_batch_invariance,
                )
                with startup.phase("choosing GEMV kernels (timed on this GPU)"):
                    use_gemv(model, self.gemv_selector)
        self.runner = ModelRunner(model, self.kv, get_backend(config.backend_name()))
        self.runner.backend.batch_invariant = not config.disable_batch_invariance
        if device.type == "cuda":  # compile every attention variant now, not mid-serving
            with startup.phase("compiling attention kernels"):
                self.runner.backend.warm_up(self.model_config.num_heads, self.kv.layers[0])
        # What speculation is built from (it never sees this engine).
        self.target = TargetParts(
            config,
            self.model_config,
            self.dtype,
            self.kv,
            self.runner,
            self.max_model_len,
            getattr(self, "gemv_selector", None),
        )
        self.spec = None
        if config.speculative_algorithm:
            with startup.phase(f"setting up the {config.speculative_algorithm} drafter"):
                self.spec = Speculator(self.target)
        if self.spec is not None and packing.use_shift_kernel(device):
            from specserve.runtime import shift_kernel

            shift_kernel.warm_up(device)  # (overlapped steps after drafting ones shift)
        self.plan_tuning = None  # what whole-step GEMV tuning changed (CUDA graphs only)
        self.verify_tiles = None  # the verify steps' own GEMV tiles (runtime/verify_tiles.py)
        if device.type == "cuda" and not config.disable_cuda_graph:
            self.runner.graphs = self._capture_graphs(startup)
        if self.spec is not None:
            policy = config.speculative_policy
            with startup.phase(
                "timing steps for the goodput policy"
                if policy == "goodput"
                else f"setting up the {policy} policy"
            ):
                self.spec.start(self.target)
        tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | frozenset(
            [tokenizer_eos] if tokenizer_eos is not None else []
        )
        # How ids become text, decided once for every request (engine/detokenizer.py).
        self.token_decoder = TokenDecoder(self.tokenizer) if self.tokenizer is not None else None
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._rng = random.Random(config.seed)
        # Where processed requests go: finished ones leave, every one gets its output.
        self.sink = RequestSink(self.scheduler, self.requests, self.spec)
        self.loop = StepLoop(
            self.scheduler,
            self.runner,
            self.spec,
            self.sink,
            max_model_len=self.max_model_len,
            overlap=config.overlap_enabled(),
        )
        startup.ready()

    def _capture_graphs(self, startup: StartupProgress):
        """Capture decode and verify graphs for every batch bucket and draft length."""
        from specserve.runtime.cuda_graphs import CudaGraphRunner, engine_graph_shapes

        k_max = self.config.speculative_num_steps if self.spec else 0
        buckets, tokens_per_request = engine_graph_shapes(self.config)  # (kv_cache sizes for them)
        graphs = CudaGraphRunner(
            self.runner.model,
            self.kv.layers,
            self.runner.backend,
            buckets,
            tokens_per_request=tokens_per_request,
            max_seq_len=self.max_model_len,
            aux_layer_ids=self.spec.aux_layer_ids if self.spec else (),
            # EAGLE-3's feature projection and store write inside each graph: a step that
            # does not draft is one replay, as a plain one.
            feature_writer=self.spec.proposer.feature_writer() if self.spec else None,
            # the logits and their greedy tokens inside each graph: a greedy decode step
            # launches nothing more to sample (model_runner.sample_async)
            logits_head=lambda hidden: self.runner.model.compute_logits(hidden, fp32=False),
        )
        plan = getattr(self.runner.model, "gemv_plan", None)
        if plan is not None and plan.choices and not self.config.disable_gemv_tuning:
            # the selection's choices revised where the whole step runs faster
            from specserve.layers.gemv_select import SHARED_ROWS, plan_candidates
            from specserve.runtime.plan_tuning import tune_engine_plan

            with startup.phase("tuning GEMV kernels in whole steps"):
                self.plan_tuning = tune_engine_plan(
                    graphs,
                    plan,
                    plan_candidates(self.kv.layers[0][0].device, plan.torch_varies),
                    SHARED_ROWS,
                    verify_tokens=k_max + 1,
                )
            if k_max and plan.by_requests and not self.config.disable_verify_tiles:
                # verify steps of up to SHARED_ROWS requests: faster tiles, same bits
                from specserve.runtime.verify_tiles import tune_engine_verify_tiles

                with startup.phase("searching verify-step kernels"):
                    self.verify_tiles = tune_engine_verify_tiles(
                        graphs, plan, SHARED_ROWS, k_max + 1
                    )
        with startup.phase("capturing CUDA graphs"):
            report = graphs.capture()
        log.info(
            "captured %d CUDA graphs in %.1f s (warm-up %.1f s, first replays %.2f s), graph "
            "memory %.1f MiB",
            report.num_graphs,
            report.capture_s,
            report.warmup_s,
            report.first_replay_s,
            report.graph_pool_bytes / 2**20,
        )
        return graphs

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: send token ids", "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        return list(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises InvalidRequestError."""
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty; send at least one token", "prompt")
        vocab = self.model_config.vocab_size
        if any(not (0 <= t < vocab) for t in ids):
            raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab})", "prompt")
        if len(ids) >= self.max_model_len:
            raise RequestTooLargeError(
                f"the prompt has {len(ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens, so prompts must be shorter than that",
                "prompt",
            )
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        if total > self.kv.capacity_tokens:
            raise RequestTooLargeError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{total} tokens of KV cache but the whole cache holds "
                f"{self.kv.capacity_tokens}; lower max_tokens or enlarge the cache",
                "max_tokens",
            )
        request_id = request_id or f"req-{next(self._arrivals)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "id")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            arrival=next(self._arrivals),
            seed=seed & ((1 << 62) - 1),
            max_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            detokenizer=(
                IncrementalDetokenizer(self.tokenizer, ids, params.stop, self.token_decoder)
                if self.tokenizer is not None
                else None
            ),
            prompt=prompt if isinstance(prompt, str) else None,
        )
        self.requests[request_id] = req
        self.scheduler.add(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            req.finish_reason = "abort"
            self.sink.finish(req)

    @property
    def num_steps(self) -> int:
        """Target forwards run so far."""
        return self.loop.num_steps

    def has_unfinished(self) -> bool:
        """Requests queued or running, or a step still in flight (overlap scheduling)."""
        return self.scheduler.has_work or self.loop.inflight is not None

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of every request that produced a token. Under
        overlap scheduling these are the previous step's (engine/step_loop.py)."""
        return self.loop.step()

    def stats(self) -> dict:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_pages_used": self.kv.allocator.num_used,
            "kv_pages_total": self.kv.allocator.num_usable,
            "preemptions": self.scheduler.num_preemptions,
            "steps": self.num_steps,
            "overlap_schedule": self.loop.overlap,
            **self.loop.stats(),
            **(self.spec.stats() if self.spec else {}),
        }
