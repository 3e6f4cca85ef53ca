"""The tiny target, prompt file and TrainConfig that the train-eagle3 tests share
(test_train_eagle3.py, test_train_data.py)."""

from __future__ import annotations

import json
from pathlib import Path

from specserve.train.config import TrainConfig
from tests.support.tiny_models import make_tiny_model

AUX = [1, 2, 3]


def make_target(folder: Path) -> Path:
    """A tiny 4-layer Llama checkpoint (AUX: its layers 1-3)."""
    return make_tiny_model(folder, "llama", num_layers=4)


def write_prompt_file(path: Path) -> Path:
    """36 JSONL prompts, in turn in each accepted layout (prompt, messages, conversations)."""
    lines = []
    for i in range(36):
        text = f"The quick brown fox {i} jumps over the lazy dog"
        if i % 3 == 0:
            lines.append({"prompt": text})
        elif i % 3 == 1:
            lines.append({"messages": [{"role": "user", "content": text}]})
        else:
            lines.append(
                {
                    "conversations": [
                        {"from": "human", "value": text},
                        {"from": "gpt", "value": "dropped"},
                    ]
                }
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def train_config(out, target, prompt_file, **kw) -> TrainConfig:
    base = dict(
        out=str(out),
        data=[str(prompt_file)],
        target=str(target),
        steps=60,
        batch_size=8,
        lr=5e-3,
        warmup_steps=5,
        ttt_steps=3,
        draft_vocab_size=128,
        heldout_prompts=4,
        max_new_tokens=32,
        aux_layer_ids=AUX,
        gen_batch=32,
        save_every=30,
        eval_every=30,
        progress=False,
    )
    return TrainConfig(**{**base, **kw})
