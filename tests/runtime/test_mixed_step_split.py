"""A mixed step's metadata splits where the Triton backend launches its two kernels: packing
keeps each request's query length and KV bound on the host, the engine's real steps lead
with their decode and verify rows, and `AttentionMetadata.split` hands each launch its own
requests with token offsets of its own (computed once a step, however many layers ask);
a step carrying a prefill chunk is marked so (`AttentionMetadata.prefill`)."""

from __future__ import annotations

import torch

from specserve import LLM, SamplingParams
from specserve.runtime.packing import Segment, pack
from tests.support.spies import spy_on

CPU = torch.device("cpu")


def test_pack_keeps_the_host_lengths_and_split_slices_them():
    segments = [
        Segment([1, 2], 5, [7]),
        Segment([3, 4], 9, [7, 8, 9], pad=1, max_shift=2),
        Segment([5, 6, 7], 0, list(range(40))),
    ]
    _, meta, _ = pack(segments, 16, CPU)
    assert meta.query_lens == [1, 4, 40] and meta.seq_bounds == [6, 14, 40]
    tokens, head, tail = meta.split(most=4)
    assert tokens == 5 and head.num_requests == 2 and tail.num_requests == 1
    assert head.query_start_loc.tolist() == [0, 1, 5] and head.max_query_len == 4
    assert head.max_seq_len == 14 and tail.max_seq_len == 40
    assert tail.query_start_loc.tolist() == [0, 40] and tail.max_query_len == 40
    assert torch.equal(tail.positions, meta.positions[5:])
    assert torch.equal(tail.block_tables, meta.block_tables[2:])
    assert meta.split(most=4) is meta.split(most=4)  # once a step
    assert meta.split(most=40) is None and meta.split(most=0) is None  # all short, none


def test_the_engines_mixed_steps_lead_with_their_decode_rows(tiny_llama):
    llm = LLM(str(tiny_llama), max_num_batched_tokens=64)
    engine = llm.engine
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    for prompt in ([5, 6, 7], [8, 9]):
        engine.add_request(prompt, greedy)
    engine.step()  # both prompts prefilled; both decode from now on
    engine.add_request(list(range(3, 43)), greedy)  # a 40-token prompt joins them
    prepare, seen = engine.runner.prepare, []

    def spy(batch, prev=None, *rest):
        step = prepare(batch, prev, *rest)
        seen.append(step.meta)
        return step

    spy_on(engine.runner, "prepare", spy)
    engine.step()
    meta = seen[-1]
    assert meta.query_lens == [1, 1, 40]
    tokens, head, tail = meta.split(most=16)
    assert (tokens, head.num_requests, tail.num_requests) == (2, 2, 1)
    # marked as carrying prefill (its dense layers go by row count); decode steps are not
    assert meta.prefill
    engine.step()
    assert seen[-1].query_lens == [1, 1, 1] and not seen[-1].prefill
