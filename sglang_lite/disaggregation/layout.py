"""Where a request's data lives in a rank's pools, as addresses a peer can write to.

A decode rank publishes its ``PoolLayout`` with each reservation: its page size, and per kind of data the
*regions* a slot holds (``row`` bytes at ``base + slot * stride``): the KV pool keeps every full-attention layer's
K and V of a token slot together (one region), the state pool every GDN layer's conv states of a state slot
together and every recurrent state together (two regions), and its metadata rows. The prefill rank turns a
request's pages and state slot on both sides into the byte ranges to write (``request_blocks``, a pure function):
one block per run of positions whose slots are consecutive on both sides (a run of pages, whatever the page sizes
of the two sides), and one block per state region. A region whose rows are a slice of the slot's bytes (a head
shard) gives one block per slot of a run instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from sglang_lite.mem_cache.pools import ModelPools

Blocks = tuple[list[int], list[int], list[int]]  # sources, targets, lengths (bytes)


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
class PoolLayout:
    session: str  # the rank's transfer-engine session, host:port
    page_size: int  # tokens per KV page
    kv: list[Region]  # of a token slot
    states: list[Region]  # of a state slot
    meta: tuple[
        int, int
    ]  # the metadata rows (status, first token, ...) of each state slot: base, row bytes

    @classmethod
    def of(cls, session: str, pools: ModelPools, meta: torch.Tensor) -> PoolLayout:
        states = pools.states
        kv = [Region.of(pools.kv.buffer)] if pools.kv.k_buffers else []
        return cls(
            session,
            pools.page_size,
            kv,
            [Region.of(states.conv_buffer), Region.of(states.ssm_buffer)],
            (meta.data_ptr(), meta[0].numel() * meta.element_size()),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "page_size": self.page_size,
            "kv": [list(r) for r in self.kv],
            "states": [list(r) for r in self.states],
            "meta": list(self.meta),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolLayout:
        return cls(
            data["session"],
            data["page_size"],
            [Region(*r) for r in data["kv"]],
            [Region(*r) for r in data["states"]],
            tuple(data["meta"]),
        )

    def check_matches(self, other: PoolLayout) -> None:
        """The two ranks run the same model shape: the same regions with equal rows."""
        mine = ([r.row for r in self.kv], [r.row for r in self.states])
        theirs = ([r.row for r in other.kv], [r.row for r in other.states])
        if mine != theirs:
            raise ValueError(
                f"the decode rank's pools do not match this prefill rank's: {theirs} != {mine}"
            )


class Run(NamedTuple):
    """Slots ``src .. src + length`` on one side map to ``dst .. dst + length`` on the other."""

    src: int
    dst: int
    length: int


def request_blocks(
    src: PoolLayout,
    dst: PoolLayout,
    src_pages: list[int],
    dst_pages: list[int],
    num_tokens: int,
    src_state: int,
    dst_state: int,
) -> Blocks:
    """Byte ranges that copy the KV of a request's first ``num_tokens`` positions (in ``src_pages`` on one side,
    ``dst_pages`` on the other) and its states (one state slot each) from ``src`` to ``dst``."""
    sources: list[int] = []
    targets: list[int] = []
    lengths: list[int] = []
    runs = slot_runs(src_pages, src.page_size, dst_pages, dst.page_size, num_tokens)
    for s, d in zip(src.kv, dst.kv):
        for run in runs:
            _add(sources, targets, lengths, s, d, run)
    for s, d in zip(src.states, dst.states):
        _add(sources, targets, lengths, s, d, Run(src_state, dst_state, 1))
    return sources, targets, lengths


def _add(sources: list, targets: list, lengths: list, s: Region, d: Region, run: Run) -> None:
    if s.row == s.stride and d.row == d.stride:  # whole slots: the run is one range on each side
        sources.append(s.base + run.src * s.stride)
        targets.append(d.base + run.dst * d.stride)
        lengths.append(run.length * s.row)
        return
    for i in range(run.length):
        sources.append(s.base + (run.src + i) * s.stride)
        targets.append(d.base + (run.dst + i) * d.stride)
        lengths.append(s.row)


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
