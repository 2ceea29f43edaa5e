"""Writes a checkpoint in AMD Quark's MXFP4 export format from a high-precision one (tests and benchmarks use it;
so can a user who wants an MXFP4 checkpoint without Quark).

    python -m sglang_lite.quantization.quark_export SRC DST [--w4a4] [--exclude PATTERN ...]

Each quantized ``<module>.weight`` [out, in] becomes uint8 [out, in / 2] (``kernels/quant/mxfp4.py``'s packing)
with a uint8 ``<module>.weight_scale`` [out, ceil(in / 32)] beside it; a fused expert tensor
(``experts.gate_up_proj``, ``experts.down_proj``) keeps its name and gets ``<name>_scale``. config.json gains a
``quantization_config`` with ``quant_method: "quark"``: weights fp4 per 32-group with e8m0 scales, activations
unquantized (W4A16) or, with ``--w4a4``, fp4 per 32-group quantized at run time; ``exclude`` lists the fnmatch
patterns of the modules left in high precision.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang_lite.kernels.quant import mxfp4
from sglang_lite.quantization.mxfp4 import DEFAULT_EXCLUDE

FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def fp4_spec(dynamic: bool, scale_mode: str = "even") -> dict:
    """Quark's quantization spec of fp4 per 32-group with e8m0 scales (``is_dynamic``: activations)."""
    return {
        "dtype": "fp4",
        "qscheme": "per_group",
        "group_size": mxfp4.GROUP,
        "ch_axis": -1,
        "is_dynamic": dynamic,
        "scale_format": "e8m0",
        "scale_type": "float",
        "scale_calculation_mode": scale_mode,
        "round_method": "half_even",
        "symmetric": None,
        "observer_cls": "PerBlockMXObserver",
    }


def quark_config(exclude: tuple[str, ...], w4a4: bool) -> dict:
    """The ``quantization_config`` of a Quark MXFP4 export (W4A16, or W4A4 with ``w4a4``)."""
    return {
        "quant_method": "quark",
        "global_quant_config": {
            "weight": fp4_spec(dynamic=False),
            "input_tensors": fp4_spec(dynamic=True) if w4a4 else None,
            "output_tensors": None,
            "bias": None,
        },
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "exclude": list(exclude),
        "export": {
            "pack_method": "reorder",
            "weight_format": "real_quantized",
            "kv_cache_group": [],
        },
        "quant_mode": "eager_mode",
    }


def quantized_module(name: str, tensor: torch.Tensor, exclude: tuple[str, ...]) -> str | None:
    """The module a checkpoint tensor quantizes as (None: kept as it is): 2-D ``.weight``s of modules no pattern
    excludes, and fused expert stacks."""
    if name.endswith(".weight") and tensor.dim() == 2:
        module = name.removesuffix(".weight")
    elif name.endswith(FUSED_EXPERTS) and tensor.dim() == 3:
        module = name.rsplit(".", 1)[0]
    else:
        return None
    if not tensor.is_floating_point() or any(fnmatch.fnmatch(module, p) for p in exclude):
        return None
    return module


def export(
    src: str, dst: str, exclude: tuple[str, ...] = DEFAULT_EXCLUDE, w4a4: bool = False
) -> str:
    """Writes ``src``'s checkpoint to ``dst`` as a Quark MXFP4 export (other files copied); returns ``dst``."""
    os.makedirs(dst, exist_ok=True)
    for entry in os.listdir(src):
        path = os.path.join(src, entry)
        if entry.endswith(".safetensors"):
            save_file(_quantized_file(path, exclude), os.path.join(dst, entry), {"format": "pt"})
        elif entry == "config.json":
            _write_config(path, os.path.join(dst, entry), exclude, w4a4)
        elif os.path.isfile(path) and not entry.endswith(".safetensors.index.json"):
            shutil.copy(path, os.path.join(dst, entry))
    _write_index(src, dst, exclude)
    return dst


def _quantized_file(path: str, exclude: tuple[str, ...]) -> dict[str, torch.Tensor]:
    out = {}
    with safe_open(path, "pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            if quantized_module(name, tensor, exclude) is None:
                out[name] = tensor
                continue
            packed, scales = mxfp4.quantize(tensor)
            out[name] = packed
            out[_scale_name(name)] = scales
    return out


def _scale_name(name: str) -> str:
    return name + "_scale"


def _write_config(src: str, dst: str, exclude: tuple[str, ...], w4a4: bool) -> None:
    with open(src) as f:
        config = json.load(f)
    config["quantization_config"] = quark_config(exclude, w4a4)
    with open(dst, "w") as f:
        json.dump(config, f, indent=2)


def _write_index(src: str, dst: str, exclude: tuple[str, ...]) -> None:
    """A sharded checkpoint's index, with each scale in its weight's file."""
    index_path = os.path.join(src, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        return
    with open(index_path) as f:
        index = json.load(f)
    weight_map = dict(index["weight_map"])
    for file in set(weight_map.values()):
        with safe_open(os.path.join(dst, file), "pt") as f:
            weight_map.update({name: file for name in f.keys()})
    index["weight_map"] = weight_map
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument(
        "--w4a4", action="store_true", help="activations fp4 per 32-group at run time"
    )
    parser.add_argument("--exclude", nargs="*", default=list(DEFAULT_EXCLUDE))
    args = parser.parse_args()
    print(export(args.src, args.dst, tuple(args.exclude), args.w4a4))


if __name__ == "__main__":
    main()
