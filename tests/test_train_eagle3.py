"""train-eagle3: prompt sources, draft vocabulary, target features against transformers, the
training-time-test bookkeeping, and a tiny end-to-end run (loss falls, acceptance rises, the
head reloads strictly, training resumes from its checkpoint)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specserve.cli import main
from specserve.model.eagle3 import load_eagle3_head
from specserve.model.hf_config import load_hf_config
from specserve.model.loader import load_model, resolve_model
from specserve.train.config import TrainConfig
from specserve.train.distill import Sample, build_draft_vocab
from specserve.train.features import record_features
from specserve.train.prompts import (
    PromptSourceError,
    jsonl_prompts,
    load_prompts,
    reserved_keys,
    shakespeare_prompts,
    stdlib_prompts,
)
from specserve.train.trainer import train
from specserve.train.ttt import UnrollOutput, acceptance_stats, ttt_mask
from tests.tiny_models import make_tiny_model

AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target4"), "llama", num_layers=4)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = []
    for i in range(36):
        text = f"The quick brown fox {i} jumps over the lazy dog"
        if i % 3 == 0:
            lines.append({"prompt": text})
        elif i % 3 == 1:
            lines.append({"messages": [{"role": "user", "content": text}]})
        else:
            lines.append({"conversations": [{"from": "human", "value": text},
                                             {"from": "gpt", "value": "dropped"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def _config(out, target, prompt_file, **kw) -> TrainConfig:
    base = dict(out=str(out), data=[str(prompt_file)], target=str(target), steps=60,
                batch_size=8, lr=5e-3, warmup_steps=5, ttt_steps=3, draft_vocab_size=128,
                heldout_prompts=4, max_new_tokens=32, aux_layer_ids=AUX, gen_batch=32,
                save_every=30, eval_every=30, progress=False)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target, prompt_file):
    out = tmp_path_factory.mktemp("run")
    return out, train(_config(out, target, prompt_file))


def test_loss_falls_and_acceptance_rises(trained):
    _, result = trained
    first, last = result.losses[:5], result.losses[-5:]
    assert sum(last) / 5 < 0.9 * sum(first) / 5
    before = result.metrics["initial"]["train_subset"]
    after = result.metrics["train_subset"]
    assert after["step_acc"][0] > before["step_acc"][0] + 0.03
    assert after["mean_accept_len"][-1] > before["mean_accept_len"][-1]


def test_outputs_and_strict_reload(trained, target):
    out, result = trained
    for name in ("data.jsonl", "heldout_prompts.jsonl", "log.jsonl", "metrics.json",
                 "state.pt", "config.json", "model.safetensors"):
        assert (out / name).is_file(), name
    raw = json.loads((out / "config.json").read_text())
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    head = load_eagle3_head(out, load_hf_config(target), torch.bfloat16, "cpu")
    assert head.aux_layer_ids == tuple(AUX)
    trained_w = result.head.state_dict()
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, trained_w[name].to(tensor.dtype)), name
    curve = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in curve if "loss" in r] == [10, 20, 30, 40, 50, 60]


def test_resume_continues_from_checkpoint(trained, target, prompt_file, tmp_path, capsys):
    out, _ = trained
    shutil.copytree(out, tmp_path / "run", dirs_exist_ok=True)
    args = ["train-eagle3", "--target", str(target), "--data", str(prompt_file), "--out",
            str(tmp_path / "run"), "--steps", "70", "--batch-size", "8", "--ttt-steps", "3",
            "--draft-vocab-size", "128", "--heldout-prompts", "4", "--max-new-tokens", "32",
            "--aux-layer-ids", "1", "2", "3", "--no-progress"]
    assert main(args) == 2  # a checkpoint is there and --resume was not given
    assert "--resume" in capsys.readouterr().err
    assert main(args + ["--resume"]) == 0
    assert "mean acceptance length" in capsys.readouterr().out
    records = [json.loads(ln) for ln in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("event") == "start"] == [0, 60]
    assert not [r for r in records if r.get("event") == "generated"][1:]  # data reused
    assert torch.load(tmp_path / "run" / "state.pt", weights_only=False)["step"] == 70
    # A time budget ends training early, whatever --steps says.
    steps_at = args.index("--steps") + 1
    long_run = args[:steps_at] + ["100000"] + args[steps_at + 1 :]
    assert main(long_run + ["--resume", "--train-time-s", "1"]) == 0
    assert 70 < torch.load(tmp_path / "run" / "state.pt", weights_only=False)["step"] < 100000


def test_init_head_continues_training(trained, target, prompt_file, tmp_path):
    out, result = trained
    shutil.copy(out / "data.jsonl", tmp_path / "data.jsonl")
    cfg = _config(tmp_path, target, prompt_file, init_head=str(out), steps=5, resume=True,
                  draft_vocab_size=64)  # the head's own vocabulary wins
    more = train(cfg)
    assert more.head.config.draft_vocab_size == 128
    assert torch.equal(more.head.d2t, result.head.d2t)
    start = more.metrics["initial"]["train_subset"]["step_acc"][0]
    assert start == pytest.approx(result.metrics["train_subset"]["step_acc"][0], abs=0.02)


def test_generation_time_budget(target):
    from specserve.config import EngineConfig
    from specserve.engine.engine import LLMEngine
    from specserve.train.distill import generate_samples
    from specserve.train.prompts import PromptItem

    engine = LLMEngine(EngineConfig(model=str(target), max_num_seqs=2, num_kv_pages=64))
    prompts = [PromptItem(str(i), [{"role": "user", "content": f"hi {i}"}]) for i in range(6)]
    kw = dict(max_new_tokens=4, temperature=0.0, seed=0, max_prompt_tokens=64, progress=False)
    assert generate_samples(engine, prompts, time_budget_s=0.0, **kw) == []
    samples = generate_samples(engine, prompts, **kw)
    assert [s.key for s in samples] == [str(i) for i in range(6)]
    assert all(s.response_len == 4 for s in samples) and not engine.has_unfinished()


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_generation_deadline_keeps_greedy_prefixes(target, monkeypatch, overlap):
    """Past budget + grace, running requests stop and their partial replies are kept: they
    are prefixes of the full greedy replies. A fake clock ticks once per reading."""
    from specserve.config import EngineConfig
    from specserve.engine.engine import LLMEngine
    from specserve.train import distill
    from specserve.train.prompts import PromptItem

    engine = LLMEngine(EngineConfig(model=str(target), max_num_seqs=2, num_kv_pages=64,
                                    overlap_schedule=overlap))
    prompts = [PromptItem(str(i), [{"role": "user", "content": f"hi {i}"}]) for i in range(6)]
    kw = dict(max_new_tokens=40, temperature=0.0, seed=0, max_prompt_tokens=64, progress=False)
    full = distill.generate_samples(engine, prompts[:2], **kw)
    ticks = iter(range(10**6))
    monkeypatch.setattr(distill.time, "monotonic", lambda: float(next(ticks)))
    cut = distill.generate_samples(engine, prompts, time_budget_s=1.5, grace_s=12.0,
                                   min_partial_tokens=3, **kw)
    assert [s.key for s in cut] == ["0", "1"]  # no prompt started after the budget
    for short, whole in zip(cut, full):
        assert 3 <= short.response_len < whole.response_len == 40
        assert short.token_ids == whole.token_ids[: len(short.token_ids)]
    monkeypatch.undo()
    again = distill.generate_samples(engine, prompts[:2], **kw)  # the engine stays usable
    assert [s.token_ids for s in again] == [s.token_ids for s in full]
    # Without detokenization (TokenIdsOnly, as train-eagle3 runs it): the same token ids.
    ids_only = LLMEngine(EngineConfig(model=str(target), max_num_seqs=2, num_kv_pages=64,
                                      overlap_schedule=overlap),
                         tokenizer=distill.TokenIdsOnly(engine.tokenizer))
    same = distill.generate_samples(ids_only, prompts[:2], **kw)
    assert [s.token_ids for s in same] == [s.token_ids for s in full]


def test_generation_retries_on_the_safe_engine_path(target, prompt_file, tmp_path, monkeypatch):
    """A failure of the fast generation engine is logged and generation runs again eagerly
    with the synchronous loop, so a fixed lease still trains."""
    from specserve.train import distill

    real, calls, records = distill.generate_samples, [], []

    def flaky(engine, *args, **kwargs):
        calls.append(engine.config.disable_overlap_schedule)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(distill, "generate_samples", flaky)
    cfg = _config(tmp_path, target, prompt_file, num_prompts=6, max_new_tokens=4)
    train_samples, heldout = distill.distill(cfg, tmp_path, records.append)
    assert len(train_samples) == 6 and len(heldout) == 4
    assert calls == [False, True, True]  # held-out on the fast engine fails; both again
    failed = [r for r in records if r.get("event") == "generation_failed"]
    assert len(failed) == 1 and "boom" in failed[0]["error"]
    # The user's own errors are not retried: they would fail the same way, later.
    from specserve.errors import InvalidRequestError

    def refused(engine, *args, **kwargs):
        calls.append("refused")
        raise InvalidRequestError("the prompt is empty", "prompt")

    monkeypatch.setattr(distill, "generate_samples", refused)
    calls.clear()
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises(InvalidRequestError):
        distill.distill(cfg, again, records.append)
    assert calls == ["refused"]


def test_features_are_inputs_of_the_aux_layers(target):
    transformers = pytest.importorskip("transformers")
    model = load_model(resolve_model(str(target)), torch.float32, torch.device("cpu"))
    samples = [Sample("a", [5, 9, 11, 40, 7, 3, 90], 2), Sample("b", list(range(20, 45)), 4),
               Sample("c", [8, 8, 8], 1)]
    store = record_features(model, samples, tuple(AUX), tokens_per_batch=16, page_size=4,
                            progress=False)  # several batches, sequences across pages
    ref = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    for i, s in enumerate(samples):
        rows = slice(store.offsets[i], store.offsets[i + 1])
        with torch.no_grad():
            o = ref(torch.tensor([s.token_ids]), output_hidden_states=True)
        want = torch.cat([o.hidden_states[j][0] for j in AUX], dim=-1)  # [j] enters layer j
        torch.testing.assert_close(store.aux[rows], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(store.hidden[rows], o.hidden_states[-1][0], atol=1e-4,
                                   rtol=1e-4)
        assert torch.equal(store.argmax[rows], o.logits[0].argmax(-1))


def test_draft_vocab_is_most_frequent_reply_tokens():
    samples = [Sample("a", [1, 2, 7, 7, 7, 9], 2), Sample("b", [3, 9, 9, 5], 1)]
    d2t, t2d, coverage = build_draft_vocab(samples, vocab_size=12, draft_vocab_size=3)
    ids = torch.arange(3) + d2t
    assert ids.tolist() == [5, 7, 9] and t2d.nonzero().flatten().tolist() == [5, 7, 9]
    assert coverage == 1.0
    d2t, t2d, coverage = build_draft_vocab(samples, vocab_size=12, draft_vocab_size=2)
    assert (torch.arange(2) + d2t).tolist() == [7, 9] and coverage == pytest.approx(6 / 7)
    # --min-draft-coverage: the smallest size (multiples of granularity) holding the share
    d2t, _, coverage = build_draft_vocab(samples, 12, 3, min_coverage=0.8, granularity=1)
    assert (torch.arange(2) + d2t).tolist() == [7, 9] and coverage == pytest.approx(6 / 7)
    d2t, _, coverage = build_draft_vocab(samples, 12, 3, min_coverage=0.9, granularity=1)
    assert len(d2t) == 3 and coverage == 1.0


def test_ttt_mask_and_acceptance_stats():
    mask = ttt_mask(3, 2, torch.device("cpu"))
    assert mask.int().tolist() == [[1, 0, 0, 1, 0, 0, 1, 0, 0],
                                   [1, 1, 0, 0, 1, 0, 0, 1, 0],
                                   [1, 1, 1, 0, 0, 1, 0, 0, 1]]
    t = torch.tensor
    valid = [t([[True, True, True, False]]), t([[True, True, False, False]])]
    correct = [t([[True, False, True, False]]), t([[True, True, False, False]])]
    stats = acceptance_stats([UnrollOutput(torch.zeros(()), [0.0, 0.0], valid, correct)])
    assert stats["step_acc"] == [pytest.approx(2 / 3), 1.0]
    assert stats["chain"] == [pytest.approx(2 / 3), pytest.approx(1 / 3)]
    assert stats["mean_accept_len"] == [pytest.approx(5 / 3), 2.0]


def test_prompt_sources(tmp_path, prompt_file):
    lib = tmp_path / "lib"
    (lib / "test").mkdir(parents=True)
    code = ('"""A module docstring long enough to be worth summarizing: ' + "words " * 10 + '"""\n'
            "def visible(x):\n    '''Doc.'''\n    y = x + 1\n    return y * 2\n\n"
            "def _hidden(x):\n    a = 1\n    b = 2\n    return a + b\n\n"
            "class Box:\n    def put(self, item):\n        self.items = []\n"
            "        self.items.append(item)\n        return item\n")
    (lib / "mod.py").write_text(code)
    (lib / "test" / "test_mod.py").write_text(code)
    keys = sorted(p.key.rsplit(":", 1)[0] for p in stdlib_prompts(lib))
    assert keys == ["stdlib:mod", "stdlib:mod.Box", "stdlib:mod.Box.put", "stdlib:mod.visible"]

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "play_gut.txt").write_text("THE PLAY\n" + "A line of verse, and more.\n" * 200)
    (texts / "play_gut_f.txt").write_text("folio duplicate\n" * 200)
    passages = shakespeare_prompts(texts)
    assert passages and all(p.key.startswith("shakespeare:play_gut:") for p in passages)
    # Variants: other kinds of request on the same text share its source key.
    three = shakespeare_prompts(texts, variants=3)
    assert len(three) == 3 * len(passages)
    first = [p for p in three if p.source_key == passages[0].key]
    assert len({p.messages[0]["content"] for p in first}) == 3  # three kinds of request
    assert {p.source_key for p in three} == {p.key for p in passages}
    assert sorted({p.variant for p in three}) == [0, 1, 2]
    two = stdlib_prompts(lib, variants=2)
    assert len(two) == 2 * len(keys) - 1  # the module docstring has one kind only
    reserved = reserved_keys(three, 0, 2)
    assert {p.source_key for p in three if p.source_key in reserved} == reserved

    items = jsonl_prompts(prompt_file)
    assert len(items) == 36 and all(p.messages[-1]["role"] == "user" for p in items)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "assistant", "content": "x"}]}\n')
    with pytest.raises(PromptSourceError, match="no user turn"):
        jsonl_prompts(bad)
    with pytest.raises(PromptSourceError, match="neither"):
        load_prompts(["no-such-source"], 0, None, 0)
    train_a, held_a = load_prompts([str(prompt_file)], 3, 20, 5)
    train_b, held_b = load_prompts([str(prompt_file)], 3, 20, 5)
    assert [p.key for p in train_a] == [p.key for p in train_b] and len(train_a) == 20
    assert len(held_a) == 5 and not {p.key for p in held_a} & {p.key for p in train_a}
    assert len(load_prompts([str(prompt_file)], 0, None, 40)[1]) == 36  # all held out


def test_heldout_split_does_not_depend_on_other_prompts():
    from specserve.train.prompts import PromptItem

    items = [PromptItem(f"src:{i}", []) for i in range(3000)]
    fewer = items[::2] + [PromptItem(f"other:{i}", []) for i in range(500)]
    a, b = reserved_keys(items, 0, 8), reserved_keys(fewer, 0, 8)
    common = {p.key for p in items} & {p.key for p in fewer}
    assert a & common == b & common and 30 < len(a) < 90  # about 2% reserved
