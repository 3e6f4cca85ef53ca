"""Per-request state: tokens, committed and cached lengths, pages, finish reason."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specserve.core.detokenizer import IncrementalDetokenizer
from specserve.core.sampling_params import SamplingParams


@dataclass
class SpecStats:
    """Speculation statistics of one request.

    Per draft position j, `position_verified[j]` counts the verify steps that judged the
    draft at j (it was drafted and every draft before it accepted) and
    `position_accepted[j]` those that accepted it, as the AcceptanceModel counts them: a
    step that drafted fewer than K (a request's last tokens) judged only what it drafted."""

    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accept_hist: list[int] = field(default_factory=list)  # index: accepted drafts in a step
    position_verified: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        self.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted
        while len(self.accept_hist) <= accepted:
            self.accept_hist.append(0)
        self.accept_hist[accepted] += 1
        verified = min(accepted + 1, drafted)  # the first rejected draft was judged too
        while len(self.position_verified) < verified:
            self.position_verified.append(0)
            self.position_accepted.append(0)
        for j in range(verified):
            self.position_verified[j] += 1
        for j in range(accepted):
            self.position_accepted[j] += 1

    @property
    def mean_accept_len(self) -> float:
        """Tokens committed per verify step (accepted drafts + the bonus token)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_FINISHED = RequestStatus.FINISHED  # a module constant: half the cost of the enum lookup
NEVER = 1 << 62  # a length no request reaches


@dataclass(eq=False)  # one object per request: identity is equality (and hashing)
class Request:
    """One generation request as the engine tracks it.

    committed_len counts prompt plus generated tokens; cached_len counts the tokens whose
    K/V sit in the request's pages. A request is in prefill while cached_len < committed_len
    - 1 and decodes one token a step after that.

    Under overlap scheduling a step's tokens reach the request in two stages: first their
    count (`num_inflight`: drawn on the device, values not yet on the host), then their
    values (`unprocessed_token_ids`: on the host, stop conditions not yet checked), and
    finally `output_token_ids` through `append_token`. committed_len counts all three.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    seed: int
    max_len: int  # stop (finish "length") when committed_len reaches it
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer | None = None
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)  # TokenLogprobs per output token
    # With params.prompt_logprobs: TokenLogprobs per prompt token (None for the first)
    prompt_logprobs: list = field(default_factory=list)
    unprocessed_token_ids: list[int] = field(default_factory=list)  # see the class doc
    num_inflight: int = 0  # tokens drawn by the step in flight, values still on the device
    num_inflight_drafts: int = 0  # its drafts: it may commit up to this many more tokens
    page_table: list[int] = field(default_factory=list)
    cached_len: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Drafter state: positions < draft_cached_len are in the drafter's KV (EAGLE-3's
    # features of the positions after it wait in its feature store, by KV slot).
    draft_cached_len: int = 0
    # Prefix caching (core/prefix_cache.py): the keys of its full pages so far, how many
    # leading pages of its table are in the cache, on how many of those the drafter's
    # entries are marked valid, and the prompt tokens found cached when it was first
    # admitted (usage.prompt_tokens_details.cached_tokens).
    page_keys: list[bytes] = field(default_factory=list)
    published_pages: int = 0
    drafter_pages: int = 0
    # The cached length at which its prompt's pages are published (once; the rest when it
    # leaves): one comparison a step (Scheduler.schedule). Never, without prefix caching.
    publish_at: int = NEVER
    num_cached_prompt_tokens: int = 0
    spec: SpecStats = field(default_factory=lambda: SpecStats())
    # Drafts beyond this could never be committed (max_tokens or the context limit):
    # max(0, num_left - 1) when the scheduler hands the request to a policy whose choice
    # reads it (`Scheduler._draft` stores it then, unless `SpeculationPolicy.reads_caps`
    # says the choice reads none: no property chain per read). Stale between schedules
    # and after a choice that read none: read `num_left` elsewhere.
    max_useful_drafts: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        # Fixed for the request's life; append_token and the length properties run per token.
        p = self.params
        self._prompt_len = len(self.prompt_token_ids)
        self._output_limit = min(p.max_tokens, self.max_len - self._prompt_len)
        self._stop_token_ids = frozenset(p.stop_token_ids) | (
            frozenset() if p.ignore_eos else self.eos_token_ids
        )
        self.max_useful_drafts = max(0, self._output_limit - 1)
        # Read for every request of every step (runtime/logit_shaping.py, the step loop's
        # waits): plain attributes, not SamplingParams' properties.
        self.shapes_logits = p.shapes_logits
        self.penalized = p.penalized
        self.constrained = p.grammar is not None
        self.grammar_state = None  # its grammar matcher (runtime/grammar.py), made on first use

    @property
    def stop_ids(self) -> frozenset[int]:
        """The tokens that end its output: EOS (unless ignore_eos) and its stop tokens."""
        return self._stop_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Every token whose value the host knows (all committed ones but the in-flight)."""
        return self.prompt_token_ids + self.output_token_ids + self.unprocessed_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        prompt = self._prompt_len
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        if start < prompt:
            return self.all_token_ids[start:end]
        known = self.output_token_ids
        if self.unprocessed_token_ids:
            known = known + self.unprocessed_token_ids
        return known[start - prompt : end - prompt]

    @property
    def drafter_backlog(self) -> int:
        """Committed tokens the drafter has not taken yet: what it catches up on when the
        request next drafts (an EAGLE-3 head's pairs end one token short)."""
        return max(0, self.committed_len - 1 - self.draft_cached_len)

    @property
    def num_known(self) -> int:
        """Tokens whose values the host knows (committed_len less the in-flight)."""
        return self._prompt_len + len(self.output_token_ids) + len(self.unprocessed_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids) + len(self.unprocessed_token_ids) + self.num_inflight

    @property
    def committed_len(self) -> int:
        return (
            self._prompt_len
            + len(self.output_token_ids)
            + len(self.unprocessed_token_ids)
            + self.num_inflight
        )

    @property
    def num_left(self) -> int:
        """Tokens it may still generate (max_tokens and the context limit)."""
        return self._output_limit - (
            len(self.output_token_ids) + len(self.unprocessed_token_ids) + self.num_inflight
        )

    @property
    def num_uncached(self) -> int:
        return self.committed_len - self.cached_len

    def reset_cache(self) -> None:
        """Forget all KV (target and drafter): the request will be recomputed."""
        self.cached_len = 0
        self.draft_cached_len = 0
        self.published_pages = self.drafter_pages = 0
        self.publish_at = NEVER

    @property
    def finished(self) -> bool:
        return self.status is _FINISHED

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer else ""

    def append_token(self, token: int, logprobs=None) -> None:
        """Commit one sampled token and decide whether the request is done."""
        output = self.output_token_ids
        output.append(token)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        detokenizer = self.detokenizer
        if token in self._stop_token_ids:  # eos (unless ignore_eos) or a stop token: its
            self.finish_reason = "stop"  # text is not the output's (as vLLM's)
        elif detokenizer is not None:
            detokenizer.push(token)
            if detokenizer.stopped:
                self.finish_reason = "stop"
        # Only processed tokens count here: committed_len may include a later step's.
        if self.finish_reason is None and len(output) >= self._output_limit:
            self.finish_reason = "length"
            if detokenizer is not None:  # its held-back text ends now: a stop string in it
                detokenizer.finish()  # ends the output as a stop does
                if detokenizer.stopped:
                    self.finish_reason = "stop"
