"""Which CUDA graphs an engine captures: the batch buckets and tokens per request of decode
and verify steps, and the request and token buckets of steps that carry prefill chunks
(runtime/cuda_graphs.py captures and replays them; KV sizing reserves for their outputs).
"""

from __future__ import annotations

from specserve.core.config import EngineConfig


def default_batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then multiples of 16, up to and including max_batch."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return tuple(small + list(range(16, max_batch, 16)) + [max_batch])


def default_token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token counts of mixed-step graphs: 32, 64, 128, 256, then multiples of 128, up to
    and including max_tokens (the dense layers run the padded count: finer steps where
    it costs more); none for max_tokens < 1."""
    if max_tokens < 1:
        return ()
    small = [t for t in (32, 64, 128, 256) if t < max_tokens]
    return tuple(small + list(range(384, max_tokens, 128)) + [max_tokens])


def mixed_request_buckets(max_requests: int) -> tuple[int, ...]:
    """Request counts of mixed-step graphs, padding included: powers of four from 4 up to
    max_requests, then max_requests + 1 (a mixed step pads at least one request, which owns
    its padded tokens). Padded requests cost attention a few empty programs and the dense
    layers nothing, so coarse buckets lose little and save captures."""
    buckets = [4]
    while buckets[-1] * 4 <= max_requests:
        buckets.append(4 * buckets[-1])
    if buckets[-1] <= max_requests:
        buckets.append(max_requests + 1)
    return tuple(buckets)


def engine_mixed_shapes(config: EngineConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(request buckets, token buckets) of an engine's mixed-step graphs: tokens up to
    min(cuda_graph_max_tokens, max_num_batched_tokens); none when that is 0."""
    tokens = default_token_buckets(
        min(config.execution.cuda_graph_max_tokens, config.scheduler.max_num_batched_tokens)
    )
    if not tokens:
        return (), ()
    batch = min(config.scheduler.max_num_seqs, config.execution.cuda_graph_max_batch)
    return mixed_request_buckets(batch), tokens


def mixed_keys(request_buckets, token_buckets) -> list[tuple[int, int]]:
    """The (requests, tokens) pairs worth a graph: a step has at least a token a request,
    and its request bucket is the smallest above its count."""
    keys = []
    for t in token_buckets:
        for b in request_buckets:
            keys.append((b, t))
            if b > t:
                break
    return keys


def engine_graph_shapes(config: EngineConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(batch buckets, q_lens: tokens per request) of an engine's target graphs: buckets up to
    min(max_num_seqs, cuda_graph_max_batch); 1..K_max + 1 tokens with speculation, else 1."""
    k_max = config.speculative.num_steps if config.speculative.algorithm else 0
    buckets = default_batch_buckets(
        min(config.scheduler.max_num_seqs, config.execution.cuda_graph_max_batch)
    )
    return buckets, tuple(range(1, k_max + 2))
