"""What a safetensors checkpoint holds (each tensor's name, file, dtype and shape), from each file's header, read once.

That is all the checks before loading need (names, shapes, which tensors are FP8, scale shapes). ``safe_open``
parses a file's whole header on each open, so opening the file per tensor costs the number of tensors times the
header (a 397B MoE index has ~92k expert scales over ~100 files, ~2,000 tensors a header); one open per file costs
one pass (``benchmarks/bench_load.py``).
"""

from __future__ import annotations

import json
import math
import os
from typing import NamedTuple

from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: the message names the tensor, the shapes and the file."""


class TensorInfo(NamedTuple):
    """One checkpoint tensor as its file's header describes it (a tuple: a 397B index makes ~180k of them)."""

    raw: str  # its name in the checkpoint
    file: str
    dtype: str  # safetensors' dtype name: "BF16", "F32", "F8_E4M3", ...
    shape: tuple[int, ...]

    @property
    def is_fp8(self) -> bool:
        return self.dtype.startswith("F8")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(file: str) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file, by name, from its header alone (no tensor data is read)."""
    try:
        with safe_open(file, "pt") as f:
            tensors = {}
            for name in f.keys():
                part = f.get_slice(name)
                tensors[name] = TensorInfo(name, file, part.get_dtype(), tuple(part.get_shape()))
            return tensors
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot read the safetensors header of {file}: {e}") from e


def checkpoint_tensors(path: str) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint at ``path`` (a single file or a sharded index), by its raw name; each file's
    header is read once."""
    index_path = os.path.join(path, INDEX_FILE)
    if not os.path.exists(index_path):
        single = os.path.join(path, SINGLE_FILE)
        if not os.path.exists(single):
            raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
        return read_header(single)
    with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    tensors = {}
    for relative, names in by_file.items():
        file = os.path.join(path, relative)
        if not os.path.exists(file):
            raise CheckpointError(
                f"{index_path} lists {len(names)} tensors in {file}, which is missing"
            )
        header = read_header(file)
        for name in names:
            if name not in header:
                raise CheckpointError(
                    f"{INDEX_FILE} puts tensor {name!r} in {file}, whose header has no such tensor"
                )
            tensors[name] = header[name]
    return tensors
