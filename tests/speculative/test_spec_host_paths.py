"""The host shortcuts of speculative steps compute what the general paths compute.

- Dense steps (every request drafts K on the device under overlap, every row samples): the
  verify inputs placed from the step in flight, logits and drafts read as views, the
  drafter's catch-up copied as one block and accept lengths read without an upload; the
  tokens equal the synchronous loop's (where none of these run) and the fast paths ran.
- The EAGLE-3 feature store: a request catches its drafter up on features written by any
  earlier step, however long ago; after plain steps of a dormant policy (which keeps no
  drafter state up to date along the way) the drafts equal those of an engine that always
  drafts, at the same committed context. Under the off policy the target keeps no drafter
  inputs at all: the store stays empty.
- Greedy verification returns the argmax row: its committed prefix equals the assembled
  tokens of the general verifier.
"""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.runtime import inflight
from specserve.runtime.verify import verify_greedy
from specserve.speculative import eagle3_graph_inputs
from specserve.speculative.policy import FixedPolicy, PerRequestPolicy
from tests.support.model_cases import install_padded_runner
from tests.support.overlap_cases import make_models, prompts_for, record_drafts, spec_kwargs
from tests.support.spies import spy_on

PARAMS = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory)


def _engine(models, overlap: str, **kw) -> LLM:
    from specserve.speculative.eagle3 import capture_drafter_graphs

    kw = {"speculative_num_steps": 3, **spec_kwargs(models, "eagle3"), "page_size": 4, **kw}
    llm = LLM(models["target"], overlap_schedule=overlap, **kw)
    install_padded_runner(llm, q_lens=(1, 2, 3, 4), aux_layer_ids=llm.engine.spec.aux_layer_ids)
    proposer = llm.engine.spec.proposer
    proposer.graphs = capture_drafter_graphs(proposer, llm.engine.target, use_graphs=False)
    return llm


def _count(monkeypatch, owner, name: str, hits: dict, when=bool) -> None:
    fn = getattr(owner, name)

    def counted(*args, **kwargs):
        out = fn(*args, **kwargs)
        hits[name] += bool(when(out))
        return out

    static = isinstance(vars(owner).get(name), staticmethod)
    monkeypatch.setattr(owner, name, staticmethod(counted) if static else counted)


def test_dense_speculative_steps_equal_the_synchronous_loop(models, monkeypatch):
    prompts = prompts_for()[:4]
    outs = {}
    for overlap in ("off", "on"):
        llm = _engine(models, overlap, speculative_simulate_acceptance=0.6)
        outs[overlap] = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    hits = {"_place_dense": 0, "_is_dense": 0}
    _count(monkeypatch, inflight, "_place_dense", hits)
    _count(monkeypatch, eagle3_graph_inputs, "_is_dense", hits)
    llm = _engine(models, "on", speculative_simulate_acceptance=0.6)
    again = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    assert hits["_place_dense"] > 5 and hits["_is_dense"] > 5
    # As in test_overlap_device: the last few tokens may differ (draft-length caps).
    assert [t[:22] for t in again] == [t[:22] for t in outs["off"]]
    assert again == outs["on"]
    # Positions and KV slots by numpy in every pack and drafter pass: the same tokens.
    from specserve.runtime import packing

    monkeypatch.setattr(packing, "VECTOR_MIN_TOKENS", 0)
    monkeypatch.setattr(eagle3_graph_inputs, "VECTOR_MIN_TOKENS", 0)
    llm = _engine(models, "on", speculative_simulate_acceptance=0.6)
    assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == outs["on"]


class _Dormant(PerRequestPolicy):
    """Plain decoding with the drafter's upkeep stopped (the goodput policy's dormancy)."""

    dormant = True

    def __init__(self):
        super().__init__(3, lambda r: 0)


def test_catch_up_from_the_store_after_plain_steps(models):
    """Dormant for a stretch (no ride-along, no drafter work at all), then fixed K: the
    first drafts after the pause equal those of an engine that drafted all along."""
    prompts = prompts_for()[:4]
    always = _engine(models, "on", speculative_policy="fixed")
    want = record_drafts(always)
    ref = [o.token_ids for o in always.generate(prompts, PARAMS)]

    llm = _engine(models, "on", speculative_policy="fixed")
    engine = llm.engine
    engine.spec.policy = _Dormant()
    proposer, runs = engine.spec.proposer, []
    propose = proposer.propose
    spy_on(
        proposer, "propose", lambda items, *prev: (runs.append(len(items)), propose(items, *prev))
    )
    got = record_drafts(llm)
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    for _ in range(12):
        engine.step()
    assert not runs  # dormant: the proposer never ran
    engine.spec.policy = FixedPolicy(3)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out.token_ids
    assert runs
    assert [outs[rid] for rid in ids] == ref
    common = got.keys() & want.keys()
    assert len(common) >= 8
    assert {key: got[key] for key in common} == {key: want[key] for key in common}


def test_greedy_verify_prefix_equals_assembled_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, 11, generator=gen)
    argmax = logits.argmax(-1)
    drafts = torch.where(torch.rand(6, 3, generator=gen) < 0.7, argmax[:, :3], 0)
    draft_lens = torch.tensor([3, 2, 1, 0, 3, 3])
    res = verify_greedy(logits, drafts, draft_lens)
    assembled = torch.cat([drafts, torch.zeros(6, 1, dtype=torch.int64)], dim=1)
    assembled[torch.arange(6), res.accept_len] = argmax[torch.arange(6), res.accept_len]
    for row, want, a in zip(res.tokens.tolist(), assembled.tolist(), res.accept_len.tolist()):
        assert row[: a + 1] == want[: a + 1]
    full = verify_greedy(logits, drafts, None)  # every row drafted 3
    assert (
        full.accept_len.tolist()
        == verify_greedy(logits, drafts, torch.full((6,), 3)).accept_len.tolist()
    )


@pytest.mark.gpu
def test_pinned_arena_reuses_memory_safely():
    """Many uploads through a small arena (it wraps often): every one arrives intact."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from specserve.runtime import packing

    device = torch.device("cuda")
    arena = packing.PinnedArena(half_slots=4096)
    outs, wants = [], []
    for i in range(400):
        n = 1 + (i * 37) % 900
        host_view, host = arena.take(n)
        host_view[:] = range(i, i + n)
        outs.append(host.to(device, non_blocking=True))
        wants.append(list(range(i, i + n)))
    torch.cuda.synchronize()
    assert [o.tolist() for o in outs] == wants


@pytest.mark.parametrize("shifted", [False, True])
def test_pack_vectorized_equals_the_loop(monkeypatch, shifted):
    """Large steps compute positions and slots with numpy: the same tensors as the loop
    (decodes, verify rows, prefill chunks, padding, shifts on the device)."""
    import random

    from specserve.runtime import packing

    rng = random.Random(3)
    page_size = 4
    for trial in range(20):
        segments = []
        for _ in range(rng.randint(1, 12)):
            start, n = rng.randint(0, 30), rng.choice([1, 1, 4, rng.randint(1, 20)])
            pad = rng.choice([0, 0, 3])
            table = rng.sample(range(1, 200), -(-(start + n + 3) // page_size))
            segments.append(
                packing.Segment(table, start, [rng.randrange(500) for _ in range(n)], pad, 3)
            )
        shift = None
        if shifted:
            shift = torch.tensor([rng.randint(0, 3) for _ in segments])
        got = []
        for threshold in (0, 10**9):
            monkeypatch.setattr(packing, "VECTOR_MIN_TOKENS", threshold)
            ids, meta, last_rows = packing.pack(segments, page_size, torch.device("cpu"), shift)
            got.append(
                (
                    ids.tolist(),
                    meta.positions.tolist(),
                    meta.slot_mapping.tolist(),
                    meta.query_start_loc.tolist(),
                    meta.seq_lens.tolist(),
                    meta.block_tables.tolist(),
                    meta.max_query_len,
                    meta.max_seq_len,
                    last_rows,
                )
            )
        assert got[0] == got[1], trial


def test_the_off_policy_keeps_no_drafter_inputs(models):
    """Under `--speculative-policy off` the target writes no EAGLE-3 features (nothing will
    ever draft from them): no auxiliary layers, an empty store, outputs as plain decoding."""
    prompts = prompts_for()[:4]
    plain = LLM(models["target"], page_size=4, speculative_algorithm="none")
    ref = [o.token_ids for o in plain.generate(prompts, PARAMS)]
    llm = _engine(models, "on", speculative_policy="off")
    spec = llm.engine.spec
    assert spec.aux_layer_ids == () and spec.feature_writer() is None
    assert [o.token_ids for o in llm.generate(prompts, PARAMS)] == ref
    assert not spec.proposer.feature_store.any()
    fixed = _engine(models, "on", speculative_policy="fixed")  # (and K > 0 writes them)
    fixed.generate(prompts, PARAMS)
    assert fixed.engine.spec.proposer.feature_store.any()
