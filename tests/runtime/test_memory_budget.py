"""The memory budget with an explicit --max-mamba-cache-size: its state slots' bytes come out of the
budget and the KV pool gets what is left (SGLang's rule), so the two pools fit the budget together;
a size the budget cannot hold is an error naming the flag."""

from __future__ import annotations

import pytest
import torch

from sglang_lite import assets
from sglang_lite.config import ModelConfig
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.runtime import memory
from sglang_lite.server_args import ServerArgs

CONTEXT = 2048
RUNNING = 4


@pytest.fixture
def config() -> ModelConfig:
    return ModelConfig.from_hf(assets.TINY_MODEL_DIR)


@pytest.fixture
def per_state(config: ModelConfig) -> int:
    return ModelPools.bytes_per_request_state(config, torch.float32)


@pytest.fixture
def per_token(config: ModelConfig) -> int:
    return ModelPools.bytes_per_token(config, torch.float32)


def budget_of(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    monkeypatch.setattr(memory, "device_budget_bytes", lambda device, fraction: budget)


def sizes(config: ModelConfig, **flags) -> tuple[int, int]:
    """(KV tokens, state slots in all) the server would allocate."""
    args = ServerArgs(max_running_requests=RUNNING, **flags)
    tokens = memory.resolve_max_total_tokens(args, config, torch.float32, CONTEXT)
    snapshots = memory.resolve_state_snapshots(args, config, torch.float32, tokens)
    return tokens, RUNNING + snapshots


def test_explicit_state_slots_and_the_kv_pool_fit_the_budget_together(
    monkeypatch, config, per_state, per_token
):
    budget = CONTEXT * per_token + 110 * per_state  # under the cap of 8 full rows
    budget_of(monkeypatch, budget)
    for slots in (8, 40, 100):
        tokens, states = sizes(config, max_mamba_cache_size=slots)
        assert states == slots
        page = ServerArgs().page_size  # the KV pool is rounded up to whole pages
        assert tokens * per_token + states * per_state <= budget + (page - 1) * per_token
        # the rest of the budget goes to KV: less than a page of it is left unused
        assert budget - states * per_state - tokens * per_token < page * per_token


def test_fewer_state_slots_leave_a_larger_kv_pool(monkeypatch, config, per_state, per_token):
    budget_of(monkeypatch, 2 * CONTEXT * per_token + 100 * per_state)
    small, _ = sizes(config, max_mamba_cache_size=8)
    large, _ = sizes(config, max_mamba_cache_size=100)
    page = ServerArgs().page_size
    # the 92 slots fewer went to KV, to the page
    assert abs((small - large) * per_token - 92 * per_state) < page * per_token


def test_without_an_explicit_size_the_ratio_still_sizes_the_snapshots(
    monkeypatch, config, per_state, per_token
):
    """Unchanged: the snapshot pool is mamba_full_memory_ratio (0.9) of the KV pool's bytes,
    reserved beside it."""
    budget = 12 * 2**20
    budget_of(monkeypatch, budget)
    tokens, states = sizes(config)
    page = ServerArgs().page_size
    assert abs(tokens * per_token * 1.9 + RUNNING * per_state - budget) <= page * 1.9 * per_token
    assert states == int(0.9 * tokens * per_token) // per_state


def test_too_many_state_slots_for_the_budget_is_an_error_naming_the_flag(
    monkeypatch, config, per_state, per_token
):
    budget_of(monkeypatch, CONTEXT * per_token + 20 * per_state)
    assert sizes(config, max_mamba_cache_size=20)[0] >= CONTEXT
    with pytest.raises(
        MemoryError, match="less than the context length 2048: .* --max-mamba-cache-size 21 "
    ):
        sizes(config, max_mamba_cache_size=21)
    with pytest.raises(MemoryError, match="--max-mamba-cache-size 100000"):
        sizes(config, max_mamba_cache_size=100000)  # more than the whole budget


def test_an_explicit_size_without_the_prefix_cache_reserves_only_the_running_slots(
    monkeypatch, config, per_state, per_token
):
    budget_of(monkeypatch, 2 * CONTEXT * per_token + RUNNING * per_state)
    off = {"disable_radix_cache": True}
    assert sizes(config, max_mamba_cache_size=1000, **off) == sizes(config, **off)
