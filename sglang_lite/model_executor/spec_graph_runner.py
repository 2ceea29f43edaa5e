"""CUDA graphs of speculative decoding's forwards (issue 35): the verify forward and the MTP head's steps.

Both run one row a token (``forward_batch.build_rows_batch``), so their shape is fixed by their number of rows:

- the verify forward of ``steps + 1`` tokens for each of ``bs`` requests (the main model and the LM head): one
  graph per captured ``bs``, its Gated DeltaNet states kept in static ``VerifyStates`` (the largest size's
  buffers, shared by the smaller sizes). A step whose requests do not all verify ``steps + 1`` tokens (a grammar's
  request decodes one, a request near its length limit fewer) runs eagerly;
- the MTP head over any rows (a chain step has one a request, the pass over kept tokens one a kept token): one
  graph per captured number of rows, up to ``bs * (steps + 1)``. Its LM head runs outside the graph, on the rows a
  draft is taken from.

Batches are padded up to the next captured size with rows aimed at the reserved dummies (request row 0, KV slot 0,
state slot 0), as the decode graphs do (``cuda_graph_runner.py``). ``use_graphs=False`` runs the same
static-buffer path eagerly: that is how the padding and the static states are tested on the CPU.
"""

from __future__ import annotations

import bisect
import logging

import torch

from sglang_lite.forward_batch import ForwardBatch, VerifyStates, verify_buffers
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.model_executor.cuda_graph_runner import (
    StaticInputs,
    capture_batch_sizes,
    capture_graph,
)

logger = logging.getLogger(__name__)


class SpecGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pools: ModelPools,
        steps: int,
        max_bs: int,
        use_graphs: bool = True,
    ) -> None:
        self.model, self.pools = model, pools
        self.device = model.lm_head.weight.device
        # what capturing reserves, the static verify states included (/v1/loads graph_gb)
        reserved = torch.cuda.memory_reserved(self.device) if use_graphs else 0
        self.tokens = steps + 1  # verified a request: its last token and its drafts
        # drafts from the MTP head (NEXTN), else from elsewhere (NGRAM: no head graphs)
        self.has_head = hasattr(model, "mtp")
        self.use_graphs = use_graphs
        self.verify_sizes = capture_batch_sizes(max_bs)
        self.head_sizes = capture_batch_sizes(self.verify_sizes[-1] * self.tokens)
        rows = self.head_sizes[-1]
        self.verify_inputs = StaticInputs(rows, self.device)
        self.head_inputs = StaticInputs(rows, self.device)
        dtype = model.compute_dtype
        self.head_hidden = torch.zeros(
            rows, model.config.hidden_size, dtype=dtype, device=self.device
        )
        # the verify states of every size, and of the eager verify forwards that fit them
        self.buffers = verify_buffers(pools, self.verify_sizes[-1], self.tokens)
        self.states = {
            bs: VerifyStates(pools, [self.tokens] * bs, self.device, self.buffers)
            for bs in self.verify_sizes
        }
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.verify_outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.head_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.head_outputs: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0
        if use_graphs:
            model.streams.runtime.get()  # streams must exist before capture starts
            pool = torch.cuda.graph_pool_handle()
            # largest first, so smaller graphs reuse its memory
            for bs in reversed(self.verify_sizes):
                self.verify_inputs.pad(0, bs * self.tokens)
                graph, out = capture_graph(lambda bs=bs: self._verify(bs), pool, self.device)
                self.verify_graphs[bs], self.verify_outputs[bs] = graph, out
            for rows in reversed(self.head_sizes if self.has_head else []):
                self.head_inputs.pad(0, rows)
                graph, out = capture_graph(lambda rows=rows: self._head(rows), pool, self.device)
                self.head_graphs[rows], self.head_outputs[rows] = graph, out
            self.memory_bytes = torch.cuda.memory_reserved(self.device) - reserved
            logger.info(
                "speculative CUDA graphs: verify forwards of %s requests (%d tokens each), the MTP head over up "
                "to %d rows; %.2f GB",
                self.verify_sizes,
                self.tokens,
                self.head_sizes[-1],
                self.memory_bytes / 2**30,
            )

    # ---- the verify forward ---------------------------------------------------------------------------------------
    def can_verify(self, counts: list[int]) -> bool:
        """Whether a verify forward of ``counts[i]`` tokens for request i has a graph."""
        return len(counts) <= self.verify_sizes[-1] and all(n == self.tokens for n in counts)

    def eager_states(self, counts: list[int]) -> VerifyStates | None:
        """States for an eager verify forward of ``counts`` (one without a graph) in the graphs' buffers, so that
        the two do not take that memory twice; None when they do not fit."""
        if len(counts) > self.verify_sizes[-1] or max(counts) > self.tokens:
            return None
        return VerifyStates(self.pools, counts, self.device, self.buffers)

    def verify(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, VerifyStates]:
        """(hidden [T, H], logits [T, vocab], the states after each token) of a verify forward whose rows are
        ``batch``'s (``can_verify``). The outputs are the graph's: read them before the next replay."""
        bs = batch.num_tokens // self.tokens
        padded = self.verify_sizes[bisect.bisect_left(self.verify_sizes, bs)]
        self.verify_inputs.fill(batch, padded * self.tokens)
        if self.use_graphs:
            self.verify_graphs[padded].replay()
            hidden, logits = self.verify_outputs[padded]
        else:
            hidden, logits = self._verify(padded)
        return hidden[: batch.num_tokens], logits[: batch.num_tokens], self.states[padded]

    def _verify(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.verify_inputs.batch(bs * self.tokens, self.pools)
        batch.verify = self.states[bs]
        with torch.no_grad():
            hidden = self.model.forward_hidden(batch)
            return hidden, self.model.logits(hidden)

    # ---- the MTP head ---------------------------------------------------------------------------------------------
    def can_run_head(self, batch: ForwardBatch) -> bool:
        return self.has_head and batch.is_decode and batch.num_tokens <= self.head_sizes[-1]

    def head(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP head's hidden state [T, H] over ``batch``'s rows (``hidden``: the model's there)."""
        rows = batch.num_tokens
        padded = self.head_sizes[bisect.bisect_left(self.head_sizes, rows)]
        self.head_inputs.fill(batch, padded)
        self.head_hidden[:rows].copy_(hidden)
        self.head_hidden[rows:padded].zero_()
        if not self.use_graphs:
            return self._head(padded)[:rows]
        self.head_graphs[padded].replay()
        return self.head_outputs[padded][:rows]

    def _head(self, rows: int) -> torch.Tensor:
        batch = self.head_inputs.batch(rows, self.pools)
        with torch.no_grad():
            return self.model.mtp(batch, self.head_hidden[:rows])
