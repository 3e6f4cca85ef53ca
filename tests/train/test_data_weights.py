"""train-eagle3 --data-weights: each source's share of the training prompts, in every prefix
(a time-limited generation covers a prefix), held-out prompts balanced as before."""

from __future__ import annotations

import argparse

import pytest

from specserve.train.config import TrainConfig, add_train_args, config_from_args
from specserve.train.prompts import PromptItem, load_prompts


def _pool(name: str, n: int) -> list[PromptItem]:
    return [
        PromptItem(f"{name}/{i}", [{"role": "user", "content": f"{name} {i}"}]) for i in range(n)
    ]


def _shares(items: list[PromptItem]) -> dict[str, float]:
    names = [p.key.split("/")[0] for p in items]
    return {n: names.count(n) / len(names) for n in sorted(set(names))}


def test_weights_set_each_prefix_share_and_leave_heldout_balanced():
    made = {"chat": _pool("chat", 4000), "code": _pool("code", 3000), "play": _pool("play", 3000)}
    names = list(made)
    train, held = load_prompts(names, 0, None, 30, made=made, weights=[4, 1, 1])
    for n in (60, 600, 3000):  # while every source lasts: 4/6, 1/6, 1/6 in any prefix
        shares = _shares(train[:n])
        assert shares["chat"] == pytest.approx(4 / 6, abs=2 / n)
        assert shares["code"] == pytest.approx(1 / 6, abs=2 / n)
    assert len(train) + len({p.key for p in held}) <= 10000
    assert len({p.key for p in train}) == len(train)  # each prompt once
    assert {k: round(v * 30) for k, v in _shares(held).items()} == {
        "chat": 10,
        "code": 10,
        "play": 10,
    }
    same, _ = load_prompts(names, 0, None, 30, made=made, weights=[4, 1, 1])
    assert [p.key for p in same] == [p.key for p in train]  # seeded
    even, _ = load_prompts(names, 0, None, 30, made=made)
    assert _shares(even[:600]) == pytest.approx({"chat": 1 / 3, "code": 1 / 3, "play": 1 / 3})


def test_data_weights_flag_and_validation(tmp_path):
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    args = parser.parse_args(
        ["--out", str(tmp_path), "--data", "self-chat", "stdlib", "--data-weights", "3", "1"]
    )
    assert config_from_args(args).data_weights == [3.0, 1.0]
    with pytest.raises(ValueError, match="one positive weight per --data source"):
        TrainConfig(out=str(tmp_path), data=["stdlib", "shakespeare"], data_weights=[1.0])
    with pytest.raises(ValueError, match="one positive weight per --data source"):
        TrainConfig(out=str(tmp_path), data=["stdlib"], data_weights=[0.0])
