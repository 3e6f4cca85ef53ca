"""The Triton attention backend: paged KV write plus one attention kernel for prefill, extend,
decode and verify (see triton_kernels.py), split over the KV length when a step has too few
(request, KV head) pairs to fill the GPU.

Importing this module does not import triton; the kernels are loaded on first use, so the
backend can be registered on machines without triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from specserve.layers.attention.base import TILE_ROWS, AttentionBackend, AttentionMetadata

MAX_SPLITS = 32
MIN_SPLIT_TOKENS = 128  # a KV chunk shorter than this is not worth a separate program
# Prefill tiles (TILE_ROWS rows, 8 warps) resident per multiprocessor, and their shortest
# chunk in keys: a short chunk over a long context (a question after a cached system prompt
# or conversation: 64 tokens x 4 query heads a KV head after 2,048 cached tokens on the 8B
# shape) is 3 tiles x 8 KV heads = 24 programs walking all the keys one block at a time on
# a 132-multiprocessor GPU; split, its first token came 12.0 -> 9.7 ms after it was added
# on the H200 (docs/performance.md, prefix caching).
PREFILL_PROGRAMS_PER_SM = 2
PREFILL_MIN_CHUNK = 256
# The shortest chunk of batch-invariant steps, in keys (one 32-key block: chunks as short as
# the split count's by program count; longer ones cut the partials a verify step writes and
# merges, at a cost to parallelism: on the H200 chunks of 128+ keys lost 1-3% at batches
# 1-16, plain and K=3 alike)
INVARIANT_MIN_CHUNK = 32
# Decode and verify steps of up to this many requests cut every request's keys into
# MAX_SPLITS chunks whatever their program count (`batch_invariant`): the GEMVs' shared row
# buckets (kernels/gemv_plan.py SHARED_ROWS) keep a row's bits up to the same request count.
INVARIANT_MAX_REQUESTS = 16


@dataclass(frozen=True)
class LaunchConfig:
    """Keys per loop iteration, warps and software-pipelining stages of the attention kernel."""

    block_n: int
    num_warps: int
    num_stages: int


DECODE_LAUNCH = LaunchConfig(block_n=32, num_warps=4, num_stages=3)  # decode and verify
PREFILL_LAUNCH = LaunchConfig(block_n=64, num_warps=8, num_stages=2)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter on the CPU: keep the split count small


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through Triton kernels; same contract as the torch reference.

    `num_splits` fixes the KV split count (1: never split), None chooses it per step from
    the number of (request, KV head) programs and `meta.max_seq_len`, so that about
    `programs_per_sm` programs run per multiprocessor. With `batch_invariant`, decode and
    verify steps of at most INVARIANT_MAX_REQUESTS requests cut each row's keys into
    MAX_SPLITS chunks of its own length (position + 1, in whole key blocks) however many
    programs run: a verify row then gets the bits of the same request's decode row, at any
    request count up to that (the split count and the step's length would otherwise move
    the chunk boundaries). Under CUDA
    graphs pass max_seq_len = the longest context the graph serves: the split count is then
    fixed at capture and chunk sizes adapt on the device. `decode` applies to steps of at most
    DECODE_MAX_ROWS query rows per (request, KV head), `prefill` to the others.
    `kernels` replaces the kernel module (tests pass one defined under the interpreter).
    Like the model runner's metadata, it assumes a request's new tokens sit at ascending
    positions (the last one bounds the keys a query block reads).
    """

    name = "triton"
    mixed_graphs = True

    def __init__(
        self,
        num_splits: int | None = None,
        programs_per_sm: float = 4,
        decode: LaunchConfig = DECODE_LAUNCH,
        prefill: LaunchConfig = PREFILL_LAUNCH,
        kernels: ModuleType | None = None,
        batch_invariant: bool = True,
    ):
        self.num_splits = num_splits
        self.batch_invariant = batch_invariant
        self.cpu_invariant_chunks: int | None = None  # see invariant_chunks
        self.min_chunk = INVARIANT_MIN_CHUNK  # keys: the shortest chunk of invariant steps
        self.programs_per_sm = programs_per_sm
        self.prefill_programs_per_sm = PREFILL_PROGRAMS_PER_SM
        self.prefill_min_chunk = PREFILL_MIN_CHUNK  # keys
        self.decode, self.prefill = decode, prefill
        self._kernels = kernels
        self._sms: dict[torch.device, int] = {}

    @property
    def kernels(self) -> ModuleType:
        if self._kernels is None:
            from specserve.kernels.attention import triton_kernels

            self._kernels = triton_kernels
        return self._kernels

    def warm_up(self, num_heads: int, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> int:
        """Compile every kernel variant a model with `num_heads` query heads over this cache
        layout can need (query blocks of 16/32/64 rows for decode, verify and short
        catch-ups, 128 for prefill; split and unsplit, and with `batch_invariant` fewer
        programs than chunks), so that no step ever waits for Triton's compiler. Writes only
        to the scratch page 0; returns the variants run."""
        ops = self.kernels
        k_cache, v_cache = kv_cache
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        group = num_heads // kv_heads
        device = k_cache.device
        chunkings = [(1, None), (2, None)]
        if self.batch_invariant:  # fewer programs than chunks, and as many
            chunkings += [(2, MAX_SPLITS), (MAX_SPLITS, MAX_SPLITS)]
        shapes = [
            (q_len, splits, chunks)
            for q_len in sorted({max(1, rows // group) for rows in (16, 32, ops.DECODE_MAX_ROWS)})
            for splits, chunks in chunkings
        ]
        prefill_q = ops.DECODE_MAX_ROWS // group + 1
        shapes += [(prefill_q, 1, None), (prefill_q, 2, 2)]  # prefill-like: whole, chunked
        i64 = dict(dtype=torch.int64, device=device)
        for q_len, splits, chunks in shapes:
            q = torch.zeros(q_len, num_heads, head_dim, dtype=k_cache.dtype, device=device)
            kv = torch.zeros(q_len, kv_heads, head_dim, dtype=k_cache.dtype, device=device)
            slots = torch.zeros(q_len, **i64)  # every write to slot 0 of page 0
            ops.write_kv(kv, kv, k_cache, v_cache, slots)
            launch = self.decode if q_len * group <= ops.DECODE_MAX_ROWS else self.prefill
            ops.paged_attention(
                q,
                k_cache,
                v_cache,
                torch.arange(q_len, **i64) % 1,
                torch.tensor([0, q_len], **i64),
                torch.ones(1, **i64),
                torch.zeros(1, 1, **i64),
                q_len,
                1.0,
                num_splits=splits,
                chunk_splits=chunks,
                block_n=launch.block_n,
                num_warps=launch.num_warps,
                num_stages=launch.num_stages,
            )
        return len(shapes)

    def choose_num_splits(
        self, meta: AttentionMetadata, num_kv_heads: int, group: int, device: torch.device
    ) -> int:
        """How many chunks to cut each request's KV length into for this step."""
        if self.num_splits is not None:
            return self.num_splits
        rows = meta.max_query_len * group
        if rows > self.kernels.DECODE_MAX_ROWS:  # prefill: a program per row tile
            tiles = -(-rows // TILE_ROWS) * meta.num_requests
            return self.prefill_num_splits(tiles * num_kv_heads, meta.max_seq_len, device)
        # As many splits as keep every program in one wave: a second wave of short
        # programs plus the merge cost more than idle slots.
        return self.kernels.decode_num_splits(
            meta.num_requests * num_kv_heads,
            meta.max_seq_len,
            self._num_sms(device),
            self.programs_per_sm,
            MIN_SPLIT_TOKENS,
            MAX_SPLITS,
        )

    def prefill_num_splits(self, num_programs: int, max_seq_len: int, device) -> int:
        """Chunks for prefill tiles: as for decode (one wave), with fewer, larger programs
        resident and chunks of at least PREFILL_MIN_CHUNK keys. Most prefill steps fill the
        wave with tiles alone; a short chunk over a long context does not."""
        if self.num_splits is not None:
            return self.num_splits
        return self.kernels.decode_num_splits(
            num_programs,
            max_seq_len,
            self._num_sms(device),
            self.prefill_programs_per_sm,
            self.prefill_min_chunk,
            MAX_SPLITS,
        )

    def _num_sms(self, device: torch.device) -> int:
        if device not in self._sms:
            self._sms[device] = _num_sms(device)
        return self._sms[device]

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self.kernels.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        """Write the new K/V, then attend. A mixed step (decode or verify rows first, then
        prefill chunks: the scheduler's order) runs its short rows through the decode path
        and its chunks through the prefill tiles, each launch over its own requests: a
        one-token row inside a 128-row prefill tile would pay for the whole tile (on the
        8B shape that made decode rows in mixed steps ~30x dearer than in decode steps)."""
        ops = self.kernels
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.mixed is not None:
            return self._attend_mixed(q, k_cache, v_cache, meta, scale)
        split = meta.split(self.short_query_len(q.shape[1] // k_cache.shape[2]))
        if split is None:
            return self._attend(q, k_cache, v_cache, meta, scale)
        tokens, head, tail = split  # the short rows' tokens lead the step's
        out = torch.empty_like(q)
        self._attend(q[:tokens], k_cache, v_cache, head, scale, out[:tokens])
        self._attend(q[tokens:], k_cache, v_cache, tail, scale, out[tokens:])
        return out

    def _attend_mixed(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        """A mixed step of a CUDA graph (`MixedLayout`): the short rows through the decode
        path (as a decode or verify step of the graph's request count would take them:
        the same split count and chunking), then the prefill chunks' listed row blocks.
        The first launch also writes zeros over the rows of the chunks among its tokens;
        the second, after it, overwrites them."""
        mixed = meta.mixed
        out = torch.empty_like(q)
        n = min(mixed.short_tokens, q.shape[0])
        short = AttentionMetadata(
            meta.positions,
            meta.slot_mapping,
            mixed.short_query_start,
            meta.seq_lens,
            meta.block_tables,
            mixed.short_query_len,
            meta.max_seq_len,
        )
        self._attend(q[:n], k_cache, v_cache, short, scale, out[:n], clear=True)
        if n < q.shape[0]:
            out[n:].zero_()
        # the graph's tile count and longest context fix the chunking; each row block's
        # chunk length follows its own context on the device
        splits = self.prefill_num_splits(
            mixed.tiles.shape[0] * k_cache.shape[2], meta.max_seq_len, q.device
        )
        return self._launch(
            q,
            k_cache,
            v_cache,
            meta,
            scale,
            self.prefill,
            out=out,
            tiles=mixed.tiles,
            tile_rows=TILE_ROWS,
            **self._prefill_chunks(splits),
        )

    def short_query_len(self, group: int) -> int:
        """The longest query (tokens) of a request the decode path serves: DECODE_MAX_ROWS
        rows a KV head."""
        return self.kernels.DECODE_MAX_ROWS // group

    def _attend(
        self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out=None, clear=False
    ):
        ops = self.kernels
        kv_heads = k_cache.shape[2]
        splits = self.choose_num_splits(meta, kv_heads, q.shape[1] // kv_heads, q.device)
        rows = meta.max_query_len * q.shape[1] // kv_heads
        decode_like = rows <= ops.DECODE_MAX_ROWS
        launch = self.decode if decode_like else self.prefill
        invariant = (
            self.batch_invariant and decode_like and meta.num_requests <= INVARIANT_MAX_REQUESTS
        )
        chunks = self.invariant_chunks(q.device) if invariant else None
        if not decode_like:
            options = self._prefill_chunks(splits)
        else:
            if chunks:
                splits = min(splits, chunks)  # no program without a chunk
            options = dict(
                num_splits=splits, chunk_splits=chunks, min_chunk=self.min_chunk if chunks else None
            )
        return self._launch(
            q, k_cache, v_cache, meta, scale, launch, out=out, clear=clear, **options
        )

    def _prefill_chunks(self, splits: int) -> dict:
        """Launch options of prefill tiles in `splits` chunks, of at least
        `prefill_min_chunk` keys unless the split count is fixed (a row block's shorter
        context: fewer chunks, the other programs idle)."""
        if splits == 1 or self.num_splits is not None:
            return {"num_splits": splits}
        return {"num_splits": splits, "chunk_splits": splits, "min_chunk": self.prefill_min_chunk}

    def _launch(self, q, k_cache, v_cache, meta, scale, launch: LaunchConfig, **options):
        """`paged_attention` over `meta`'s requests with `launch`'s configuration."""
        return self.kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            meta.positions,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            scale,
            block_n=launch.block_n,
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
            **options,
        )

    def invariant_chunks(self, device: torch.device) -> int | None:
        """How many chunks batch-invariant steps cut keys into on `device`: MAX_SPLITS on a
        GPU (a constant, which is what invariance needs); on the CPU `cpu_invariant_chunks`
        (None: the split count's chunking). The CPU runs these kernels only through the
        Triton interpreter, in tests, whose whole-model cases a split and merge of every
        step would slow several-fold; the kernels' invariance is tested directly."""
        return MAX_SPLITS if device.type == "cuda" else self.cpu_invariant_chunks
