"""PD under tensor parallelism, without servers: each prefill rank's blocks (``request_blocks``) copy the heads it
holds into every decode rank that holds them, whatever the two attention groups' sizes. The blocks are applied
with memmove between real pools, and every decode rank must end up holding exactly its shard of the request's KV,
conv and recurrent states, with nothing else written."""

from __future__ import annotations

import ctypes

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig

from sglang_lite.config import ModelConfig
from sglang_lite.mem_cache.pools import LinearStatePool, ModelPools, ReqToTokenPool, TokenKVPool
from sglang_lite.pd_transport.layout import PoolLayout, PoolShard, request_blocks
from tests.hf_checkpoints import BASE, MOE

# 8 query heads over 2 KV heads (replicated over 4 ranks), 4 GDN key heads with 2 value heads each
CONFIG = ModelConfig.from_hf(
    Qwen3_5MoeTextConfig(
        **{
            **BASE,
            **MOE,
            "num_attention_heads": 8,
            "linear_num_key_heads": 4,
            "linear_num_value_heads": 8,
        }
    )
)
PAGES = 64
PROMPT = 11


class Rank:
    """One rank's pools (pages of ``page_size`` tokens), holding its shard of an attention group of ``size``."""

    def __init__(self, rank: int, size: int, fill: float, page_size: int = 1) -> None:
        local = CONFIG.attention_shard(size)
        self.pools = ModelPools(
            ReqToTokenPool(2, 32, page_size, "cpu"),
            TokenKVPool(local, PAGES, page_size, torch.float32, "cpu"),
            LinearStatePool(local, 4, torch.float32, "cpu"),
            {i: n for n, i in enumerate(CONFIG.full_attention_layers)},
            {i: n for n, i in enumerate(CONFIG.linear_attention_layers)},
        )
        for buffer in self._buffers():
            buffer.fill_(fill)
        self.shard = PoolShard.of(CONFIG, rank, size, torch.float32)
        meta, extras = torch.zeros(5, 4), torch.zeros(8, dtype=torch.uint8)
        self.layout = PoolLayout.of(f"rank{rank}:0", self.pools, meta, extras, self.shard)

    def _buffers(self) -> list[torch.Tensor]:
        states = self.pools.states
        return [self.pools.kv.buffer, states.conv_buffer, states.ssm_buffer]

    def slots(self, pages: list[int]) -> list[int]:
        size = self.pools.page_size
        return [pages[p // size] * size + p % size for p in range(PROMPT)]

    def write(self, full: dict, slots: list[int], state: int) -> None:
        for name, buffers in self._views().items():
            for buffer, whole in zip(buffers, full[name]):
                buffer[slots if name in ("k", "v") else state] = self._part(whole, name)

    def read(self, slots: list[int], state: int) -> dict:
        return {
            name: [self._region(b, name, slots, state).clone() for b in buffers]
            for name, buffers in self._views().items()
        }

    def expected(self, full: dict) -> dict:
        return {name: [self._part(w, name) for w in full[name]] for name in full}

    def _views(self) -> dict[str, list[torch.Tensor]]:
        kv, states = self.pools.kv, self.pools.states
        return {
            "k": kv.k_buffers,
            "v": kv.v_buffers,
            "conv": states.conv_states,
            "ssm": states.ssm_states,
        }

    @staticmethod
    def _region(buffer: torch.Tensor, name: str, slots: list[int], state: int) -> torch.Tensor:
        return buffer[slots] if name in ("k", "v") else buffer[state]

    def _part(self, whole: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's heads of a whole (unsharded) tensor, as the model lays them out."""
        s = self.shard
        if name in ("k", "v"):
            return whole[:, s.kv.first : s.kv.end]
        if name == "ssm":
            return whole[s.value_heads.first : s.value_heads.end]
        dk, dv = CONFIG.linear_key_head_dim, CONFIG.linear_value_head_dim
        keys = CONFIG.linear_num_key_heads * dk
        q = whole[s.key_heads.first * dk : s.key_heads.end * dk]
        k = whole[keys + s.key_heads.first * dk : keys + s.key_heads.end * dk]
        v = whole[2 * keys + s.value_heads.first * dv : 2 * keys + s.value_heads.end * dv]
        return torch.cat([q, k, v])


def _full_request() -> dict:
    """A request's whole KV (every head) and states, as a single rank would hold them."""
    torch.manual_seed(0)
    n_attn, n_gdn = len(CONFIG.full_attention_layers), len(CONFIG.linear_attention_layers)
    kv_shape = (PROMPT, CONFIG.num_key_value_heads, CONFIG.head_dim)
    conv_shape = (CONFIG.conv_dim, CONFIG.linear_conv_kernel_dim - 1)
    ssm = (CONFIG.linear_num_value_heads, CONFIG.linear_key_head_dim, CONFIG.linear_value_head_dim)
    return {
        "k": [torch.randn(kv_shape) for _ in range(n_attn)],
        "v": [torch.randn(kv_shape) for _ in range(n_attn)],
        "conv": [torch.randn(conv_shape) for _ in range(n_gdn)],
        "ssm": [torch.randn(ssm) for _ in range(n_gdn)],
    }


def _apply(blocks: tuple[list[int], list[int], list[int]]) -> int:
    for source, target, length in zip(*blocks):
        ctypes.memmove(target, source, length)
    return len(blocks[0])


@pytest.mark.parametrize(
    "prefill_size,decode_size", [(1, 1), (2, 2), (1, 2), (2, 1), (1, 4), (4, 2), (4, 1)]
)
@pytest.mark.parametrize("page_sizes", [(1, 1), (4, 2)], ids=["pages1", "pages4-2"])
def test_every_decode_rank_gets_exactly_its_heads(
    prefill_size: int, decode_size: int, page_sizes: tuple[int, int]
) -> None:
    full = _full_request()
    src_size, dst_size = page_sizes
    # pages with gaps on both sides, so the runs differ in length
    src_pages = [3, 4, 9, 10, 20, 21, 22, 23, 40, 41, 42][: -(-PROMPT // src_size)]
    dst_pages = [7, 8, 9, 10, 30, 31, 32, 50, 51, 52, 60][: -(-PROMPT // dst_size)]
    src_state, dst_state = 2, 3
    prefill = [Rank(r, prefill_size, 0.0, src_size) for r in range(prefill_size)]
    decode = [Rank(r, decode_size, float("nan"), dst_size) for r in range(decode_size)]
    src_slots, dst_slots = prefill[0].slots(src_pages), decode[0].slots(dst_pages)
    for rank in prefill:
        rank.write(full, src_slots, src_state)
    for src in prefill:
        for dst in decode:
            blocks = request_blocks(
                src.layout, dst.layout, src_pages, dst_pages, PROMPT, src_state, dst_state
            )
            _apply(blocks)
    for dst in decode:
        got, want = dst.read(dst_slots, dst_state), dst.expected(full)
        for name in want:
            for g, w in zip(got[name], want[name]):
                assert torch.equal(g, w), (name, dst.shard)
        # nothing outside the request's slots and state slot was written
        kv, states = dst.pools.kv.buffer, dst.pools.states
        untouched = [s for s in range(kv.shape[0]) if s not in dst_slots]
        assert kv[untouched].isnan().all()
        others = [s for s in range(states.conv_buffer.shape[0]) if s != dst_state]
        assert states.conv_buffer[others].isnan().all() and states.ssm_buffer[others].isnan().all()


def test_whole_rows_coalesce_and_sliced_heads_go_token_by_token() -> None:
    pages = list(range(1, PROMPT + 1))  # one run on both sides
    one, other = Rank(0, 1, 0.0), Rank(1, 2, 0.0)
    same = request_blocks(one.layout, one.layout, pages, pages, PROMPT, 1, 1)
    # every layer's K and V of the run one block; each state kind of every GDN layer one block
    assert len(same[0]) == 3
    sliced = request_blocks(one.layout, other.layout, pages, pages, PROMPT, 1, 1)
    n_attn, n_gdn = len(CONFIG.full_attention_layers), len(CONFIG.linear_attention_layers)
    # one KV head of two, per token and layer, K and V apart; per GDN layer the conv state's q, k and v parts and
    # the recurrent state
    assert len(sliced[0]) == 2 * n_attn * PROMPT + 4 * n_gdn


def test_replicated_kv_heads_are_sent_once() -> None:
    """Four prefill ranks share two KV heads (two ranks each): only the first of each pair sends its head, so the
    bytes written into a single decode rank are exactly what it holds of the request."""
    decode = Rank(0, 1, 0.0)
    slots = [1, 2, 3]
    assert [PoolShard.of(CONFIG, r, 4, torch.float32).kv_writer for r in range(4)] == [
        True,
        False,
        True,
        False,
    ]
    written = sum(
        sum(request_blocks(Rank(r, 4, 0.0).layout, decode.layout, slots, slots, 3, 1, 1)[2])
        for r in range(4)
    )
    held = sum(t.numel() * 4 for ts in decode.read(slots, 1).values() for t in ts)
    assert written == held
