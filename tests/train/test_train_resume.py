"""train-eagle3 --resume rebuilds the head from its checkpoint (its auxiliary layers and
draft vocabulary), not from the invocation's flags; a flag that disagrees is refused before
any generation or feature work. Flags that cannot work are refused before the generation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specserve.core.errors import SpecserveError
from specserve.model.loader import load_config, resolve_model
from specserve.train import trainer
from specserve.train.checkpoint import load_checkpoint
from specserve.train.trainer import train
from tests.support.tiny_models import make_tiny_model
from tests.support.train_cases import train_config, write_prompt_file

AUX = [1, 2, 3]  # not the 8-layer target's default layers (2, 4, 5)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target8"), "llama", num_layers=8)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompt_file(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


def _config(out, target, prompt_file, **kw):
    """A short run of `train_config`'s; --draft-vocab-size not given unless in kw."""
    small = dict(steps=4, ttt_steps=2, max_new_tokens=16, save_every=2, eval_every=100)
    small["draft_vocab_size"] = None
    return train_config(out, target, prompt_file, **{**small, **kw})


@pytest.fixture(scope="module")
def run(tmp_path_factory, target, prompt_file):
    """A stopped run: aux layers AUX, the default draft vocabulary (the tiny target's whole
    vocabulary of 384: the default 16,384 cut to it)."""
    out = tmp_path_factory.mktemp("run")
    result = train(_config(out, target, prompt_file))
    assert result.head.config.draft_vocab_size == 384
    return out


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _no_data_work(monkeypatch):
    def reached(*args, **kwargs):
        raise AssertionError("generation or feature work began")

    monkeypatch.setattr(trainer, "distill", reached)
    monkeypatch.setattr(trainer, "record_features", reached)


def test_resume_keeps_the_checkpoints_layers_and_vocabulary(run, target, prompt_file, tmp_path):
    out = _copy(run, tmp_path)
    cfg = _config(out, target, prompt_file, aux_layer_ids=None, steps=6, resume=True)
    head = train(cfg).head
    assert head.aux_layer_ids == tuple(AUX) and head.config.draft_vocab_size == 384
    exported = json.loads((out / "config.json").read_text())
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    records = [json.loads(ln) for ln in (out / "log.jsonl").read_text().splitlines()]
    starts = [(r["step"], r["aux_layer_ids"]) for r in records if r.get("event") == "start"]
    assert starts == [(0, AUX), (4, AUX)]
    state = torch.load(out / "state.pt", weights_only=False)
    assert state["step"] == 6 and state["aux_layer_ids"] == AUX


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            dict(aux_layer_ids=[2, 4, 5]),
            "--aux-layer-ids [2, 4, 5] differ from the layers [1, 2, 3]",
        ),
        (dict(draft_vocab_size=128), "--draft-vocab-size 128: the head of the checkpoint"),
        (dict(draft_vocab_size=256, min_draft_coverage=0.9), "--draft-vocab-size 256"),
    ],
    ids=["aux-layers", "draft-vocab", "draft-vocab-cap"],
)
def test_flags_that_disagree_with_the_checkpoint_are_refused_first(
    run, target, prompt_file, tmp_path, monkeypatch, flags, message
):
    out = _copy(run, tmp_path)
    _no_data_work(monkeypatch)
    with pytest.raises(SpecserveError, match=message.replace("[", r"\[")):
        train(_config(out, target, prompt_file, resume=True, **{"aux_layer_ids": None, **flags}))


def test_agreeing_flags_and_old_checkpoints_resume(run, target, prompt_file, tmp_path):
    out = _copy(run, tmp_path)
    target_cfg = load_config(resolve_model(str(target)))
    state = out / "state.pt"
    for flags in (
        dict(aux_layer_ids=AUX, draft_vocab_size=384),
        dict(aux_layer_ids=None, draft_vocab_size=None),
        dict(draft_vocab_size=16384, min_draft_coverage=0.9),  # a cap the head is within
    ):
        ckpt = load_checkpoint(state, _config(out, target, prompt_file, **flags), target_cfg)
        assert ckpt.aux_layer_ids == tuple(AUX) and ckpt.head_config.draft_vocab_size == 384
    # A checkpoint written before they held the head's config: config.json beside it
    saved = torch.load(state, weights_only=False)
    del saved["head_config"], saved["aux_layer_ids"]
    torch.save(saved, state)
    cfg = _config(out, target, prompt_file, aux_layer_ids=None)
    head = load_checkpoint(state, cfg, target_cfg).build_head(torch.device("cpu"))
    assert head.aux_layer_ids == tuple(AUX)
    assert torch.equal(head.fc.weight, saved["head"]["fc.weight"])


def test_a_draft_vocabulary_past_the_targets_is_refused_first(
    target, prompt_file, tmp_path, monkeypatch
):
    _no_data_work(monkeypatch)
    with pytest.raises(SpecserveError, match="--draft-vocab-size 400 exceeds the target's"):
        train(_config(tmp_path, target, prompt_file, draft_vocab_size=400))
