"""The step loop: schedule, prepare, forward + sample, process."""

from __future__ import annotations

import itertools
import logging
import numbers
import random
import re
import threading
import time
import weakref
from dataclasses import replace

from specserve.core.config import EngineConfig
from specserve.core.detokenizer import IncrementalDetokenizer, TokenDecoder
from specserve.core.errors import InvalidRequestError, RequestTooLargeError, TensorParallelError
from specserve.core.kernel_options import current, using
from specserve.core.parallel import SINGLE_RANK
from specserve.core.prefix_cache import PrefixCache
from specserve.core.request import Request
from specserve.core.sampling_params import SamplingParams, engine_seed
from specserve.engine.builder import (
    build_kv_cache,
    build_speculator,
    build_target,
    capture_target_graphs,
    context_limit,
    eos_token_ids,
    load_target,
    start_speculator,
)
from specserve.engine.outputs import RequestOutput, RequestSink
from specserve.engine.scheduler import Scheduler
from specserve.engine.startup import StartupProgress
from specserve.engine.step_loop import StepLoop
from specserve.engine.step_plan import (
    MirrorSink,
    PlanChannel,
    PlanFollower,
    PlanPublisher,
    TokenCheck,
)
from specserve.model.llama import LlamaForCausalLM
from specserve.runtime.grammar import GrammarCompiler
from specserve.runtime.grammar_pool import default_workers

log = logging.getLogger("specserve")
# How gloo and NCCL say a collective's peer is gone (its connection closed, reset, timed out)
_PEER_GONE = re.compile(r"connection (closed|reset)|closed by peer|timed? ?out|NCCL", re.I)


class LLMEngine:
    """Loads a model and runs continuous-batching steps over the requests added to it."""

    def __init__(
        self,
        config: EngineConfig,
        progress: bool = False,
        tokenizer=None,
        model: LlamaForCausalLM | None = None,
        rank: int | None = None,
        address: str | None = None,
    ):
        """Load `config.load.model`, or serve a prebuilt `model` (benchmarks build random-weight
        models of real shapes on the GPU; without a tokenizer, prompts are token ids and
        outputs carry no text). `progress`: the start-up phases and their timings on stderr
        (engine/startup.py), else in the log. Under tensor parallelism the engine built
        without a `rank` is its machine's first rank and spawns the machine's others
        (engine/tensor_parallel.py), which build theirs with their `rank` and the group's
        `address`; every rank but 0 then `follow`s rank 0's plans."""
        self.config = config
        config.load.check_device()  # a missing GPU in one line, not deep inside the loading
        self.parallel = None
        self._plan_lock = threading.Lock()  # rank 0's steps and keep-alive plans, one a time
        self._keep_alive_stop = None
        self._interrupted = False  # a step raised (tensor parallelism: see `step`)
        self._broken: str | None = None  # why, when a keep-alive plan found a rank gone
        self._closed_group = False  # close() left the tensor-parallel group
        if config.parallel.tensor_parallel_size > 1:
            from specserve.engine import tensor_parallel

            self.parallel = tensor_parallel.start(config, rank, address)
            # an engine dropped without close() (garbage-collected) takes its ranks along
            self._drop_ranks = weakref.finalize(self, self.parallel.abort)
        rank = self.parallel.rank if self.parallel is not None else 0
        # (rank 0 decides the steps: its policy's trace is the one; written once, at close)
        self._trace_file = config.speculative.trace_file if rank == 0 else None
        # This engine's kernel switches: in force while its start-up and its steps run
        # (warm-up, selection, graph capture, eager steps), whatever other engines use; the
        # config's, and the process default's where the config names none (benchmarks A/B
        # the argmax and the staging kernel so).
        self.kernel_options = replace(
            current(), pdl=not config.execution.disable_pdl, stream_k=config.execution.gemv_stream_k
        )
        with using(self.kernel_options):
            try:
                self._start(config, progress, model, tokenizer, rank)
            except BaseException:
                if self.parallel is not None:  # the error stands; the other ranks stop
                    self.parallel.abort()
                raise

    def _start(self, config: EngineConfig, progress: bool, model, tokenizer, rank: int) -> None:
        startup = StartupProgress(progress)
        tp = self.parallel.tp if self.parallel is not None else SINGLE_RANK
        loaded = load_target(config, startup, progress, model, tokenizer, tp)
        self.source, self.model_config = loaded.source, loaded.model_config
        self.dtype, self.tokenizer = loaded.dtype, loaded.tokenizer
        self.kv = build_kv_cache(config, loaded, startup, progress, self.parallel)
        self.max_model_len = context_limit(config, self.model_config)
        self.scheduler = Scheduler(
            self.kv,
            config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )
        # The target's parts, which speculation is built from (it never sees this engine).
        self.target = build_target(config, loaded, self.kv, self.max_model_len, startup)
        self.runner, self.gemv_selector = self.target.runner, self.target.gemv_selector
        self.spec = build_speculator(self.target, startup)
        tuned = capture_target_graphs(self.target, self.spec, startup)  # (CUDA only)
        self.plan_tuning, self.verify_tiles = tuned.plan_tuning, tuned.verify_tiles
        if self.spec is not None:
            start_speculator(self.spec, self.target, startup)
            if rank > 0:  # rank 0's policy decides every step's draft lengths
                self.spec.follow()
        if not config.cache.disable_prefix_caching and rank == 0:  # (rank 0 lends all pages)
            successor = self.spec is not None and self.spec.proposer.reads_next_token
            self.scheduler.prefix = PrefixCache(self.kv, successor_bound=successor)
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer)
        self.runner.grammars = GrammarCompiler(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
        )
        self.runner.grammars.warm_up(self.kv.pool.device, self.runner.model.lm_head_weight.dtype)
        workers = config.execution.grammar_workers
        if workers is None:
            parallel = config.parallel  # (ranks on this machine share its cores)
            ranks_here = parallel.tensor_parallel_size // parallel.nnodes
            workers = default_workers(self.kv.pool.device, ranks_here)
        if self.tokenizer is not None:  # (started with the first grammar a request brings)
            self.runner.grammars.workers_on_first_use = workers
        # How ids become text, decided once for every request (core/detokenizer.py).
        self.token_decoder = TokenDecoder(self.tokenizer) if self.tokenizer is not None else None
        self.requests: dict[str, Request] = {}
        self._arrivals, self._rng = itertools.count(), random.Random(config.load.seed)
        self._ids = itertools.count()  # generated request ids
        # Where processed requests go: finished ones leave, every one gets its output.
        self.sink = RequestSink(self.scheduler, self.requests, self.spec)
        overlap = config.overlap_enabled()
        self.scheduler.overlap = overlap
        self.loop = StepLoop(self.scheduler, self.target, self.spec, self.sink, overlap)
        self.follower = self._connect_ranks(config, rank) if self.parallel else None
        startup.ready()

    def _connect_ranks(self, config: EngineConfig, rank: int) -> PlanFollower | None:
        """Tensor parallelism: rank 0 publishes each step's plan (and with the debug check its
        tokens); any other rank gets a follower of those plans, its outputs go nowhere."""
        channel = PlanChannel(self.parallel.control, rank)
        check = config.parallel.debug_check
        if rank == 0:
            plans = PlanPublisher(channel, self.runner.grammars.serialize)
            self.loop.plans = self.sink.plans = plans
            self.loop.token_check = self.loop.plans.resolved if check else None
            from specserve.engine import tensor_parallel

            self._keep_alive_stop = threading.Event()
            threading.Thread(
                target=tensor_parallel.keep_alive,
                args=(weakref.ref(self), self._keep_alive_stop),
                name="specserve-tp-keep-alive",
                daemon=True,
            ).start()
            return None
        tokens = TokenCheck(rank) if check else None
        follower = PlanFollower(channel, tokens)
        self.loop.token_check = tokens.local if check else None
        self.loop.sink = MirrorSink(follower, self.spec)
        return follower

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: send token ids", "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
        ids = list(prompt)
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("prompt token ids must be integers", "prompt")
        return [int(t) for t in ids]  # (numpy's as Python's)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Raises InvalidRequestError. The
        params are checked again here (SamplingParams.validate): a field changed after
        construction is refused as the constructor would refuse it."""
        params = params or SamplingParams()
        params.validate()
        if params.n != 1:
            raise InvalidRequestError(
                "an engine request is one choice (n = 1): LLM.generate and the server fan n "
                "out into requests",
                "n",
            )
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
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(
                f"logit_bias token ids must lie in [0, {vocab}); got {max(params.logit_bias)}",
                "logit_bias",
            )
        if params.stop and self.tokenizer is None:  # (no text to find them in)
            raise InvalidRequestError(
                "stop strings need the model's tokenizer and this engine has none: use "
                "stop_token_ids",
                "stop",
            )
        if params.grammar is not None:
            self.runner.grammars.compile(params.grammar)  # (cached for its matcher)
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        if len(ids) > self.kv.capacity_tokens:
            raise RequestTooLargeError(
                f"the prompt ({len(ids)} tokens) needs more KV cache than the whole cache "
                f"holds ({self.kv.capacity_tokens} tokens); shorten it or enlarge the cache",
                "prompt",
            )
        if total > self.kv.capacity_tokens:
            raise RequestTooLargeError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{total} tokens of KV cache but the whole cache holds "
                f"{self.kv.capacity_tokens}; lower max_tokens or enlarge the cache",
                "max_tokens",
            )
        if request_id is None:  # (one the caller did not name: never one it did)
            request_id = f"req-{next(self._ids)}"
            while request_id in self.requests:
                request_id = f"req-{next(self._ids)}"
        elif request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "id")
        seed = engine_seed(params.seed) if params.seed is not None else self._rng.getrandbits(62)
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            arrival=next(self._arrivals),
            seed=seed,
            max_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            detokenizer=(
                IncrementalDetokenizer(
                    self.tokenizer, ids, params.stop, self.token_decoder, params.min_tokens
                )
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
        overlap scheduling these are the previous step's (engine/step_loop.py).

        Under tensor parallelism a step whose collectives fail because a rank is gone says
        which rank and how it ended (TensorParallelError); a step that raised leaves the
        other ranks perhaps inside its collectives, so later steps are refused (their
        collectives would pair with the wrong ones: a hang, or a plan read from tensor
        bytes) and `close` stops the ranks rather than sending them plans; and a step
        that never ends (a rank hung) ends this process after STEP_TIMEOUT_S
        (engine/tensor_parallel.py)."""
        parallel = self.parallel
        if parallel is None:
            if self._closed_group:  # (its collectives' group is gone: they would fail)
                raise TensorParallelError("this tensor-parallel engine is closed")
            with using(self.kernel_options):
                return self.loop.step()
        with self._plan_lock:  # (the keep-alive thread's plans go between steps)
            if self._interrupted:  # the other ranks may wait inside it: no step pairs up
                raise TensorParallelError(
                    self._broken
                    or "a tensor-parallel step of this engine was interrupted (its ranks may "
                    "be inside its collectives): close() it and start another"
                )
            return self._parallel_step(parallel, self.loop.step)

    def _parallel_step(self, parallel, run):
        parallel.step_began()
        try:
            with using(self.kernel_options):
                return run()
        except BaseException as e:
            self._interrupted = True
            # (a collective's error, or the plan channel's: is a rank gone?)
            failed = isinstance(e, (RuntimeError, TensorParallelError))
            lost = parallel.lost_rank() if failed else None
            if lost is not None:
                raise TensorParallelError(f"{lost}; this engine cannot go on") from e
            raise
        finally:
            parallel.step_ended()

    def keep_alive(self, idle_s: float) -> None:
        """Rank 0 under tensor parallelism: a plan of no step to the other ranks if none
        went out for `idle_s` and no step runs (engine/tensor_parallel.py `keep_alive`)."""
        if not self._plan_lock.acquire(blocking=False):
            return  # a step, a close: plans go out anyway
        try:
            parallel, plans = self.parallel, self.loop.plans
            if parallel is None or plans is None or self._interrupted:
                return
            if time.monotonic() - plans.channel.last_sent < idle_s:
                return
            try:
                self._parallel_step(parallel, plans.keep_alive)
            except Exception as e:  # the next step says it
                self._broken = f"{e}" if isinstance(e, TensorParallelError) else None
                log.warning("tensor-parallel keep-alive failed: %s", e)
        finally:
            self._plan_lock.release()

    # ---- tensor parallelism ------------------------------------------------------------
    def follow(self) -> None:
        """A rank > 0: replay rank 0's step plans until it stops the group. A collective
        that fails (rank 0 or another rank gone) ends it with a TensorParallelError, as a
        plan that cannot be received does: one line, not a traceback."""
        follower = self.follower
        try:
            with using(self.kernel_options):
                while True:
                    plan = follower.next()
                    if plan.stop:
                        break
                    if plan.drain or plan.keep_alive:
                        follower.batch(plan)  # (its requests that left)
                        if plan.drain:
                            self.loop.drain()
                        continue
                    batch, drafting = follower.batch(plan)
                    self.loop.replay(batch, drafting, plan.keeps_drafter, plan.waited, plan.late)
                self.loop.drain()
        except RuntimeError as e:
            if not _PEER_GONE.search(str(e)):
                raise  # (a failure of this rank's own: its traceback)
            raise TensorParallelError(
                f"rank {self.parallel.rank} lost the tensor-parallel group (another rank "
                f"exited?): {e}"
            ) from e
        self.parallel.close()

    def close(self) -> None:
        """Release what outlives a step: the grammar workers, if any; under tensor
        parallelism, stop the other ranks (rank 0) and leave the process groups; write the
        speculation policy's trace where `--speculative-trace-file` asks. Idempotent."""
        trace_file, self._trace_file = self._trace_file, None
        if trace_file and self.spec is not None:
            self.spec.write_trace(trace_file)
        self.runner.grammars.close()  # (its workers, if any)
        if self._keep_alive_stop is not None:
            self._keep_alive_stop.set()
        with self._plan_lock:  # (not between a keep-alive plan and its end)
            self._close_ranks()

    def _close_ranks(self) -> None:
        parallel, self.parallel = self.parallel, None
        if parallel is None:
            return
        self._closed_group = True
        self._drop_ranks.detach()
        plans = self.loop.plans
        self.loop.plans = self.sink.plans = None
        if plans is None:  # (a rank > 0: rank 0 stops it)
            parallel.close()
            return
        if self._interrupted:  # the other ranks may wait inside the step that raised
            parallel.abort()
            return
        parallel.step_began()  # (a rank that hangs now ends this process too)
        try:
            self.loop.drain()
            plans.stop()
        except Exception as e:  # (a rank gone: stop the rest, leave the group)
            log.warning("tensor-parallel ranks did not stop cleanly (%s); stopping them", e)
            parallel.abort()
            return
        finally:
            parallel.step_ended()
        parallel.close()

    def queue_lengths(self) -> dict:
        """Requests running and waiting (the part of `stats` admission reads)."""
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting)}

    def stats(self) -> dict:
        return {
            **self.queue_lengths(),
            "kv_pages_used": self.kv.allocator.num_used,
            "kv_pages_total": self.kv.allocator.num_usable,
            "preemptions": self.scheduler.num_preemptions,
            **self._prefix_stats(),
            "steps": self.num_steps,
            "overlap_schedule": self.loop.overlap,
            **self.loop.stats(),
            **(self.spec.stats() if self.spec else {}),
        }

    def _prefix_stats(self) -> dict:
        prefix = self.scheduler.prefix
        if prefix is None:
            return {}
        return {
            "prefix_cache_queried_tokens": prefix.queried_tokens,
            "prefix_cache_hit_tokens": prefix.hit_tokens,
            "prefix_cache_pages": prefix.num_pages,
            "prefix_cache_idle_pages": self.kv.allocator.num_idle,
            "prefix_cache_evictions": self.kv.allocator.num_evictions,
        }
