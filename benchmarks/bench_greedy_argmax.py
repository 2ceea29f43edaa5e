"""CPU: the sampler's greedy argmax (``argmax_rows``) against ``torch.argmax`` over the vocabulary.

torch's CPU argmax along a long last dimension is not vectorised; the sampler finds each row's maximum by blocks
with ``amax`` and runs the argmax only within the first block that holds it. Each row times both on random
logits, checks that they return the same ids, and prints the ratio. Vocabularies: the mid benchmark model's
(32000) and Qwen3.5's (248320).

    python benchmarks/bench_greedy_argmax.py [--threads 2] [--batch-sizes 1 8 32 128]
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_cases._timing import time_ms  # noqa: E402

from sglang_lite.sampling.sampler import argmax_rows  # noqa: E402

CPU = torch.device("cpu")
VOCABS = (32000, 248320)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for vocab in tqdm(VOCABS, desc="vocabularies"):
        for batch in args.batch_sizes:
            logits = torch.randn(batch, vocab)
            if not torch.equal(argmax_rows(logits), logits.argmax(dim=-1)):
                raise AssertionError(
                    f"argmax_rows differs from torch.argmax at batch {batch}, vocab {vocab}"
                )
            plain = time_ms(partial(torch.argmax, logits, dim=-1), CPU, iters=100)
            ours = time_ms(partial(argmax_rows, logits), CPU, iters=100)
            rows.append((vocab, batch, plain, ours))
    print(f"\n{args.threads} thread(s); median ms per call")
    print(f"{'vocab':>7} {'batch':>5} {'torch.argmax':>13} {'argmax_rows':>12} {'speed-up':>9}")
    for vocab, batch, plain, ours in rows:
        print(f"{vocab:>7} {batch:>5} {plain:>13.3f} {ours:>12.3f} {plain / ours:>8.2f}x")


if __name__ == "__main__":
    main()
