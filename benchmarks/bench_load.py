"""Checkpoint checks at load: each safetensors file's header read once, against the file opened per weight.

Before reading any data the loader checks the checkpoint against the model from the files' headers: names, shapes,
which tensors are FP8, the shape of every block scale. It used to open a quantized weight's file (``safe_open``,
which parses that file's whole header) for each scale it checked, so the checks grew as weights x header size; now
``models/checkpoint.py`` reads each file's header once. This writes a block-FP8 MoE checkpoint with a large model's
number of expert tensors per file (each expert's gate, up and down projection with its ``weight_scale_inv``; the
tensors themselves tiny, so the files stay small) and times, in one run, the same scale checks both ways:

- per-weight open (before): the scales read with one ``safe_open`` per file, then a ``safe_open`` of the weight's
  file per scale for the weight's shape, as ``_check_scale`` did;
- per-file header (now): ``checkpoint_tensors`` (one ``safe_open`` per file, every tensor's dtype and shape kept),
  then ``quant_loading``'s scale checks on those.

It prints the time before as a multiple of the time now (absolute times depend on the disk, its cache and the
machine's load). Not run in CI.

    python benchmarks/bench_load.py [--layers 4 8 16] [--experts 512] [--files-per-layer 1.5]

The defaults keep a 397B-A17B index's ~2,000 tensors per file (512 experts, 3 projections and their scales, 1.5
files a layer) over 4 to 16 of its 60 layers; the per-weight open grows with the layers as the rest does, so the
ratio is what the full index gives (``--layers 60``: 92k scales, tens of minutes the per-weight way).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from sglang_lite.config import QuantConfig
from sglang_lite.layers.quant import SCALE_SUFFIX, scale_shape
from sglang_lite.models.checkpoint import INDEX_FILE, checkpoint_tensors
from sglang_lite.models.quant_loading import _check_scale

QUANT = QuantConfig(block_size=(128, 128))
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# each expert matrix: tiny (one partial 128x128 block), the headers are what is measured
SHAPE = (16, 16)


def write_checkpoint(path: str, layers: int, experts: int, files: int) -> None:
    """Per-expert FP8 weights with their scales over ``files`` files and an index, as a released MoE has them."""
    names = [
        f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
        for layer in range(layers)
        for e in range(experts)
        for proj in PROJECTIONS
    ]
    weight = torch.zeros(SHAPE, dtype=torch.float8_e4m3fn)
    scale = torch.ones(scale_shape(SHAPE, QUANT.block_size))
    weight_map = {}
    per_file = -(-len(names) // files)
    for i in tqdm(range(files), desc="writing shards", unit="file", leave=False):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = names[i * per_file : (i + 1) * per_file]
        tensors = {n: weight.clone() for n in part} | {
            n + SCALE_SUFFIX: scale.clone() for n in part
        }
        save_file(tensors, os.path.join(path, file))
        weight_map |= dict.fromkeys(tensors, file)
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"weight_map": weight_map}, f)


def index_of(path: str) -> dict[str, str]:
    with open(os.path.join(path, INDEX_FILE)) as f:
        return {n: os.path.join(path, file) for n, file in json.load(f)["weight_map"].items()}


def check(weight_shape: tuple, found: tuple) -> None:
    assert tuple(found) == scale_shape(tuple(weight_shape), QUANT.block_size)


def per_weight_open(path: str) -> None:
    """As the loader did: the scales read with one ``safe_open`` per file, then, per scale, a ``safe_open`` of its
    weight's file for the weight's shape."""
    index = index_of(path)
    by_file: dict[str, list[str]] = {}
    for name, file in index.items():
        if name.endswith(SCALE_SUFFIX):
            by_file.setdefault(file, []).append(name)
    scales = {}
    for file, names in by_file.items():
        with safe_open(file, "pt") as f:
            scales |= {n.removesuffix(SCALE_SUFFIX): f.get_tensor(n) for n in names}
    for weight, scale in tqdm(scales.items(), desc="per-weight open", unit="scale", leave=False):
        with safe_open(index[weight], "pt") as f:
            check(f.get_slice(weight).get_shape(), scale.shape)


def per_file_header(path: str) -> None:
    """The loader now: ``checkpoint_tensors`` (each header parsed once), then its scale checks."""
    files = checkpoint_tensors(path)
    for name in files:
        if name.endswith(SCALE_SUFFIX):
            _check_scale(files, name.removesuffix(SCALE_SUFFIX), QUANT)


def seconds(fn, path: str, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn(path)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--experts", type=int, default=512)
    parser.add_argument("--files-per-layer", type=float, default=1.5)
    parser.add_argument("--repeat", type=int, default=3, help="best of, for the per-file way")
    args = parser.parse_args()
    rows = []
    for layers in tqdm(args.layers, desc="checkpoints", unit="ckpt"):
        files = max(1, round(layers * args.files_per_layer))
        with tempfile.TemporaryDirectory() as path:
            write_checkpoint(path, layers, args.experts, files)
            now = seconds(per_file_header, path, args.repeat)
            before = seconds(per_weight_open, path, 1)
        tensors = layers * args.experts * len(PROJECTIONS) * 2
        rows.append((f"{layers} x {args.experts}", files, tensors, before / now))
    print(
        "\nscale checks before loading: the per-weight open's time over the per-file header read's\n"
    )
    print(
        f"{'layers x experts':>17} {'files':>6} {'tensors':>8} {'per-weight open / per-file header':>34}"
    )
    for name, files, tensors, ratio in rows:
        print(f"{name:>17} {files:>6} {tensors:>8} {ratio:>33.0f}x")


if __name__ == "__main__":
    main()
