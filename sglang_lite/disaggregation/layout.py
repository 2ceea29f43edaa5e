"""Where a request's data lives in a rank's pools, as addresses a peer can write to.

A decode rank publishes its ``PoolLayout`` (the base address and row size of every KV and state buffer, and of its
metadata rows) with each reservation; the prefill rank turns a request's KV slots and state slot on both sides into
the list of byte ranges to write (``request_blocks``), runs of consecutive slots coalesced into one range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from sglang_lite.mem_cache.pools import ModelPools

Blocks = tuple[list[int], list[int], list[int]]  # sources, targets, lengths (bytes)


def _row(buffer: torch.Tensor) -> tuple[int, int]:
    return buffer.data_ptr(), buffer[0].numel() * buffer.element_size()


@dataclass(frozen=True)
class PoolLayout:
    session: str  # the rank's transfer-engine session, host:port
    kv: list[tuple[int, int, int]]  # per full-attention layer: K base, V base, bytes per token slot
    # per Gated DeltaNet layer: conv base, conv row, ssm base, ssm row
    states: list[tuple[int, int, int, int]]
    # the metadata rows (status, first token) of each state slot: base, row bytes
    meta: tuple[int, int]

    @classmethod
    def of(cls, session: str, pools: ModelPools, meta: torch.Tensor) -> PoolLayout:
        kv = [
            (*_row(k)[:1], v.data_ptr(), _row(k)[1])
            for k, v in zip(pools.kv.k_buffers, pools.kv.v_buffers)
        ]
        states = [
            (*_row(c), *_row(s)) for c, s in zip(pools.states.conv_states, pools.states.ssm_states)
        ]
        return cls(session, kv, states, _row(meta))

    def to_dict(self) -> dict[str, Any]:
        return {"session": self.session, "kv": self.kv, "states": self.states, "meta": self.meta}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolLayout:
        return cls(
            data["session"],
            [tuple(x) for x in data["kv"]],
            [tuple(x) for x in data["states"]],
            tuple(data["meta"]),
        )

    def check_matches(self, other: PoolLayout) -> None:
        """The two ranks run the same model shape: equal layer counts and row sizes."""
        mine = ([r for *_, r in self.kv], [(c, s) for _, c, _, s in self.states])
        theirs = ([r for *_, r in other.kv], [(c, s) for _, c, _, s in other.states])
        if mine != theirs:
            raise ValueError(
                f"the decode rank's pools do not match this prefill rank's: {theirs} != {mine}"
            )


def request_blocks(
    src: PoolLayout,
    dst: PoolLayout,
    src_slots: list[int],
    dst_slots: list[int],
    src_state: int,
    dst_state: int,
) -> Blocks:
    """Byte ranges that copy a request's KV (``src_slots`` -> ``dst_slots``, token by token) and its conv and
    recurrent states (one slot each) from ``src`` to ``dst``."""
    assert len(src_slots) == len(dst_slots), "KV slots of the two sides disagree"
    sources: list[int] = []
    targets: list[int] = []
    lengths: list[int] = []
    runs = _runs(src_slots, dst_slots)
    for (src_k, src_v, row), (dst_k, dst_v, _) in zip(src.kv, dst.kv):
        for s, d, n in runs:
            sources += [src_k + s * row, src_v + s * row]
            targets += [dst_k + d * row, dst_v + d * row]
            lengths += [n * row, n * row]
    for (src_c, conv_row, src_s, ssm_row), (dst_c, _, dst_s, _) in zip(src.states, dst.states):
        sources += [src_c + src_state * conv_row, src_s + src_state * ssm_row]
        targets += [dst_c + dst_state * conv_row, dst_s + dst_state * ssm_row]
        lengths += [conv_row, ssm_row]
    return sources, targets, lengths


class _Run(NamedTuple):
    """Slots ``src .. src + length`` on one side map to ``dst .. dst + length`` on the other."""

    src: int
    dst: int
    length: int


def _runs(src: list[int], dst: list[int]) -> list[_Run]:
    """The maximal runs where both sides' slots are consecutive."""
    runs: list[_Run] = []
    for s, d in zip(src, dst):
        last = runs[-1] if runs else None
        if last and last.src + last.length == s and last.dst + last.length == d:
            runs[-1] = last._replace(length=last.length + 1)
        else:
            runs.append(_Run(s, d, 1))
    return runs
