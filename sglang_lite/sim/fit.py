"""Fits the decode part of the cost model to a real run, from the balance sampler's CSV.

Each sample of a busy rank gives one observation of its step time: running requests / generated tokens per
second (gen_throughput is measured by the server over a recent window). A least-squares fit of
    step_s = base + per_req * running + per_kv_token * kv_used
gives the three decode parameters; prefill and transfer parameters are kept from the base file. With DP attention
a server's step is its slowest rank's, so the fitted per-rank model is an upper envelope; good enough for the
ordering of policies, which is what the simulator is used for.
"""
from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import numpy as np

from sglang_lite.sim.config import CostModel


def read_observations(csv_path: str | Path) -> np.ndarray:
    """[n, 3] of (running, kv_used, step seconds) from samples where the rank was decoding."""
    rows = []
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            running, rate = int(row["running"]), float(row["gen_throughput"])
            if running > 0 and rate > 0:
                rows.append((running, int(row["kv_used"]), running / rate))
    return np.array(rows, dtype=float).reshape(-1, 3)


def fit_decode(obs: np.ndarray, base: CostModel) -> CostModel:
    assert len(obs) >= 3, "need at least three busy samples to fit three parameters"
    design = np.column_stack([np.ones(len(obs)), obs[:, 0], obs[:, 1]])
    coef, *_ = np.linalg.lstsq(design, obs[:, 2], rcond=None)
    coef = np.maximum(coef, 0.0)  # a negative cost is noise, not physics
    return dataclasses.replace(base, decode_base_s=float(coef[0]), decode_per_req_s=float(coef[1]),
                               decode_per_kv_token_s=float(coef[2]))
