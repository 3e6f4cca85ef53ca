"""Tensor parallelism's control plane: each step, rank 0 (the one scheduler and the one policy)
hands every other rank the same step plan, and those ranks replay it on mirrors of its
requests, so that every rank launches the same forward, drafter passes and sampling, in the
same order (their collectives pair up), with K decided once.

A plan carries what a rank needs beyond its own step loop's bookkeeping: requests first
scheduled (prompt, sampling parameters, seed), requests that left (finished by a stop string,
aborted: only rank 0 detokenizes), and the step's rows (request, tokens fed, draft length,
the pages it gained since the last plan), which rows the proposer runs for, whether the
drafter is kept up to date, and whether rank 0 waited for the step in flight before
launching. Everything else (cached and committed lengths, drafter lengths, tokens) each rank
derives from the same tokens, which every rank samples alike from the same logits and seeds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch.distributed as dist

from specserve.core.batch import ScheduledRequest
from specserve.core.errors import TensorParallelError
from specserve.core.request import Request, RequestStatus
from specserve.core.sampling_params import SamplingParams
from specserve.runtime.grammar import GrammarHandOver


@dataclass(slots=True)
class PlannedRequest:
    """A request as a follower mirrors it (no tokenizer: only rank 0 produces text)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    seed: int
    max_len: int
    eos_token_ids: frozenset[int]

    def mirror(self) -> Request:
        return Request(
            self.request_id,
            self.prompt_token_ids,
            self.params,
            self.arrival,
            self.seed,
            self.max_len,
            self.eos_token_ids,
        )


@dataclass(slots=True)
class PlannedRow:
    """One scheduled request of the step (ScheduledRequest's fields that the scheduler
    sets), with its page table's changes since the last plan that carried it: the pages it
    still holds of those (`kept`: the scheduler may have given lookahead pages back, and
    grown others since) and the pages after them (from the first page after a preemption:
    `preemptions` counts them)."""

    request_id: str
    num_tokens: int
    draft_len: int
    decoding: bool
    preemptions: int
    kept: int
    new_pages: list[int]
    # With its first pages (first plan, or after a preemption): the cached and drafter
    # lengths it starts from (nonzero after a prefix cache hit).
    start: tuple[int, int] | None = None


@dataclass(slots=True)
class StepPlan:
    """What rank 0 decided for a step (`stop`: no step; the followers shut down)."""

    added: list[PlannedRequest] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    rows: list[PlannedRow] = field(default_factory=list)
    drafting: list[int] = field(default_factory=list)  # rows the proposer runs for
    keeps_drafter: bool = False
    waited: bool = False  # rank 0 resolved the step in flight before launching this one
    late: bool = False  # ... or once this one's forward was queued, before it samples
    tokens: list = field(default_factory=list)  # --debug-tp-check: (step, rank 0's tokens)
    drain: bool = False  # no step: process the one in flight (StepLoop.drain)
    keep_alive: bool = False  # no step: rank 0 is idle (a wait never outlasts the timeout)
    stop: bool = False


class PlanChannel:
    """Plans from rank 0 to every rank over the control group (gloo: host objects; the
    tensors' group stays free for the forward's collectives)."""

    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank
        self.last_sent = time.monotonic()

    def send(self, plan: StepPlan) -> None:
        self._broadcast([plan])
        self.last_sent = time.monotonic()

    def recv(self) -> StepPlan:
        box = [None]
        self._broadcast(box)
        return box[0]

    def _broadcast(self, box: list) -> None:
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except RuntimeError as e:  # gloo: a rank's connection closed (it died)
            raise TensorParallelError(
                f"rank {self.rank} lost the tensor-parallel group (another rank exited?): {e}"
            ) from e


class TokenCheck:
    """--debug-tp-check on a follower: its tokens of each step against rank 0's, which come
    with a later plan (`StepPlan.tokens`: every step rank 0 resolved since the last plan), so
    the check adds no collective and no wait. A rank whose tokens differ would go on with
    other lengths than rank 0's and hang or corrupt later steps; this stops it at the first
    such step (rank 0 then stops on its death, naming it)."""

    def __init__(self, rank: int):
        self.rank = rank
        self._mine: dict[int, list] = {}
        self._theirs: dict[int, list] = {}

    def local(self, step: int, tokens: list[list[int]]) -> None:
        """This rank resolved `step` (StepLoop.token_check)."""
        self._mine[step] = tokens
        self._compare(step)

    def remote(self, pairs: list[tuple[int, list]]) -> None:
        """Rank 0's tokens of the steps it resolved (from a plan)."""
        for step, tokens in pairs:
            self._theirs[step] = tokens
            self._compare(step)

    def _compare(self, step: int) -> None:
        if step in self._mine and step in self._theirs:
            mine, theirs = self._mine.pop(step), self._theirs.pop(step)
            if mine != theirs:
                raise TensorParallelError(
                    f"step {step}: rank {self.rank}'s tokens {mine} differ from rank 0's {theirs}"
                )


class PlanPublisher:
    """Rank 0's side: turns each step's final batch into a plan and sends it."""

    def __init__(self, channel: PlanChannel, serialize_grammar=None):
        self.channel = channel
        # A request's grammar reaches the ranks compiled (rank 0's, `serialize_grammar`)
        # with the first planned request that brings it, wherever rank 0 got it from
        self._serialize = serialize_grammar
        self._grammars = GrammarHandOver()
        self._sent: dict[str, tuple[int, list[int]]] = {}  # id -> (preemptions, table sent)
        self._gone: list[str] = []
        self._tokens: list[tuple[int, list]] = []  # resolved steps' tokens (TokenCheck)

    def resolved(self, step: int, tokens: list[list[int]]) -> None:
        """--debug-tp-check: rank 0 resolved `step`; its tokens go with the next plan."""
        self._tokens.append((step, tokens))

    def _plan(self, **kwargs) -> StepPlan:
        plan = StepPlan(gone=self._gone, tokens=self._tokens, **kwargs)
        self._gone, self._tokens = [], []
        return plan

    def gone(self, req: Request) -> None:
        """A request left rank 0 (finished, aborted): followers drop their mirror."""
        if self._sent.pop(req.request_id, None) is not None:
            self._gone.append(req.request_id)

    def publish(
        self,
        batch: list[ScheduledRequest],
        drafting: list[ScheduledRequest],
        keeps_drafter: bool,
        waited: bool,
        late: bool = False,
    ) -> None:
        plan = self._plan(keeps_drafter=keeps_drafter, waited=waited, late=late)
        sent = self._sent
        for s in batch:
            req = s.request
            rid = req.request_id
            known = sent.get(rid)
            if known is None:
                plan.added.append(
                    PlannedRequest(
                        rid,
                        req.prompt_token_ids,
                        self._params(req.params),
                        req.arrival,
                        req.seed,
                        req.max_len,
                        req.eos_token_ids,
                    )
                )
                known = (req.num_preemptions, [])
            table = req.page_table
            start = _kept(known[1], table) if known[0] == req.num_preemptions else 0
            sent[rid] = (req.num_preemptions, table.copy())
            row = PlannedRow(
                rid,
                s.num_tokens,
                s.draft_len,
                s.decoding,
                req.num_preemptions,
                start,
                table[start:],
            )
            if start == 0 and req.cached_len:  # a prefix cache hit: it starts past 0
                row.start = (req.cached_len, req.draft_cached_len)
            plan.rows.append(row)
        if drafting:
            index = {id(s): i for i, s in enumerate(batch)}
            plan.drafting = [index[id(s)] for s in drafting]
        self.channel.send(plan)

    def _params(self, params: SamplingParams) -> SamplingParams:
        """A request's parameters as its mirrors get them: a grammar compiled where the
        ranks may lack it (its first request may have left rank 0 before any plan carried
        it: the ranks would compile it on their step loops), else without its compiled form
        (megabytes, in every plan's pickle)."""
        grammar = params.grammar
        if grammar is None:
            return params
        sent = self._grammars.grammar(grammar, self._serialize)
        return params if sent is grammar else replace(params, grammar=sent)

    def drain(self) -> None:
        self.channel.send(self._plan(drain=True))

    def keep_alive(self) -> None:
        self.channel.send(self._plan(keep_alive=True))

    def stop(self) -> None:
        self.channel.send(self._plan(stop=True))


def _kept(sent: list[int], table: list[int]) -> int:
    """How many of the pages last sent a request's table still holds: all of them, unless
    the scheduler gave lookahead pages back (`Scheduler._reclaim_lookahead`: from the end)
    and may have grown it again since."""
    n = len(sent)
    if table[:n] == sent:  # (the common case, compared in C)
        return n
    kept = 0
    for a, b in zip(sent, table):
        if a != b:
            break
        kept += 1
    return kept


class PlanFollower:
    """A follower's side: the mirrors of rank 0's requests, kept by its plans."""

    def __init__(self, channel: PlanChannel, check: TokenCheck | None = None):
        self.channel = channel
        self.requests: dict[str, Request] = {}
        self.check = check

    def next(self) -> StepPlan:
        plan = self.channel.recv()
        if self.check is not None and plan.tokens:
            self.check.remote(plan.tokens)
        return plan

    def batch(self, plan: StepPlan) -> tuple[list[ScheduledRequest], list[ScheduledRequest]]:
        """The plan's step on the mirrors: (batch, the rows the proposer runs for)."""
        requests = self.requests
        for rid in plan.gone:  # its tokens still in flight are dropped, as on rank 0
            gone = requests.pop(rid, None)
            if gone is not None:
                gone.status = RequestStatus.FINISHED
                if gone.grammar_state is not None:  # (this rank's grammar workers' matcher)
                    gone.grammar_state.release()
        for new in plan.added:
            req = requests[new.request_id] = new.mirror()
            req.status = RequestStatus.RUNNING
        batch = []
        for row in plan.rows:
            req = requests[row.request_id]
            if row.preemptions != req.num_preemptions:  # recomputed from its tokens
                req.reset_cache()
                req.num_preemptions = row.preemptions
                req.page_table = []
            del req.page_table[row.kept :]  # (lookahead pages rank 0 gave back)
            req.page_table.extend(row.new_pages)
            if row.start is not None:
                req.cached_len, req.draft_cached_len = row.start
            batch.append(ScheduledRequest(req, row.num_tokens, row.draft_len, row.decoding))
        return batch, [batch[i] for i in plan.drafting]

    def finished(self, req: Request) -> None:
        """A mirror found finished by its own tokens (EOS, stop token, length)."""
        req.status = RequestStatus.FINISHED
        if self.requests.pop(req.request_id, None) is not None and req.grammar_state is not None:
            req.grammar_state.release()


class MirrorSink:
    """A follower's sink (StepLoop's `sink`): finished mirrors leave, nothing is output (rank
    0 answers the requests) and no page goes back (rank 0's allocator owns them all)."""

    def __init__(self, follower: PlanFollower, spec):
        self.follower, self.spec = follower, spec

    def finish(self, req: Request) -> None:
        self.follower.finished(req)

    def output(self, req: Request, num_new: int) -> None:
        return None
