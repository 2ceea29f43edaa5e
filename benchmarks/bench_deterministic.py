"""What ``--enable-deterministic-inference`` costs (``bench_offline.py --deterministic`` runs this): the engine
without and with it on one model, side by side in one run.

Both engines load the same model (``--model-shape`` / ``--model-config``) with the same options and generate as
``bench_offline.py``'s engine does: ``--output-len`` tokens per request, greedily, from random ``--input-len``-token
prompts, the two engines' runs alternating so that they share the host's noise (best of ``--repeats``). Both stay
up for the whole run, only one of them generating at a time. Per batch size: output tok/s of each over the whole
call (wall clock and per CPU-second), and the prefill (the call with one new token) and a decode step
((whole call - prefill call) / (output_len - 1)) in ms; each ratio is the deterministic engine's speed over the
plain one's (0.90: 10% slower).

The last columns check what the flag is for: the first prompt's output ids alone against those it had in the
batch's timed call, ``same`` or ``DIFFERENT``. Under the flag ``DIFFERENT`` is a bug; without it either may come
(greedy ids often survive the small numeric differences a batch makes).

    python benchmarks/bench_offline.py --deterministic --model-shape mid --threads 2 --batch-sizes 1 32
"""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from dataclasses import dataclass

from bench_offline import (
    Side,
    best_side,
    engine_generate,
    engine_options,
    measure_side,
    print_setup,
    random_prompts,
)
from tqdm import tqdm

ENGINES = {"plain": False, "deterministic": True}


class RecordedEngine:
    """``engine_generate`` on one engine that keeps, per output length, the first prompt's output ids of its last
    call, so that the determinism check reuses the timed calls."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.first_ids: dict[int, list[int]] = {}

    def __call__(self, prompts: list[list[int]], output_len: int) -> None:
        self.first_ids[output_len] = engine_generate(self.engine, prompts, output_len)[0]

    def same_alone(self, prompts: list[list[int]], output_len: int) -> bool:
        """Whether the first of ``prompts`` alone gives the ids it had in the last call of them all."""
        alone = engine_generate(self.engine, prompts[:1], output_len)[0]
        return alone == self.first_ids[output_len]


@dataclass(frozen=True)
class Row:
    batch_size: int
    sides: dict[str, Side]
    same_alone: dict[str, bool]


def compare(args: argparse.Namespace, model_dir: str, dummy: bool) -> None:
    from sglang_lite import Engine
    from sglang_lite.config import ModelConfig

    vocab = ModelConfig.from_hf(model_dir).vocab_size
    options = engine_options(args, dummy)
    with ExitStack() as engines:  # both shut down, whatever fails
        recorded = {
            name: RecordedEngine(
                engines.enter_context(
                    Engine(model_dir, **options, enable_deterministic_inference=on)
                )
            )
            for name, on in ENGINES.items()
        }
        batch_sizes = tqdm(args.batch_sizes, desc=f"{args.model_shape}: batch sizes")
        rows = [measure_batch(recorded, args, vocab, batch_size) for batch_size in batch_sizes]
    print_table(rows, args)


def measure_batch(
    recorded: dict[str, RecordedEngine], args: argparse.Namespace, vocab: int, batch_size: int
) -> Row:
    prompts = random_prompts(batch_size, args.input_len, vocab, seed=batch_size)
    for generate in recorded.values():  # warm-up (and compiles, when compiling)
        generate(random_prompts(batch_size, 16, vocab, seed=7), 4)
    sides: dict[str, Side] = {}
    for _ in range(args.repeats):  # alternating, so that both share the host's noise
        for name, generate in recorded.items():
            side = measure_side(generate, prompts, args.output_len, 1)
            sides[name] = side if name not in sides else best_side(sides[name], side)
    same_alone = {
        name: generate.same_alone(prompts, args.output_len) for name, generate in recorded.items()
    }
    return Row(batch_size, sides, same_alone)


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    print_setup(args)
    print(
        "ratio: the deterministic engine's speed over the plain one's (0.90: 10% slower), runs alternating; "
        "alone: the first prompt's output ids alone against in the batch"
    )
    groups = ("wall clock tok/s", "tok per CPU-second", "prefill ms", "decode step ms")
    print(f"{'':>6}" + "".join(f" {g:^25}" for g in groups) + f" {'alone':^19}")
    columns = f" {'plain':>8} {'determ.':>8} {'ratio':>7}"
    print(f"{'batch':>6}" + columns * len(groups) + f" {'plain':>9} {'determ.':>9}")
    for r in rows:
        print(f"{r.batch_size:>6}" + "".join(_cells(r, args.output_len)) + _checks(r))


def _cells(row: Row, output_len: int) -> list[str]:
    plain, deterministic = row.sides["plain"], row.sides["deterministic"]
    wall = (plain.speed.wall_tok_s, deterministic.speed.wall_tok_s)
    cpu = (plain.speed.cpu_tok_s, deterministic.speed.cpu_tok_s)
    prefill_ms = (plain.prefill_s * 1e3, deterministic.prefill_s * 1e3)
    step_ms = (plain.decode_step_s(output_len) * 1e3, deterministic.decode_step_s(output_len) * 1e3)
    # speeds, then times (their ratio inverted: a speed's again)
    cells = [f" {a:>8.1f} {b:>8.1f} {b / a:>6.2f}x" for a, b in (wall, cpu)]
    return cells + [f" {a:>8.2f} {b:>8.2f} {a / b:>6.2f}x" for a, b in (prefill_ms, step_ms)]


def _checks(row: Row) -> str:
    words = ["same" if row.same_alone[name] else "DIFFERENT" for name in ENGINES]
    return "".join(f" {word:>9}" for word in words)


if __name__ == "__main__":  # bench_offline.py reads the flags
    import bench_offline

    sys.argv.insert(1, "--deterministic")
    bench_offline.main()
