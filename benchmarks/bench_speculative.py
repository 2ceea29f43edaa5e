"""Speculative decoding (the MTP head, NEXTN, or prompt lookup, NGRAM) against plain decoding, side by side in
one run (``bench_offline.py --speculative`` runs this).

``--head builtin`` (the default) is the built-in model's own trained head (``scripts/train_tiny_model.py``). For
the cost of speculating apart from what a head wins, a head can be added to a copy of the model instead:
``--head repeat`` passes the model's hidden state through ``fc`` (its decoder layer scaled down), so it drafts the
token it is given again (accepted where the text repeats: indentation, runs of one token); ``--head random`` is a
random head (drafts are almost never accepted: the figures are then the cost of speculating). Prompts are this
repository's Python source (held out from the model's training on the standard library), tokenised and cut into
``--input-len`` tokens. Each engine generates ``--output-len`` tokens per request greedily; decode tok/s is
``batch * (output_len - 1)`` over (the whole call - the one-token call), best of ``--repeats``, the engines
alternating so that they share the host's noise. Accepted length: tokens per verify step (accepted drafts plus
the corrected or bonus token) from ``meta_info``.

    python benchmarks/bench_speculative.py --batch-sizes 1 4 16 --steps 1 2 3 --threads 2
    python benchmarks/bench_speculative.py --algorithm NGRAM --prompts repeating --batch-sizes 1 4 --steps 2 4 8

``--algorithm NGRAM`` drafts by prompt lookup (no head: ``--head`` is ignored, the built-in model runs). Its
``--prompts repeating`` are prompts that repeat themselves as users' do: a function from this repository's source
followed by "rewritten with a docstring" and its first line (code editing), or a text followed by a request to
summarise it and its first sentence; the model's continuation copies from the prompt where it can.

``--costs`` times the parts of a step instead, in this process (one scheduler, ``--threads`` torch threads), per
batch size: a plain decode step, and in a speculative step (``--steps`` k, the largest given) the MTP head's
chain steps (without their LM head), the verify forward of k + 1 tokens per request (its LM head included), the
head's pass over the kept tokens (its LM head and argmax included), and one LM head call of the head's (each chain
step's and the kept pass's: k a step), each the median over the steps of ``--output-len`` tokens. Speculation pays
when (accepted length) * (plain step) exceeds the whole speculative step.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sglang_lite import Engine, assets  # noqa: E402
from tests.hf_checkpoints import add_mtp_head  # noqa: E402
from tests.speculative.conftest import repeating_head  # noqa: E402


def model_with_head(folder: str, head: str, shape: str = "tiny") -> str:
    """A copy of the built-in model (``shape`` tiny), or bench_offline's random mid-size one, with an MTP head in
    ``folder``."""
    from transformers import AutoModelForCausalLM

    if head == "builtin":
        if shape != "tiny":
            raise SystemExit(
                "--head builtin is the built-in (tiny) model's head: use repeat or random"
            )
        return str(assets.model_dir(None))
    path = os.path.join(folder, "model")
    if shape == "tiny":
        shutil.copytree(assets.model_dir(None), path)
    else:
        from bench_offline import MID, _save_random_model

        _save_random_model(MID, path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    add_mtp_head(hf, path, seed=0)
    if head == "repeat":
        repeating_head(path)
    return path


def prompts_for(kind: str, tokenizer, count: int, length: int) -> list[list[int]]:
    """``source``: ``source_prompts``; ``function``: ``function_prompts``; ``repeating``: ``repeating_prompts``."""
    if kind == "function":
        return function_prompts(tokenizer, count)
    if kind == "repeating":
        return repeating_prompts(tokenizer, count, length)
    return source_prompts(tokenizer, count, length)


def repeating_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` prompts that ask for their own text again: a function of this repository (at most ``length``
    tokens of it) then "the same function, rewritten with a docstring" and its first line; every other prompt a
    module docstring then a request to summarise it and its first sentence."""
    import ast

    functions, texts = [], []
    for file in sorted(glob.glob(os.path.join(ROOT, "sglang_lite", "**", "*.py"), recursive=True)):
        with open(file) as f:
            source = f.read()
        tree = ast.parse(source)
        if ast.get_docstring(tree):
            texts.append(ast.get_docstring(tree))
        functions += [ast.get_source_segment(source, node) for node in ast.walk(tree)]
        functions = [f for f in functions if f and f.startswith("def ") and f.count("\n") >= 6]
        if len(functions) >= count and len(texts) >= count:
            break
    prompts = []
    for i in range(count):
        if i % 2 == 0:
            body = tokenizer.decode(tokenizer.encode(functions[i // 2])[:length])
            ask = (
                "\n\n\n# The same function, rewritten with a docstring:\n"
                + body.splitlines()[0]
                + "\n"
            )
        else:
            body = tokenizer.decode(tokenizer.encode(texts[i // 2])[:length])
            ask = "\n\nSummarise the text above.\n\n" + body.split(". ")[0]
        prompts.append(tokenizer.encode(body + ask))
    return prompts


def function_prompts(tokenizer, count: int) -> list[list[int]]:
    """``count`` prompts cut from one held-out standard-library-style function (the tests' ``UNSEEN_PYTHON``, the
    kind of code the built-in model was trained on), from 12 tokens to all of it: the model completes the rest."""
    from tests.models.test_trained_tiny_model import UNSEEN_PYTHON

    ids = tokenizer.encode(UNSEEN_PYTHON)
    return [ids[: 12 + (i * 37) % (len(ids) - 12)] for i in range(count)]


def source_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens from this repository's Python source, in file order."""
    ids: list[int] = []
    for file in sorted(glob.glob(os.path.join(ROOT, "sglang_lite", "**", "*.py"), recursive=True)):
        with open(file) as f:
            ids += tokenizer.encode(f.read())
        if len(ids) >= count * length:
            break
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def generate(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """(seconds, tokens per verify step; 1.0 without speculation) of one greedy call."""
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    engine.flush_cache()  # every call prefills its prompts: no call's prefill is another's cache hit
    start = time.perf_counter()
    results = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    assert all(len(r["output_ids"]) == output_len for r in results)
    steps = sum(r["meta_info"].get("spec_verify_ct", 0) for r in results)
    produced = sum(len(r["output_ids"]) - 1 for r in results)
    return seconds, (produced / steps if steps else 1.0)


def measure(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """(decode tok/s, accepted length) of one batch."""
    whole, accepted = generate(engine, prompts, output_len)
    first, _ = generate(engine, prompts, 1)
    decode_s = max(whole - first, 1e-9)
    return len(prompts) * (output_len - 1) / decode_s, accepted


def measure_groups(
    engine: Engine, batches: list[list[list[int]]], output_len: int
) -> tuple[float, float]:
    """(decode tok/s, accepted length) over batches run one after another: tokens over the sum of their decode
    times, the accepted lengths averaged."""
    results = [measure(engine, batch, output_len) for batch in batches]
    seconds = sum(
        len(batch) * (output_len - 1) / speed for batch, (speed, _) in zip(batches, results)
    )
    tokens = sum(len(batch) * (output_len - 1) for batch in batches)
    return tokens / seconds, sum(accepted for _, accepted in results) / len(results)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--head", choices=("builtin", "repeat", "random"), default="builtin")
    parser.add_argument("--costs", action="store_true", help="time the parts of a step (see above)")
    parser.add_argument(
        "--prompts",
        choices=("source", "function", "repeating"),
        default="source",
        help="source: this repository's Python, cut into --input-len tokens; function: prefixes of one held-out "
        "function of the kind the built-in model learnt (its drafts are accepted more often); repeating: prompts "
        "that ask for their own text again (see above)",
    )
    parser.add_argument("--algorithm", choices=("NEXTN", "NGRAM"), default="NEXTN")
    parser.add_argument(
        "--groups",
        type=int,
        default=1,
        help="batches of each size run one after another, each of other prompts (tok/s over all of them)",
    )
    parser.add_argument(
        "--model-shape",
        choices=("tiny", "mid"),
        default="tiny",
        help="with --costs: tiny, the built-in model; mid, bench_offline's random 34M-parameter one",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        head = (
            "builtin" if args.algorithm == "NGRAM" else args.head
        )  # the model runs without its head
        path = model_with_head(folder, head, args.model_shape)
        (run_costs if args.costs else run)(args, path)


class Timer:
    """Wraps a method, keeping the seconds of each call by the mode of the batch it is given (``all`` for other
    arguments). While ``inside`` (another Timer) runs, calls are not counted."""

    def __init__(self, owner, name: str, inside: Timer | None = None) -> None:
        self.calls: dict[str, list[float]] = {}
        self.running = False
        self._inner = getattr(owner, name)
        self._inside = inside
        setattr(owner, name, self)

    def __call__(self, first, *rest, **kwargs):
        start = time.perf_counter()
        self.running = True
        try:
            out = self._inner(first, *rest, **kwargs)
        finally:
            self.running = False
        if self._inside is not None and self._inside.running:
            return out
        kind = "all" if isinstance(first, (torch.Tensor, list)) else first.mode.value
        self.calls.setdefault(kind, []).append(time.perf_counter() - start)
        return out


def median_ms(values: list[float]) -> float:
    return 1000 * sorted(values)[len(values) // 2] if values else float("nan")


def step_times(args: argparse.Namespace, path: str, steps: int, batch: list[list[int]]):
    """Scheduler steps of decoding ``batch`` to the end: (decode step seconds, the runner's timers)."""
    from sglang_lite.runtime.factory import create_scheduler
    from sglang_lite.server_args import ServerArgs

    spec = (
        {"speculative_algorithm": args.algorithm, "speculative_num_steps": steps} if steps else {}
    )
    scheduler = create_scheduler(
        ServerArgs(model_path=path, max_total_tokens=16384, max_running_requests=len(batch), **spec)
    )
    # the verify forward (its LM head too), and the LM head calls of the rest
    timers = {name: Timer(scheduler.runner, name) for name in ("forward_verify", "logits")}
    # the head's pass over kept tokens (its LM head and argmax too), and its chain steps
    if steps and args.algorithm != "NGRAM":
        timers["kept"] = Timer(scheduler.speculation.drafter, "_extend")
        timers["forward_mtp"] = Timer(scheduler.runner, "forward_mtp", inside=timers["kept"])
    params = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    for i, prompt in enumerate(batch):
        scheduler.add_request(str(i), prompt, params)
    decode_steps = []
    while scheduler.has_work:
        decoding = not scheduler.queues.waiting and scheduler.queues.chunked is None
        start = time.perf_counter()
        scheduler.step()
        if decoding:
            decode_steps.append(time.perf_counter() - start)
    return decode_steps, timers


def run_costs(args: argparse.Namespace, path: str) -> None:
    from transformers import AutoTokenizer

    from sglang_lite.utils.process import keep_freed_heap_memory

    torch.set_num_threads(args.threads)
    keep_freed_heap_memory()  # as a scheduler process does
    k = max(args.steps)
    count = max(args.batch_sizes)
    if args.model_shape == "tiny":
        prompts = prompts_for(
            args.prompts, AutoTokenizer.from_pretrained(path), count, args.input_len
        )
    else:  # no tokenizer: random tokens (the parts' costs do not depend on what is accepted)
        from bench_offline import random_prompts

        prompts = random_prompts(count, args.input_len, 32000, seed=0)
    print(
        f"{args.model_shape}, k={k}, head {args.head}; input {args.input_len}, "
        f"output {args.output_len}, threads {args.threads}"
    )
    print(
        "| batch | plain decode step ms | speculative step ms | MTP chain step ms | verify forward ms "
        "| MTP over kept tokens ms | the head's LM head call ms (k a step) |"
    )
    for steps in (0, k):  # warm-up: the kernels' first calls
        step_times(args, path, steps, prompts[:1])
    for batch_size in args.batch_sizes:
        batch = prompts[:batch_size]
        plain, _ = step_times(args, path, 0, batch)
        spec, timers = step_times(args, path, k, batch)
        cells = [
            median_ms(plain),
            median_ms(spec),
            median_ms(
                timers["forward_mtp"].calls.get("decode", []) if "forward_mtp" in timers else []
            ),
            median_ms(timers["forward_verify"].calls.get("decode", [])),
            median_ms(timers["kept"].calls.get("all", [])[batch_size:] if "kept" in timers else []),
            median_ms(timers["logits"].calls.get("all", [])),
        ]
        print(f"| {batch_size} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)


def run(args: argparse.Namespace, path: str) -> None:
    settings = [0, *args.steps]
    common = dict(
        max_running_requests=max(args.batch_sizes),
        max_total_tokens=16384,
        cpu_threads_per_rank=args.threads,
    )
    engines = {
        k: Engine(
            path,
            **common,
            **({"speculative_num_steps": k, "speculative_algorithm": args.algorithm} if k else {}),
        )
        for k in settings
    }
    try:
        prompts = prompts_for(
            args.prompts, engines[0].tokenizer, max(args.batch_sizes) * args.groups, args.input_len
        )
        for engine in engines.values():
            generate(engine, prompts[:2], 4)  # warm up
        drafts = "prompt lookup" if args.algorithm == "NGRAM" else f"head: {args.head}"
        print(
            f"{args.algorithm} ({drafts}); prompts {args.prompts}, input {args.input_len}, output "
            f"{args.output_len}, threads {args.threads}, {args.groups} group(s) of each batch size, "
            f"{time.strftime('%Y-%m-%d %H:%M')}"
        )
        header = "| batch | " + " | ".join(
            "plain tok/s" if k == 0 else f"k={k} tok/s (x) | k={k} accepted" for k in settings
        )
        print(header + " |")
        for batch_size in args.batch_sizes:
            batches = [prompts[g * batch_size : (g + 1) * batch_size] for g in range(args.groups)]
            best: dict[int, tuple[float, float]] = {}
            for _ in range(args.repeats):
                for k, engine in engines.items():
                    speed, accepted = measure_groups(engine, batches, args.output_len)
                    if k not in best or speed > best[k][0]:
                        best[k] = (speed, accepted)
            plain = best[0][0]
            cells = [f"{plain:.0f}"] + [
                f"{best[k][0]:.0f} ({best[k][0] / plain:.2f}x) | {best[k][1]:.2f}"
                for k in args.steps
            ]
            print(f"| {batch_size} | " + " | ".join(cells) + " |", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
