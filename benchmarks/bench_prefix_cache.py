"""Prefix cache: follow-up requests that extend a long prompt, with the cache on and off, side by side.

One Engine per setting (the built-in model, its trained weights); a ``--prompt-len``-token prompt runs once, then
``--turns`` follow-ups each extend it by ``--extend`` more tokens (as the next turn of a conversation does). The
table shows each setting's mean follow-up time, the cached tokens reported, and the speed-up; the greedy tokens of
both settings must agree (checked, not assumed). Settings alternate ``--repeats`` times: the machines are noisy.

    python benchmarks/bench_prefix_cache.py --prompt-len 3000 --extend 90
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tqdm import tqdm

from sglang_lite.utils.process import keep_freed_heap_memory


def run_setting(
    cache: bool, base: list[int], follow_ups: list[list[int]], new_tokens: int, threads: int | None
) -> tuple[list[float], list[int], list[list[int]]]:
    from sglang_lite import Engine

    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    with Engine(None, disable_radix_cache=not cache, cpu_threads_per_rank=threads) as engine:
        # the first turn (cached when the cache is on)
        engine.generate(input_ids=base, sampling_params=params)
        seconds, cached, outputs = [], [], []
        for prompt in follow_ups:
            start = time.perf_counter()
            result = engine.generate(input_ids=prompt, sampling_params=params)
            seconds.append(time.perf_counter() - start)
            cached.append(result["meta_info"]["cached_tokens"])
            outputs.append(result["output_ids"])
    return seconds, cached, outputs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-len", type=int, default=3000)
    parser.add_argument(
        "--extend", type=int, default=90, help="tokens each follow-up adds to the prompt"
    )
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads of the engine's process"
    )
    args = parser.parse_args()
    keep_freed_heap_memory()
    rng = random.Random(0)
    base = [rng.randrange(10, 4000) for _ in range(args.prompt_len)]
    # each turn extends the last
    follow_ups = [base + [rng.randrange(10, 4000) for _ in range(args.extend)]]
    for _ in range(args.turns - 1):
        follow_ups.append(follow_ups[-1] + [rng.randrange(10, 4000) for _ in range(args.extend)])
    times: dict[bool, list[float]] = {True: [], False: []}
    cached: dict[bool, list[int]] = {}
    outputs: dict[bool, list[list[int]]] = {}
    for _, cache in tqdm(
        [(r, c) for r in range(args.repeats) for c in (True, False)], desc="settings"
    ):
        seconds, cached[cache], outputs[cache] = run_setting(
            cache, base, follow_ups, args.new_tokens, args.threads
        )
        times[cache] += seconds
    assert outputs[True] == outputs[False], "the cache changed greedy tokens"
    on, off = statistics.mean(times[True]), statistics.mean(times[False])
    print(
        f"\nprefix cache: built-in model, {args.prompt_len}-token prompt, {args.turns} follow-ups of +{args.extend} "
        f"tokens each, {args.new_tokens} new tokens, {args.repeats} alternating repeats"
    )
    print(f"{'setting':<18} {'follow-up s (mean)':>19} {'cached tokens':>22}")
    print(f"{'radix cache':<18} {on:>19.3f} {str(cached[True]):>22}")
    print(f"{'--disable-radix-cache':<18} {off:>16.3f} {str(cached[False]):>22}")
    print(f"speed-up of a follow-up: {off / on:.2f}x (greedy tokens equal)")


if __name__ == "__main__":
    main()
