"""The EAGLE-3 drafter's CUDA graphs at start-up: which head passes get one
(`catch_up_lengths`: draft steps, the catch-ups after a verify step, chains for every K >= 2;
catch-ups that only write the head's KV by token bucket) and their capture,
logged with its time and memory."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from specserve.speculative.eagle3_graphs import DrafterGraphs

if TYPE_CHECKING:
    from specserve.speculative.eagle3 import Eagle3Proposer
    from specserve.speculative.target import TargetParts

log = logging.getLogger("specserve")


def catch_up_lengths(k_max: int) -> tuple[int, ...]:
    """Tokens per request of the captured head passes: 1 (draft steps), up to K+1 (the
    catch-up after a verify step) and 2(K+1) (after a verify step and a plain step, as
    draft lengths switching between 0 and K leave it); longer catch-ups run eagerly."""
    return (*range(1, k_max + 2), 2 * (k_max + 1))


def capture_drafter_graphs(
    proposer: Eagle3Proposer, target: TargetParts, use_graphs: bool = True
) -> DrafterGraphs:
    """Graphs for draft steps and catch-ups (`catch_up_lengths`), and for catch-ups of any
    lengths that only write the head's KV, by the token buckets of the target's steps
    carrying prefill (none where those are off: `--cuda-graph-max-tokens 0`);
    use_graphs=False: the same padded path, eager."""
    from specserve.runtime.graph_shapes import default_token_buckets, engine_graph_shapes

    cfg = target.config
    catch_up_tokens = default_token_buckets(
        min(cfg.execution.cuda_graph_max_tokens, cfg.scheduler.max_num_batched_tokens)
    )
    graphs = DrafterGraphs(
        proposer.head,
        proposer.embed,
        proposer.kv.layers[0],
        proposer.backend,
        engine_graph_shapes(cfg)[0],
        catch_up_lengths(cfg.speculative.num_steps),
        target.max_model_len,
        use_graphs,
        chain_lengths=tuple(range(2, cfg.speculative.num_steps + 1)),  # every K >= 2
        feature_store=proposer.feature_store,
        catch_up_tokens=catch_up_tokens,
    )
    report = graphs.capture()
    log.info(
        "captured %d EAGLE-3 drafter CUDA graphs in %.1f s (warm-up %.1f s), graph memory "
        "%.1f MiB, static buffers %.1f MiB",
        report.num_graphs,
        report.capture_s,
        report.warmup_s,
        report.graph_pool_bytes / 2**20,
        report.static_bytes / 2**20,
    )
    return graphs
