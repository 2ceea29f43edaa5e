"""Memory pools for cached, packed forwards: request rows, a paged KV pool, linear-attention states.

- ``ReqToTokenPool``: one row per running request, its page table mapping positions to KV pages.
- ``TokenKVPool``: K and V of one token per slot ([slots, KV heads, head_dim] per full-attention layer), slots in
  pages of ``page_size``: a request's positions fill its pages in order, position p at offset p % page_size.
- ``LinearStatePool``: per Gated DeltaNet layer, the conv state [conv_dim, K-1] and the recurrent state
  [HV, dk, dv] (fp32) of one request per slot; a slot's states of all layers of a kind are contiguous.
Under tensor parallelism a rank's pools hold its own heads only (``ModelConfig.attention_shard``).
Page 0 of the KV pool and slot 0 of the state pool are reserved (dummies for padded batches) and never handed out.
Allocation is a free list (``allocator.py``); ``num_used`` counts exactly what is held.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from sglang_lite.config import ModelConfig
from sglang_lite.distributed import get_parallel_state
from sglang_lite.mem_cache.allocator import PageAllocator, SlotAllocator

__all__ = ["ModelPools", "PageAllocator", "ReqToTokenPool", "SlotAllocator", "TokenKVPool"]


class ReqToTokenPool:
    """Request rows and their page tables: ``page_table[row, i]`` is the KV page of positions ``i * page_size`` to
    ``(i + 1) * page_size - 1`` of the request in that row. A host copy (``host``) answers the scheduler's reads
    without a device round trip; both are written together, only by ``ModelPools.alloc_kv``."""

    def __init__(
        self, max_requests: int, max_context_len: int, page_size: int, device: torch.device
    ) -> None:
        width = -(-max_context_len // page_size)
        self.page_table = torch.zeros(max_requests + 1, width, dtype=torch.int64, device=device)
        self.host = np.zeros((max_requests + 1, width), dtype=np.int64)
        self.allocator = SlotAllocator(max_requests, "request rows")
        self.max_context_len = max_context_len
        self.page_size = page_size

    def pages(self, row: int, start: int, end: int) -> list[int]:
        """The pages of positions ``start..end`` of ``row`` (``start`` a page boundary)."""
        return self.host[row, start // self.page_size : -(-end // self.page_size)].tolist()

    def slots(self, row: int, start: int, end: int) -> list[int]:
        """The KV slots of positions ``start..end`` of ``row``."""
        positions = np.arange(start, end)
        pages = self.host[row, positions // self.page_size]
        return (pages * self.page_size + positions % self.page_size).tolist()


class TokenKVPool:
    """K and V of every full-attention layer for token slots in pages of ``page_size``. One buffer [slots, layers,
    2, KV heads, head_dim] keeps all layers' K and V of a slot together, so a run of consecutive pages is one
    contiguous range (one block of a PD transfer); ``k_buffers[i]`` and ``v_buffers[i]`` are layer i's views
    [slots, KV heads, head_dim] (rows strided). Page 0 (slots 0..page_size - 1) is reserved. ``draft_layers``:
    the MTP head's attention layers after the model's (speculation), in the same slots and pages."""

    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        draft_layers: int = 0,
    ) -> None:
        n = len(config.full_attention_layers) + draft_layers
        shape = ((num_pages + 1) * page_size, n, 2, config.num_key_value_heads, config.head_dim)
        self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.k_buffers = [self.buffer[:, i, 0] for i in range(n)]
        self.v_buffers = [self.buffer[:, i, 1] for i in range(n)]
        self.allocator = PageAllocator(num_pages, "KV pages")
        self.page_size = page_size

    @property
    def bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class LinearStatePool:
    """``num_slots`` slots for running requests, then ``num_snapshots`` for the prefix cache's state snapshots.

    One conv buffer [rows, layers, conv_dim, K-1] and one recurrent buffer [rows, layers, HV, dk, dv] (fp32): a
    slot's states of every GDN layer are one contiguous range per kind (two blocks of a PD transfer, whatever the
    layer count); ``conv_states[i]`` and ``ssm_states[i]`` are layer i's views (slots strided)."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        num_snapshots: int = 0,
    ) -> None:
        rows = num_slots + num_snapshots + 1
        n = len(config.linear_attention_layers)
        conv_shape = (rows, n, config.conv_dim, config.linear_conv_kernel_dim - 1)
        head_shape = (
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
        )
        self.conv_buffer = torch.zeros(conv_shape, dtype=dtype, device=device)
        self.ssm_buffer = torch.zeros((rows, n, *head_shape), dtype=torch.float32, device=device)
        self.conv_states = [self.conv_buffer[:, i] for i in range(n)]
        self.ssm_states = [self.ssm_buffer[:, i] for i in range(n)]
        self.allocator = SlotAllocator(num_slots, "linear-attention state slots")
        self.snapshots = SlotAllocator(
            num_snapshots, "prefix-cache state snapshots", first=num_slots + 1
        )

    def copy_slot(self, src: int, dst: int) -> None:
        """The conv and recurrent states of slot ``src`` into slot ``dst`` (every GDN layer)."""
        self.conv_buffer[dst].copy_(self.conv_buffer[src])
        self.ssm_buffer[dst].copy_(self.ssm_buffer[src])

    def alloc(self, n: int) -> list[int] | None:
        """Slots with zeroed states: a new request starts from an empty conv window and recurrent state."""
        slots = self.allocator.alloc(n)
        for slot in slots or ():
            self.conv_buffer[
                slot
            ].zero_()  # a view's memset: 3x cheaper than an indexed write of one slot
            self.ssm_buffer[slot].zero_()
        return slots

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.conv_buffer, self.ssm_buffer))


@dataclass
class ModelPools:
    """Everything a cached forward reads and writes besides the weights; layers index it by their own order."""

    req_to_token: ReqToTokenPool
    kv: TokenKVPool
    states: LinearStatePool
    attention_index: dict[int, int]  # model layer id -> index into kv buffers
    linear_index: dict[int, int]  # model layer id -> index into state buffers

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        max_total_tokens: int,
        max_running_requests: int,
        max_context_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_snapshots: int = 0,
        page_size: int = 1,
        draft_layers: int = 0,
    ) -> ModelPools:
        """Pools of at least ``max_total_tokens`` KV slots, in pages of ``page_size`` tokens. ``draft_layers``:
        the MTP head's attention layers (numbered after the model's), whose KV the slots hold too."""
        device = torch.device(device)
        config = _local(config)
        num_pages = -(-max_total_tokens // page_size)
        attention_layers = config.full_attention_layers + [
            config.num_layers + i for i in range(draft_layers)
        ]
        return cls(
            req_to_token=ReqToTokenPool(max_running_requests, max_context_len, page_size, device),
            kv=TokenKVPool(config, num_pages, page_size, dtype, device, draft_layers),
            states=LinearStatePool(config, max_running_requests, dtype, device, num_snapshots),
            attention_index={layer: i for i, layer in enumerate(attention_layers)},
            linear_index={layer: i for i, layer in enumerate(config.linear_attention_layers)},
        )

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    def pages_needed(self, starts: list[int], counts: list[int]) -> int:
        """New pages for positions ``starts[i]`` to ``starts[i] + counts[i]`` of requests holding ``starts[i]``."""
        size = self.page_size
        return sum(-(-(s + c) // size) - -(-s // size) for s, c in zip(starts, counts))

    def alloc_kv(self, rows: list[int], starts: list[int], counts: list[int]) -> list[int]:
        """KV slots for positions ``starts[i]`` to ``starts[i] + counts[i]`` of each request row, in the row's pages
        (new pages recorded in its page table); raises MemoryError when the pool cannot hold them. Requests get
        theirs through ``RequestMemory``; this is the one place pages enter a row."""
        allocator = self.kv.allocator
        needed = self.pages_needed(starts, counts)
        if needed > allocator.num_free:
            raise MemoryError(
                f"KV pool has {allocator.num_free} free pages of {self.page_size} tokens, {needed} needed"
            )
        table = self.req_to_token
        where: list[tuple[int, int]] = []  # (row, page index) of each new page
        pages: list[int] = []
        for row, start, count in zip(rows, starts, counts):
            first, end = -(-start // self.page_size), -(-(start + count) // self.page_size)
            if end > first:
                last = int(table.host[row, first - 1]) if first else None
                pages += allocator.alloc(end - first, after=last)
                where += [(row, i) for i in range(first, end)]
        if pages:
            try:
                self._record(where, pages)
            except Exception:  # a position past the row (a caller's bug): the pages are not lost
                self.kv.allocator.free(pages)
                raise
        return self._slots(rows, starts, counts)

    def map_pages(self, row: int, first: int, pages: list[int]) -> None:
        """Points the row's page indices ``first..`` at ``pages`` (pages it reads and does not own: the prefix
        cache's, or a parent's)."""
        self._record([(row, first + i) for i in range(len(pages))], pages)

    def _record(self, where: list[tuple[int, int]], pages: list[int]) -> None:
        if not pages:
            return
        table = self.req_to_token
        rows, index = (np.array(x, dtype=np.int64) for x in zip(*where))
        table.host[rows, index] = pages
        device = table.page_table.device
        table.page_table[torch.from_numpy(rows).to(device), torch.from_numpy(index).to(device)] = (
            torch.tensor(pages, dtype=torch.int64, device=device)
        )

    def _slots(self, rows: list[int], starts: list[int], counts: list[int]) -> list[int]:
        size, host = self.page_size, self.req_to_token.host
        # a decode step (or a few back to back): a few scalars, quicker than numpy's indexing
        if len(rows) * max(counts, default=0) <= 48:
            return [
                int(host[row, p // size]) * size + p % size
                for row, start, count in zip(rows, starts, counts)
                for p in range(start, start + count)
            ]
        positions = np.concatenate(
            [np.arange(s, s + c, dtype=np.int64) for s, c in zip(starts, counts)] or [[]]
        ).astype(np.int64)
        token_rows = np.repeat(np.asarray(rows, dtype=np.int64), counts)
        pages = host[token_rows, positions // size]
        return (pages * size + positions % size).tolist()

    def free_kv(self, slots: list[int]) -> None:
        """Frees the pages of the slots of positions at the end of requests (those an ``alloc_kv`` returned, or a
        tail of them): the pages that start among them, which hold no earlier position."""
        size = self.page_size
        self.kv.allocator.free([s // size for s in slots if s % size == 0])

    def copy_kv(self, src: list[int], dst: list[int]) -> None:
        """Copies the keys and values of slots ``src`` into slots ``dst``, in every full-attention layer."""
        if not src or not self.kv.k_buffers:
            return
        buffer = self.kv.buffer
        src_index = torch.tensor(src, device=buffer.device)
        buffer[torch.tensor(dst, device=buffer.device)] = buffer[src_index]

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.attention_index[layer_id]
        return self.kv.k_buffers[i], self.kv.v_buffers[i]

    def state_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.linear_index[layer_id]
        return self.states.conv_states[i], self.states.ssm_states[i]

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype, draft_layers: int = 0) -> int:
        config, elem = _local(config), torch.empty((), dtype=dtype).element_size()
        return (
            2
            * (len(config.full_attention_layers) + draft_layers)
            * config.num_key_value_heads
            * config.head_dim
            * elem
        )

    @staticmethod
    def bytes_per_request_state(config: ModelConfig, dtype: torch.dtype) -> int:
        config, elem = _local(config), torch.empty((), dtype=dtype).element_size()
        conv = config.conv_dim * (config.linear_conv_kernel_dim - 1) * elem
        ssm = (
            config.linear_num_value_heads
            * config.linear_key_head_dim
            * config.linear_value_head_dim
            * 4
        )
        return len(config.linear_attention_layers) * (conv + ssm)


def _local(config: ModelConfig) -> ModelConfig:
    """The heads this rank's layers hold (all of them outside a tensor-parallel world)."""
    return config.attention_shard(get_parallel_state().attn_tp_size)


def per_token(values: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each request's value repeated for each of its ``counts[i]`` new tokens."""
    if all(n == 1 for n in counts):
        return values
    return values.repeat_interleave(torch.tensor(counts, device=values.device))


def token_positions(
    starts: list[int], counts: list[int], device: torch.device | str
) -> torch.Tensor:
    """[T] position of each new token in its request: start, start + 1, ... per request."""
    firsts = torch.tensor(starts, dtype=torch.int64, device=device)
    if all(n == 1 for n in counts):
        return firsts
    offsets = torch.tensor(
        [0, *itertools.accumulate(counts)][:-1], dtype=torch.int64, device=device
    )
    return torch.arange(sum(counts), device=device) + per_token(firsts - offsets, counts)
