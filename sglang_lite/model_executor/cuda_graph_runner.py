"""CUDA-graph capture and replay of decode steps, one graph per captured batch size.

Decode batches are padded up to the next captured size. Static input buffers are refilled before each replay;
padding rows point at the reserved dummies (request row 0, whose page table points at the reserved KV page 0, KV
slot 0, state slot 0), so they never touch a real request. The alternate-stream overlaps of the model's plan are
recorded into the graphs. With ``auto`` both variants (overlap on and off) are captured and timed per batch size,
and the faster one is kept (``choose_overlap_per_batch_size``).

``use_graphs=False`` runs the same static-buffer path eagerly: that is how the padding logic is tested on the CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from sglang_lite.forward_batch import ForwardBatch, ForwardMode
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.streams.plan import choose_overlap_per_batch_size

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_bs`` (decode batches are padded to the next one)."""
    sizes = [bs for bs in (1, 2, 4) if bs <= max_bs] + list(range(8, max_bs + 1, 8))
    return sizes if sizes and sizes[-1] == max_bs else sizes + [max_bs]


class StaticInputs:
    """Static input buffers of decode batches of up to ``max_bs`` rows, refilled before each replay."""

    def __init__(self, max_bs: int, device: torch.device) -> None:
        def zeros(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(max_bs, dtype=dtype, device=device)

        self.input_ids, self.positions = zeros(torch.int64), zeros(torch.int64)
        self.req_pool_indices, self.out_cache_loc = zeros(torch.int64), zeros(torch.int64)
        self.state_slots = zeros(torch.int64)
        self.seq_lens, self.prefix_lens = zeros(torch.int32), zeros(torch.int32)
        self.extend_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.cu_seqlens = torch.arange(max_bs + 1, dtype=torch.int32, device=device)

    def fill(self, batch: ForwardBatch, padded_bs: int) -> None:
        """Real rows from ``batch``, then padding rows."""
        bs = batch.batch_size
        for name, source in (
            ("input_ids", batch.input_ids),
            ("positions", batch.positions),
            ("req_pool_indices", batch.req_pool_indices),
            ("out_cache_loc", batch.out_cache_loc),
            ("state_slots", batch.state_slots),
            ("seq_lens", batch.seq_lens_t),
            ("prefix_lens", batch.prefix_lens_t),
        ):
            getattr(self, name)[:bs].copy_(source)
        self.pad(bs, padded_bs)

    def pad(self, start: int, end: int) -> None:
        """Rows [start, end) aim at the reserved dummies: request row 0, KV slot 0, state slot 0, one cached token."""
        for name in (
            "input_ids",
            "positions",
            "req_pool_indices",
            "out_cache_loc",
            "state_slots",
            "prefix_lens",
        ):
            getattr(self, name)[start:end].zero_()
        self.seq_lens[start:end].fill_(1)

    def batch(self, bs: int, pools: ModelPools) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            prefix_lens=[0] * bs,
            extend_lens=[1] * bs,
            out_cache_loc=self.out_cache_loc[:bs],
            state_slots=self.state_slots[:bs],
            pools=pools,
            capturing=True,
            seq_lens_t=self.seq_lens[:bs],
            prefix_lens_t=self.prefix_lens[:bs],
            extend_lens_t=self.extend_lens[:bs],
            cu_seqlens=self.cu_seqlens[: bs + 1],
        )


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        pools: ModelPools,
        max_bs: int,
        auto: bool = False,
        use_graphs: bool = True,
        timing_replays: int = 20,
    ) -> None:
        self.model, self.pools = model, pools
        self.device = model.lm_head.weight.device
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.use_graphs = use_graphs
        self.inputs = StaticInputs(self.batch_sizes[-1], self.device)
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.timings_ms: dict[int, tuple[float, float]] = {}
        self.memory_bytes = (
            0  # what capturing reserved (graph pool and warm-up), /v1/loads graph_gb
        )
        if use_graphs:
            model.streams.runtime.get()  # streams must exist before capture starts
            self._pool = torch.cuda.graph_pool_handle()
            reserved = torch.cuda.memory_reserved(self.device)
            # largest first, so smaller graphs reuse its memory
            for bs in reversed(self.batch_sizes):
                self._capture_size(bs, auto, timing_replays)
            self.memory_bytes = torch.cuda.memory_reserved(self.device) - reserved
            if auto:
                logger.info(
                    "alt-stream auto choice per decode batch size: %s",
                    model.streams.overlap_by_batch_size,
                )

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.batch_size <= self.batch_sizes[-1]

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] of a decode batch, from the graph of the smallest captured size that fits."""
        padded = self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch.batch_size)]
        self.inputs.fill(batch, padded)
        if not self.use_graphs:
            return self._forward(padded)[: batch.batch_size]
        self.graphs[padded].replay()
        return self.outputs[padded][: batch.batch_size]

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model.forward_batch(self.inputs.batch(bs, self.pools))

    def _capture_size(self, bs: int, auto: bool, timing_replays: int) -> None:
        if not auto:
            self.graphs[bs], self.outputs[bs] = self._capture(bs)
            return
        variants = {}
        for overlapped in (False, True):
            self.model.streams.overlap_by_batch_size[bs] = overlapped
            graph, out = self._capture(bs)
            variants[overlapped] = (graph, out, _time_replays(graph.replay, timing_replays))
        self.timings_ms[bs] = (variants[False][2], variants[True][2])
        choice = choose_overlap_per_batch_size({bs: self.timings_ms[bs]})[bs]
        self.model.streams.overlap_by_batch_size[bs] = choice
        self.graphs[bs], self.outputs[bs] = variants[choice][:2]

    def _capture(self, bs: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.inputs.pad(0, bs)
        return capture_graph(lambda: self._forward(bs), self._pool, self.device)


def capture_graph(
    forward: Callable[[], Any], pool: Any, device: torch.device
) -> tuple[torch.cuda.CUDAGraph, Any]:
    """A graph of ``forward`` (its static inputs already filled) and its outputs, after two warm-up calls on a
    side stream (Triton autotuning, the allocator) outside the capture."""
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


def _time_replays(replay: Callable[[], None], n: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / n
