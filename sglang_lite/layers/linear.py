"""Packed projections: several checkpoint matrices stacked into one GEMM.

A layer that packs declares, through ``packed_shards()``, which checkpoint tensor fills which rows of which of its
parameters; an MoE block declares its experts once per checkpoint layout (``per_expert_shards()``,
``fused_expert_shards()``). The loader (sglang_lite/models/weights.py) reads those declarations.
"""
from __future__ import annotations

from torch import nn

ShardMap = dict[str, tuple[str, tuple]]  # checkpoint name -> (parameter name, index into the parameter)


class PackedLinear(nn.Linear):
    """A bias-free linear layer whose output rows are the concatenation of ``output_sizes``."""

    def __init__(self, in_features: int, output_sizes: list[int]) -> None:
        super().__init__(in_features, sum(output_sizes), bias=False)
        self.output_sizes = list(output_sizes)

    def row_slices(self) -> list[slice]:
        out, start = [], 0
        for size in self.output_sizes:
            out.append(slice(start, start + size))
            start += size
        return out


def packed_rows(param: str, linear: PackedLinear, checkpoint_names: list[str]) -> ShardMap:
    """Maps each checkpoint matrix to its block of rows in ``param`` (e.g. ``in_proj_qkvz.weight``)."""
    assert len(checkpoint_names) == len(linear.output_sizes), f"{param}: names and output sizes disagree"
    return {name: (param, (rows,)) for name, rows in zip(checkpoint_names, linear.row_slices())}
