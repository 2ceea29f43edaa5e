"""One model over several processes (a world of --tp-size ranks) behind both front ends: the offline Engine, an HTTP
server with DP attention, two nodes on one machine, and a world that loses a process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from sglang_lite import Engine
from sglang_lite.distributed import ParallelConfig
from sglang_lite.launch_server import parse_args
from sglang_lite.runtime.factory import create_scheduler
from sglang_lite.server_args import ServerArgs
from tests.hf_checkpoints import make_hf_model, save_checkpoint
from tests.server.conftest import ServerProcess, free_port, start_server

ONE_THREAD = ["--cpu-threads-per-rank", "1"]
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11] * 40]


def greedy(model_path: str | None, tp_size: int) -> list[list[int]]:
    engine = Engine(
        model_path,
        tp_size=tp_size,
        skip_tokenizer_init=True,
        cpu_threads_per_rank=1,
        context_length=256,
        max_total_tokens=2048,
        max_running_requests=4,
    )
    try:
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        return [r["output_ids"] for r in engine.generate(input_ids=PROMPTS, sampling_params=params)]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("checkpoint", ["builtin", "hf_moe"])
def test_engine_tp2_greedy_tokens_equal_tp1(checkpoint: str, tmp_path) -> None:
    path = (
        None
        if checkpoint == "builtin"
        else save_checkpoint(make_hf_model(moe=True), str(tmp_path / "moe"))
    )
    assert greedy(path, tp_size=2) == greedy(path, tp_size=1)


def test_parallel_flags_are_validated_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="ep_size"):
        ServerArgs(tp_size=2, ep_size=4)
    with pytest.raises(ValueError, match="dp_size .* must divide tp_size"):
        ServerArgs(tp_size=2, dp_size=4, enable_dp_attention=True)
    with pytest.raises(ValueError, match="nnodes"):
        ServerArgs(tp_size=3, nnodes=2, dist_init_addr="127.0.0.1:5000")
    with pytest.raises(ValueError, match="node_rank"):
        ServerArgs(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:5000")
    with pytest.raises(ValueError, match="dist_init_addr"):
        ServerArgs(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match="dp_size 1 or enable_dp_attention"):
        ServerArgs(tp_size=2, dp_size=2, nnodes=2, dist_init_addr="127.0.0.1:5000")
    args = ServerArgs(
        tp_size=4, dp_size=2, nnodes=2, dist_init_addr="h:1", enable_dp_attention=True
    )
    assert (args.num_worlds, args.ranks_per_node, args.parallel_config.attn_tp_size) == (1, 2, 2)
    assert ServerArgs(tp_size=2, dp_size=3, cpu_threads_per_rank=None).cpu_threads == max(
        1, os.cpu_count() // 6
    )
    assert parse_args(["--tp", "2", "--ep-size", "2"]).parallel_config == ParallelConfig(
        tp_size=2, ep_size=2
    )


def test_upstream_spellings_of_the_parallel_sizes() -> None:
    long = [
        "--tensor-parallel-size",
        "4",
        "--data-parallel-size",
        "2",
        "--expert-parallel-size",
        "2",
    ]
    short = ["--tp-size", "4", "--dp-size", "2", "--ep-size", "2"]
    assert (
        parse_args(long) == parse_args(short) == parse_args(["--tp", "4", "--dp", "2", "--ep", "2"])
    )


def test_dp_attention_divides_the_request_and_chunk_totals_over_the_dp_ranks() -> None:
    """As upstream: under DP attention --max-running-requests and --chunked-prefill-size are the server's totals."""
    args = ServerArgs(
        tp_size=4,
        dp_size=4,
        enable_dp_attention=True,
        max_running_requests=32,
        chunked_prefill_size=4096,
    )
    rank = args.per_dp_rank()
    assert (rank.max_running_requests, rank.chunked_prefill_size) == (8, 1024)
    replicas = ServerArgs(dp_size=4, max_running_requests=32, chunked_prefill_size=4096)
    assert replicas.per_dp_rank() == replicas  # independent replicas: per rank, as before
    unchunked = ServerArgs(tp_size=2, dp_size=2, enable_dp_attention=True, chunked_prefill_size=-1)
    assert unchunked.per_dp_rank().chunked_prefill_size == -1
    with pytest.raises(ValueError, match="max_running_requests .* at least one per rank"):
        ServerArgs(tp_size=4, dp_size=4, enable_dp_attention=True, max_running_requests=2)


def count_forwards(runner) -> list[str]:
    """The forwards ``runner`` runs from now on, in order ("batch" or "idle"; an idle one runs nothing)."""
    forwards: list[str] = []
    real_forward = runner.forward_batch
    runner.forward_batch = lambda *args: forwards.append("batch") or real_forward(*args)
    runner.forward_idle = lambda: forwards.append("idle")
    return forwards


def test_a_lockstep_step_runs_exactly_one_forward_real_or_idle() -> None:
    scheduler = create_scheduler(
        ServerArgs(
            load_format="dummy",
            skip_tokenizer_init=True,
            context_length=128,
            max_total_tokens=256,
            max_running_requests=2,
        )
    )
    forwards = count_forwards(scheduler.runner)
    scheduler.step()  # nothing to do and not in lockstep: no forward
    scheduler.step(must_forward=True)
    scheduler.add_request("r", [1, 2, 3], {"max_new_tokens": 2, "ignore_eos": True})
    outputs = scheduler.step(must_forward=True)
    assert forwards == ["idle", "batch"] and outputs[0].new_token_ids


# ---- the HTTP server ---------------------------------------------------------------------------------------------
def generate(
    server: ServerProcess, rank: int | None = None, max_new_tokens: int = 4, timeout: float = 60
) -> dict:
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0},
    }
    if rank is not None:
        body["routed_dp_rank"] = rank
    response = httpx.post(f"{server.url}/generate", json=body, timeout=timeout)
    return {"status": response.status_code, **response.json()}


@pytest.fixture(scope="module")
def dp_attention_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", *ONE_THREAD]
    yield from start_server(tmp_path_factory, "tp2_dp2_dpattn", flags)


def test_dp_attention_server_answers_on_both_dp_ranks(dp_attention_server: ServerProcess) -> None:
    results: dict[int, dict] = {}
    threads = [
        threading.Thread(
            target=lambda r=r: results.__setitem__(r, generate(dp_attention_server, r, 6))
        )
        for r in (0, 1, 1)
    ]  # both ranks at once: one batch meets an idle or smaller one in the MoE
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert {
        r: (v["status"], v["meta_info"]["dp_rank"], len(v["output_ids"]))
        for r, v in results.items()
    } == {0: (200, 0, 6), 1: (200, 1, 6)}
    loads = httpx.get(f"{dp_attention_server.url}/v1/loads", timeout=10).json()["loads"]
    # one entry per DP-attention rank, each in upstream's nested shape
    assert [load["dp_rank"] for load in loads] == [0, 1]
    assert all(load["memory"]["token_capacity"] == load["max_total_num_tokens"] for load in loads)
    info = httpx.get(f"{dp_attention_server.url}/server_info", timeout=10).json()
    layout = {
        k: info[k] for k in ("tp_size", "ep_size", "dp_size", "enable_dp_attention", "nnodes")
    }
    assert layout == {
        "tp_size": 2,
        "ep_size": 1,
        "dp_size": 2,
        "enable_dp_attention": True,
        "nnodes": 1,
    }
    assert httpx.get(f"{dp_attention_server.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("stopped_first", ["node0", "node1"])
def test_two_nodes_on_one_machine_serve_through_node_0(stopped_first: str, tmp_path) -> None:
    address = f"127.0.0.1:{free_port()}"
    flags = [
        "--tp-size",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        address,
        "--dist-timeout",
        "60",
        *ONE_THREAD,
    ]
    log = open(tmp_path / "node1.log", "w")
    command = [
        sys.executable,
        "-m",
        "sglang_lite.launch_server",
        "--load-format",
        "dummy",
        "--node-rank",
        "1",
        *flags,
    ]
    node1 = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    node0 = ServerProcess([*flags, "--node-rank", "0"], str(tmp_path / "node0.log"))
    try:
        node0.wait_ready()
        result = generate(node0, max_new_tokens=5)
        assert (result["status"], len(result["output_ids"])) == (200, 5)
        assert httpx.get(f"{node0.url}/server_info", timeout=10).json()["nnodes"] == 2
        if stopped_first == "node0":
            node0.kill()
            node1.wait(
                30
            )  # node 0's ranks are gone (stopped, or killed with their group): node 1's follow
        else:
            node1.send_signal(signal.SIGTERM)
            assert node1.wait(30) == 0  # it stops its ranks and exits
            _wait_health(node0, 503)  # node 0 lost a rank of its world: it says so and stays up
            assert node0.process.poll() is None and generate(node0)["status"] == 503
    finally:
        node0.kill()
        _kill_group(node1)
        log.close()


# ---- failure -----------------------------------------------------------------------------------------------------
def test_a_killed_follower_fails_the_world_without_hanging(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    flags = ["--tp-size", "2", "--dist-timeout", "30", *ONE_THREAD]
    with contextlib.contextmanager(start_server)(tmp_path_factory, "tp2_failure", flags) as server:
        follower = _child_with_arg(server.process.pid, b"--rank=1")
        outcome: dict = {}
        request = threading.Thread(
            target=lambda: outcome.update(generate(server, max_new_tokens=400, timeout=60))
        )
        request.start()
        _wait_running(server)
        os.kill(follower, signal.SIGKILL)
        request.join(60)
        assert not request.is_alive() and outcome["status"] == 503, outcome
        assert "cannot be restarted" in outcome["error"]["message"]
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["ranks"][0]["state"] == "failed"
        assert server.process.poll() is None  # the HTTP server stays up and says why
        assert generate(server)["status"] == 503


def _wait_health(server: ServerProcess, status: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{server.url}/health", timeout=10).status_code != status:
        assert time.monotonic() < deadline, f"/health is not {status} after {timeout_s} s"
        time.sleep(0.1)


def _wait_running(server: ServerProcess, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loads = httpx.get(f"{server.url}/v1/loads", timeout=10).json()["loads"]
        if loads[0]["num_running_reqs"]:
            return
        time.sleep(0.1)
    raise AssertionError(f"the request never ran in {timeout_s} s")


def _child_with_arg(parent: int, arg: bytes) -> int:
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and arg in args:
            return pid
    raise AssertionError(f"no child of {parent} has {arg!r}")


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(10)
