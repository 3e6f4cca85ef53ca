"""train-eagle3 --generate-only writes the distillation data and stops; --resume then trains
on exactly that data without generating again (a fixed lease: generation in one call,
training in the next)."""

from __future__ import annotations

import json

import torch

from specserve.cli import main
from tests.support.train_cases import make_target, write_prompt_file


def _records(out):
    return [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]


def _args(target, prompts, out, steps: int) -> list[str]:
    """A tiny train-eagle3 run's command line (checkpoints and evaluations every 3 steps)."""
    return [
        "train-eagle3",
        "--target",
        str(target),
        "--data",
        str(prompts),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--batch-size",
        "8",
        "--ttt-steps",
        "2",
        "--draft-vocab-size",
        "128",
        "--heldout-prompts",
        "4",
        "--max-new-tokens",
        "8",
        "--aux-layer-ids",
        "1",
        "2",
        "3",
        "--eval-every",
        "3",
        "--save-every",
        "3",
        "--no-progress",
    ]


def test_generate_only_then_resume(tmp_path, capsys):
    target = make_target(tmp_path / "target")
    prompts = write_prompt_file(tmp_path / "prompts.jsonl")
    out = tmp_path / "run"
    args = _args(target, prompts, out, 6)
    assert main(args + ["--generate-only"]) == 0
    assert "train on them with --resume" in capsys.readouterr().out
    data = (out / "data.jsonl").read_text()
    assert data and (out / "heldout_prompts.jsonl").is_file()
    assert not (out / "model.safetensors").exists() and not (out / "state.pt").exists()
    assert [r["event"] for r in _records(out) if r.get("event") in ("generated", "start")] == [
        "generated"
    ]
    assert main(args + ["--resume"]) == 0
    assert (out / "data.jsonl").read_text() == data  # trained on the same samples
    events = [r.get("event") for r in _records(out)]
    assert events.count("generated") == 1 and events.count("start") == 1
    assert (out / "model.safetensors").is_file()
    assert torch.load(out / "state.pt", weights_only=False)["step"] == 6


def test_append_adds_replies_for_new_prompts_and_keeps_the_held_out_ones(tmp_path, capsys):
    """--generate-only --append adds to data.jsonl replies for prompts whose text it does not
    hold yet, in any number of calls (a fixed lease each), never one the first run's seed
    holds out (eval-draft's held-out split), its held-out samples and file untouched;
    --resume then trains on them all."""
    from specserve.train.distill import _read_samples
    from specserve.train.prompts import PromptItem, always_held_out, read_source

    target = make_target(tmp_path / "target")
    prompts = write_prompt_file(tmp_path / "prompts.jsonl")
    out = tmp_path / "run"
    args = _args(target, prompts, out, 2)
    assert main(args + ["--append", "--generate-only"]) == 2  # nothing to add to yet
    assert "holds no data.jsonl" in capsys.readouterr().err
    assert main(args + ["--generate-only", "--num-prompts", "6"]) == 0
    first_train, heldout = _read_samples(out / "data.jsonl")
    heldout_file = (out / "heldout_prompts.jsonl").read_text()
    assert len(first_train) == 6 and len(heldout) == 4
    assert json.loads((out / "data_settings.json").read_text())["seed"] == 0

    def source(sample):
        return PromptItem(sample.key, []).source_key

    assert main(args + ["--generate-only", "--append", "--num-prompts", "5"]) == 0
    train, kept = _read_samples(out / "data.jsonl")
    assert train[:6] == first_train and len(train) == 11 and kept == heldout
    # a new seed: other texts held out by it, none the first run's
    assert main(args + ["--generate-only", "--append", "--seed", "1"]) == 0
    train, kept = _read_samples(out / "data.jsonl")
    assert kept == heldout and (out / "heldout_prompts.jsonl").read_text() == heldout_file
    sources = [source(s) for s in train]
    assert len(set(sources)) == len(sources)  # each text once
    assert not set(sources) & {source(s) for s in heldout}
    assert not any(always_held_out(0, PromptItem(s.key, [])) for s in train)
    # every text of the file but the first run's held-out ones, whatever seed 1 holds out
    everything = read_source(str(prompts), 1)
    out_first = {source(s) for s in heldout} | {
        p.source_key for p in everything if always_held_out(0, p)
    }
    assert set(sources) == {p.source_key for p in everything} - out_first
    settings = json.loads((out / "data_settings.json").read_text())
    assert settings["seed"] == 0 and [r["seed"] for r in settings["runs"]] == [0, 0, 1]
    assert [r["train_samples"] for r in settings["runs"]] == [6, 5, len(train) - 11]
    # nothing left to add: a clear error, the data untouched
    data = (out / "data.jsonl").read_text()
    assert main(args + ["--generate-only", "--append", "--seed", "2"]) == 2
    assert "already or held out" in capsys.readouterr().err
    assert (out / "data.jsonl").read_text() == data
    assert main(args + ["--append"]) == 2  # only with --generate-only
    assert "--append" in capsys.readouterr().err
    assert main(args + ["--resume"]) == 0
    (start,) = [r for r in _records(out) if r.get("event") == "start"]
    assert start["train_tokens"] == sum(len(s.token_ids) for s in train)
    # texts the first seed holds out that it wrote no held-out sample for (--heldout-prompts
    # 0) stay out too, though seed 1 would train on them
    alone = tmp_path / "alone"
    args[args.index(str(out))] = str(alone)
    assert main(args + ["--generate-only", "--num-prompts", "6", "--heldout-prompts", "0"]) == 0
    assert main(args + ["--generate-only", "--append", "--seed", "1"]) == 0
    train, kept = _read_samples(alone / "data.jsonl")
    reserved = {p.source_key for p in everything if always_held_out(0, p)}
    assert reserved and not kept  # (the case is exercised)
    assert {source(s) for s in train} == {p.source_key for p in everything} - reserved


def test_append_leaves_out_every_text_the_first_run_held_out():
    """Also a held-out prompt whose sample the generation skipped (too long): its text is in
    heldout_prompts.jsonl, not in data.jsonl; and each text once, at most `limit`."""
    from specserve.train.distill import Sample, _Appended, _new_prompts
    from specserve.train.prompts import PromptItem, always_held_out

    before = _Appended(
        train=[Sample("f:1", [1, 2], 1)],
        heldout=[Sample("f:2", [1, 2], 1)],
        first_seed=0,
        held_keys={"f:2", "f:3"},  # f:3 held out, skipped
    )
    items = [PromptItem(f"f:{i}", []) for i in range(1, 40)]
    kept = {p.key for p in _new_prompts(items + items[5:9], before, None)}
    reserved = {p.key for p in items if always_held_out(0, p)}
    assert kept == {p.key for p in items} - {"f:1", "f:2", "f:3"} - reserved
    assert len(_new_prompts(items, before, 4)) == 4
