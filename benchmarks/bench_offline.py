"""Offline throughput: sglang_lite.Engine against transformers ``generate`` on one Qwen3.5-MoE shape, with where
each phase stands against the machine's limits.

Both generate exactly ``--output-len`` tokens per request (eos ignored) greedily from random ``--input-len``-token
prompts, for each batch size, alternating engine and transformers runs (best of ``--repeats``). Output tokens per
second over the whole call (prefill included), by the wall clock and per second of CPU time (all threads of this
process and of the engine's scheduler process): on a shared, busy host the second is the steadier figure.

Shapes (``--model-shape``): ``tiny`` is the built-in model (its trained weights); ``mid`` a Qwen3.5-MoE of 34M
parameters (hidden 256, 8 layers, 16 experts top-4, vocab 32000) with random weights saved as safetensors, both
sides loading the same files; ``large`` hidden 1024 (4 layers, 16 experts top-4 of 512, vocab 32000, 190M
parameters) with dummy weights (each side its own random ones: only the speed is compared). ``--model-config``
takes a JSON object (or a JSON file) of config fields over mid's: another shape, saved and loaded like mid.

The roofline table splits each run into its phases: the prefill (the call with one new token) and a decode step
((whole call - prefill call) / (output_len - 1)). Each phase's FLOPs and bytes are counted from the model shape
(``roofline.py``) and set against the fp32 GEMM peak and the memory bandwidth this process measures first, at the
same thread count.

    python benchmarks/bench_offline.py --model-shape mid --threads 2 --batch-sizes 1 32
    python benchmarks/bench_offline.py --model-config '{"hidden_size": 512, "num_experts": 32}' --threads 2
    python benchmarks/bench_offline.py                     # tiny, 128 in, 64 out, batch 1, 8, 32
    python benchmarks/bench_offline.py --tp-size 2 --threads 1   # the engine on two tensor-parallel ranks

``--scaling`` compares tensor-parallel engines with each other instead of with transformers: TP=1 on one thread
against TP=``--tp-size`` with one thread per rank, on a dummy-weight Qwen3.5-MoE of ``--hidden`` (default 1024,
large enough for compute to dominate), side by side in one run. Prefill: ``--batch-sizes`` prompts of
``--input-len`` tokens in one forward (one new token each); decode: ``--output-len`` tokens of as many 16-token
prompts, less the time of their first token.

    python benchmarks/bench_offline.py --scaling --tp-size 2 --input-len 1024 --batch-sizes 4

``--deterministic`` compares the engine with itself instead: without and with ``enable_deterministic_inference``
(batch-invariant kernels) on the same model, side by side in one run (``bench_deterministic.py``): tok/s, the
flag's cost in each phase, and whether the first prompt's output ids are the same alone and in the batch.

    python benchmarks/bench_offline.py --deterministic --model-shape mid --threads 2 --batch-sizes 1 32

``--speculative`` runs ``bench_speculative.py`` with the other flags: plain against speculative decoding (MTP head)
side by side, tok/s and mean accepted length at each batch size; ``--speculative --costs`` the parts of a step.

    python benchmarks/bench_offline.py --speculative --batch-sizes 1 4 16 --steps 1 2 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

from sglang_lite.envs import torch_isa_env


def _force_isa_from_argv() -> None:
    """--isa before torch is imported: PyTorch reads its own ISA (transformers' side) from the environment then,
    and the engine's rank, a fresh interpreter, inherits both it and SGLANG_CPU_ISA."""
    if "--isa" in sys.argv[:-1]:
        isa = sys.argv[sys.argv.index("--isa") + 1]
        os.environ.update({"SGLANG_CPU_ISA": isa, **torch_isa_env(isa)})


_force_isa_from_argv()

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import Machine, decode_work, measure_machine, prefill_work  # noqa: E402

from sglang_lite.utils.process import keep_freed_heap_memory  # noqa: E402

SHAPES = ("tiny", "mid", "large")


@dataclass(frozen=True)
class Speed:
    wall_tok_s: float
    cpu_tok_s: float


@dataclass(frozen=True)
class Side:
    """One side's runs at one batch size: the whole call, and the call with one new token (the prefill)."""

    speed: Speed
    whole_s: float
    prefill_s: float

    def decode_step_s(self, output_len: int) -> float:
        """NaN when noise made the whole call look no longer than its prefill."""
        steps = self.whole_s - self.prefill_s
        return steps / (output_len - 1) if steps > 0 and output_len > 1 else float("nan")


@dataclass(frozen=True)
class Row:
    batch_size: int
    hf: Side
    engine: Side

    @property
    def ratio(self) -> float:
        return self.engine.speed.wall_tok_s / self.hf.speed.wall_tok_s

    @property
    def cpu_ratio(self) -> float:
        return self.engine.speed.cpu_tok_s / self.hf.speed.cpu_tok_s


def cpu_seconds() -> float:
    """CPU time of this process and its child processes (the engine's scheduler process lives in one): from /proc
    on Linux, else this process's alone."""
    me = os.getpid()
    if not os.path.exists(f"/proc/{me}/task"):
        return time.process_time()
    pids = [me]
    for task in os.listdir(f"/proc/{me}/task"):
        with open(f"/proc/{me}/task/{task}/children") as f:
            pids += [int(pid) for pid in f.read().split()]
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            # fields from the third on; utime and stime are 14 and 15
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def timed(fn, tokens: int) -> tuple[Speed, float]:
    wall, cpu = time.perf_counter(), cpu_seconds()
    fn()
    seconds = time.perf_counter() - wall
    return Speed(tokens / seconds, tokens / max(cpu_seconds() - cpu, 1e-9)), seconds


def best(speeds: list[Speed]) -> Speed:
    return Speed(max(s.wall_tok_s for s in speeds), max(s.cpu_tok_s for s in speeds))


def random_prompts(batch_size: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # no special tokens
    return torch.randint(0, vocab - 8, (batch_size, input_len), generator=gen).tolist()


# The mid-size model and a large one; the tiny one is the built-in model.
MID = dict(
    model_type="qwen3_5_moe_text",
    vocab_size=32000,
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def large_config() -> dict:
    return {**scaling_config(1024), "vocab_size": 32000}


@contextmanager
def shape_checkpoint(shape: str, overrides: dict | None = None) -> Iterator[tuple[str, bool]]:
    """The model folder of ``shape`` (mid with ``overrides`` applied, when given) and whether it holds only a config
    (dummy weights)."""
    if overrides:
        with tempfile.TemporaryDirectory() as model_dir:
            _save_random_model({**MID, **overrides}, model_dir)
            yield model_dir, False
        return
    if shape == "tiny":
        from sglang_lite.assets import TINY_MODEL_DIR

        yield str(TINY_MODEL_DIR), False
        return
    with tempfile.TemporaryDirectory() as model_dir:
        if shape == "mid":
            _save_random_model(MID, model_dir)
        else:
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump(large_config(), f)
        yield model_dir, shape == "large"


def _save_random_model(config: dict, model_dir: str) -> None:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    options = {k: v for k, v in config.items() if k != "model_type"}
    Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**options)).save_pretrained(model_dir)


def build_hf_model(model_dir: str, dummy: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if not dummy:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(model_dir), dtype=torch.float32
    ).eval()


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], output_len: int) -> None:
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert out.shape == (len(prompts), ids.shape[1] + output_len)


def engine_generate(engine, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """The Engine's call, its prompts prefilled in full as transformers' are: the same prompts run several times
    (repeats, the one-token call), so the prefix cache is emptied first. Each prompt's output ids."""
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    engine.flush_cache()
    results = engine.generate(input_ids=prompts, sampling_params=params)
    assert all(len(r["output_ids"]) == output_len for r in results)
    return [r["output_ids"] for r in results]


def measure_side(generate, prompts: list[list[int]], output_len: int, repeats: int) -> Side:
    """Best of ``repeats`` of the whole call and of the one-token call."""
    tokens = len(prompts) * output_len
    wholes = [timed(partial(generate, prompts, output_len), tokens) for _ in range(repeats)]
    prefill_s = min(timed(partial(generate, prompts, 1), len(prompts))[1] for _ in range(repeats))
    return Side(best([w[0] for w in wholes]), min(w[1] for w in wholes), prefill_s)


def run(args: argparse.Namespace, model_dir: str, dummy: bool) -> list[Row]:
    from sglang_lite import Engine

    hf_model = build_hf_model(model_dir, dummy)
    vocab = hf_model.config.vocab_size
    rows = []
    with Engine(model_dir, **engine_options(args, dummy)) as engine:
        warm = random_prompts(2, 16, vocab, seed=99)
        hf_generate(hf_model, warm, 4)
        engine_generate(engine, warm, 4)
        for batch_size in tqdm(args.batch_sizes, desc=f"{args.model_shape}: batch sizes"):
            prompts = random_prompts(batch_size, args.input_len, vocab, seed=batch_size)
            # compiles, when compiling
            engine_generate(engine, random_prompts(batch_size, 16, vocab, seed=7), 4)
            sides = {}
            for _ in range(args.repeats):  # alternating, so that both sides share the host's noise
                for name, generate in (
                    ("engine", partial(engine_generate, engine)),
                    ("hf", partial(hf_generate, hf_model)),
                ):
                    side = measure_side(generate, prompts, args.output_len, 1)
                    sides[name] = side if name not in sides else best_side(sides[name], side)
            rows.append(Row(batch_size, sides["hf"], sides["engine"]))
    return rows


def engine_options(args: argparse.Namespace, dummy: bool) -> dict:
    """The Engine's keyword arguments from the command line."""
    return dict(
        load_format="dummy" if dummy else "auto",
        skip_tokenizer_init=True,
        max_running_requests=max(args.batch_sizes),
        max_total_tokens=args.max_total_tokens,
        enable_torch_compile=args.torch_compile,
        cpu_threads_per_rank=args.threads,
        tp_size=args.tp_size,
    )


def best_side(a: Side, b: Side) -> Side:
    return Side(best([a.speed, b.speed]), min(a.whole_s, b.whole_s), min(a.prefill_s, b.prefill_s))


def print_setup(args: argparse.Namespace) -> None:
    """The run's shape, threads, host load and instruction sets: the header of a table."""
    print(
        f"\n{args.model_shape} Qwen3.5-MoE, engine TP={args.tp_size}, {args.input_len} prompt tokens, "
        f"{args.output_len} new tokens, {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, engine "
        f"torch.compile {'on' if args.torch_compile else 'off'}, load average {os.getloadavg()[0]:.1f} "
        f"(best of {args.repeats})"
    )
    from sglang_lite.kernels import cpu as cpu_kernels

    print(
        f"ISA: our kernels {cpu_kernels.describe_isa()}, PyTorch's {torch.backends.cpu.get_cpu_capability()}"
    )


def print_table(
    rows: list[Row], args: argparse.Namespace, machine: Machine, model_dir: str
) -> None:
    print_setup(args)
    print(f"{'':>6} {'wall clock tok/s':^36} {'tok per CPU-second':^36}")
    print(
        f"{'batch':>6} {'transformers':>13} {'sglang_lite':>12} {'ratio':>9} "
        f"{'transformers':>13} {'sglang_lite':>12} {'ratio':>9}"
    )
    for r in rows:
        print(
            f"{r.batch_size:>6} {r.hf.speed.wall_tok_s:>13.1f} {r.engine.speed.wall_tok_s:>12.1f} "
            f"{r.ratio:>8.2f}x {r.hf.speed.cpu_tok_s:>13.1f} {r.engine.speed.cpu_tok_s:>12.1f} "
            f"{r.cpu_ratio:>8.2f}x"
        )
    print_roofline(rows, args, machine, model_dir)


def print_roofline(
    rows: list[Row], args: argparse.Namespace, machine: Machine, model_dir: str
) -> None:
    from sglang_lite.config import ModelConfig

    config = ModelConfig.from_hf(model_dir)
    print(
        f"\nroofline: fp32 GEMM peak {machine.gemm_gflops:.0f} GFLOP/s, memory bandwidth "
        f"{machine.bandwidth_gbs:.1f} GB/s (measured here, {torch.get_num_threads()} threads); "
        "% = share of each, FLOPs and bytes counted from the shape"
    )
    print(
        f"{'phase':<16} {'GFLOP':>7} {'MB':>7} {'engine ms':>10} {'GEMM %':>7} {'bw %':>6} "
        f"{'HF ms':>9} {'GEMM %':>7} {'bw %':>6}"
    )
    context = args.input_len + args.output_len // 2
    for r in rows:
        b = r.batch_size
        phases = (
            (
                f"prefill {b}x{args.input_len}",
                prefill_work(config, b, args.input_len),
                r.engine.prefill_s,
                r.hf.prefill_s,
            ),
            (
                f"decode bs {b}",
                decode_work(config, b, context),
                r.engine.decode_step_s(args.output_len),
                r.hf.decode_step_s(args.output_len),
            ),
        )
        for name, work, engine_s, hf_s in phases:
            (eg, eb), (hg, hb) = work.shares(engine_s, machine), work.shares(hf_s, machine)
            print(
                f"{name:<16} {work.flops / 1e9:>7.2f} {work.bytes / 1e6:>7.1f} {engine_s * 1e3:>10.2f} "
                f"{100 * eg:>6.1f}% {100 * eb:>5.1f}% {hf_s * 1e3:>9.2f} {100 * hg:>6.1f}% {100 * hb:>5.1f}%"
            )


# A Qwen3.5-MoE shape whose forward is compute-bound on the CPU (dummy weights: only the speed is measured).
def scaling_config(hidden: int) -> dict:
    heads = hidden // 128
    return dict(
        model_type="qwen3_5_moe_text",
        vocab_size=8192,
        hidden_size=hidden,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=heads // 2,
        linear_num_value_heads=heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden // 2,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )


@dataclass(frozen=True)
class ScalingRow:
    tp_size: int
    prefill_tok_s: float
    decode_tok_s: float


def measure_tp(
    model_dir: str, tp_size: int, prompts: list[list[int]], output_len: int
) -> ScalingRow:
    from sglang_lite import Engine

    batch, input_len = len(prompts), len(prompts[0])
    with Engine(
        model_dir,
        tp_size=tp_size,
        cpu_threads_per_rank=1,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_running_requests=batch,
        max_total_tokens=batch * (input_len + output_len) + 64,
        chunked_prefill_size=input_len,
        max_prefill_tokens=batch * input_len,
    ) as engine:
        # decode from short prompts, so that their prefill is a small part
        short = [p[:16] for p in prompts]
        engine_generate(engine, short, 2)  # warm-up
        prefill_s = _seconds(partial(engine_generate, engine, prompts, 1))
        first_token_s = _seconds(partial(engine_generate, engine, short, 1))
        decode_s = _seconds(partial(engine_generate, engine, short, output_len)) - first_token_s
    return ScalingRow(
        tp_size, batch * input_len / prefill_s, batch * (output_len - 1) / max(decode_s, 1e-9)
    )


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_scaling(args: argparse.Namespace) -> None:
    config = scaling_config(args.hidden)
    batch = args.batch_sizes[0]
    prompts = random_prompts(batch, args.input_len, config["vocab_size"], seed=0)
    best_rows: dict[int, ScalingRow] = {}
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(config, f)
        # alternating: shared noise
        rounds = [(r, tp) for r in range(args.repeats) for tp in (1, args.tp_size)]
        for _, tp in tqdm(rounds, desc="TP scaling"):
            row = measure_tp(model_dir, tp, prompts, args.output_len)
            old = best_rows.get(tp)
            best_rows[tp] = (
                row
                if old is None
                else ScalingRow(
                    tp,
                    max(old.prefill_tok_s, row.prefill_tok_s),
                    max(old.decode_tok_s, row.decode_tok_s),
                )
            )
    base = best_rows[1]
    print(
        f"\nTP scaling: Qwen3.5-MoE hidden {args.hidden} (16 experts top-4, 4 layers), batch {batch} x "
        f"{args.input_len} prompt tokens, {args.output_len} new tokens, one thread per rank, gloo, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (best of {args.repeats}, alternating)"
    )
    print(f"{'tp':>4} {'prefill tok/s':>14} {'vs TP=1':>8} {'decode tok/s':>13} {'vs TP=1':>8}")
    for tp, row in sorted(best_rows.items()):
        print(
            f"{tp:>4} {row.prefill_tok_s:>14.1f} {row.prefill_tok_s / base.prefill_tok_s:>7.2f}x "
            f"{row.decode_tok_s:>13.1f} {row.decode_tok_s / base.decode_tok_s:>7.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of both sides (default: torch's choice here, the CPU count in the engine)",
    )
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument(
        "--isa",
        choices=("native", "avx2", "avx512"),
        default="native",
        help="the instruction set of both sides: our kernels (SGLANG_CPU_ISA) and PyTorch's (transformers')",
    )
    parser.add_argument(
        "--model-shape",
        choices=SHAPES,
        default="tiny",
        help="tiny: the built-in model; mid: 34M parameters, hidden 256; large: hidden 1024, dummy",
    )
    parser.add_argument(
        "--model-config",
        default=None,
        help="JSON object or JSON file of Qwen3.5-MoE config fields over mid's (random weights)",
    )
    parser.add_argument(
        "--torch-compile", action="store_true", help="engine decode steps through torch.compile"
    )
    parser.add_argument(
        "--tp-size", type=int, default=1, help="tensor-parallel ranks of the engine"
    )
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="TP=1 against TP=--tp-size (one thread per rank) instead of against transformers",
    )
    parser.add_argument(
        "--hidden", type=int, default=1024, help="hidden size of the --scaling model"
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="the engine without and with --enable-deterministic-inference instead of against "
        "transformers (bench_deterministic.py)",
    )
    parser.add_argument(
        "--speculative",
        action="store_true",
        help="speculative decoding with an MTP head against plain decoding instead (bench_speculative.py; "
        "its flags follow, e.g. --speculative --steps 1 2 3 --batch-sizes 1 4 16)",
    )
    # bench_speculative.py's own flags, listed here for --help (they are read there)
    parser.add_argument("--steps", type=int, nargs="+", help="with --speculative: drafts per step")
    parser.add_argument(
        "--head",
        choices=("builtin", "repeat", "random"),
        help="with --speculative: the MTP head (default: the built-in model's own)",
    )
    parser.add_argument(
        "--costs", action="store_true", help="with --speculative: time a step's parts"
    )
    parser.add_argument(
        "--prompts", choices=("source", "function"), help="with --speculative: the prompts' text"
    )
    if "--speculative" in sys.argv[1:]:
        import bench_speculative

        sys.argv = [sys.argv[0], *(a for a in sys.argv[1:] if a != "--speculative")]
        bench_speculative.main()
        return
    args = parser.parse_args()
    if args.scaling:
        run_scaling(args)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_heap_memory()  # as in the engine's scheduler process, so both sides allocate alike
    # the roofline's limits; --deterministic has no roofline
    machine = None if args.deterministic else measure_machine()
    overrides = _model_config(args.model_config)
    if overrides:
        args.model_shape = "custom"
    with shape_checkpoint(args.model_shape, overrides) as (model_dir, dummy):
        if args.deterministic:
            import bench_deterministic

            bench_deterministic.compare(args, model_dir, dummy)
        else:
            print_table(run(args, model_dir, dummy), args, machine, model_dir)


def _model_config(value: str | None) -> dict:
    if not value:
        return {}
    if os.path.isfile(value):
        with open(value) as f:
            value = f.read()
    text = value
    overrides = json.loads(text)
    if not isinstance(overrides, dict):
        raise SystemExit(f"--model-config: expected a JSON object of config fields, got {text!r}")
    return overrides


if __name__ == "__main__":
    main()
