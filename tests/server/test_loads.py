"""/v1/loads and /get_load: the schema, the filters, live counts while requests run, and routed_dp_rank."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess, get_loads, wait_idle

CORE = {
    "dp_rank",
    "timestamp",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_used_tokens",
    "num_total_tokens",
    "max_total_num_tokens",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
    "max_running_requests",
    "cached_tokens",
    "num_cached_prompt_tokens",
}
# each section's sub-object: its key in the rank's entry and its figures (upstream's, then ours)
SECTIONS = {
    "memory": (
        "memory",
        {
            "weight_gb",
            "kv_cache_gb",
            "graph_gb",
            "token_capacity",
            "snapshot_slots",
            "snapshot_slots_used",
            "snapshots_evicted",
        },
    ),
    "spec": ("speculative", {"accept_length", "accept_rate"}),
    "lora": ("lora", {"slots_used", "slots_total", "utilization"}),
    "disagg": (
        "disaggregation",
        {
            "mode",
            "prefill_prealloc_queue_reqs",
            "prefill_inflight_queue_reqs",
            "decode_prealloc_queue_reqs",
            "decode_transfer_queue_reqs",
            "decode_retracted_queue_reqs",
            "kv_transfer_speed_gb_s",
            "kv_transfer_latency_ms",
            "kv_transfers_in_flight",
            "kv_transfers_total",
            "kv_transfer_bytes_total",
            "kv_transfer_seconds_total",
            "kv_transfer_latency_counts",
            "kv_transfer_size_counts",
            "num_prefill_tokens",
        },
    ),
    "queues": ("queues", {"waiting", "grammar", "paused", "retracted", "num_retractions"}),
}
SUB_OBJECTS = {key for key, _ in SECTIONS.values()}


def test_loads_schema_all_sections(server_dp2: ServerProcess) -> None:
    body = get_loads(server_dp2)
    assert set(body) == {"timestamp", "version", "loads"}
    assert [load["dp_rank"] for load in body["loads"]] == [0, 1]
    for load in body["loads"]:
        # upstream's shape: the core figures flat, every section a nested sub-object
        assert set(load) == CORE | SUB_OBJECTS
        for key, figures in SECTIONS.values():
            assert set(load[key]) == figures, key
        assert load["max_total_num_tokens"] == 8192 and load["max_running_requests"] == 16
        assert load["memory"]["token_capacity"] == 8192 and load["memory"]["weight_gb"] > 0
        # the snapshot pool is sized from memory: at least one slot per running request
        assert load["memory"]["snapshot_slots"] >= 16
        assert 0 <= load["memory"]["snapshot_slots_used"] <= load["memory"]["snapshot_slots"]
        assert load["disaggregation"]["mode"] == "null"
        # no speculative decoding, no LoRA here: upstream's sections, zero
        assert load["speculative"] == {"accept_length": 0, "accept_rate": 0}
        assert load["lora"] == {"slots_used": 0, "slots_total": 0, "utilization": 0}
        assert all(isinstance(load[k], (int, float)) for k in CORE - {"timestamp"})


@pytest.mark.parametrize(
    "query,asked",
    [
        ("?include=core", set()),
        ("?include=core,memory", {"memory"}),
        ("?include=memory&include=queues", {"memory", "queues"}),
        ("?include=disagg", {"disagg"}),
        ("?include=spec,lora", {"spec", "lora"}),
        ("?include=all", set(SECTIONS)),
        ("", set(SECTIONS)),
    ],
)
def test_include_filter(server_dp2: ServerProcess, query: str, asked: set[str]) -> None:
    for load in get_loads(server_dp2, query)["loads"]:
        assert set(load) == CORE | SUB_OBJECTS  # core always, as upstream's
        for name, (key, figures) in SECTIONS.items():
            if name in asked:
                assert set(load[key]) == figures, key
            else:
                assert load[key] is None, key  # present as null when not asked for


def test_dp_rank_filter_and_bad_queries(server_dp2: ServerProcess) -> None:
    assert [
        load["dp_rank"] for load in get_loads(server_dp2, "?dp_rank=1&include=core")["loads"]
    ] == [1]
    unknown = httpx.get(f"{server_dp2.url}/v1/loads?include=core,bogus")
    assert unknown.status_code == 400 and "bogus" in unknown.json()["error"]["message"]
    # the sub-objects' keys are not include names
    assert httpx.get(f"{server_dp2.url}/v1/loads?include=speculative").status_code == 400
    assert httpx.get(f"{server_dp2.url}/v1/loads?dp_rank=7").status_code == 400
    assert httpx.get(f"{server_dp2.url}/v1/loads?dp_rank=x").status_code == 400


def _generate(server: ServerProcess, body: dict, results: list) -> None:
    results.append(httpx.post(f"{server.url}/generate", json=body, timeout=120).json())


@pytest.mark.parametrize("field,rank", [("routed_dp_rank", 1), ("data_parallel_rank", 0)])
def test_named_rank_runs_the_requests_and_loads_return_to_zero(
    server_dp2: ServerProcess, field: str, rank: int
) -> None:
    wait_idle(server_dp2)
    # one call of three prompts: they reach the rank together and decode side by side until they all end (three
    # calls could arrive far enough apart for the first to finish before the third is admitted)
    body = {
        "text": ["count the loads"] * 3,
        field: rank,
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True, "temperature": 0},
    }
    batches: list = []
    call = threading.Thread(target=_generate, args=(server_dp2, body, batches))
    call.start()
    # admitted, not merely queued: a waiting request holds no KV yet
    seen = _wait_for_busy(server_dp2, rank, expected=3, running=True)
    assert (
        seen[rank]["num_used_tokens"] > 0
        and seen[rank]["num_total_tokens"] >= seen[rank]["num_used_tokens"]
    )
    assert seen[1 - rank]["num_running_reqs"] == seen[1 - rank]["num_waiting_reqs"] == 0
    legacy = httpx.get(f"{server_dp2.url}/get_load").json()
    assert {e["dp_rank"] for e in legacy} == {0, 1}
    assert set(legacy[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    call.join(120)
    (results,) = batches
    assert [r["meta_info"]["dp_rank"] for r in results] == [rank] * 3
    assert all(r["meta_info"]["completion_tokens"] == 300 for r in results)
    assert all(load["num_total_tokens"] == 0 for load in wait_idle(server_dp2))


def _wait_for_busy(
    server: ServerProcess, rank: int, expected: int, timeout_s: float = 60.0, running: bool = False
) -> list[dict]:
    """Loads once ``rank`` holds ``expected`` requests (``running``: all of them admitted)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loads = get_loads(server, "?include=core")["loads"]
        held = loads[rank]["num_running_reqs"]
        if not running:
            held += loads[rank]["num_waiting_reqs"]
        if held == expected:
            return loads
        time.sleep(0.01)
    raise AssertionError(f"rank {rank} never held {expected} requests: {loads}")


def test_metrics_has_rank_gauges_and_histograms(server_dp2: ServerProcess) -> None:
    httpx.post(
        f"{server_dp2.url}/generate",
        json={"text": "x", "sampling_params": {"max_new_tokens": 3}},
        timeout=60,
    )
    text = httpx.get(f"{server_dp2.url}/metrics").text
    for rank in (0, 1):
        assert f'sglang_lite_num_running_reqs{{dp_rank="{rank}"}}' in text
    assert "sglang_lite_time_to_first_token_seconds_bucket{" in text
    assert "sglang_lite_e2e_request_latency_seconds_count{" in text
    assert 'sglang_lite_http_requests_total{route="/generate",status="200"}' in text
    # figures of the nested sections too
    assert 'sglang_lite_snapshot_slots{dp_rank="1"} ' in text
    assert 'sglang_lite_kv_transfers_total{dp_rank="0"} 0' in text
