"""The wire between the HTTP process and the engine process: one dataclass per message.

To the engine (its inbox, server/inbox.py): `AddRequests`, `AbortRequests`, `Shutdown`.
From it (a pipe, pickled by its outbox thread): `Ready` or `LoadFailed` once, then a
`StepReport` per loop turn, and at the end `Stopped` (told to) or `Fatal` (it crashed).
`Dead` is the HTTP side's own note that the pipe closed without a word. A step's outputs
travel as plain tuples of `OutputDelta`'s fields: tuples pickle several times faster than
dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.core.sampling_params import SamplingParams


@dataclass
class EngineInfo:
    """What the HTTP process needs to validate requests before they are queued."""

    model_name: str
    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int
    kv_pages_total: int
    max_num_seqs: int
    simulated_acceptance: bool = False  # outputs are not the model's: mark every response
    # the engine's end-of-sequence ids (config and tokenizer): grammars compiled here for it
    # must stop on the same ids, or it cannot load them (xgrammar checks)
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class OutputDelta:
    """One engine request's progress in one step. On the wire it is a plain tuple of its
    fields in order (`astuple`-like, built by `_delta`): tuples pickle several times faster
    than dataclasses, and pickling happens between steps."""

    request_id: str
    delta_text: str
    new_token_ids: list[int]
    # (logprob of the chosen token, [(id, logprob) of the top alternatives]) per new token;
    # None when the request did not ask for logprobs.
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] | None
    finished: bool
    finish_reason: str | None
    spec_stats: object | None = None  # the request's SpecStats, sent with its last delta
    num_cached_tokens: int | None = None  # its prompt tokens found cached, with its last delta
    # With prompt logprobs asked for, with its first delta: None for the first prompt token,
    # then (logprob, [(id, logprob) of the top alternatives]) per prompt token
    prompt_logprobs: list | None = None
    # With its first generated tokens: when the engine process took the request in
    # (time.monotonic(), one clock for every process of the machine).
    added_at: float | None = None


@dataclass
class AddRequest:
    """Queue one already tokenized and validated prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class RequestError:
    """The engine refused a request at add time (validation the HTTP side could not do)."""

    request_id: str
    message: str
    field: str | None
    status: int  # 400 for InvalidRequestError, 500 otherwise


@dataclass
class StepReport:
    """Everything one loop turn produced; `outputs` holds OutputDelta field tuples."""

    outputs: list[tuple] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # the engine's, or only its queue lengths
    step_s: list[float] = field(default_factory=list)  # model step durations
    gap_s: list[float] = field(default_factory=list)  # idle time between back-to-back steps
    sent_at: float = 0.0  # time.monotonic() when the engine process sent it


@dataclass
class AddRequests:
    """Queue these requests."""

    requests: list[AddRequest]


@dataclass
class AbortRequests:
    """Abort these requests (unknown or finished ids are ignored)."""

    request_ids: list[str]


@dataclass
class Shutdown:
    """Abort everything, send the final stats and `Stopped`, exit."""


@dataclass
class Ready:
    """The model is loaded; what the HTTP side validates requests against."""

    info: EngineInfo


@dataclass
class LoadFailed:
    """Loading failed: a user's error (a bad checkpoint or config: `user`) or a bug."""

    user: bool
    message: str
    traceback: str


@dataclass
class Stopped:
    """The engine stopped as told."""


@dataclass
class Fatal:
    """The engine loop crashed; its traceback."""

    traceback: str


@dataclass
class Dead:
    """(HTTP side) the engine's pipe closed without a final message."""

    reason: str
