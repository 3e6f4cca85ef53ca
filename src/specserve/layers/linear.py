"""A linear layer whose weight stacks several checkpoint projections along its rows."""

from __future__ import annotations

from torch import nn


class MergedLinear(nn.Linear):
    """nn.Linear over the row-wise concatenation of named projections (`shards`, name ->
    output rows, in order), e.g. q/k/v or gate/up: one GEMM instead of several.

    Checkpoints keep the separate tensors; the loader copies each into its row range
    (`shard_rows`), strictly, under the checkpoint's own names.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)

    def shard_rows(self) -> dict[str, tuple[int, int]]:
        """Checkpoint projection name -> (first row, rows) in the merged weight."""
        out, start = {}, 0
        for name, rows in self.shards.items():
            out[name] = (start, rows)
            start += rows
        return out
