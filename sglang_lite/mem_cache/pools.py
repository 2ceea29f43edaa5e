"""Memory pools for cached, packed forwards: request rows, a token-level KV pool, linear-attention states.

- ``ReqToTokenPool``: one row per running request, mapping its positions to KV slots (``req_to_token``).
- ``TokenKVPool``: per full-attention layer, K and V of one token per slot ([slots, KV heads, head_dim]).
- ``LinearStatePool``: per Gated DeltaNet layer, the conv state [conv_dim, K-1] and the recurrent state
  [HV, dk, dv] (fp32) of one request per slot.
Under tensor parallelism a rank's pools hold its own heads only (``ModelConfig.attention_shard``).
Slot 0 of the KV and state pools is reserved (a dummy for padded batches) and never handed out. Allocation is a
free list; ``num_used`` counts exactly what is held.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from sglang_lite.config import ModelConfig
from sglang_lite.distributed import get_parallel_state


class SlotAllocator:
    """Free list over slots first..first + size - 1 (by default 1..size: slot 0 is reserved)."""

    def __init__(self, size: int, name: str, first: int = 1) -> None:
        self.size = size
        self.name = name
        self._free = list(range(first + size - 1, first - 1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.size - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n slots, or None when fewer than n are free (nothing is taken then)."""
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return taken[::-1]

    def free(self, slots: list[int]) -> None:
        # kept so that the next alloc hands them out ascending: the KV slots of one request then stay in runs,
        # which a PD transfer writes as one block each
        self._free.extend(sorted(slots, reverse=True))
        assert len(self._free) <= self.size, f"{self.name}: freed more slots than exist"


class ReqToTokenPool:
    def __init__(self, max_requests: int, max_context_len: int, device: torch.device) -> None:
        self.req_to_token = torch.zeros(
            max_requests + 1, max_context_len, dtype=torch.int64, device=device
        )
        self.allocator = SlotAllocator(max_requests, "request rows")
        self.max_context_len = max_context_len


class TokenKVPool:
    def __init__(
        self, config: ModelConfig, num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (num_tokens + 1, config.num_key_value_heads, config.head_dim)
        n = len(config.full_attention_layers)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.allocator = SlotAllocator(num_tokens, "KV tokens")

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.k_buffers + self.v_buffers)


class LinearStatePool:
    """``num_slots`` slots for running requests, then ``num_snapshots`` for the prefix cache's state snapshots."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        num_snapshots: int = 0,
    ) -> None:
        rows = num_slots + num_snapshots + 1
        conv_shape = (rows, config.conv_dim, config.linear_conv_kernel_dim - 1)
        head_shape = (
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
        )
        ssm_shape = (rows, *head_shape)
        n = len(config.linear_attention_layers)
        self.conv_states = [torch.zeros(conv_shape, dtype=dtype, device=device) for _ in range(n)]
        self.ssm_states = [
            torch.zeros(ssm_shape, dtype=torch.float32, device=device) for _ in range(n)
        ]
        self.allocator = SlotAllocator(num_slots, "linear-attention state slots")
        self.snapshots = SlotAllocator(
            num_snapshots, "prefix-cache state snapshots", first=num_slots + 1
        )

    def copy_slot(self, src: int, dst: int) -> None:
        """The conv and recurrent states of slot ``src`` into slot ``dst`` (every GDN layer)."""
        for buf in self.conv_states + self.ssm_states:
            buf[dst].copy_(buf[src])

    def alloc(self, n: int) -> list[int] | None:
        """Slots with zeroed states: a new request starts from an empty conv window and recurrent state."""
        slots = self.allocator.alloc(n)
        for slot in slots or ():
            for buf in self.conv_states + self.ssm_states:
                buf[slot].zero_()  # a view's memset: 3x cheaper than an indexed write of one slot
        return slots

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.conv_states + self.ssm_states)


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
    ) -> ModelPools:
        device = torch.device(device)
        config = _local(config)
        return cls(
            req_to_token=ReqToTokenPool(max_running_requests, max_context_len, device),
            kv=TokenKVPool(config, max_total_tokens, dtype, device),
            states=LinearStatePool(config, max_running_requests, dtype, device, num_snapshots),
            attention_index={layer: i for i, layer in enumerate(config.full_attention_layers)},
            linear_index={layer: i for i, layer in enumerate(config.linear_attention_layers)},
        )

    def alloc_kv(self, rows: list[int], starts: list[int], counts: list[int]) -> list[int]:
        """KV slots for positions ``starts[i]`` to ``starts[i] + counts[i]`` of each request row, recorded in
        req_to_token; raises MemoryError when the pool cannot hold them. Requests get theirs through
        ``RequestMemory``; this is the one place slots enter a row."""
        total = sum(counts)
        slots = self.kv.allocator.alloc(total)
        if slots is None:
            raise MemoryError(
                f"KV pool has {self.kv.allocator.num_free} free slots, {total} needed"
            )
        if total == 0:
            return slots
        table = self.req_to_token.req_to_token
        device = table.device
        per_token_rows = per_token(torch.tensor(rows, device=device), counts)
        positions = token_positions(starts, counts, device)
        try:
            table[per_token_rows, positions] = torch.tensor(slots, dtype=table.dtype, device=device)
        except Exception:  # a position past the row (a caller's bug): the slots are not lost
            self.kv.allocator.free(slots)
            raise
        return slots

    def copy_kv(self, src: list[int], dst: list[int]) -> None:
        """Copies the keys and values of slots ``src`` into slots ``dst``, in every full-attention layer."""
        if not src or not self.kv.k_buffers:
            return
        src_index = torch.tensor(src, device=self.kv.k_buffers[0].device)
        dst_index = torch.tensor(dst, device=src_index.device)
        for buffer in (*self.kv.k_buffers, *self.kv.v_buffers):
            buffer[dst_index] = buffer[src_index]

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.attention_index[layer_id]
        return self.kv.k_buffers[i], self.kv.v_buffers[i]

    def state_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.linear_index[layer_id]
        return self.states.conv_states[i], self.states.ssm_states[i]

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        config, elem = _local(config), torch.empty((), dtype=dtype).element_size()
        return (
            2
            * len(config.full_attention_layers)
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
