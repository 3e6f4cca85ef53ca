"""Where each checkpoint tensor goes in a model, and the strict copy of a checkpoint into a
model built on the meta device.

A checkpoint tensor fills a whole parameter or a row range of a merged one (`MergedLinear`:
q/k/v, gate/up), and under tensor parallelism only this rank's part of it (a
`TensorSlice`: `MergedLinear.slices`, a module's `weight_slice`). Tensors may come lazily
(`LazyTensor`: a shape, then `read(part)`), so a rank reads only its part of the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.core.errors import CheckpointError
from specserve.core.parallel import TensorSlice
from specserve.layers.linear import MergedLinear

# Buffers some checkpoints carry that are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LazyTensor(Protocol):
    """A checkpoint tensor not read yet: its full shape, and a read of a part of it."""

    shape: tuple[int, ...]

    def read(self, part: TensorSlice | None) -> torch.Tensor:
        """The tensor, or only `part` of it (None: all)."""
        ...


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor goes: the model parameter, its first row there when it
    fills a row range of a merged parameter (else None), the checkpoint tensor's full shape,
    and the part of it this rank holds (None: all)."""

    param: str
    first: int | None
    shape: tuple[int, ...]
    part: TensorSlice | None = None


def placements(model: torch.nn.Module) -> dict[str, Placement]:
    """Checkpoint tensor name -> Placement, for every parameter of the model, in parameter
    order (a merged parameter's tensors in row order)."""
    modules = dict(model.named_modules())
    out: dict[str, Placement] = {}
    for name, param in model.named_parameters():
        prefix, _, attr = name.rpartition(".")
        module = modules[prefix]
        if isinstance(module, MergedLinear):
            parent = prefix.rpartition(".")[0]
            for shard, (first, rows) in module.shard_rows().items():
                part = module.slices.get(shard)
                key = f"{parent}.{shard}.{attr}" if parent else f"{shard}.{attr}"
                full = rows if part is None else part.full
                out[key] = Placement(name, first, (full, *param.shape[1:]), part)
            continue
        part = getattr(module, "weight_slice", None)
        if part is not None and (attr == "weight" or part.dim == 0):
            shape = list(param.shape)
            shape[part.dim] = part.full
            out[name] = Placement(name, None, tuple(shape), part)
        else:
            out[name] = Placement(name, None, tuple(param.shape))
    return out


def checkpoint_layout(model: torch.nn.Module) -> dict[str, tuple[str, int | None, tuple]]:
    """Checkpoint tensor name -> (model parameter, first row or None, checkpoint shape) for
    every parameter of the model; a `MergedLinear` parameter is filled from several
    checkpoint tensors, each into its row range."""
    return {k: (p.param, p.first, p.shape) for k, p in placements(model).items()}


def _read(tensor: torch.Tensor | LazyTensor, part: TensorSlice | None) -> torch.Tensor:
    if isinstance(tensor, torch.Tensor):
        return tensor if part is None else part.take(tensor)
    return tensor.read(part)


def assign_weights(
    model: torch.nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor | LazyTensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Copy named tensors (this rank's part of each) into a meta-built model; missing, extra
    or misshapen tensors fail (named as the checkpoint names them, also where they fill part
    of a merged parameter). Rows a rank holds beyond the checkpoint's (a padded vocabulary
    shard) are zeros."""
    layout = placements(model)
    params = dict(model.named_parameters())
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    loaded: set[str] = set()
    built: dict[str, torch.nn.Parameter] = {}
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        if name not in layout:
            raise CheckpointError(f"checkpoint has an unexpected tensor {name!r}")
        place = layout[name]
        if tuple(tensor.shape) != place.shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies {place.shape}"
            )
        data = _read(tensor, place.part)
        if not data.is_floating_point():
            raise CheckpointError(f"tensor {name!r} has dtype {data.dtype}, not a float type")
        if name in loaded:
            raise CheckpointError(f"tensor {name!r} appears twice in the checkpoint")
        shape = params[place.param].shape
        if place.first is None and place.part is None:
            param = torch.nn.Parameter(data.to(device=device, dtype=dtype), requires_grad=False)
        else:
            param = built.get(place.param)
            if param is None:
                param = torch.nn.Parameter(
                    torch.zeros(shape, dtype=dtype, device=device), requires_grad=False
                )
                built[place.param] = param
            dest = param.data
            if place.first is not None:
                dest = dest[place.first : place.first + data.shape[0]]
            for dim, size in enumerate(data.shape):  # a padded shard: its leading rows
                dest = dest.narrow(dim, 0, size)
            dest.copy_(data)
        module_name, _, attr = place.param.rpartition(".")
        setattr(model.get_submodule(module_name), attr, param)
        loaded.add(name)
    missing = sorted(set(layout) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"checkpoint lacks {len(missing)} tensor(s): {shown}")


def full_tensors(
    model: torch.nn.Module, make: Callable[[str, tuple[int, ...]], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint of a model as the unsharded model would hold it, parameter by
    parameter in parameter order: `make(name, shape)` builds each unsharded parameter (a
    merged one whole), which is then cut into its checkpoint tensors. Fed to
    `assign_weights`, a sharded model takes its parts of the same values."""
    by_param: dict[str, list[tuple[str, Placement]]] = {}
    for key, place in placements(model).items():
        by_param.setdefault(place.param, []).append((key, place))
    for name, parts in by_param.items():
        key, first = parts[0]
        if first.first is None:  # the parameter is one checkpoint tensor
            yield key, make(name, first.shape)
            continue
        rows = [p.shape[0] for _, p in parts]
        full = make(name, (sum(rows), *first.shape[1:]))
        for (key, _), chunk in zip(parts, full.split(rows)):
            yield key, chunk
