"""On a GPU: the model classes, the CUDA-graph decode step and the engine against transformers (a companion of
gpu_check.py, which checks the kernels one by one). Under 2 minutes.

1. Logits of tiny random dense and MoE checkpoints loaded on the GPU (float32 and bfloat16) against transformers
   on the CPU in float32.
2. Packed prefill of several requests, then decode steps through ``ModelRunner`` (CUDA graphs captured) with the
   alt-stream overlaps on and off, against the full forward of each sequence.
3. Greedy generation of the offline ``Engine`` on the GPU against transformers ``generate``.

Prints PASS/FAIL per check and exits non-zero when any fails. On a machine without a GPU it says so and exits 0.

    python benchmarks/gpu_model_check.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the repository (for tests/) and benchmarks/
from bench_alt_stream import overlap_flags  # noqa: E402

from sglang_lite import Engine, load_model  # noqa: E402
from sglang_lite.forward_batch import ForwardMode, build_forward_batch  # noqa: E402
from sglang_lite.mem_cache.pools import ModelPools  # noqa: E402
from sglang_lite.model_executor import ModelRunner  # noqa: E402
from sglang_lite.server_args import ServerArgs  # noqa: E402
from tests.engine.conftest import TinyCheckpoint, random_prompts  # noqa: E402
from tests.hf_checkpoints import make_hf_model, save_checkpoint  # noqa: E402

# float32 as on the CPU (the kernels' float32 dots keep float32 accuracy); bf16 weights lose about 1e-2.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
results: list[bool] = []
_last = [time.perf_counter()]
# "cpu" runs the same checks here, without graphs
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")


def report(name: str, ok: bool, detail: str) -> None:
    now = time.perf_counter()
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail} [{now - _last[0]:.1f} s]", flush=True)
    _last[0] = now
    results.append(ok)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def check_logits(hf: torch.nn.Module, path: str, kind: str) -> None:
    ids = torch.randint(
        0, hf.config.vocab_size, (2, 200), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = hf(ids).logits
    for dtype, tol in TOLERANCE.items():
        model = load_model(path, dtype=dtype, device=DEVICE)
        err = rel_err(model(ids.to(DEVICE)).float(), expected)
        report(
            f"{kind} logits {str(dtype)[6:]}", err < tol, f"max rel err {err:.2e} (tol {tol:.0e})"
        )


def check_graph_decode(path: str, kind: str, alt: bool) -> None:
    """Five requests of different lengths prefill packed, then decode 6 steps by CUDA-graph replay."""
    steps, lengths = 6, [1, 17, 64, 65, 100]
    with overlap_flags(alt):
        model = load_model(
            path,
            dtype=torch.float32,
            device=DEVICE,
            server_args=ServerArgs(device=DEVICE, disable_shared_experts_fusion=False),
        )
    gen = torch.Generator().manual_seed(1)
    full = [
        torch.randint(0, model.config.vocab_size, (n + steps,), generator=gen).tolist()
        for n in lengths
    ]
    expected = [model(torch.tensor([seq], device=DEVICE))[0] for seq in full]
    pools = ModelPools.create(model.config, 8 * 128, 8, 128, torch.float32, DEVICE)
    runner = ModelRunner(
        model, pools, ServerArgs(device=DEVICE, max_running_requests=8, cuda_graph_max_bs=8)
    )
    rows, slots = pools.req_to_token.allocator.alloc(len(lengths)), pools.states.alloc(len(lengths))

    def run(
        mode: ForwardMode, tokens: list[list[int]], cached: list[int], all_logits: bool
    ) -> torch.Tensor:
        kv_slots = pools.alloc_kv(rows, cached, [len(t) for t in tokens])
        batch = build_forward_batch(pools, mode, tokens, cached, rows, slots, DEVICE, kv_slots)
        return runner.forward_batch(batch, all_logits=all_logits)

    packed = run(
        ForwardMode.EXTEND, [seq[:n] for seq, n in zip(full, lengths)], [0] * len(lengths), True
    )
    err = max(rel_err(p, e[:n]) for p, e, n in zip(packed.split(lengths), expected, lengths))
    for step in range(steps):
        logits = run(
            ForwardMode.DECODE,
            [[seq[n + step]] for seq, n in zip(full, lengths)],
            [n + step for n in lengths],
            False,
        )
        err = max(err, *(rel_err(logits[r], expected[r][n + step]) for r, n in enumerate(lengths)))
    graphs = runner.graph_runner.batch_sizes if runner.graph_runner else []
    captured = [site for site, on in model.streams.describe()["decode_captured"].items() if on]
    report(
        f"{kind} prefill + graph decode, alt streams {'on' if alt else 'off'}",
        err < 1e-3 and (bool(graphs) or DEVICE == "cpu"),
        f"max rel err {err:.2e} vs eager full forward; graphs for bs {graphs}; captured overlaps {captured}",
    )


def check_engine(checkpoint: TinyCheckpoint, kind: str) -> None:
    prompts = random_prompts([3, 17, 40, 9, 33, 1], seed=1)
    greedy = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    with Engine(
        model_path=checkpoint.path,
        device=DEVICE,
        dtype="float32",
        skip_tokenizer_init=True,
        chunked_prefill_size=8,
        max_prefill_tokens=16,
        max_total_tokens=2048,
        max_running_requests=8,
        cuda_graph_max_bs=8,
    ) as engine:
        outputs = engine.generate(input_ids=prompts, sampling_params=greedy)
        loads = engine.get_loads()
    pairs = [(out["output_ids"], checkpoint.greedy(p, 16)) for out, p in zip(outputs, prompts)]
    same = sum(ours == theirs for ours, theirs in pairs)
    tokens = sum(a == b for ours, theirs in pairs for a, b in zip(ours, theirs))
    report(
        f"{kind} engine greedy vs transformers generate",
        same == len(prompts) and loads["num_used_tokens"] == 0,
        f"{same}/{len(prompts)} requests identical, {tokens}/{16 * len(prompts)} tokens; "
        f"used tokens after: {loads['num_used_tokens']}",
    )


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no GPU found: nothing to check (run the CPU tests with pytest instead)")
        return 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        for kind in ("moe", "dense"):
            # = experts': fusable
            hf = make_hf_model(moe=kind == "moe", seed=7, shared_expert_intermediate_size=24)
            path = save_checkpoint(hf, os.path.join(root, kind))
            checks = [
                (check_logits, hf, path, kind),
                (check_graph_decode, path, kind, False),
                (check_graph_decode, path, kind, True),
                (check_engine, TinyCheckpoint(kind, os.path.join(root, "engine")), kind),
            ]
            for check, *args in checks:
                try:
                    check(*args)
                except Exception as exc:  # one crash must not hide the other checks' results
                    report(
                        f"{kind} {check.__name__} crashed", False, f"{type(exc).__name__}: {exc}"
                    )
    print(
        f"model checks: {sum(results)}/{len(results)} passed in {time.perf_counter() - start:.0f} s"
    )
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
