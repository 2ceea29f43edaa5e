"""Vocabulary-parallel embedding and LM head: each rank of the attention group holds vocab/T rows.

The vocabulary is padded to a multiple of the group size (the padded rows are zero and their logits are cut off).
The embedding looks up the ids in its own rows, zeroes the others and all-reduces; the LM head computes the logits
of its rows and all-gathers them. A tied LM head shares the embedding's shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_lite.distributed import attn_all_gather, attn_all_reduce, get_parallel_state
from sglang_lite.kernels import linear
from sglang_lite.layers.linear import Shard, ShardMap


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        state = get_parallel_state()
        self.vocab_size, self.parts = vocab_size, state.attn_tp_size
        self.rows_per_rank = -(-vocab_size // self.parts)
        self.start = state.attn_tp_rank * self.rows_per_rank
        self.num_real = max(0, min(vocab_size, self.start + self.rows_per_rank) - self.start)
        self.weight = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size))

    def packed_shards(self) -> ShardMap:
        if self.parts == 1:
            return {}
        if self.num_real == 0:  # all of this rank's rows are padding
            return {"weight": []}
        mine = slice(self.start, self.start + self.num_real)
        return {"weight": [Shard("weight", (slice(0, self.num_real),), (mine,))]}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parts == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        other = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(other, 0), self.weight).masked_fill(
            other.unsqueeze(-1), 0.0
        )
        return attn_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """``hidden @ weight^T`` over the whole vocabulary: [N, H] -> [N, vocab]."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight)
        if self.parts == 1:
            return logits
        return attn_all_gather(logits)[..., : self.vocab_size]
