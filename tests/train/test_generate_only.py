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


def test_generate_only_then_resume(tmp_path, capsys):
    target = make_target(tmp_path / "target")
    prompts = write_prompt_file(tmp_path / "prompts.jsonl")
    out = tmp_path / "run"
    args = [
        "train-eagle3",
        "--target",
        str(target),
        "--data",
        str(prompts),
        "--out",
        str(out),
        "--steps",
        "6",
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
