"""The head being trained: built fresh (draft vocabulary from the distilled replies, weights
seeded) or loaded from --init-head to train further, run over feature batches with the
training-time test, evaluated teacher-forced, and exported in the public layout."""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.core.errors import SpecserveError
from specserve.model.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    default_aux_layer_ids,
    load_eagle3_head,
)
from specserve.model.eagle3 import save_eagle3_head as _save_head
from specserve.train.config import DEFAULT_DRAFT_VOCAB, TrainConfig
from specserve.train.distill import Sample, build_draft_vocab, vocab_coverage
from specserve.train.features import FeatureStore, LiveFeatures
from specserve.train.ttt import acceptance_stats, unroll


class Trainee:
    """The head being trained plus the frozen pieces of the target it needs."""

    def __init__(
        self, head: Eagle3Head, embed: torch.Tensor, target_head: torch.Tensor, cfg: TrainConfig
    ):
        self.head, self.embed, self.target_head, self.cfg = head, embed, target_head, cfg
        self.autocast = head.fc.weight.device.type == "cuda"

    def run(self, store: FeatureStore | LiveFeatures, indices: list[int]):
        batch = store.batch(indices, self.cfg.max_seq_len)
        with torch.autocast("cuda", torch.bfloat16, enabled=self.autocast):
            return unroll(self.head, self.embed, self.target_head, batch, self.cfg.ttt_steps)

    @torch.no_grad()
    def evaluate(self, store: FeatureStore | LiveFeatures) -> dict:
        if len(store) == 0:
            return {}
        order = sorted(range(len(store)), key=store.length)
        size = self.cfg.batch_size
        outs = [self.run(store, order[i : i + size]) for i in range(0, len(order), size)]
        return acceptance_stats(outs)


def draft_vocab_size(cfg: TrainConfig, target_cfg) -> int:
    """A new head's draft vocabulary size: --draft-vocab-size, or DEFAULT_DRAFT_VOCAB cut to
    the target's vocabulary. An explicit size past the target's vocabulary is refused (the
    trainer asks before the data is generated)."""
    vocab = target_cfg.vocab_size
    if cfg.draft_vocab_size is None:
        return min(DEFAULT_DRAFT_VOCAB, vocab)
    if cfg.draft_vocab_size > vocab:
        raise SpecserveError(
            f"--draft-vocab-size {cfg.draft_vocab_size} exceeds the target's vocabulary of "
            f"{vocab} tokens; give at most {vocab} (or leave it out: the default fits)"
        )
    return cfg.draft_vocab_size


def make_head(cfg: TrainConfig, target_cfg, samples: list[Sample], device: torch.device):
    """(head, draft coverage): a fresh fp32 head with the draft vocabulary of `samples`, or
    the head of --init-head (its own draft vocabulary) to train further."""
    if cfg.init_head is not None:
        head = load_eagle3_head(cfg.init_head, target_cfg, torch.float32, device)
        if cfg.aux_layer_ids and tuple(cfg.aux_layer_ids) != head.aux_layer_ids:
            raise SpecserveError(
                f"--aux-layer-ids {cfg.aux_layer_ids} differ from the layers "
                f"{list(head.aux_layer_ids)} of --init-head {cfg.init_head}"
            )
        return head.requires_grad_(True).train(), vocab_coverage(samples, head.t2d.cpu())
    aux_ids = tuple(cfg.aux_layer_ids or default_aux_layer_ids(target_cfg.num_layers))
    d2t, t2d, coverage = build_draft_vocab(
        samples, target_cfg.vocab_size, draft_vocab_size(cfg, target_cfg), cfg.min_draft_coverage
    )  # (--min-draft-coverage may choose a smaller vocabulary)
    head_cfg = Eagle3Config.for_target(target_cfg, len(d2t), aux_ids)
    torch.manual_seed(cfg.seed)
    head = Eagle3Head(head_cfg, aux_ids)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    head = head.to(device)
    head.rotary.materialize(device)
    return head, coverage


def save_head(head: Eagle3Head, folder: Path, dtype: torch.dtype) -> None:
    """Export a copy of the head in `dtype` (the trained copy keeps fp32 weights)."""
    with torch.device("meta"):
        copy = Eagle3Head(head.config, head.aux_layer_ids)
    copy.load_state_dict(
        {k: v.to(dtype) if v.is_floating_point() else v for k, v in head.state_dict().items()},
        assign=True,
    )
    _save_head(copy, folder)
