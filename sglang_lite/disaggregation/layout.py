"""Where a request's data lives in a rank's pools, as addresses a peer can write to, and which heads they hold.

A decode rank publishes its ``PoolLayout`` (the base address and row size of every KV and state buffer, of its
metadata rows and of its log-probability area, and the ``PoolShard``: which heads its pools hold) with each
reservation; every rank of the decode DP rank's attention group publishes one. A prefill rank turns a request's KV
slots and state slot on both sides into the byte ranges to write into one decode rank (``request_blocks``): the
heads the two ranks both hold, so that under tensor parallelism each prefill rank writes its own shard into the
decode ranks that hold the same heads, whatever the two servers' TP sizes. Ranges that continue one another on
both sides (a run of consecutive slots holding whole rows) become one range.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any

import torch

from sglang_lite.config import ModelConfig
from sglang_lite.mem_cache.pools import ModelPools

Blocks = tuple[list[int], list[int], list[int]]  # sources, targets, lengths (bytes)
# a metadata row of one state slot: one sub-row per prefill rank that writes into it (its source index)
MAX_SOURCES = 64
META_FIELDS = 8


class Meta(IntEnum):
    """The int64 fields of a metadata sub-row, as one prefill rank writes it after its data; status last."""

    TOKEN = 0  # the first output token
    BYTES = 1  # bytes this source wrote into the rank
    NANOS = 2  # nanoseconds its writes took
    SOURCES = 3  # prefill ranks that write into the rank (each its own sub-row)
    CACHED = 4  # prompt tokens the prefill server's prefix cache served
    STATUS = 7  # PENDING, DONE or FAILED (scheduler.disagg.base)


@dataclass(frozen=True)
class HeadRange:
    first: int
    count: int

    @property
    def end(self) -> int:
        return self.first + self.count

    def overlap(self, other: HeadRange) -> HeadRange | None:
        first, end = max(self.first, other.first), min(self.end, other.end)
        return HeadRange(first, end - first) if end > first else None


@dataclass(frozen=True)
class PoolShard:
    """The heads a rank's pools hold (global head indices) and the bytes one head takes in each buffer."""

    kv: HeadRange  # full-attention KV heads
    kv_writer: bool  # the first of the ranks that replicate these KV heads: the one that sends them
    key_heads: HeadRange  # Gated DeltaNet key heads (q and k channels of the conv state)
    value_heads: HeadRange  # Gated DeltaNet value heads (v channels, recurrent state)
    kv_head_bytes: int  # head_dim elements of K (or V) of one token
    conv_key_bytes: int  # conv state rows of one key head: key_head_dim x (kernel - 1)
    conv_value_bytes: int  # conv state rows of one value head: value_head_dim x (kernel - 1)
    ssm_head_bytes: int  # recurrent state of one value head: key_head_dim x value_head_dim (fp32)

    @classmethod
    def of(cls, config: ModelConfig, rank: int, size: int, dtype: torch.dtype) -> PoolShard:
        """Rank ``rank`` of an attention group of ``size`` with pools of ``dtype`` (the recurrent state is fp32),
        as the model shards it (``attention_shard``): KV heads split, or each replicated over ``size / heads``
        consecutive ranks when fewer than the ranks."""
        local = config.attention_shard(size)
        total = config.num_key_value_heads
        per = max(1, size // total)  # ranks holding the same KV head
        first_kv = rank // per if total < size else rank * local.num_key_value_heads
        width = config.linear_conv_kernel_dim - 1
        elem = torch.empty((), dtype=dtype).element_size()
        return cls(
            kv=HeadRange(first_kv, local.num_key_value_heads),
            kv_writer=rank % per == 0,
            key_heads=HeadRange(rank * local.linear_num_key_heads, local.linear_num_key_heads),
            value_heads=HeadRange(
                rank * local.linear_num_value_heads, local.linear_num_value_heads
            ),
            kv_head_bytes=config.head_dim * elem,
            conv_key_bytes=config.linear_key_head_dim * width * elem,
            conv_value_bytes=config.linear_value_head_dim * width * elem,
            ssm_head_bytes=config.linear_key_head_dim * config.linear_value_head_dim * 4,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolShard:
        ranges = {k: HeadRange(**data[k]) for k in ("kv", "key_heads", "value_heads")}
        return cls(**{**data, **ranges})

    def head_sizes(self) -> tuple[int, int, int, int]:
        return (self.kv_head_bytes, self.conv_key_bytes, self.conv_value_bytes, self.ssm_head_bytes)


def _row(buffer: torch.Tensor) -> tuple[int, int]:
    return buffer.data_ptr(), buffer[0].numel() * buffer.element_size()


@dataclass(frozen=True)
class PoolLayout:
    session: str  # the rank's transfer-engine session, host:port
    kv: list[tuple[int, int, int]]  # per full-attention layer: K base, V base, bytes per token slot
    # per Gated DeltaNet layer: conv base, conv row, ssm base, ssm row
    states: list[tuple[int, int, int, int]]
    meta: tuple[int, int]  # the metadata rows of the state slots: base, row bytes
    extras: tuple[int, int]  # the log-probability area: base, bytes
    shard: PoolShard

    @classmethod
    def of(
        cls,
        session: str,
        pools: ModelPools,
        meta: torch.Tensor,
        extras: torch.Tensor,
        shard: PoolShard,
    ) -> PoolLayout:
        kv = [
            (k.data_ptr(), v.data_ptr(), _row(k)[1])
            for k, v in zip(pools.kv.k_buffers, pools.kv.v_buffers)
        ]
        states = [
            (*_row(c), *_row(s)) for c, s in zip(pools.states.conv_states, pools.states.ssm_states)
        ]
        return cls(session, kv, states, _row(meta), (extras.data_ptr(), extras.numel()), shard)

    def meta_address(self, row: int, source: int) -> int:
        base, row_bytes = self.meta
        return base + row * row_bytes + source * META_FIELDS * 8

    def to_dict(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "kv": self.kv,
            "states": self.states,
            "meta": self.meta,
            "extras": self.extras,
            "shard": self.shard.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolLayout:
        return cls(
            data["session"],
            [tuple(x) for x in data["kv"]],
            [tuple(x) for x in data["states"]],
            tuple(data["meta"]),
            tuple(data["extras"]),
            PoolShard.from_dict(data["shard"]),
        )

    def check_matches(self, other: PoolLayout) -> None:
        """The two ranks run the same model: equal layer counts and per-head sizes (their TP may differ)."""
        mine = (len(self.kv), len(self.states), self.shard.head_sizes())
        theirs = (len(other.kv), len(other.states), other.shard.head_sizes())
        if mine != theirs:
            raise ValueError(
                "the decode rank's pools do not hold the same model as this prefill rank's: "
                f"(attention layers, GDN layers, bytes per head) {theirs} != {mine}"
            )


class _BlockList:
    """Byte ranges, each one merged into the last when it continues it on both sides."""

    def __init__(self) -> None:
        self.sources: list[int] = []
        self.targets: list[int] = []
        self.lengths: list[int] = []

    def add(self, source: int, target: int, length: int) -> None:
        if self.lengths:
            end = self.sources[-1] + self.lengths[-1]
            if end == source and self.targets[-1] + self.lengths[-1] == target:
                self.lengths[-1] += length
                return
        self.sources.append(source)
        self.targets.append(target)
        self.lengths.append(length)

    def blocks(self) -> Blocks:
        return self.sources, self.targets, self.lengths


def request_blocks(
    src: PoolLayout,
    dst: PoolLayout,
    src_slots: list[int],
    dst_slots: list[int],
    src_state: int,
    dst_state: int,
) -> Blocks:
    """Byte ranges that copy what ``src``'s pools hold of a request and ``dst``'s pools hold too: the KV of the
    heads both hold (``src_slots`` -> ``dst_slots``, token by token; only from the rank that sends replicated
    heads) and the conv and recurrent states of the GDN heads both hold (one state slot each)."""
    assert len(src_slots) == len(dst_slots), "KV slots of the two sides disagree"
    out = _BlockList()
    _kv_blocks(out, src, dst, src_slots, dst_slots)
    _state_blocks(out, src, dst, src_state, dst_state)
    return out.blocks()


def _kv_blocks(
    out: _BlockList, src: PoolLayout, dst: PoolLayout, src_slots: list[int], dst_slots: list[int]
) -> None:
    heads = src.shard.kv.overlap(dst.shard.kv) if src.shard.kv_writer else None
    if heads is None or not src.kv:
        return
    size = src.shard.kv_head_bytes
    src_offset = (heads.first - src.shard.kv.first) * size
    dst_offset = (heads.first - dst.shard.kv.first) * size
    whole_rows = heads.count == src.shard.kv.count == dst.shard.kv.count
    spans = (
        _spans(src_slots, dst_slots)
        if whole_rows
        else [(s, d, 1) for s, d in zip(src_slots, dst_slots)]
    )
    for (src_k, src_v, src_row), (dst_k, dst_v, dst_row) in zip(src.kv, dst.kv):
        for src_base, dst_base in ((src_k, dst_k), (src_v, dst_v)):
            for s, d, n in spans:
                out.add(
                    src_base + s * src_row + src_offset,
                    dst_base + d * dst_row + dst_offset,
                    n * heads.count * size,
                )


def _spans(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first source slot, first destination slot, length) of each run consecutive on both sides."""
    spans: list[list[int]] = []
    for s, d in zip(src, dst):
        if spans and spans[-1][0] + spans[-1][2] == s and spans[-1][1] + spans[-1][2] == d:
            spans[-1][2] += 1
        else:
            spans.append([s, d, 1])
    return [(s, d, n) for s, d, n in spans]


def _state_blocks(
    out: _BlockList, src: PoolLayout, dst: PoolLayout, src_state: int, dst_state: int
) -> None:
    s, d = src.shard, dst.shard
    keys = s.key_heads.overlap(d.key_heads)
    values = s.value_heads.overlap(d.value_heads)
    for (src_c, src_conv, src_s, src_ssm), (dst_c, dst_conv, dst_s, dst_ssm) in zip(
        src.states, dst.states
    ):
        src_row = src_c + src_state * src_conv
        dst_row = dst_c + dst_state * dst_conv
        # the conv state's channels are [q | k | v] of the rank's own heads
        if keys is not None:
            for part in range(2):
                out.add(
                    src_row
                    + (part * s.key_heads.count + keys.first - s.key_heads.first)
                    * s.conv_key_bytes,
                    dst_row
                    + (part * d.key_heads.count + keys.first - d.key_heads.first)
                    * d.conv_key_bytes,
                    keys.count * s.conv_key_bytes,
                )
        if values is not None:
            out.add(
                src_row
                + 2 * s.key_heads.count * s.conv_key_bytes
                + (values.first - s.value_heads.first) * s.conv_value_bytes,
                dst_row
                + 2 * d.key_heads.count * d.conv_key_bytes
                + (values.first - d.value_heads.first) * d.conv_value_bytes,
                values.count * s.conv_value_bytes,
            )
            out.add(
                src_s
                + src_state * src_ssm
                + (values.first - s.value_heads.first) * s.ssm_head_bytes,
                dst_s
                + dst_state * dst_ssm
                + (values.first - d.value_heads.first) * d.ssm_head_bytes,
                values.count * s.ssm_head_bytes,
            )
