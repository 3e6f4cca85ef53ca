"""Structured output: a request's grammar (SamplingParams.grammar: JSON, a JSON schema, a
regular expression) compiled by xgrammar for the model's tokenizer, one matcher per request,
and each step's token masks.

xgrammar over llguidance, by measurement (SmolLM2's 49,152-token vocabulary, a three-field
JSON schema, CPU): a token's mask and advance take 12 us against 92 us, compiling takes 0.2 s
against 0.5 s, and both roll back.

Speculation stays lossless: a constrained request has a mask on every logit row of the step,
the row of its last committed token and one per draft, each from its matcher advanced through
the drafts before it (then rolled back). Verification therefore compares each draft with the
masked distribution plain decoding draws from, and the bonus token is drawn from it too: an
illegal draft has probability 0 and is rejected, so the rows after it are never read (they
keep the last legal state's mask). The matcher follows the committed tokens lazily, when the
next step needs its masks; the overlapped loop waits for the step in flight first (wait
reason "grammar"), as the masks depend on its tokens. A step's masks are filled position-major
(`fill_masks`): the rows of every request at one draft position in one xgrammar batch fill,
threaded when there are many, into host memory kept for the engine's life (`MaskBuffer`).
What a grammar's source becomes for xgrammar (schema checks and rewrites):
runtime/grammar_sources.py. No grammar allows the tokenizer's special tokens other than the
stop tokens (`tokenizer_info`); grammars compiled elsewhere stay loaded while a request holds
them (`LoadedGrammars`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
import xgrammar as xgr

from specserve.core.errors import InvalidRequestError
from specserve.core.sampling_params import Grammar
from specserve.runtime.grammar_pool import GrammarPool, RemoteGrammar, take_tokens, unseen_tokens
from specserve.runtime.grammar_sources import (
    SchemaRefused,
    compile_error,
    ebnf_text,
    schema_grammar,
)
from specserve.runtime.packing import to_device
from specserve.runtime.schema_checks import TOO_DEEP

logger = logging.getLogger(__name__)

CACHE_BYTES = 256 << 20  # compiled grammars kept (distinct schemas would grow it forever)
# Grammars compiled elsewhere (`Grammar.compiled`) kept once loaded, by key, beyond those a
# request still holds (`LoadedGrammars`): the server sends a grammar compiled only while it
# is not among the last LOADED_KEPT // 2 it sent
LOADED_KEPT = 64


class GrammarHandOver:
    """A sender's record of the compiled grammars a receiving `GrammarCompiler` holds (it
    keeps LOADED_KEPT, by key, least recently used out): a grammar travels compiled only
    while its key is not among the last LOADED_KEPT // 2 this sender sent, so the receiver
    never compiles one again and a compiled grammar (tens of kilobytes to megabytes) crosses
    once, not with every request. The server's HTTP process hands them to the engine so,
    and rank 0 to the other tensor-parallel ranks."""

    def __init__(self):
        self._sent: OrderedDict[tuple, None] = OrderedDict()

    def grammar(self, grammar: Grammar, serialize=None) -> Grammar:
        """`grammar` as it should travel: with its compiled form where the receiver may lack
        it (`serialize(grammar)` when it has none: a str, or None to send it uncompiled),
        without where the receiver has it."""
        sent = self._sent
        if grammar.key in sent:
            sent.move_to_end(grammar.key)
            return grammar if grammar.compiled is None else replace(grammar, compiled=None)
        if grammar.compiled is None and serialize is not None:
            grammar = replace(grammar, compiled=serialize(grammar))
        if grammar.compiled is None:
            return grammar  # (its receiver compiles it: nothing to remember)
        sent[grammar.key] = None
        if len(sent) > LOADED_KEPT // 2:
            sent.popitem(last=False)
        return grammar


# A step's mask fill, threaded from THREADED_MIN_ROWS rows at one draft position: xgrammar
# starts its threads on every call (about 30 us each on the H200 host) and waits for the
# last of them, so fewer rows fill faster on one: on the idle H200 host 4 threads gained
# nothing at 64 rows (64 requests at K=3: 1.36 / 1.35 ms), 0.4 ms at 128 and 3.4 ms at 256
# (4 beat 8 up to 256: benchmarks/cpu_grammar_masks.py), and on a loaded host a thread
# that waits for a core holds the whole fill (2 busy CPU cores, 64 rows with 5 ms of other
# work between fills: 0.16 ms on one thread, 1.1 ms median and 3-4 ms p90 threaded).
FILL_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))
THREADED_MIN_ROWS = 128
# With grammar workers (runtime/grammar_pool.py), a step's masks are filled there from this
# many constrained rows: a round trip to the workers costs ~0.35 ms (2-core CPU), which fewer
# rows do not repay. H200, JSON schema, 4 workers against none: 256 rows a step (64 requests
# at K=3) 1.05x the throughput on the 8B shape and even on the default model; 64 rows (64
# requests plain on the 8B shape, 16 at K=3 on the default model) even and 0.81-0.97x.
POOL_MIN_ROWS = 128


class GrammarCompiler:
    """Grammars compiled for one tokenizer (cached by xgrammar); the tokenizer's tables are
    built on the first grammar (0.2 s for a 49k vocabulary), not at start-up."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_ids = sorted(stop_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._info: xgr.TokenizerInfo | None = None
        self.batch_fill = BatchFill(FILL_THREADS)  # a step's masks
        self.pool = None  # worker processes that fill them instead (`start_workers`) ...
        self.pool_min_rows = POOL_MIN_ROWS  # ... in steps with this many constrained rows
        self.workers_on_first_use = 0  # workers started with the first grammar compiled
        self.masks = MaskBuffer(xgr.get_bitmask_shape(1, vocab_size)[1])
        self._loaded = LoadedGrammars()  # compiled elsewhere, by Grammar.key
        self._lock = threading.Lock()
        self._load_failed = 0  # compiled grammars that did not load (warned once)

    # Row counts that cover the apply kernel's specializations (Triton compiles one per
    # integer argument that is 1, divisible by 16, or neither)
    WARM_ROWS = (1, 3, 16)

    def warm_up(self, device: torch.device, activation_dtype: torch.dtype) -> None:
        """On a GPU, run xgrammar's mask kernel (Triton, compiled on first use for each
        specialization of its row count and logits dtype) once for each, at start-up: else
        the first step with a new kind of constrained batch compiled it while every running
        request waited (H200, 8B shape, 64 constrained requests after one at a time: their
        mean time to reach the engine 127 ms against 3 unconstrained; the server started
        next, with Triton's disk cache warm, 7 ms). Nothing to do on a CPU (a C++ kernel;
        other devices compile theirs with torch.compile, warmed likewise)."""
        if device.type == "cpu" or self.tokenizer is None:
            return
        width = xgr.get_bitmask_shape(1, self.vocab_size)[1]
        for dtype in dict.fromkeys((torch.float32, activation_dtype)):  # (logits: either)
            for rows in self.WARM_ROWS:
                logits = torch.zeros(rows, self.vocab_size, dtype=dtype, device=device)
                bitmask = torch.full((rows, width), -1, dtype=torch.int32, device=device)
                xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def start_workers(self, workers: int) -> None:
        """Fill masks in `workers` processes (runtime/grammar_pool.py) once they are ready:
        they start in the background (a second or two: they import xgrammar), and until
        then the masks are filled here."""
        self.pool = GrammarPool(self.info_json(), workers)
        self.masks = MaskBuffer(self.masks.words, shared=True)

    def close(self) -> None:
        """Stop the workers, if any (idempotent)."""
        if self.pool is not None:
            self.pool.close()

    @classmethod
    def from_info(cls, info_json: str, vocab_size: int) -> GrammarCompiler:
        """A compiler for the tokenizer that `info_json` describes (`info_json()`): in a
        process that has no tokenizer (the server's compile workers)."""
        compiler = cls(None, vocab_size, [])
        compiler._info = xgr.TokenizerInfo.deserialize_json(info_json)
        compiler._compiler = xgr.GrammarCompiler(compiler._info, cache_limit_bytes=CACHE_BYTES)
        return compiler

    def info_json(self) -> str:
        """The tokenizer's tables as xgrammar serializes them, for worker processes."""
        self._compiler_for_tokenizer()
        return self._info.serialize_json()

    def _compiler_for_tokenizer(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            with self._lock:  # (the server compiles on several threads)
                if self._compiler is None:
                    self._info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_ids)
                    self._compiler = xgr.GrammarCompiler(self._info, cache_limit_bytes=CACHE_BYTES)
        return self._compiler

    def compile(self, grammar: Grammar) -> xgr.CompiledGrammar:
        """The compiled grammar (loaded from `grammar.compiled` where it was compiled
        already); a grammar xgrammar refuses is the request's error (400)."""
        if self.tokenizer is None and self._compiler is None:
            raise InvalidRequestError(
                "structured output needs the model's tokenizer; this engine has none",
                grammar.field,
            )
        compiler = self._compiler_for_tokenizer()
        if self.workers_on_first_use and self.pool is None:  # (a server that never sees a
            self.start_workers(self.workers_on_first_use)  # grammar starts none)
        loaded = self._loaded.get(grammar)
        if loaded is None and grammar.compiled is not None:
            loaded = self._load(grammar.compiled)
            if loaded is not None:
                self._loaded.add(grammar, loaded)
        if loaded is not None:
            return loaded
        if grammar.kind == "json_schema":
            self._check_schema(grammar)
        try:
            if grammar.kind == "json":
                return compiler.compile_builtin_json_grammar()
            if grammar.kind == "json_schema" and (grammar.prefix or grammar.suffix):
                between = xgr.Grammar.concat(
                    xgr.Grammar.from_ebnf(f"root ::= {ebnf_text(grammar.prefix)}"),
                    schema_grammar(grammar.source),
                    xgr.Grammar.from_ebnf(f"root ::= {ebnf_text(grammar.suffix)}"),
                )
                return compiler.compile_grammar(between)
            if grammar.kind == "json_schema":
                return compiler.compile_grammar(schema_grammar(grammar.source))
            if grammar.kind == "ebnf":
                return compiler.compile_grammar(grammar.source)
            return compiler.compile_regex(grammar.source)
        except SchemaRefused as e:
            raise InvalidRequestError(str(e), grammar.field) from None
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(
                f"the {grammar.kind} grammar cannot be used: {compile_error(e)}", grammar.field
            ) from e

    def _load(self, serialized: str) -> xgr.CompiledGrammar | None:
        """A grammar compiled elsewhere for this tokenizer; None where it does not load (it
        is compiled here instead)."""
        try:
            return xgr.CompiledGrammar.deserialize_json(serialized, self._info)
        except Exception as e:  # (a version or tokenizer mismatch: compiling is always right)
            if not self._load_failed:
                logger.warning("a compiled grammar did not load (%s); compiling it here", e)
            self._load_failed += 1
            return None

    def serialize(self, grammar: Grammar) -> str:
        """The grammar compiled (`compile`) in xgrammar's serialized form, for an engine
        with the same tokenizer to load (`Grammar.compiled`)."""
        return self.compile(grammar).serialize_json()

    @staticmethod
    def _check_schema(grammar: Grammar) -> None:
        """JSON, an object (what it asks for is checked as its grammar is built:
        runtime/grammar_sources.py)."""
        try:
            schema = json.loads(grammar.source)
        except ValueError as e:
            raise InvalidRequestError(f"the JSON schema is not JSON: {e}", grammar.field) from e
        except RecursionError:
            raise InvalidRequestError(TOO_DEEP, grammar.field) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("a JSON schema must be an object", grammar.field)

    def state(self, req) -> GrammarState:
        """The request's matcher, made on first use (on every rank: each masks its logits)."""
        if req.grammar_state is None:
            req.grammar_state = GrammarState(xgr.GrammarMatcher(self.compile(req.params.grammar)))
        return req.grammar_state

    def remote(self, req) -> RemoteGrammar:
        """The request's matcher in a worker, made on first use."""
        state = self.state(req)
        if state.remote is None:
            grammar = req.params.grammar
            state.remote = self.pool.remote(self.compile(grammar), grammar.key)
        return state.remote


def tokenizer_info(tokenizer, vocab_size: int, stop_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's tables for the tokenizer, where its special tokens other than the stop
    tokens are special to xgrammar too (no grammar allows them; the stop tokens end one):
    xgrammar's own take only padding as special and reads the rest as their text, so a
    `<|im_start|>` could fill a JSON string, which the detokenizer then drops (it skips
    special tokens) from the text it returns."""
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids
    )
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special |= {i for i, token in added.items() if getattr(token, "special", False)}
    special = {i for i in special if 0 <= i < vocab_size} - set(info.stop_token_ids)
    if special <= set(info.special_token_ids):
        return info
    vocab = list(info.decoded_vocab)
    for i in special:
        vocab[i] = b""  # (xgrammar's special tokens: those with no text)
    return xgr.TokenizerInfo(
        vocab,
        xgr.VocabType.RAW,  # (the vocabulary decoded already)
        vocab_size=vocab_size,
        stop_token_ids=info.stop_token_ids,
        add_prefix_space=info.add_prefix_space,
    )


class LoadedGrammars:
    """Grammars compiled elsewhere and loaded here, by key: the LOADED_KEPT least recently
    used, and every one a live `Grammar` object uses (pinned from `get` or `add` until that
    object goes, as its request does). A request whose grammar travelled key-only
    (`GrammarHandOver`: loaded with an earlier request) thus finds it when its matcher is
    made, however many other grammars arrived while it waited; unpinned, it was compiled
    again from source there, on the step loop (seconds for some schemas)."""

    def __init__(self, kept: int = LOADED_KEPT):
        self.kept = kept
        self._grammars: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._users: dict[tuple, int] = {}  # key -> live Grammar objects pinning it
        self._pins: dict[int, weakref.ref] = {}  # id(Grammar) -> a reference to it

    def __contains__(self, key: tuple) -> bool:
        return key in self._grammars

    def __len__(self) -> int:
        return len(self._grammars)

    def get(self, grammar: Grammar) -> xgr.CompiledGrammar | None:
        compiled = self._grammars.get(grammar.key)
        if compiled is not None:
            self._grammars.move_to_end(grammar.key)
            self._pin(grammar)
        return compiled

    def add(self, grammar: Grammar, compiled: xgr.CompiledGrammar) -> None:
        self._grammars[grammar.key] = compiled
        self._grammars.move_to_end(grammar.key)
        self._pin(grammar)
        unpinned = len(self._grammars) - len(self._users)  # (every pinned key is here)
        for key in [k for k in self._grammars if k not in self._users]:
            if unpinned <= self.kept:
                break
            del self._grammars[key]
            unpinned -= 1

    def _pin(self, grammar: Grammar) -> None:
        if id(grammar) in self._pins:
            return
        key, users, pins, gid = grammar.key, self._users, self._pins, id(grammar)

        def unpin(_):  # (the Grammar went; called before its id can be reused)
            pins.pop(gid, None)
            if users.get(key, 0) > 1:
                users[key] -= 1
            else:
                users.pop(key, None)

        pins[gid] = weakref.ref(grammar, unpin)
        users[key] = users.get(key, 0) + 1


# A compile worker's compiler (server/grammar_compile.py: one process of its pool each)
_worker_compiler: GrammarCompiler | None = None


def start_compile_worker(info_json: str, vocab_size: int) -> None:
    """A compile worker's start: its compiler for the tokenizer `info_json` describes."""
    global _worker_compiler
    _worker_compiler = GrammarCompiler.from_info(info_json, vocab_size)


def compile_in_worker(grammar: Grammar) -> tuple[str | None, str | None]:
    """In a compile worker: (the grammar compiled and serialized, None), or (None, why)
    for a grammar that cannot be used (the request's 400, naming its field)."""
    try:
        return _worker_compiler.serialize(grammar), None
    except InvalidRequestError as e:
        return None, str(e)


class GrammarState:
    """One request's matcher and how many of its output tokens it has taken; and its matcher
    in a grammar worker (`remote`), which follows the same tokens on its own count, where
    steps with many constrained rows have been filled there."""

    __slots__ = ("matcher", "num_taken", "remote")

    def __init__(self, matcher: xgr.GrammarMatcher):
        self.matcher, self.num_taken = matcher, 0
        self.remote: RemoteGrammar | None = None

    def follow(self, output: list[int], unprocessed: Sequence[int] = ()) -> None:
        """Take the committed tokens it has not seen (`unseen_tokens`, `take_tokens`)."""
        take_tokens(self.matcher, unseen_tokens(self.num_taken, output, unprocessed))
        self.num_taken = len(output) + len(unprocessed)

    def release(self) -> None:
        """The request ended: its worker's matcher goes too (once)."""
        remote, self.remote = self.remote, None
        if remote is not None:
            remote.release()


class MaskBuffer:
    """Host memory for a step's token masks (int32 bitmask rows of `words` words), kept for
    the engine's life and reused step after step, two buffers in turn: pinned on CUDA, so
    the upload never waits for the device, and reset with numpy. A bitmask allocated and
    filled with torch each step (`torch.full`, 98k integers at 64 rows of a 49k vocabulary)
    went through the pinned allocator and woke torch's intra-op threads, past their grain
    of 32k elements: on a loaded host the step then waited for a worker to get a core
    (2 CPU cores, one busy, 5 ms of other work between fills: 3.5-8 ms median against
    0.01 ms on one thread; numpy 0.01 ms)."""

    def __init__(self, words: int, shared: bool = False):
        self.words = words
        # Shared (`shared`: a file in /dev/shm mapped here and by the grammar workers,
        # runtime/grammar_pool.py; registered with CUDA as pinned), each buffer allocated
        # numbered, its file removed once every worker has mapped it.
        self.shared = shared
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.files: list[tuple[int, int, str] | None] = [None, None]  # (slot, serial, path)
        self._serials = itertools.count()
        self.uploaded: list = [None, None]  # CUDA event after each buffer's last upload
        self.current = 0

    def take(self, rows: int, device: torch.device) -> tuple[torch.Tensor, float]:
        """A [rows, words] bitmask, every token allowed (-1), and the ms waited for the
        device (the upload of that buffer two steps ago: long done in practice)."""
        self.current ^= 1
        i, waited = self.current, 0.0
        buffer = self.buffers[i]
        if buffer is None or buffer.shape[0] < rows:
            cap = max(rows, 2 * buffer.shape[0] if buffer is not None else 64)
            if buffer is not None and self.uploaded[i] is not None:
                self.uploaded[i].synchronize()  # (its last upload, before it goes)
            buffer = self.buffers[i] = self._allocate(i, cap, device)
            self.uploaded[i] = None
        elif self.uploaded[i] is not None:
            start = time.perf_counter()
            self.uploaded[i].synchronize()
            waited = (time.perf_counter() - start) * 1e3
            self.uploaded[i] = None
        bitmask = buffer[:rows]
        bitmask.numpy().fill(-1)
        return bitmask, waited

    @property
    def file(self) -> tuple[int, int, str]:
        """The slot (0 or 1), serial number and file of the shared buffer `take` gave last."""
        return self.files[self.current]

    def _allocate(self, i: int, rows: int, device: torch.device) -> torch.Tensor:
        pinned = device.type == "cuda"
        if not self.shared:
            return torch.empty((rows, self.words), dtype=torch.int32, pin_memory=pinned)
        serial = next(self._serials)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(folder, f"specserve-masks-{os.getpid()}-{id(self)}-{serial}")
        size = rows * self.words
        buffer = torch.from_file(path, shared=True, size=size, dtype=torch.int32).view(rows, -1)
        self.files[i] = (i, serial, path)
        # (the pool removes the file once every worker has mapped it; else it goes with this)
        weakref.finalize(buffer, _remove, path)
        if pinned:  # (unregistered when the buffer goes: the finalizer)
            cudart = torch.cuda.cudart()
            ptr = buffer.data_ptr()
            if int(cudart.cudaHostRegister(ptr, buffer.nbytes, 0)) == 0:
                weakref.finalize(buffer, cudart.cudaHostUnregister, ptr)
            else:  # uploads from it then wait for the device's queue
                logger.warning("could not pin the grammar masks' shared memory")
        return buffer

    def upload(self, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The bitmask `take` gave (filled) on `device`, without waiting; it is not
        written again until the copy is done."""
        if device.type != "cuda":
            return bitmask
        on_device = bitmask.to(device, non_blocking=True)
        event = self.uploaded[self.current] = torch.cuda.Event()
        event.record()
        return on_device


class BatchFill:
    """Masks of many matchers' rows by xgrammar's batch fill, one C++ call for them all: on
    this thread, or over `threads` threads from THREADED_MIN_ROWS rows. A single matcher's
    row is filled directly (no lists to convert)."""

    def __init__(self, threads: int = 1):
        self.serial = xgr.BatchGrammarMatcher(1)
        self.threaded = xgr.BatchGrammarMatcher(threads) if threads > 1 else self.serial

    def __call__(
        self, matchers: list[xgr.GrammarMatcher], bitmask: torch.Tensor, rows: list[int]
    ) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        else:
            batch = self.threaded if len(matchers) >= THREADED_MIN_ROWS else self.serial
            batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def fill_masks(
    bitmask: torch.Tensor,
    spans: list[tuple[xgr.GrammarMatcher, int, list[int]]],
    batch_fill: BatchFill,
) -> None:
    """Fill the mask rows of each (matcher, first row, drafts): row first + j is the mask
    after drafts[:j], each taken in turn, then all rolled back. Rows after an illegal draft
    keep the mask before it (never read: see the module doc); rows past the grammar's end
    (reached under ignore_eos) allow every token, as plain decoding's rows there do.

    Position-major: at each draft position, one batch fill of the rows of every request still
    live there (grammar not ended, drafts so far legal), then each takes its draft there
    (one call each: xgrammar's batch accept and rollback convert their lists slower)."""
    live, j = spans, 0
    while live:
        filling = []
        for span in live:
            matcher, first, drafts = span
            if matcher.is_terminated():  # its output ended (the rest, under ignore_eos, is free)
                bitmask[first + j : first + len(drafts) + 1] = -1
                if j:
                    matcher.rollback(j)
            else:
                filling.append(span)
        if filling:
            batch_fill([s[0] for s in filling], bitmask, [first + j for _, first, _ in filling])
        live = []
        for span in filling:
            matcher, first, drafts = span
            if j < len(drafts):
                if matcher.accept_token(drafts[j]):
                    live.append(span)
                    continue
                bitmask[first + j + 1 : first + len(drafts) + 1] = bitmask[first + j]
            if j:  # (it took drafts[:j])
                matcher.rollback(j)
        j += 1


def _constrained_spans(step):
    """(request, its first logit row, its rows) of each constrained sampled request, and the
    input rows of their drafts in that order."""
    spans, inputs, offset = [], [], 0
    for s in step.sampled:
        rows = s.drafted + 1
        if s.request.constrained:
            spans.append((s.request, offset, rows))
            inputs += step.sample_rows[offset + 1 : offset + rows]
        offset += rows
    return spans, inputs


class PackedDrafts(NamedTuple):
    """A step's constrained requests (`_constrained_spans`) and their drafts on their way to
    the host: `host` (None: no drafts), done when `done` is (None: done already)."""

    spans: list
    host: torch.Tensor | None
    done: torch.cuda.Event | None


def copy_drafts(step) -> PackedDrafts | None:
    """Start copying the drafts of the step's constrained requests to the host, queued before
    the forward (call it when the step is packed): `mask_grammars` then waits for the drafts
    alone and fills the masks while the forward runs, not after it. None: no constrained
    request samples in the step."""
    spans, inputs = _constrained_spans(step)
    if not spans:
        return None
    if not inputs:
        return PackedDrafts(spans, None, None)
    device = step.input_ids.device
    drafts = step.input_ids[to_device(inputs, device)]
    if device.type != "cuda":
        return PackedDrafts(spans, drafts, None)
    host = torch.empty(drafts.shape, dtype=drafts.dtype, pin_memory=True)
    host.copy_(drafts, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return PackedDrafts(spans, host, done)


def _host_drafts(step, packed: PackedDrafts) -> list[int]:
    """The drafts of the step's constrained requests on the host (waiting for their copy
    only, not for the forward queued after it; the wait is added to `step.sample_wait_ms`)."""
    if packed.done is not None:
        start = time.perf_counter()
        packed.done.synchronize()
        step.sample_wait_ms += (time.perf_counter() - start) * 1e3
    return packed.host.tolist() if packed.host is not None else []


def _with_drafts(spans, drafts: list[int]):
    """(request, its first row, its drafts) of each constrained request (`drafts`: all of
    theirs, in span order, one per row after the first)."""
    used = 0
    for req, first, rows in spans:
        yield req, first, drafts[used : used + rows - 1]
        used += rows - 1


def start_masks(step, compiler: GrammarCompiler) -> bool:
    """Send the step's masks to the grammar workers, where they fill them (a pool, ready,
    and at least `pool_min_rows` constrained rows): the step's loop may then do other work
    until `mask_grammars` collects them. Needs the step in flight's tokens (resolved).
    False: nothing sent (no workers, not ready yet, too few rows, or started already)."""
    pool, packed = compiler.pool, step.grammar_drafts
    if pool is None or packed is None or step.grammar_pending is not None or not pool.ready:
        return False
    if sum(rows for _, _, rows in packed.spans) < compiler.pool_min_rows:
        return False
    drafts = _host_drafts(step, packed)
    bitmask, waited = compiler.masks.take(len(step.sample_rows), step.input_ids.device)
    step.sample_wait_ms += waited
    filling = []
    for req, first, own in _with_drafts(packed.spans, drafts):
        state = compiler.remote(req)
        tokens = state.new_tokens(req.output_token_ids, req.unprocessed_token_ids)
        filling.append((state, tokens, first, own))
    step.grammar_pending = (bitmask, pool.send(bitmask, compiler.masks.file, filling))
    return True


def mask_grammars(out: torch.Tensor, step, compiler: GrammarCompiler) -> None:
    """Mask, in place, every logit row of the step's constrained requests to the tokens their
    grammars allow there: filled by the grammar workers (`start_masks`, sent earlier or
    now), else here. Their drafts come from the step's input ids: the copy started when the
    step was packed (`copy_drafts`, `step.grammar_drafts`), else one started now (after the
    forward: it waits for it). Time spent waiting for the device is added to
    `step.sample_wait_ms` (the step loop counts it as a wait, not as sampling)."""
    if step.grammar_pending is not None or start_masks(step, compiler):
        bitmask, ticket = step.grammar_pending
        step.grammar_pending = None
        compiler.pool.collect(ticket)
    else:
        packed = step.grammar_drafts or copy_drafts(step)
        if packed is None:
            return
        drafts = _host_drafts(step, packed)
        # Every row's mask, all tokens allowed (-1) where no grammar fills it: no row
        # indices to upload (xgrammar's take a list, copied from pageable memory: that
        # waits for the forward).
        bitmask, waited = compiler.masks.take(out.shape[0], out.device)
        step.sample_wait_ms += waited
        filling = []
        for req, first, own in _with_drafts(packed.spans, drafts):
            state = compiler.state(req)
            state.follow(req.output_token_ids, req.unprocessed_token_ids)
            filling.append((state.matcher, first, own))
        fill_masks(bitmask, filling, compiler.batch_fill)
    assert bitmask.shape[0] == out.shape[0]
    xgr.apply_token_bitmask_inplace(
        out, compiler.masks.upload(bitmask, out.device), vocab_size=compiler.vocab_size
    )
