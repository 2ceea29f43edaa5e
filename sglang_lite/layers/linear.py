"""Packed and sharded projections: which part of which checkpoint tensor fills which part of which parameter.

A layer declares, through ``packed_shards()``, the checkpoint tensors it packs or shards into its parameters; an
MoE block declares its experts once per checkpoint layout (``per_expert_shards()``, ``fused_expert_shards()``).
Each ``Shard`` names the part of the parameter it fills (``index``) and the part of the checkpoint tensor it reads
(``source``: under tensor parallelism, this rank's slice, read alone from the safetensors file). The loader
(sglang_lite/models/weights.py) reads those declarations; a parameter nobody declares is read whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sglang_lite.kernels import linear
from sglang_lite.kernels.cpu import Weight


@dataclass(frozen=True)
class Shard:
    param: str  # parameter name, relative to the declaring module
    index: tuple = ()  # the part of the parameter this shard fills
    source: tuple = ()  # the part of the checkpoint tensor it reads (() = all of it)


# checkpoint name -> the shards it fills ([] = a tensor this rank does not read)
ShardMap = dict[str, list[Shard]]


@dataclass(frozen=True)
class Split:
    """This rank's part of a dimension split in ``parts``: ``size`` (local) elements from ``rank * size``."""

    rank: int = 0
    parts: int = 1

    def rows(self, total: int) -> slice:
        size = total // self.parts
        return slice(self.rank * size, (self.rank + 1) * size)


NO_SPLIT = Split()


class Linear(nn.Linear):
    """A bias-free ``nn.Linear`` whose product is the kernels' ``linear`` (the fused CPU kernel for a few rows)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class PackedLinear(Linear):
    """A bias-free linear layer whose output rows are the concatenation of ``output_sizes``."""

    def __init__(self, in_features: int, output_sizes: list[int]) -> None:
        super().__init__(in_features, sum(output_sizes))
        self.output_sizes = list(output_sizes)

    def row_slices(self) -> list[slice]:
        out, start = [], 0
        for size in self.output_sizes:
            out.append(slice(start, start + size))
            start += size
        return out


def packed_rows(
    param: str,
    linear: PackedLinear,
    checkpoint_names: list[str],
    sources: list[slice] | None = None,
) -> ShardMap:
    """Maps each checkpoint matrix to its block of rows in ``param`` (e.g. ``in_proj_qkvz.weight``), reading the
    rows ``sources[i]`` of checkpoint matrix i (all of them by default)."""
    assert len(checkpoint_names) == len(linear.output_sizes), (
        f"{param}: names and output sizes disagree"
    )
    sources = sources or [slice(None)] * len(checkpoint_names)
    return {
        name: [Shard(param, (rows,), () if src == slice(None) else (src,))]
        for name, rows, src in zip(checkpoint_names, linear.row_slices(), sources)
    }


def input_columns(param: str, split: Split, total: int) -> ShardMap:
    """A row-parallel weight [out, in]: this rank reads its columns of the input dimension."""
    return {} if split.parts == 1 else {param: [Shard(param, (), (slice(None), split.rows(total)))]}


def weight_of(layer: nn.Module) -> Weight:
    """A projection's weight for the CPU's decode blocks, with the scales a quantized one keeps beside it."""
    return Weight.of(layer)


def quant_block(*layers: nn.Module) -> tuple[int, int] | None:
    """The FP8 block of the first of ``layers`` kept FP8 (``layers/quant.py``), or None."""
    return next((tuple(layer.block) for layer in layers if hasattr(layer, "block")), None)
