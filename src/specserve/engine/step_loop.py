"""The step loop, synchronous or overlapped (shared/DESIGN.md invariant 7).

A step is launched (schedule, propose, prepare, forward, sample: device work queued, the
drawn tokens copied to pinned host memory behind an event), then resolved (the host reads
the tokens: committed and cached lengths, drafter state), then processed (stop checks,
detokenization, outputs, statistics). The synchronous loop does all three in one call.

The overlap loop launches step N+1 before it processes step N, and in the common cases
before N's tokens reach the host at all (engine/overlap_wait.py). The host counts N as one
token per sampled request (`Request.num_inflight`; its pages cover all of N's drafts being
accepted) and builds N+1 from N's results on the device (runtime/inflight.py):

- N+1's input token for a request of N is N's last drawn token (the bonus), gathered there.
- After a speculative N, a request is packed as if N accepted nothing and moved right by
  N's accept length on the device: positions, KV slots, seq_lens and sampling counters.
  Host bounds (max_seq_len, page tables, the context limit, draft lengths capped by what
  can still be committed) hold for every accept length.
- The EAGLE-3 drafter (greedy, one draft length for the step) catches up on N's tokens
  there and on N's features in its feature store (written by N's forward, by KV slot): N's
  K+1 rows are fed, it drafts from the row of N's accept length, and the rows past it write
  KV that is overwritten before it is read (as rejected drafts' is). Its drafts stay on the
  device and go into N+1's verify inputs there.
- The host's drafter and cached lengths follow the same count (N as one token); when N is
  resolved, its accepted drafts are added (to the drafter's length only for requests whose
  drafter caught up on N's rows: `InflightStep.consumed`).

Otherwise (a proposer drafting on the host: n-gram, draft model; sampled requests that
draft; mixed draft lengths; a position that could pass the context) the loop waits for
N's tokens (resolve), settles the batch on them (requests they end by length, stop token or
EOS leave it; draft lengths shrink to what can still be committed), then drafts and
launches. Rows whose logits change by N's tokens on the host (penalties, a grammar's masks,
a pending min_tokens after a speculative N) need them only to sample: N+1's forward is
queued first, then N is resolved (its tokens come before that forward on the stream) and
the changes are made while the forward runs. Either way N is processed while N+1 runs.

Stop conditions are therefore found one step late: a request that finished in step N may
already be in step N+1, whose tokens for it are dropped. Its pages are freed (on finish,
abort or preemption) while step N+1 may still write them; that is safe because every step
runs on one device stream in launch order: a page lent again is written by its new owner only
in a later step, after the stale writes, and the new owner reads only positions it wrote.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

import torch

from specserve.core.batch import ScheduledRequest
from specserve.engine.launched_step import LaunchedStep, StepTimes, step_kind
from specserve.engine.overlap_wait import sampling_reason, settle, wait_reason
from specserve.engine.step_plan import PlanPublisher
from specserve.runtime.prompt_logprobs import prompt_logprobs

if TYPE_CHECKING:
    from specserve.engine.outputs import RequestOutput, RequestSink
    from specserve.engine.scheduler import Scheduler
    from specserve.speculative.speculator import Speculator
    from specserve.speculative.target import TargetParts


class StepLoop:
    """Runs an engine's steps over its scheduler, the target's runner and the speculator
    (None: plain decoding), handing processed requests to `sink`; `overlap` keeps one step
    in flight between calls."""

    def __init__(
        self,
        scheduler: Scheduler,
        target: TargetParts,
        spec: Speculator | None,
        sink: RequestSink,
        overlap: bool,
    ):
        self.scheduler, self.runner, self.spec, self.sink = scheduler, target.runner, spec, sink
        self.overlap = overlap
        self.num_steps = 0  # steps launched (target forwards)
        self.num_resolved = 0  # steps whose tokens reached the host
        self.plans: PlanPublisher | None = None  # rank 0 under tensor parallelism
        # under tensor parallelism with the debug check: compares each step's tokens across
        # ranks (engine/step_plan.py: TokenCheck)
        self.token_check = None
        self.inflight: LaunchedStep | None = None
        # (the step in flight, its outputs) when it was processed inside the next launch,
        # while the grammar workers filled that step's masks (`_launch`)
        self._early: tuple[LaunchedStep, list[RequestOutput]] | None = None
        self.times = StepTimes()
        self._timed = target.kv.pool.device.type == "cuda"
        self._last_end = None  # CUDA event: end of the last processed step's device work
        self._idle = True
        self.num_waits = 0  # steps launched only after the previous step's tokens were read
        self.wait_reasons: Counter[str] = Counter()  # why (`wait_reason`) -> steps
        # Running totals (ms) for metrics: device spans of steps (CUDA events; none on the
        # CPU), idle device gaps between back-to-back steps, host waits for drawn tokens.
        self.totals = {"device_step_ms": 0.0, "device_gap_ms": 0.0, "host_wait_ms": 0.0}
        # Host time of the steps by part (ms; waits for drawn tokens are host_wait_ms):
        # scheduling, drafting, preparing the inputs, queueing the forward, sampling (logit
        # changes and grammar masks in), processing the tokens.
        self.host_ms: Counter[str] = Counter()
        # Steps by kind (`step_kind`: decode-only or carrying prefill, and the step's K) and
        # their summed time (ms): device spans on CUDA, host time (drafting's included)
        # elsewhere.
        self.kind_steps: Counter[str] = Counter()
        self.kind_ms: Counter[str] = Counter()

    def step(self) -> list[RequestOutput]:
        """Launch the next step; process the previous one (overlap) or this one (sync)."""
        prev, self.inflight = self.inflight, None
        t0 = time.perf_counter()
        batch = self._schedule()
        self.host_ms["schedule"] += (time.perf_counter() - t0) * 1e3
        drafting = self._drafting(batch)
        reason = late = None
        if prev is not None and prev.result is None:
            counts = self.scheduler.counts
            reason = wait_reason(prev, batch, drafting, counts, self.spec)
            if reason is None:
                late = sampling_reason(prev, batch, counts)
        if late is not None:  # launched now; the step in flight is read before sampling
            self.wait_reasons[f"{late}_before_sampling"] += 1
        if reason is not None:
            # Scheduled while step N runs (pages grown for all of its drafts); this step
            # cannot be built from N's results on the device: wait for them, then settle.
            self.num_waits += 1
            self.wait_reasons[reason] += 1
            self._resolve(prev)
            batch = settle(batch)
            drafting = self._drafting(batch)
        keeps_drafter = self.spec is not None and self.spec.keeps_drafter
        if self.plans is not None:  # tensor parallelism: every other rank replays it
            self.plans.publish(batch, drafting, keeps_drafter, reason is not None, late is not None)
        waited = reason is not None or late is not None
        return self._run(prev, batch, drafting, keeps_drafter, late is not None, waited)

    def replay(
        self,
        batch: list[ScheduledRequest],
        drafting: list[ScheduledRequest],
        keeps_drafter: bool,
        waited: bool,
        late: bool = False,
    ) -> list[RequestOutput]:
        """A step that rank 0 planned (engine/step_plan.py), on this rank's mirrors of its
        requests: the same launch, in the same order, as rank 0's (`waited`: the step in
        flight resolved before it, `late`: before it samples)."""
        prev, self.inflight = self.inflight, None
        if waited and prev is not None and prev.result is None:
            self._resolve(prev)
        return self._run(prev, batch, drafting, keeps_drafter, late, waited or late)

    def _run(
        self, prev, batch, drafting, keeps_drafter: bool, late: bool = False, waited: bool = False
    ) -> list[RequestOutput]:
        """Launch the step (`late`: resolving `prev` before it samples; `waited`: launched
        after waiting for its tokens) and process one."""
        launched = self._launch(prev, batch, drafting, keeps_drafter, late, waited)
        if self.overlap:
            self.inflight, done = launched, prev
        else:
            done = launched
        if done is None:
            return []
        early, self._early = self._early, None
        if early is not None and early[0] is done:  # processed while the masks were filled
            return early[1]
        return self._process_counted(done)

    def _process_counted(self, step: LaunchedStep) -> list[RequestOutput]:
        """`_process`, its host time counted (waits apart)."""
        t0, waited = time.perf_counter(), self.totals["host_wait_ms"]
        outputs = self._process(step)
        waited = self.totals["host_wait_ms"] - waited
        self.host_ms["process"] += (time.perf_counter() - t0) * 1e3 - waited
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Process the step in flight, if any, without launching another; returns its
        outputs. The next step starts on an idle device (no gap recorded before it): for
        callers that time decoding from a settled state, e.g. after prefill."""
        prev, self.inflight = self.inflight, None
        self._idle = True
        if self.plans is not None and prev is not None:  # the other ranks drain too
            self.plans.drain()
        return self._process(prev) if prev is not None else []

    # ---- launch ---------------------------------------------------------------------------
    def _schedule(self):
        spec = self.spec
        return self.scheduler.schedule(spec.scheduling_policy if spec else None)

    def _drafting(self, batch: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """The requests the proposer runs for: drafting, or catching the drafter up (not
        when the policy never drafts or is dormant: the drafter's state would not be read
        soon)."""
        spec = self.spec
        if spec is None or not spec.may_draft:
            return []
        if not spec.keeps_drafter:
            if not self.scheduler.drafted:  # (plain decoding, the drafter dormant)
                return []
            return [s for s in batch if s.draft_len > 0]
        idle = [s for s in batch if s.decoding and not s.draft_len]
        riding = spec.proposer.ride_alongs([s.request for s in idle])
        riders = {id(s) for s, rides in zip(idle, riding) if rides}
        return [s for s in batch if s.draft_len > 0 or id(s) in riders]

    def stats(self) -> dict:
        """Loop figures for metrics: steps launched after waiting for the previous step's
        tokens, in all and by reason; the host's time by part (`host_ms`); processed steps
        and their time by kind (`step_kind`); running totals of device and wait times
        (`totals`)."""
        return {
            "loop_waits": self.num_waits,
            "loop_wait_reasons": dict(self.wait_reasons),
            "host_ms_by_part": dict(self.host_ms),
            "steps_by_kind": dict(self.kind_steps),
            "step_ms_by_kind": dict(self.kind_ms),
            **self.totals,
        }

    def _launch(
        self,
        prev: LaunchedStep | None,
        batch,
        drafting,
        keeps_drafter: bool,
        late: bool,
        waited: bool = False,
    ) -> LaunchedStep | None:
        spec = self.spec
        if not batch:
            self._idle = True
            return None
        self.num_steps += 1
        inflight = prev.inflight() if prev is not None and prev.result is None else None
        # Device timeline: a step starts with its first real work (drafting, else the
        # forward), so host work that leaves the device idle counts in the gap before it.
        events = self._events()
        t0 = time.perf_counter()
        if drafting:
            if events is not None:
                events[0].record()
            if inflight is not None:
                spec.proposer.propose(drafting, inflight)
            else:
                spec.proposer.propose(drafting)
        t1 = time.perf_counter()
        runner = self.runner
        step_input = runner.prepare(batch, inflight, self.scheduler.counts.constrained > 0)
        tp = time.perf_counter()
        if events is not None:
            if not drafting:  # the step starts with the forward: before its event
                events[0].record()
            events[1].record()
        hidden, aux = runner.forward(step_input, spec.aux_layer_ids if spec else ())
        tf = time.perf_counter()
        if late and prev is not None and prev.result is None:  # queued before this forward
            self._resolve(prev)  # (logit changes read them: sampling_reason)
        ts = time.perf_counter()
        if self.overlap and prev is not None and prev.result is not None:
            if runner.start_masks(step_input):
                # The grammar workers fill this step's masks (runtime/grammar_pool.py): the
                # step in flight is processed meanwhile, not after this step's sampling
                # (its time is the process part's, not the sample part's).
                tm = time.perf_counter()
                self._early = (prev, self._process_counted(prev))
                ts += time.perf_counter() - tm
        sampled = runner.sample_async(step_input, hidden, spec.simulate_rate if spec else None)
        host = self.host_ms
        host["draft"] += (t1 - t0) * 1e3
        host["prepare"] += (tp - t1) * 1e3
        host["forward"] += (tf - tp) * 1e3
        # waits for the device inside sampling (a grammar's drafts) count as waits
        waited = step_input.sample_wait_ms
        host["sample"] += (time.perf_counter() - ts) * 1e3 - waited
        self.totals["host_wait_ms"] += waited
        # Taken now: graph outputs are overwritten by the next step's replay.
        features = (
            spec.proposer.features(aux, step_input.meta.slot_mapping) if spec is not None else None
        )
        prompt_logprobs(runner.model, batch, step_input, hidden)  # prefill chunks that ask
        t2 = time.perf_counter()
        # Bookkeeping that needs no drawn token: the fed tokens are in the KV cache (in
        # device order), and each sampled request has at least one token in flight.
        for s in batch:
            s.request.cached_len += s.num_tokens
        upkeep_ms = None
        if keeps_drafter:  # after the draw: its copy is not delayed
            prefilled = [s for s in batch if not s.decoding]
            if prefilled:
                tu = time.perf_counter()
                spec.proposer.catch_up_prefill(prefilled)
                upkeep_ms = (time.perf_counter() - tu) * 1e3
                if not any(s.draft_len for s in batch):  # (its passes were ride-alongs only)
                    upkeep_ms += (t1 - t0) * 1e3
        for s in step_input.sampled:
            s.request.num_inflight += 1
            s.request.num_inflight_drafts += s.drafted
        launched = LaunchedStep(
            batch,
            step_input,
            sampled,
            features,
            speculative=any(s.drafted for s in batch),
            draft_ms=(t1 - t0) * 1e3,
            host_ms=(t2 - t1) * 1e3,
            preemptions=[s.request.num_preemptions for s in batch],
            events=events,
            after_idle=self._idle,
            kept_drafter=keeps_drafter,
            waited=waited,
            upkeep_ms=upkeep_ms,
        )
        self._idle = False
        if events is not None:
            events[2].record()
        return launched

    def _events(self):
        if not self._timed:
            return None
        return tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))

    def _commit_drafter(
        self, step: LaunchedStep, items: list[ScheduledRequest], accepted: list[int]
    ) -> None:
        rows = dict(zip(map(id, step.batch), step.step_input.first_rows))
        first_rows = [rows[id(s)] for s in items]
        self.spec.proposer.commit(items, accepted, step.features, first_rows)

    # ---- resolve: the step's tokens on the host ---------------------------------------
    def _resolve(self, step: LaunchedStep) -> None:
        """Wait for the step's tokens; commit their count (cached lengths, drafter state)."""
        t0 = time.perf_counter()
        result = step.result = step.sampled.result()
        step.resolved_s = time.perf_counter()
        if self.token_check is not None:
            self.token_check(self.num_resolved, result.tokens)
        self.num_resolved += 1
        wait_ms = step.wait_ms = (step.resolved_s - t0) * 1e3
        self.times.wait_ms.append(wait_ms)
        self.totals["host_wait_ms"] += wait_ms
        # Requests preempted since the launch recompute from their tokens: their KV and
        # drafter state start over.
        kept = [s.request.num_preemptions == n for s, n in zip(step.batch, step.preemptions)]
        unmoved = {id(s.request) for s, keep in zip(step.batch, kept) if keep}
        accepted = {}
        for r, (s, tokens) in enumerate(zip(step.step_input.sampled, result.tokens)):
            req = s.request
            req.num_inflight -= 1
            req.num_inflight_drafts -= s.drafted
            if s.device_drafts is not None:  # the host sees them now (statistics)
                s.drafts = result.drafts[r][: s.draft_len]
            accepted[id(s)] = len(tokens) - 1
            if req.finished:
                continue  # finished or aborted while in flight: its tokens are dropped
            if id(req) in unmoved:
                req.cached_len += len(tokens) - 1  # accepted drafts: their KV is valid
            req.unprocessed_token_ids = list(tokens)
        spec = self.spec
        if spec is not None and (spec.proposer.needs_commit or step.consumed):
            items = [s for s, keep in zip(step.batch, kept) if keep]
            consumed = step.consumed
            if spec.proposer.needs_commit:  # in launch order (features in position order)
                queued = [s for s in items if id(s.request) not in consumed]
                self._commit_drafter(step, queued, [accepted.get(id(s), 0) for s in queued])
            for s in items if consumed else ():
                if id(s.request) in consumed:  # the next step's drafter caught up on them
                    s.request.draft_cached_len += accepted.get(id(s), 0)

    # ---- process: stop checks, outputs, statistics -----------------------------------
    def _process(self, step: LaunchedStep) -> list[RequestOutput]:
        if step.result is None:
            self._resolve(step)
        spec, result, sink = self.spec, step.result, self.sink
        live = [
            (s, tokens, lps)
            for s, tokens, lps in zip(step.step_input.sampled, result.tokens, result.logprobs)
            if not s.request.finished
        ]
        target_ms = self._record_times(step)
        kind = step_kind(step.batch)
        self.kind_steps[kind] += 1
        # (on the CPU the host's time is the run: drafting's included)
        self.kind_ms[kind] += (
            step.draft_ms + step.host_ms if step.events is None else step.device_ms
        )
        if spec is not None:  # before finishing: finished requests' estimates are dropped
            if live:  # else every request finished one step before (run ahead): no news
                batch = [s for s in step.batch if not s.request.finished]
                committed = {id(s): len(tokens) for s, tokens, _ in live}
                spec.observe(batch, committed, step.draft_ms, target_ms)
            spec.observe_period(
                step.batch,
                step.resolved_s,
                step.after_idle,
                step.device_ms,
                kept_drafter=step.kept_drafter,
                waited=step.waited,
                upkeep=None if step.upkeep_ms is None else (step.upkeep_ms, step.wait_ms),
            )
        outputs = []
        for s, tokens, lps in live:
            req = s.request
            req.unprocessed_token_ids = []
            before = len(req.output_token_ids)
            for i, token in enumerate(tokens):
                req.append_token(token, lps[i] if lps else None)
                if req.finish_reason is not None:
                    break
            if s.drafts:
                # The request's statistics count the tokens it kept: where a stop or its
                # length ended it inside the accepted drafts, the last kept one stands for
                # the bonus (the drafts after it were not needed).
                kept = len(req.output_token_ids) - before
                drafted, accepted = len(s.drafts), len(tokens) - 1
                if kept < len(tokens):
                    drafted, accepted = min(drafted, kept - 1), kept - 1
                req.spec.record(drafted, accepted)
            if req.finish_reason is not None:
                sink.finish(req)
            outputs.append(sink.output(req, len(req.output_token_ids) - before))
        return outputs

    def _record_times(self, step: LaunchedStep) -> float:
        """The step's device time in ms (host time on the CPU, where launch is the run);
        records it and the idle gap before it."""
        if step.events is None:
            return step.host_ms
        start, target_start, end = step.events
        t0 = time.perf_counter()
        end.synchronize()  # (a wait, not processing: the step's work after its tokens)
        self.totals["host_wait_ms"] += (time.perf_counter() - t0) * 1e3
        target_ms = target_start.elapsed_time(end)
        step_ms = step.device_ms = start.elapsed_time(end)
        self.times.step_ms.append(step_ms)
        self.times.target_ms.append(target_ms)
        self.totals["device_step_ms"] += step_ms
        if self._last_end is not None and not step.after_idle:
            gap_ms = self._last_end.elapsed_time(start)
            self.times.gap_ms.append(gap_ms)
            self.totals["device_gap_ms"] += gap_ms
        self._last_end = end
        return target_ms
