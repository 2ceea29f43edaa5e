"""GPU check of the alt-stream overlaps: overlapped and plain execution give bit-identical logits, eagerly and
replayed from CUDA graphs; timing rows compare decode steps with and without the overlaps."""

from __future__ import annotations

import os

import torch

# benchmarks/ is on sys.path in the drivers
from bench_alt_stream import DecodeSession, build_model, qwen3_5_35b_a3b_layers

STEPS = 4


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    config = qwen3_5_35b_a3b_layers(num_layers=4, num_experts=64)
    return build_model(config, fusion=False, alt=False), build_model(config, fusion=False, alt=True)


def _logits(model: torch.nn.Module, concurrency: int, graphs: bool) -> list[torch.Tensor]:
    session = DecodeSession(model, concurrency, STEPS, graphs=graphs)
    return [session.prefill_logits.clone()] + [session.step()[0] for _ in range(STEPS)]


def check(device: torch.device) -> list[dict]:
    if device.type != "cuda":
        return []  # streams and graphs exist only on a GPU (gpu_model_check runs the plans on the CPU too)
    # eager forwards overlap too, so the eager check exercises them
    os.environ["SGLANG_ALT_STREAM_EAGER"] = "1"
    try:
        plain, overlapped = _pair()
    finally:
        os.environ.pop("SGLANG_ALT_STREAM_EAGER")
    assert overlapped.streams.plan(capturing=True, num_tokens=8).any_overlap, (
        "the overlapped model plans no overlap"
    )
    results = []
    for graphs in (False, True):
        for concurrency in (1, 16):
            a, b = _logits(plain, concurrency, graphs), _logits(overlapped, concurrency, graphs)
            err = max(
                ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
                for x, y in zip(a, b)
            )
            same = all(torch.equal(x, y) for x, y in zip(a, b))
            mode = "graph" if graphs else "eager"
            results.append(
                {
                    "name": f"overlap == plain, {mode}, bs={concurrency}",
                    "ok": same,
                    "max_rel_err": err,
                }
            )
    return results


def bench(device: torch.device, quick: bool) -> list[dict]:
    if device.type != "cuda":
        return []  # streams exist only on a GPU; on the CPU the overlap is plain execution
    plain, overlapped = _pair()
    rows = []
    for concurrency in (1, 32) if quick else (1, 8, 32, 128):
        ms = {}
        for name, model in (("plain", plain), ("overlapped", overlapped)):
            session = DecodeSession(model, concurrency, 16)
            ms[name] = sorted(session.step()[1] for _ in range(16))[8]
        rows.append(
            {
                "kernel": "decode step (alt-stream overlaps)",
                "shape": f"bs={concurrency}, 4 layers",
                "ours_ms": ms["overlapped"],
                "ref_name": "same graph without overlaps",
                "ref_ms": ms["plain"],
            }
        )
    return rows
