"""The calibration fits of sglang_lite/sim/fit.py: windowed decode observations, prefill rate, KV transfer."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sglang_lite.sim.fit import fit_decode, fit_prefill, fit_transfer, read_observations
from sglang_lite.sim.sim_config import load_cluster_file


def test_windowed_observations_match_a_trailing_throughput_window(tmp_path):
    """A rank whose batch flips between 0 and a few requests; gen_throughput is a trailing-window figure, so the
    step is recovered only from window means of the batch and the KV."""
    cost, _ = load_cluster_file()
    cost = dataclasses.replace(
        cost, decode_base_s=0.002, decode_per_req_s=0.0005, decode_per_kv_token_s=1e-6
    )
    rng = np.random.default_rng(1)
    times = np.arange(400) * 0.25
    running = rng.integers(0, 4, size=len(times)) * (rng.random(len(times)) < 0.6)
    kv = running * rng.integers(200, 700, size=len(times))
    path = tmp_path / "loads.csv"
    with open(path, "w") as f:
        f.write("time,rank,outstanding,running,kv_tokens,kv_used,gen_throughput\n")
        for i, t in enumerate(times):
            lo = int(np.searchsorted(times, t - 10.0, side="right"))
            count = (
                i + 1 - lo if lo > 0 else 40
            )  # idle before the first sample: a 10 s window of 0.25 s samples
            mean_run, mean_kv = running[lo : i + 1].sum() / count, kv[lo : i + 1].sum() / count
            rate = mean_run / cost.rank_step_s(mean_run, mean_kv) if mean_run > 0 else 0.0
            f.write(f"{t:.3f},r@0,{running[i]},{running[i]},{kv[i]},{kv[i]},{rate}\n")
    fitted = fit_decode(read_observations(path, window_s=10.0), load_cluster_file()[0])
    assert fitted.decode_base_s == pytest.approx(cost.decode_base_s, rel=1e-6)
    assert fitted.decode_per_req_s == pytest.approx(cost.decode_per_req_s, rel=1e-6)
    assert fitted.decode_per_kv_token_s == pytest.approx(cost.decode_per_kv_token_s, rel=1e-6)
    # without the window, instantaneous batches against a 10 s rate give a different (wrong) answer
    plain = fit_decode(read_observations(path), load_cluster_file()[0])
    assert plain.decode_per_req_s != pytest.approx(cost.decode_per_req_s, rel=0.05)


def test_fit_prefill_uses_only_busy_intervals():
    cost, _ = load_cluster_file()
    times = np.arange(10) * 0.5
    busy = np.array([False, True, True, True, True, False, False, True, True, True])
    tokens = np.zeros(10)
    for i in range(
        1, 10
    ):  # 2000 tokens/s while busy at both ends, an idle stretch that gains 10 tokens
        tokens[i] = tokens[i - 1] + (1000 if busy[i - 1] and busy[i] else 10)
    fitted = fit_prefill(times, tokens, busy, cost)
    assert fitted.prefill_per_token_s == pytest.approx(1 / 2000)
    assert fitted.prefill_base_s == fitted.prefill_per_token_ctx_s == 0.0
    assert fitted.decode_base_s == cost.decode_base_s  # the rest is kept


def test_fit_transfer_recovers_latency_and_rate():
    cost, _ = load_cluster_file()
    rng = np.random.default_rng(2)
    latency, rate = 0.004, 5e7
    n = rng.integers(0, 4, size=60)
    sizes = n * rng.integers(100_000, 400_000, size=60)
    secs = latency * n + sizes / rate
    counts, nbytes, seconds = (np.concatenate([[0], np.cumsum(x)]) for x in (n, sizes, secs))
    fitted = fit_transfer(counts, nbytes, seconds, prompt_tokens=int(nbytes[-1] // 500), base=cost)
    assert fitted.transfer_latency_s == pytest.approx(latency, rel=1e-6)
    assert fitted.transfer_request_bytes_s == pytest.approx(rate, rel=1e-6)
    assert fitted.kv_bytes_per_token == 500


def test_tpot_observations_fit_the_decode_step(tmp_path):
    from sglang_lite.sim.fit import request_weighted_batch, tpot_observations

    path = tmp_path / "loads.csv"
    path.write_text(
        "time,rank,outstanding,running,kv_tokens,kv_used,gen_throughput\n"
        "0,r@0,1,1,0,0,0\n0,r@1,3,3,0,0,0\n0.25,r@0,0,0,0,0,0\n"
    )
    assert request_weighted_batch(path) == pytest.approx((1 + 9) / 4)
    cost, _ = load_cluster_file()
    truth = dataclasses.replace(
        cost, decode_base_s=0.003, decode_per_req_s=0.001, decode_per_kv_token_s=2e-6
    )
    obs = []
    for batch in (1.2, 1.5, 2.0):
        reqs = []
        for inp in (100, 300, 500, 700):
            out, ttft = 9, 0.2
            reqs.append(
                (inp, out, ttft, ttft + (out - 1) * truth.rank_step_s(batch, inp + out / 2))
            )
        reqs.append((50, 1, 0.1, 0.1))  # one token: no TPOT
        obs.append(tpot_observations(batch, reqs))
    obs = np.concatenate(obs)
    assert len(obs) == 12
    fitted = fit_decode(obs, cost)
    assert fitted.decode_base_s == pytest.approx(0.003, rel=1e-6)
    assert fitted.decode_per_req_s == pytest.approx(0.001, rel=1e-6)
    assert fitted.decode_per_kv_token_s == pytest.approx(2e-6, rel=1e-6)
