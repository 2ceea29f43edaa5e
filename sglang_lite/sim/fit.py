"""Fits the cost model to a real run: the decode step from the balance sampler's CSV, and (for a PD run) the
prefill rate and the KV transfer from counters the servers report in /v1/loads.

Decode: each sample of a busy rank gives one observation of its step time: running requests / generated tokens
per second. gen_throughput is measured by the server over a trailing window (10 s in sglang_lite's scheduler), so
with `window_s` the running batch and the KV are averaged over the same trailing window of samples first (a rank
that decodes 1 request half of the window and nothing the other half makes 0.5 requests per step-time; the
instantaneous batch would be 0 or 1). A least-squares fit of
    step_s = base + per_req * running + per_kv_token * kv_used
gives the three decode parameters; prefill and transfer parameters are kept from the base file. With DP attention
a server's step is its slowest rank's, so the fitted per-rank model is an upper envelope; good enough for the
ordering of policies, which is what the simulator is used for.

Prefill (`fit_prefill`): seconds per prefilled token while the prefill server had work queued, from the growth of
its `num_prefill_tokens` counter between samples; the fixed and context terms are set to 0 (folded into the
per-token cost: one rate cannot separate them).

Transfer (`fit_transfer`): per sample interval, the decode ranks' transfer counters give (transfers, bytes,
seconds); a least-squares fit of seconds = latency * transfers + bytes / per-request rate gives
`transfer_latency_s` and `transfer_request_bytes_s`; `kv_bytes_per_token` is the bytes moved per prompt token.
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import numpy as np

from sglang_lite.sim.sim_config import CostModel


def read_observations(csv_path: str | Path, window_s: float = 0.0) -> np.ndarray:
    """[n, 3] of (running, kv_used, step seconds) from samples where the rank was decoding. With `window_s` > 0,
    running and kv_used are each rank's means over the samples of the trailing `window_s` seconds (the window of
    gen_throughput; before the first sample the rank counts as idle), and a sample counts when that mean is
    positive."""
    per_rank: dict[str, list[tuple[float, int, int, float]]] = {}
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            per_rank.setdefault(row["rank"], []).append(
                (
                    float(row["time"]),
                    int(row["running"]),
                    int(row["kv_used"]),
                    float(row["gen_throughput"]),
                )
            )
    rows = []
    for samples in per_rank.values():
        times = np.array([s[0] for s in samples])
        # a window reaching back before the first sample sees an idle rank there (a run starts from idle)
        per_window = (
            max(1, round(window_s / float(np.median(np.diff(times))))) if len(times) > 1 else 1
        )
        for i, (t, running, kv_used, rate) in enumerate(samples):
            if window_s > 0:
                lo = int(np.searchsorted(times, t - window_s, side="right"))
                count = len(samples[lo : i + 1]) if lo > 0 else max(i + 1, per_window)
                running = sum(s[1] for s in samples[lo : i + 1]) / count
                kv_used = sum(s[2] for s in samples[lo : i + 1]) / count
            if running > 0 and rate > 0:
                rows.append((running, kv_used, running / rate))
    return np.array(rows, dtype=float).reshape(-1, 3)


def fit_decode(obs: np.ndarray, base: CostModel) -> CostModel:
    assert len(obs) >= 3, "need at least three busy samples to fit three parameters"
    design = np.column_stack([np.ones(len(obs)), obs[:, 0], obs[:, 1]])
    coef, *_ = np.linalg.lstsq(design, obs[:, 2], rcond=None)
    coef = np.maximum(coef, 0.0)  # a negative cost is noise, not physics
    return dataclasses.replace(
        base,
        decode_base_s=float(coef[0]),
        decode_per_req_s=float(coef[1]),
        decode_per_kv_token_s=float(coef[2]),
    )


def fit_prefill(
    times: np.ndarray, prefill_tokens: np.ndarray, busy: np.ndarray, base: CostModel
) -> CostModel:
    """`times`, the prefill server's `num_prefill_tokens` counter and whether it had work (running, waiting or
    bootstrap-queued requests) at each sample. Seconds per token = time / tokens over the intervals busy at both
    ends; base and context terms 0."""
    keep = busy[:-1] & busy[1:] & (np.diff(prefill_tokens) >= 0)
    tokens = float(np.diff(prefill_tokens)[keep].sum())
    assert tokens > 0, "no prefill work observed between busy samples"
    return dataclasses.replace(
        base,
        prefill_base_s=0.0,
        prefill_per_token_s=float(np.diff(times)[keep].sum()) / tokens,
        prefill_per_token_ctx_s=0.0,
    )


def fit_transfer(
    counts: np.ndarray, nbytes: np.ndarray, seconds: np.ndarray, prompt_tokens: int, base: CostModel
) -> CostModel:
    """Cumulative transfer counters (summed over the decode ranks) at each sample, and the prompt tokens all
    those transfers carried. Least squares over the sample intervals that completed a transfer."""
    dn = np.diff(counts)
    db = np.diff(nbytes)
    ds = np.diff(seconds)
    keep = dn > 0
    assert keep.sum() >= 2 and prompt_tokens > 0, "need transfers in at least two intervals"
    coef, *_ = np.linalg.lstsq(np.column_stack([dn[keep], db[keep]]), ds[keep], rcond=None)
    latency, s_per_byte = (max(float(c), 0.0) for c in coef)
    if s_per_byte <= 0:  # the data say the size does not matter: no per-request rate limit
        s_per_byte = 0.0
    return dataclasses.replace(
        base,
        transfer_latency_s=latency,
        transfer_request_bytes_s=1.0 / s_per_byte if s_per_byte > 0 else 0.0,
        kv_bytes_per_token=max(1, round(float(nbytes[-1] - nbytes[0]) / prompt_tokens)),
    )


def request_weighted_batch(csv_path: str | Path) -> float:
    """The running batch a decoding request sees on average (itself included): sum of running^2 over sum of
    running, over every sampled rank of the CSV. The batch in which a request's TPOT was measured."""
    with open(csv_path) as f:
        running = [int(row["running"]) for row in csv.DictReader(f)]
    total = sum(running)
    return sum(r * r for r in running) / total if total else 0.0


def tpot_observations(batch: float, requests: list[tuple[int, int, float, float]]) -> np.ndarray:
    """[n, 3] of (batch, KV tokens, step seconds) per request of a replay that made more than one token:
    `requests` holds (input_len, output_tokens, ttft, latency); its step is its TPOT, its KV the prompt plus
    half the output, and its batch the run's `request_weighted_batch`. Feed to `fit_decode`."""
    rows = [
        (batch, inp + out / 2, (lat - ttft) / (out - 1))
        for inp, out, ttft, lat in requests
        if out > 1
    ]
    return np.array(rows, dtype=float).reshape(-1, 3)
