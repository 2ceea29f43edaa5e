"""Decode TPOT of dummy Qwen3.5-35B-A3B layers (bf16, a few of them) for {shared-expert fusion on/off} x
{alt stream on/off}, the four variants of the upstream AMD alt-stream change, and, with ``--weights mxfp4``, the
MXFP4 model's two (its shared expert is never fused, so only the alt stream can overlap it with the routed ones:
the upstream change's "MXFP4, which disables shared expert fusion" case).

On a GPU: for each concurrency, every variant prefills the same prompts and times decode steps replayed from CUDA
graphs (the overlaps are captured into them); the table gives each variant's TPOT delta against the baseline
(fusion off, alt stream off), the shape of the upstream change's table. On a CPU it says so and exits 0.

    python benchmarks/bench_alt_stream.py [--concurrency 1,8,32,128] [--layers 8] [--experts 256] [--steps 32]
        [--weights bf16|mxfp4]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
from tqdm.auto import tqdm

from sglang_lite.config import ModelConfig
from sglang_lite.forward_batch import ForwardMode, build_forward_batch
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.model_executor import ModelRunner
from sglang_lite.models.loader import create_model, init_dummy_weights
from sglang_lite.models.qwen3_5 import Qwen3_5MoeForCausalLM
from sglang_lite.models.weights import quantize_dummy_weights
from sglang_lite.quantization import ONLINE
from sglang_lite.server_args import ServerArgs

PROMPT_LEN = 128
VARIANTS = {  # name -> (shared-expert fusion, alt stream overlaps)
    "baseline": (False, False),
    "alt stream": (False, True),
    "fusion": (True, False),
    "fusion + alt stream": (True, True),
}
# MXFP4 experts and attention projections (quantized from the dummy weights): no fusion to try
MXFP4_VARIANTS = {"baseline": (False, False), "alt stream": (False, True)}
OVERLAP_FLAGS = {
    "SGLANG_GDN_QKVZ_BA_ALT_STREAM": "1",
    "SGLANG_QK_NORM_ALT_STREAM": "1",
    "SGLANG_ALT_STREAM": "1",
}


def qwen3_5_35b_a3b_layers(num_layers: int, num_experts: int = 256) -> ModelConfig:
    """Qwen3.5-35B-A3B's layers (its vocabulary, hidden size, heads and experts; ``num_experts`` fewer to fit a
    smaller GPU) at a fraction of its depth, so that dummy weights load in seconds."""
    return ModelConfig(
        is_moe=True,
        vocab_size=248320,
        hidden_size=2048,
        layer_types=tuple(
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)
        ),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=8192,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        rotary_dim=64,
        rope_theta=1e7,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=num_experts,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    )


@contextlib.contextmanager
def overlap_flags(enabled: bool):
    saved = {k: os.environ.get(k) for k in OVERLAP_FLAGS}
    os.environ.update(OVERLAP_FLAGS if enabled else {k: "0" for k in OVERLAP_FLAGS})
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def build_model(
    config: ModelConfig, fusion: bool, alt: bool, weights: str = "bf16"
) -> Qwen3_5MoeForCausalLM:
    quantization = None if weights == "bf16" else weights
    args = ServerArgs(disable_shared_experts_fusion=not fusion, quantization=quantization)
    with overlap_flags(alt):  # the flags are read while the model is built
        model = create_model(config, torch.bfloat16, "cuda", args)
    init_dummy_weights(model, seed=0)
    if quantization is not None:
        quantize_dummy_weights(model, ONLINE[quantization], "cuda")
    if not alt:  # CUDA always has the stream; "off" means no site overlaps at any batch size
        model.streams.overlap_by_batch_size = {bs: False for bs in range(1, 1025)}
    return model.eval()


class DecodeSession:
    """``concurrency`` requests prefilled with the same random prompts, then stepped one decode token at a time."""

    def __init__(
        self, model: Qwen3_5MoeForCausalLM, concurrency: int, steps: int, graphs: bool = True
    ) -> None:
        config = model.config
        context = PROMPT_LEN + steps + 8
        self.pools = ModelPools.create(
            config, concurrency * context, concurrency, context, torch.bfloat16, "cuda"
        )
        args = ServerArgs(
            device="cuda",
            max_running_requests=concurrency,
            cuda_graph_max_bs=concurrency,
            disable_cuda_graph=not graphs,
        )
        # captures the decode graphs with the model's plan
        self.runner = ModelRunner(model, self.pools, args)
        self.rows = self.pools.req_to_token.allocator.alloc(concurrency)
        self.slots = self.pools.states.alloc(concurrency)
        gen = torch.Generator().manual_seed(concurrency)
        prompts = [
            torch.randint(0, config.vocab_size, (PROMPT_LEN,), generator=gen).tolist()
            for _ in self.rows
        ]
        self.prefill_logits = self._forward(ForwardMode.EXTEND, prompts, [0] * concurrency)
        self.cached = PROMPT_LEN

    def _forward(
        self, mode: ForwardMode, tokens: list[list[int]], prefix_lens: list[int]
    ) -> torch.Tensor:
        kv_slots = self.pools.alloc_kv(self.rows, prefix_lens, [len(t) for t in tokens])
        batch = build_forward_batch(
            self.pools, mode, tokens, prefix_lens, self.rows, self.slots, "cuda", kv_slots
        )
        return self.runner.forward_batch(batch)

    def step(self) -> tuple[torch.Tensor, float]:
        """One decode step: (logits, milliseconds)."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = self._forward(
            ForwardMode.DECODE, [[1]] * len(self.rows), [self.cached] * len(self.rows)
        )
        torch.cuda.synchronize()
        self.cached += 1
        return logits.clone(), (time.perf_counter() - start) * 1e3


def decode_tpot_ms(model: Qwen3_5MoeForCausalLM, concurrency: int, steps: int) -> float:
    session = DecodeSession(model, concurrency, steps)
    return statistics.median(session.step()[1] for _ in range(steps))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--experts", type=int, default=256, help="routed experts (Qwen3.5-35B-A3B: 256)"
    )
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--weights", choices=("bf16", "mxfp4"), default="bf16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "no GPU present: the alt-stream benchmark needs CUDA or ROCm; nothing to measure on the CPU"
        )
        return 0
    config = qwen3_5_35b_a3b_layers(args.layers, args.experts)
    levels = [int(c) for c in args.concurrency.split(",")]
    tpot = {}
    variants = VARIANTS if args.weights == "bf16" else MXFP4_VARIANTS
    for name, (fusion, alt) in tqdm(variants.items(), desc="variants"):
        model = build_model(config, fusion, alt, args.weights)
        for c in levels:
            tpot[name, c] = decode_tpot_ms(model, c, args.steps)
        del model
        torch.cuda.empty_cache()
    platform = "ROCm" if torch.version.hip else "CUDA"
    print(
        f"\nDecode TPOT on {torch.cuda.get_device_name()} ({platform}), {args.layers} layers, "
        f"{args.weights} weights, "
        f"prompt {PROMPT_LEN}"
    )
    print(f"{'concurrency':>11} | " + " | ".join(f"{n:>22}" for n in variants))
    for c in levels:
        base = tpot["baseline", c]
        cells = [f"{tpot[n, c]:7.3f} ms ({(tpot[n, c] / base - 1) * 100:+5.1f}%)" for n in variants]
        print(f"{c:>11} | " + " | ".join(f"{cell:>22}" for cell in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
