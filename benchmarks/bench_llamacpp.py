"""sglang_lite's Engine against llama.cpp on the CPU: one random Qwen3.5-MoE checkpoint, saved in bf16 as released
checkpoints are, run by both engines; prefill and decode tokens per second side by side, in one run, the engines
alternating (best of ``--repeats``), with the ratios.

    python benchmarks/bench_llamacpp.py --model-shape mid --threads 2
    python benchmarks/bench_llamacpp.py --model-shape big --threads 2
    python benchmarks/bench_llamacpp.py --model-config '{"hidden_size": 512}' --threads 2 --batch 32
    python benchmarks/bench_llamacpp.py --model-shape big --threads 2 --weights mxfp4

llama.cpp is the one vendored in the ``llama-cpp-python`` sdist, built once into the user's cache folder
(``llamacpp_build.py``: cmake and a C++ compiler needed; it says so when they are missing). Its own converter,
``convert_hf_to_gguf.py``, turns the checkpoint into GGUF files in f32 and bf16. The converter identifies a BPE
tokenizer's pre-tokenizer by hashing how it splits a test string and refuses one it does not know; the checkpoint
carries the built-in tiny model's tokenizer, whose split pattern is Qwen2's, so this harness names the
pre-tokenizer ``qwen2`` itself (and says so). The tokens are random ids either way.

``--weights`` (``llamacpp_quant.py``): ``bf16`` (the default) runs our Engine on the bf16 checkpoint against
llama.cpp's f32 and bf16 conversions; ``mxfp4`` runs it on the same weights exported as AMD Quark MXFP4
(``quantization/quark_export.py``) against the bf16 GGUF quantized by ``llama-quantize`` three ways: ``MXFP4 (our
tensors)`` (each matrix in the type ours has: experts, shared expert and full-attention projections MXFP4, the rest
as the bf16 GGUF has it), ``MXFP4_MOE`` (experts MXFP4, every other matrix Q8_0) and ``Q4_0``, the ratios against
each. The table says how many parameters of each file are in which type.

Shapes (``--model-shape``; ``--model-config`` takes a JSON object or file of config fields over mid's): ``mid`` is
``bench_offline.py``'s (34M parameters: hidden 256, 8 layers, 16 experts top-4 of 128 plus a shared one, vocab
32000); ``big`` hidden 1024, 12 layers (9 GDN + 3 attention; 8 query / 2 KV heads of 128, GDN 8 key / 16 value heads
of 128), 64 experts top-8 of 256 plus a shared one of 512, vocab 32000 (776M).

What is measured: llama.cpp's ``llama-bench -p N -n M`` (prompt processing of N tokens; generation of M tokens at
batch 1 from an empty context); the Engine's prefill of one N-token prompt (a call with one new token) and its decode
steps ((call with M new tokens - prefill) / (M - 1), context N to N + M: a little more attention work than
llama.cpp's; each call's fastest of the rounds, so that a prefill the host slowed does not read as decode speed). Both
sides are measured warm: llama-bench runs each test once unmeasured (a whole N-token prompt, one
generated token) before its repetition, and each round of ours first prefills another N-token prompt unmeasured. The
sides alternate, so without it our first call of a round would pay for the caches and the idle threads llama-bench
left behind (at 9M parameters, ~20% of a 128-token prefill). ``--batch B`` (> 1) adds batched decoding:
``llama-batched-bench -npp N -ntg M -npl B`` (S_TG) against the Engine decoding B prompts of N tokens at once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_offline import MID, _model_config, random_prompts  # noqa: E402
from llamacpp_build import (  # noqa: E402
    ISAS,
    BuildError,
    LlamaCpp,
    ensure_llamacpp,
    host_cpu,
    leaves_out_amx,
)
from llamacpp_quant import PRE_TOKENIZER, WEIGHTS, Sides, prepare  # noqa: E402

from sglang_lite.kernels import cpu as cpu_kernels  # noqa: E402

BIG = dict(
    hidden_size=1024,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=512,
)
SHAPES = {"mid": {}, "big": BIG}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass
class Best:
    """The best figure of each phase over the repeats (a shared host only ever slows a run down)."""

    tok_s: dict[str, float] = field(default_factory=dict)

    def add(self, phase: str, value: float) -> None:
        self.tok_s[phase] = max(value, self.tok_s.get(phase, 0.0))


def save_checkpoint(config: dict, model_dir: str) -> int:
    """A random Qwen3.5-MoE of ``config`` saved in bf16 with the tiny model's tokenizer; its parameter count."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from sglang_lite.assets import TINY_MODEL_DIR

    torch.manual_seed(0)
    options = {k: v for k, v in config.items() if k != "model_type"}
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**options)).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(TINY_MODEL_DIR, name), model_dir)
    return sum(p.numel() for p in model.parameters())


def llama_bench(llama: LlamaCpp, gguf: str, args: argparse.Namespace) -> dict[str, float]:
    """llama-bench's prompt processing and generation tok/s (one repetition)."""
    command = [llama.tool("llama-bench"), "-m", gguf, "-p", str(args.input_len)]
    command += ["-n", str(args.output_len), "-t", str(args.threads), "-r", "1", "-o", "json"]
    rows = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    out = {}
    for row in rows:
        phase = "prefill" if row["n_prompt"] > 0 else "decode bs 1"
        out[phase] = row["avg_ts"]
    return out


def llama_batched(llama: LlamaCpp, gguf: str, args: argparse.Namespace) -> float:
    """llama-batched-bench's generation tok/s (S_TG) of ``--batch`` sequences."""
    context = args.batch * (args.input_len + args.output_len) + 256
    command = [llama.tool("llama-batched-bench"), "-m", gguf, "-c", str(context), "-b", "2048"]
    command += ["-ub", "512", "-npp", str(args.input_len), "-ntg", str(args.output_len)]
    command += ["-npl", str(args.batch), "-t", str(args.threads), "--output-format", "jsonl"]
    lines = subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    return rows[-1]["speed_tg"]


def _seconds(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """One call's seconds, its prompts prefilled in full: the prefix cache is emptied first (the same prompts run
    twice, once for the prefill alone and once with the decode steps; a cached prompt would shorten the second's
    prefill and count as decode speed)."""
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    engine.flush_cache()
    start = time.perf_counter()
    results = engine.generate(input_ids=prompts, sampling_params=params)
    assert all(len(r["output_ids"]) == new_tokens for r in results)
    return time.perf_counter() - start


def engine_round(engine, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    """The Engine's seconds of one round: a prompt's call with one new token (its prefill) and with --output-len
    (and the same for --batch prompts)."""
    warm = random_prompts(
        1, args.input_len, vocab, seed=3
    )  # unmeasured, as llama-bench's warm-up run
    _seconds(engine, warm, 1)
    one = random_prompts(1, args.input_len, vocab, seed=1)
    out = {"prefill": _seconds(engine, one, 1), "whole": _seconds(engine, one, args.output_len)}
    if args.batch > 1:
        many = random_prompts(args.batch, args.input_len, vocab, seed=2)
        out["batch prefill"] = _seconds(engine, many, 1)
        out["batch whole"] = _seconds(engine, many, args.output_len)
    return out


def engine_tok_s(fastest: dict[str, float], args: argparse.Namespace) -> dict[str, float]:
    """The Engine's tok/s from each call's fastest seconds over the rounds: decode from the fastest whole call less
    the fastest prefill (a round's own difference would read a prefill slowed by the host as decode speed)."""
    out = {"prefill": args.input_len / fastest["prefill"]}
    out["decode bs 1"] = (args.output_len - 1) / max(fastest["whole"] - fastest["prefill"], 1e-9)
    if args.batch > 1:
        steps = fastest["batch whole"] - fastest["batch prefill"]
        out[f"decode bs {args.batch}"] = args.batch * (args.output_len - 1) / max(steps, 1e-9)
    return out


def run(args: argparse.Namespace, llama: LlamaCpp, sides: Sides) -> dict[str, Best]:
    from sglang_lite import Engine

    vocab = json.load(open(os.path.join(sides.model_dir, "config.json")))["vocab_size"]
    best = {name: Best() for name in (sides.ours, *sides.ggufs)}
    fastest: dict[str, float] = {}  # each of the Engine's calls, its fastest seconds
    with Engine(
        sides.model_dir,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        max_running_requests=max(args.batch, 1),
        max_total_tokens=max(args.batch, 1) * (args.input_len + args.output_len) + 256,
        cpu_threads_per_rank=args.threads,
        num_continuous_decode_steps=args.decode_steps,
    ) as engine:
        _seconds(engine, random_prompts(2, 16, vocab, seed=99), 4)  # warm-up
        for round_ in range(args.repeats):  # alternating, so that all sides share the host's noise
            print(f"round {round_ + 1}/{args.repeats}, load average {os.getloadavg()[0]:.1f}")
            for call, seconds in engine_round(engine, args, vocab).items():
                fastest[call] = min(seconds, fastest.get(call, float("inf")))
            for outtype, gguf in sides.ggufs.items():
                for phase, value in llama_bench(llama, gguf, args).items():
                    best[outtype].add(phase, value)
                if args.batch > 1:
                    best[outtype].add(f"decode bs {args.batch}", llama_batched(llama, gguf, args))
    for phase, value in engine_tok_s(fastest, args).items():
        best[sides.ours].add(phase, value)
    return best


def print_table(best: dict[str, Best], sides: Sides, args: argparse.Namespace, title: str) -> None:
    print(f"\n{title}")
    print(
        f"{args.threads} threads, {args.input_len}-token prompts, {args.output_len} new tokens, best of "
        f"{args.repeats} alternating rounds, load average {os.getloadavg()[0]:.1f}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}; llama.cpp's converter given the pre-tokenizer "
        f"{PRE_TOKENIZER!r} by this harness (it does not know our tokenizer's by hash)"
    )
    labels = {sides.ours: sides.ours, **{t: f"llama.cpp {t}" for t in sides.ggufs}}
    widths = {name: max(18, len(label) + 2) for name, label in labels.items()}
    ratio_widths = {t: max(10, len(t) + 5) for t in sides.ggufs}
    header = "".join(f"{label:>{widths[n]}}" for n, label in labels.items())
    print(f"{'tok/s':<14}{header}" + "".join(f"{'vs ' + t:>{w}}" for t, w in ratio_widths.items()))
    for phase, ours in best[sides.ours].tok_s.items():
        figures = {n: best[n].tok_s.get(phase, float("nan")) for n in labels}
        row = "".join(f"{figures[n]:>{widths[n]}.1f}" for n in labels)
        ratios = "".join(f"{ours / figures[t]:>{w - 1}.2f}x" for t, w in ratio_widths.items())
        print(f"{phase:<14}{row}{ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-shape", choices=sorted(SHAPES), default="mid")
    parser.add_argument(
        "--model-config",
        default=None,
        help="JSON object or JSON file of Qwen3.5-MoE config fields over mid's",
    )
    parser.add_argument("--threads", type=int, default=2, help="threads of both engines")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--batch", type=int, default=1, help="> 1: batched decoding too (llama-batched-bench)"
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHTS,
        default="bf16",
        help="bf16: ours on the bf16 checkpoint against llama.cpp's f32 and bf16 GGUF; mxfp4: ours on its Quark "
        "MXFP4 export against llama.cpp's bf16 GGUF quantized as ours (MXFP4 (our tensors)), MXFP4_MOE and Q4_0",
    )
    parser.add_argument("--dtype", default="auto", help="the Engine's --dtype")
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="the Engine's --num-continuous-decode-steps (default: the server's)",
    )
    parser.add_argument(
        "--llamacpp-version", default="0.3.36", help="llama-cpp-python sdist version"
    )
    parser.add_argument(
        "--isa",
        choices=ISAS,
        default="native",
        help="the instruction set of both sides: ours through SGLANG_CPU_ISA, llama.cpp built for it",
    )
    args = parser.parse_args()
    # the Engine's rank (a fresh interpreter) inherits both: our kernels and PyTorch's own on the ISA
    os.environ["SGLANG_CPU_ISA"] = args.isa
    os.environ.update(cpu_kernels.torch_isa_env(args.isa))
    try:
        llama = ensure_llamacpp(args.llamacpp_version, isa=args.isa)
    except BuildError as exc:
        raise SystemExit(f"llama.cpp: {exc}") from None
    overrides = _model_config(args.model_config)
    config = {**MID, **SHAPES[args.model_shape], **overrides}
    shape = "custom" if overrides else args.model_shape
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "hf")
        params = save_checkpoint(config, model_dir)
        sides = prepare(args.weights, llama, model_dir, tmp)
        best = run(args, llama, sides)
    weights = "bf16 checkpoint" if args.weights == "bf16" else "MXFP4 of its bf16 checkpoint"
    print_table(
        best, sides, args, f"{shape} Qwen3.5-MoE, {params / 1e6:.0f}M parameters, {weights}"
    )
    print(f"GGUF types compared: {', '.join(sides.ggufs)}")
    for line in sides.contents:
        print(f"  {line}")
    amx = " without AMX (its AMX path crashes at 0.3.36)" if leaves_out_amx(args.isa) else ""
    print(
        f"ISAs compared: sglang_lite {cpu_kernels.describe_isa()}, llama.cpp {args.isa} build{amx}; {host_cpu()}"
    )


if __name__ == "__main__":
    main()
