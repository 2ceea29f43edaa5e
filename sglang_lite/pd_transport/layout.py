"""Where a request's data lives in a rank's pools, as addresses a peer can write to, and which heads they hold.

A decode rank publishes its ``PoolLayout`` with each reservation: its page size; per kind of data the *regions* a
slot holds (``row`` bytes at ``base + slot * stride``: the KV pool keeps every full-attention layer's K and V of a
token slot together, the state pool every GDN layer's conv states of a state slot together and every recurrent
state together); its metadata rows and its log-probability area; and its ``PoolShard``, the heads its pools hold.
Every rank of the decode DP rank's attention group publishes one. A prefill rank turns a request's pages and state
slot on both sides into the byte ranges to write into one decode rank (``request_blocks``, a pure function): the
heads the two ranks both hold, so that under tensor parallelism each prefill rank writes its own shard into the
decode ranks that hold the same heads, whatever the two servers' TP sizes. Where both ranks hold whole rows, a run
of positions whose slots are consecutive on both sides (a run of pages, whatever the two page sizes) is one block
for every layer's K and V, and each state kind one block; a head slice is a few pieces of each slot's row instead.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import torch

from sglang_lite.config import ModelConfig
from sglang_lite.mem_cache.pools import ModelPools

Blocks = tuple[list[int], list[int], list[int]]  # sources, targets, lengths (bytes)
Piece = tuple[
    int, int, int
]  # bytes of a slot's row: offset on the source, offset on the target, length
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
    ROOM = 5  # the request's bootstrap room: a late write of an earlier request's sub-row is told apart
    STATUS = 7  # PENDING, DONE or FAILED (scheduler.pd_side.base)


class Region(NamedTuple):
    """``row`` bytes of each slot at ``base + slot * stride``."""

    base: int
    stride: int
    row: int

    @classmethod
    def of(cls, buffer: torch.Tensor) -> Region:
        """Every byte of each slot of ``buffer`` (slots along its first dimension, each one contiguous)."""
        elem = buffer.element_size()
        return cls(buffer.data_ptr(), buffer.stride(0) * elem, buffer[0].numel() * elem)


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
    """The heads a rank's pools hold (global head indices), the bytes one head takes in each buffer, and the layer
    counts (a slot's row holds every layer of its kind)."""

    kv: HeadRange  # full-attention KV heads
    kv_writer: bool  # the first of the ranks that replicate these KV heads: the one that sends them
    key_heads: HeadRange  # Gated DeltaNet key heads (q and k channels of the conv state)
    value_heads: HeadRange  # Gated DeltaNet value heads (v channels, recurrent state)
    kv_head_bytes: int  # head_dim elements of K (or V) of one token
    conv_key_bytes: int  # conv state rows of one key head: key_head_dim x (kernel - 1)
    conv_value_bytes: int  # conv state rows of one value head: value_head_dim x (kernel - 1)
    ssm_head_bytes: int  # recurrent state of one value head: key_head_dim x value_head_dim (fp32)
    attention_layers: int
    gdn_layers: int

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
            attention_layers=len(config.full_attention_layers),
            gdn_layers=len(config.linear_attention_layers),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolShard:
        ranges = {k: HeadRange(**data[k]) for k in ("kv", "key_heads", "value_heads")}
        return cls(**{**data, **ranges})

    def model_sizes(self) -> tuple[int, ...]:
        """What both sides of a transfer must agree on: the bytes of one head of each kind and the layer counts."""
        heads = (
            self.kv_head_bytes,
            self.conv_key_bytes,
            self.conv_value_bytes,
            self.ssm_head_bytes,
        )
        return (*heads, self.attention_layers, self.gdn_layers)


@dataclass(frozen=True)
class PoolLayout:
    session: str  # the rank's transfer-engine session, host:port
    page_size: int  # tokens per KV page
    kv: list[Region]  # of a token slot (none for a model without full attention)
    states: list[Region]  # of a state slot: the conv states, the recurrent states
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
        states = pools.states
        kv = [Region.of(pools.kv.buffer)] if pools.kv.k_buffers else []
        return cls(
            session,
            pools.page_size,
            kv,
            [Region.of(states.conv_buffer), Region.of(states.ssm_buffer)],
            (meta.data_ptr(), meta[0].numel() * meta.element_size()),
            (extras.data_ptr(), extras.numel()),
            shard,
        )

    def meta_address(self, row: int, source: int) -> int:
        base, row_bytes = self.meta
        return base + row * row_bytes + source * META_FIELDS * 8

    def to_dict(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "page_size": self.page_size,
            "kv": [list(r) for r in self.kv],
            "states": [list(r) for r in self.states],
            "meta": list(self.meta),
            "extras": list(self.extras),
            "shard": self.shard.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolLayout:
        return cls(
            data["session"],
            data["page_size"],
            [Region(*r) for r in data["kv"]],
            [Region(*r) for r in data["states"]],
            tuple(data["meta"]),
            tuple(data["extras"]),
            PoolShard.from_dict(data["shard"]),
        )

    def check_matches(self, other: PoolLayout) -> None:
        """The two ranks run the same model (their TP sizes and page sizes may differ)."""
        mine, theirs = self.shard.model_sizes(), other.shard.model_sizes()
        if mine != theirs:
            raise ValueError(
                "the decode rank's pools do not hold the same model as this prefill rank's: (bytes per "
                f"head of KV, conv keys, conv values, recurrent state; layers) {theirs} != {mine}"
            )


class Run(NamedTuple):
    """Slots ``src .. src + length`` on one side map to ``dst .. dst + length`` on the other."""

    src: int
    dst: int
    length: int


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

    def region(self, s: Region, d: Region, run: Run, pieces: list[Piece]) -> None:
        """The ``pieces`` of each slot's row of a run: one range for a run of whole rows."""
        whole = [(0, 0, s.row)] == pieces and s.row == s.stride == d.row == d.stride
        if whole:
            self.add(s.base + run.src * s.stride, d.base + run.dst * d.stride, run.length * s.row)
            return
        for i in range(run.length):
            source, target = s.base + (run.src + i) * s.stride, d.base + (run.dst + i) * d.stride
            for src_offset, dst_offset, length in pieces:
                self.add(source + src_offset, target + dst_offset, length)

    def blocks(self) -> Blocks:
        return self.sources, self.targets, self.lengths


def request_blocks(
    src: PoolLayout,
    dst: PoolLayout,
    src_pages: list[int],
    dst_pages: list[int],
    num_tokens: int,
    src_state: int,
    dst_state: int,
) -> Blocks:
    """Byte ranges that copy what ``src``'s pools hold of a request and ``dst``'s pools hold too: the KV of the
    first ``num_tokens`` positions (in ``src_pages`` on one side, ``dst_pages`` on the other) for the heads both
    hold (only from the rank that sends replicated heads), and the conv and recurrent states (one state slot each)
    of the GDN heads both hold."""
    out = _BlockList()
    kv = _kv_pieces(src.shard, dst.shard)
    if kv and src.kv:
        runs = slot_runs(src_pages, src.page_size, dst_pages, dst.page_size, num_tokens)
        for run in runs:
            out.region(src.kv[0], dst.kv[0], run, kv)
    state = Run(src_state, dst_state, 1)
    for s, d, pieces in zip(src.states, dst.states, _state_pieces(src.shard, dst.shard)):
        if pieces:
            out.region(s, d, state, pieces)
    return out.blocks()


def _kv_pieces(s: PoolShard, d: PoolShard) -> list[Piece]:
    """A token slot's row is [layers, K and V, the rank's KV heads, head bytes]: the shared heads of each."""
    heads = s.kv.overlap(d.kv) if s.kv_writer else None
    if heads is None:
        return []
    size = s.kv_head_bytes
    pieces = [
        (
            ((layer * 2 + k_or_v) * s.kv.count + heads.first - s.kv.first) * size,
            ((layer * 2 + k_or_v) * d.kv.count + heads.first - d.kv.first) * size,
            heads.count * size,
        )
        for layer in range(s.attention_layers)
        for k_or_v in range(2)
    ]
    return _merged(pieces)


def _state_pieces(s: PoolShard, d: PoolShard) -> tuple[list[Piece], list[Piece]]:
    """A state slot's conv row is [layers, the rank's q | k | v channels, kernel - 1]; its recurrent row is
    [layers, the rank's value heads, dk x dv]: the shared heads' parts of each layer."""
    keys, values = s.key_heads.overlap(d.key_heads), s.value_heads.overlap(d.value_heads)
    conv: list[Piece] = []
    ssm: list[Piece] = []
    src_conv = 2 * s.key_heads.count * s.conv_key_bytes + s.value_heads.count * s.conv_value_bytes
    dst_conv = 2 * d.key_heads.count * d.conv_key_bytes + d.value_heads.count * d.conv_value_bytes
    for layer in range(s.gdn_layers):
        src_row, dst_row = layer * src_conv, layer * dst_conv
        if keys is not None:
            for part in range(2):  # q, then k
                conv.append(
                    (
                        src_row
                        + (part * s.key_heads.count + keys.first - s.key_heads.first)
                        * s.conv_key_bytes,
                        dst_row
                        + (part * d.key_heads.count + keys.first - d.key_heads.first)
                        * d.conv_key_bytes,
                        keys.count * s.conv_key_bytes,
                    )
                )
        if values is not None:
            conv.append(
                (
                    src_row
                    + 2 * s.key_heads.count * s.conv_key_bytes
                    + (values.first - s.value_heads.first) * s.conv_value_bytes,
                    dst_row
                    + 2 * d.key_heads.count * d.conv_key_bytes
                    + (values.first - d.value_heads.first) * d.conv_value_bytes,
                    values.count * s.conv_value_bytes,
                )
            )
            ssm.append(
                (
                    (layer * s.value_heads.count + values.first - s.value_heads.first)
                    * s.ssm_head_bytes,
                    (layer * d.value_heads.count + values.first - d.value_heads.first)
                    * d.ssm_head_bytes,
                    values.count * s.ssm_head_bytes,
                )
            )
    return _merged(conv), _merged(ssm)


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Pieces in order, each merged into the last where it continues it on both sides."""
    out: list[Piece] = []
    for src_offset, dst_offset, length in pieces:
        if out and out[-1][0] + out[-1][2] == src_offset and out[-1][1] + out[-1][2] == dst_offset:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + length)
        else:
            out.append((src_offset, dst_offset, length))
    return out


def slot_runs(
    src_pages: list[int], src_size: int, dst_pages: list[int], dst_size: int, num_tokens: int
) -> list[Run]:
    """The maximal runs of positions ``0..num_tokens`` whose slots are consecutive on both sides (position p is in
    slot ``pages[p // size] * size + p % size`` on each)."""
    runs: list[Run] = []
    p = 0
    while p < num_tokens:
        s = src_pages[p // src_size] * src_size + p % src_size
        d = dst_pages[p // dst_size] * dst_size + p % dst_size
        # up to the next page boundary of either side
        end = min(num_tokens, (p // src_size + 1) * src_size, (p // dst_size + 1) * dst_size)
        last = runs[-1] if runs else None
        if last and last.src + last.length == s and last.dst + last.length == d:
            runs[-1] = last._replace(length=last.length + end - p)
        else:
            runs.append(Run(s, d, end - p))
        p = end
    return runs
