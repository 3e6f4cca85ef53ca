"""train-eagle3's resumable checkpoint (state.pt in --out): the head's weights and its config
(shape, draft vocabulary size, auxiliary layers), the optimizer, the step and where the
learning-rate schedule was.

--resume rebuilds the head from the checkpoint, never from the invocation's flags: a head
fed other target layers than it was trained on would train (and be exported) silently
wrong, and another draft vocabulary cannot take its weights. A flag that disagrees with the
checkpoint is refused before any generation or feature work."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.core.errors import SpecserveError
from specserve.core.model_config import ModelConfig
from specserve.model.eagle3 import Eagle3Config, Eagle3Head
from specserve.train.config import TrainConfig


@dataclass
class Checkpoint:
    """A checkpoint read back: the head's config and layers, and the saved state (head,
    optimizer, step, progress)."""

    head_config: Eagle3Config
    aux_layer_ids: tuple[int, ...]
    state: dict

    def build_head(self, device: torch.device) -> Eagle3Head:
        """The checkpoint's head (fp32, training mode) with its weights and vocabulary."""
        head = Eagle3Head(self.head_config, self.aux_layer_ids)
        head.load_state_dict(self.state["head"])
        head = head.to(device)
        head.rotary.materialize(device)
        return head.train()


def save_checkpoint(
    path: Path, head: Eagle3Head, optimizer: torch.optim.Optimizer, step: int, progress: float
) -> None:
    """Write state.pt whole (through a temporary file: a run cut mid-write keeps the last)."""
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "head": head.state_dict(),
            "head_config": head.config.to_dict(),
            "aux_layer_ids": list(head.aux_layer_ids),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "progress": progress,
        },
        tmp,
    )
    tmp.replace(path)


def load_checkpoint(path: Path, cfg: TrainConfig, target: ModelConfig) -> Checkpoint:
    """The checkpoint at `path`, checked against the target and the flags given."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if "head_config" in state:
        head_cfg = Eagle3Config.from_dict(state["head_config"])
        aux_ids = tuple(state["aux_layer_ids"])
    else:  # written before checkpoints held the config: the head's config.json, saved with it
        head_cfg = Eagle3Config.load(path.parent)
        aux_ids = head_cfg.aux_layer_ids(target.num_layers)
    where = f"the checkpoint in {path.parent}"
    if head_cfg.vocab_size != target.vocab_size or head_cfg.target_hidden_size != (
        target.hidden_size
    ):
        raise SpecserveError(
            f"--target: {where} was trained for a target of vocabulary {head_cfg.vocab_size} "
            f"and hidden size {head_cfg.target_hidden_size}; this one has {target.vocab_size} "
            f"and {target.hidden_size}: resume with the run's own target"
        )
    if cfg.aux_layer_ids is not None and tuple(cfg.aux_layer_ids) != aux_ids:
        raise SpecserveError(
            f"--aux-layer-ids {list(cfg.aux_layer_ids)} differ from the layers {list(aux_ids)} "
            f"{where} was trained on; leave --aux-layer-ids out to resume it, or train a new "
            "head in another --out"
        )
    size, given = head_cfg.draft_vocab_size, cfg.draft_vocab_size
    # With --min-draft-coverage the flag is a cap the checkpoint's vocabulary was chosen under
    if given is not None and (given < size if cfg.min_draft_coverage else given != size):
        raise SpecserveError(
            f"--draft-vocab-size {given}: the head of {where} drafts from {size} tokens; "
            "leave --draft-vocab-size out to resume it, or train a new head in another --out"
        )
    return Checkpoint(head_cfg, aux_ids, state)
