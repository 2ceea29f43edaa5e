"""The files each side of ``bench_llamacpp.py`` runs, per ``--weights``: llama.cpp's GGUF files (its converter, then
``llama-quantize``) and the checkpoint folder our Engine serves.

``bf16``: our Engine on the bf16 checkpoint; llama.cpp on its f32 and bf16 conversions of it.

``mxfp4``: our Engine on the same weights exported as AMD Quark MXFP4 (``quantization/quark_export.py``: the routed
and shared experts and the full-attention projections fp4 with e8m0 scales per 32; routers, linear attention,
embeddings and the LM head bf16); llama.cpp on the bf16 GGUF quantized by ``llama-quantize`` to ``MXFP4_MOE`` (its
expert stacks MXFP4, every other matrix Q8_0, the LM head included) and to ``Q4_0`` (most matrices Q4_0, the LM head
Q6_K). Neither quantizes exactly what Quark's export does; the table says how many parameters of each side are
in which type.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

from llamacpp_build import LlamaCpp

PRE_TOKENIZER = "qwen2"
WEIGHTS = ("bf16", "mxfp4")
QUANT_TYPES = ("MXFP4_MOE", "Q4_0")

# Runs llama.cpp's converter with the pre-tokenizer named (its hash check knows no tokenizer of ours).
_CONVERT = """
import sys
sys.path[:0] = [{source!r}, {source!r} + "/gguf-py"]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
convert_hf_to_gguf.main()
"""


@dataclass(frozen=True)
class Sides:
    """What both engines run: our checkpoint folder and its label, llama.cpp's GGUF files by type, and a line per
    side saying how many parameters are in which type."""

    model_dir: str
    ours: str
    ggufs: dict[str, str]
    contents: list[str]


def prepare(weights: str, llama: LlamaCpp, model_dir: str, out_dir: str) -> Sides:
    """The files of ``--weights`` made from the bf16 checkpoint in ``model_dir``, written under ``out_dir``."""
    print(f"converting with llama.cpp's converter (pre-tokenizer named {PRE_TOKENIZER!r} here)")
    if weights == "bf16":
        ggufs = {t: convert(llama, model_dir, t, out_dir) for t in ("f32", "bf16")}
        return Sides(model_dir, "sglang_lite", ggufs, [])
    bf16 = convert(llama, model_dir, "bf16", out_dir)
    ggufs = {q: quantize(llama, bf16, q, out_dir) for q in QUANT_TYPES}
    quark_dir = export_mxfp4(model_dir, os.path.join(out_dir, "quark"))
    contents = [f"sglang_lite (Quark MXFP4): {_counts(_checkpoint_types(quark_dir))}"]
    contents += [f"llama.cpp {q}: {_counts(gguf_types(llama, ggufs[q]))}" for q in QUANT_TYPES]
    return Sides(quark_dir, "sglang_lite MXFP4", ggufs, contents)


def convert(llama: LlamaCpp, model_dir: str, outtype: str, out_dir: str) -> str:
    path = os.path.join(out_dir, f"model-{outtype}.gguf")
    script = _CONVERT.format(source=llama.source, pre=PRE_TOKENIZER)
    command = [sys.executable, "-c", script, model_dir, "--outtype", outtype, "--outfile", path]
    command.append("--no-mtp")  # the random checkpoint has no multi-token-prediction head
    _run(command, "llama.cpp's converter")
    return path


def quantize(llama: LlamaCpp, gguf: str, qtype: str, out_dir: str) -> str:
    """``gguf`` quantized by ``llama-quantize`` to ``qtype`` (its ftype name, e.g. MXFP4_MOE)."""
    path = os.path.join(out_dir, f"model-{qtype.lower()}.gguf")
    command = [llama.tool("llama-quantize"), gguf, path, qtype]
    _run(command, f"llama-quantize {qtype}")
    return path


def _run(command: list[str], what: str) -> None:
    """``command`` run quietly; its last output lines when it fails."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed (status {done.returncode}):\n{done.stderr[-3000:]}")


def export_mxfp4(model_dir: str, quark_dir: str) -> str:
    from sglang_lite.quantization import quark_export

    print("exporting the checkpoint as AMD Quark MXFP4 (quantization/quark_export.py)")
    return quark_export.export(model_dir, quark_dir)


def gguf_types(llama: LlamaCpp, path: str) -> Counter:
    """A GGUF file's parameters by tensor type (read with llama.cpp's own gguf-py)."""
    sys.path.insert(0, os.path.join(llama.source, "gguf-py"))
    from gguf import GGUFReader

    types = Counter()
    for tensor in GGUFReader(path).tensors:
        types[tensor.tensor_type.name.lower()] += int(tensor.n_elements)
    return types


def _checkpoint_types(model_dir: str) -> Counter:
    """A Quark export's parameters by type: a uint8 weight with a scale beside it holds two fp4 a byte."""
    from safetensors import safe_open

    types = Counter()
    for entry in sorted(os.listdir(model_dir)):
        if entry.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, entry), "pt") as f:
                names = set(f.keys())
                for name in names - {n for n in names if n.endswith("_scale")}:
                    tensor = f.get_slice(name)
                    numel = math.prod(tensor.get_shape())
                    if name + "_scale" in names:
                        types["mxfp4"] += 2 * numel
                    else:
                        types[tensor.get_dtype().lower()] += numel
    return types


def _counts(types: Counter) -> str:
    """Parameters by type, most first, in millions."""
    return ", ".join(f"{count / 1e6:.1f}M {name}" for name, count in types.most_common())
