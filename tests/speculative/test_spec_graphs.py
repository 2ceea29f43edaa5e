"""Speculation's CUDA-graph runner (``SpecGraphRunner``) on its static-buffer path, run eagerly on the CPU: the
verify forward and the MTP head's steps through padded static inputs and static GDN states give the tokens of
plain decoding, and batches it has no graph for (more requests, requests verifying fewer tokens) run eagerly."""

from __future__ import annotations

import pytest
import torch

from sglang_lite import assets
from sglang_lite.config import ModelConfig
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.model_executor.spec_graph_runner import SpecGraphRunner
from sglang_lite.runtime import memory
from sglang_lite.runtime.factory import create_scheduler
from sglang_lite.server_args import ServerArgs
from tests.engine.conftest import random_prompts
from tests.speculative.conftest import GREEDY, run_scheduler, scheduler_args
from tests.speculative.test_spec_greedy import LENGTHS, NEXTN


class Counted:
    """Counts the calls of one of the runner's methods that reach the static path."""

    def __init__(self, runner: SpecGraphRunner, name: str) -> None:
        self.calls = 0
        self._inner = getattr(runner, name)
        setattr(runner, name, self)

    def __call__(self, *args):
        self.calls += 1
        return self._inner(*args)


def with_static_graphs(args, max_bs: int):
    """A scheduler whose runner takes ``SpecGraphRunner(use_graphs=False)`` for what it would capture."""
    scheduler = create_scheduler(args)
    runner = scheduler.runner
    graphs = SpecGraphRunner(
        runner.model, runner.pools, args.speculative_num_steps, max_bs, use_graphs=False
    )
    runner.spec_graphs = graphs
    return scheduler, Counted(graphs, "verify"), Counted(graphs, "head")


@pytest.mark.parametrize("kind", ["moe", "dense"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_static_graph_path_keeps_greedy_tokens(spec_checkpoints, kind, page_size, monkeypatch):
    path = spec_checkpoints[(kind, "repeat")]
    # six requests at first (more than the 4 captured: eager); after the short ones end, three padded to 4, then
    # fewer; near its length limit a request verifies fewer tokens (eager)
    lengths = [30, 8, 26, 6, 33, 8]
    prompts = random_prompts(LENGTHS, vocab=160, seed=1)
    requests = [(p, {**GREEDY, "max_new_tokens": n}) for p, n in zip(prompts, lengths)]
    plain, _, _ = run_scheduler(scheduler_args(path, page_size=page_size), requests)
    made = {}

    def create(args):
        made["scheduler"], made["verify"], made["head"] = with_static_graphs(args, max_bs=4)
        return made["scheduler"]

    eager, eager_metas, _ = run_scheduler(
        scheduler_args(path, page_size=page_size, **NEXTN), requests
    )
    monkeypatch.setattr("tests.speculative.conftest.create_scheduler", create)
    spec, metas, scheduler = run_scheduler(
        scheduler_args(path, page_size=page_size, **NEXTN), requests
    )
    assert spec == plain
    stats = scheduler.speculation.stats
    assert 0 < stats.accepted < stats.drafted
    # the same drafts as the eager steps: the head's inputs reached it through the static buffers
    for i in metas:
        assert metas[i]["spec_accept_token_num"] == eager_metas[i]["spec_accept_token_num"], i
    assert made["verify"].calls > 0 and made["head"].calls > 0
    assert made["verify"].calls < stats.verify_steps


def test_capture_sizes_cover_rows(spec_checkpoints):
    path = spec_checkpoints[("moe", "repeat")]
    scheduler, _, _ = with_static_graphs(scheduler_args(path, **NEXTN), max_bs=6)
    graphs = scheduler.runner.spec_graphs
    assert graphs.verify_sizes == [1, 2, 4, 6]
    assert graphs.head_sizes[-1] == 6 * 4  # every request's last token and its 3 drafts
    assert graphs.can_verify([4] * 6) and not graphs.can_verify([4] * 7)
    assert not graphs.can_verify([4, 1])  # a request decoding one token (a grammar's): eagerly
    # the smaller sizes keep their states in the largest size's buffers
    assert graphs.states[2].ssm.data_ptr() == graphs.states[6].ssm.data_ptr()


def test_the_kv_budget_leaves_room_for_the_verify_states(monkeypatch):
    """The states a verify forward keeps (every running request's, after each of its k + 1 tokens; static buffers
    under CUDA graphs) come out of the memory budget before the KV pool is sized."""
    config = ModelConfig.from_hf(assets.TINY_MODEL_DIR)
    budget = 4 * 2**20  # under what 4 rows of 2048 tokens could use
    monkeypatch.setattr(memory, "device_budget_bytes", lambda device, fraction: budget)
    state = ModelPools.bytes_per_request_state(config, torch.float32)
    for steps in (0, 3):
        args = ServerArgs(max_running_requests=4, disable_radix_cache=True, **nextn(steps))
        tokens = memory.resolve_max_total_tokens(args, config, torch.float32, 2048)
        per_token = ModelPools.bytes_per_token(config, torch.float32, 1 if steps else 0)
        kept = 4 * (
            1 + (steps + 1 if steps else 0)
        )  # state slots: running requests, and verify states
        fits = (budget - kept * state) // per_token
        assert tokens == -(-fits // args.page_size) * args.page_size


def nextn(steps: int) -> dict:
    return {"speculative_algorithm": "NEXTN", "speculative_num_steps": steps} if steps else {}
