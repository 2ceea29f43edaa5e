"""The files each side of ``bench_llamacpp.py`` runs, per ``--weights``: llama.cpp's GGUF files (its converter, then
``llama-quantize``) and the checkpoint folder our Engine serves.

``bf16``: our Engine on the bf16 checkpoint; llama.cpp on its f32 and bf16 conversions of it.

``mxfp4``: our Engine on the same weights exported as AMD Quark MXFP4 (``quantization/quark_export.py``: the routed
and shared experts and the full-attention projections fp4 with e8m0 scales per 32; routers, linear attention,
embeddings and the LM head bf16); llama.cpp on the bf16 GGUF quantized by ``llama-quantize`` three ways:

- ``MXFP4 (our tensors)``: each matrix in the type ours has: the expert stacks (``ffn_*_exps``), the shared expert
  (``ffn_*_shexp``) and the full-attention projections (``attn_q/k/v/output``) MXFP4, everything else as the bf16
  GGUF holds it: the LM head, the embeddings and the linear attention's matrices bf16; norms, the GDN's conv1d, A
  and dt, and the routers (``ffn_gate_inp``, ``ffn_gate_inp_shexp``) f32, as llama.cpp's converter writes them
  (ours holds those bf16; llama-quantize never touches them). MXFP4 in GGUF needs rows of a multiple of 32; a
  matrix of ours with other rows (Quark pads its last group) stays bf16 here, and the table says which.
- ``MXFP4_MOE``: its expert stacks MXFP4, every other matrix Q8_0, the LM head included.
- ``Q4_0``: most matrices Q4_0, the LM head Q6_K.

The table says how many parameters of each file are in which type.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

from llamacpp_build import LlamaCpp

PRE_TOKENIZER = "qwen2"
WEIGHTS = ("bf16", "mxfp4")
QUANT_TYPES = ("MXFP4_MOE", "Q4_0")
OUR_TENSORS = "MXFP4 (our tensors)"
# What Quark's export (quantization/mxfp4.py's DEFAULT_EXCLUDE) stores in MXFP4, by llama.cpp's names: not the
# linear attention's attn_qkv / attn_gate / ssm_out, not the routers. ECMAScript syntax too (llama-quantize's).
OUR_MXFP4 = re.compile(r"\.(ffn_(gate|up|down)_(exps|shexp)|attn_(q|k|v|output))\.weight$")

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
    ours, kept = quantize_as_ours(llama, bf16, out_dir)
    ggufs = {OUR_TENSORS: ours, **{q: quantize(llama, bf16, q, out_dir) for q in QUANT_TYPES}}
    quark_dir = export_mxfp4(model_dir, os.path.join(out_dir, "quark"))
    contents = [f"sglang_lite (Quark MXFP4): {_counts(_checkpoint_types(quark_dir))}"]
    for name, path in ggufs.items():
        note = f" ({_kept_line(kept)})" if name == OUR_TENSORS else ""
        contents.append(f"llama.cpp {name}: {_counts(gguf_types(llama, path))}{note}")
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


def quantize_as_ours(llama: LlamaCpp, gguf: str, out_dir: str) -> tuple[str, dict[str, int]]:
    """``gguf`` (bf16) with each tensor in the type ours has (``OUR_TENSORS``), checked tensor by tensor; the path
    and the row lengths of the OUR_MXFP4 matrices kept bf16 because MXFP4 cannot hold their rows."""
    rows = {t.name: int(t.shape[0]) for t in _tensors(llama, gguf) if OUR_MXFP4.search(t.name)}
    block = _mxfp4_block(llama)
    kept = {name: row for name, row in rows.items() if row % block}
    path = os.path.join(out_dir, "model-mxfp4-ours.gguf")
    command = [llama.tool("llama-quantize"), *_ours_options(kept), gguf, path, "MXFP4_MOE"]
    _run(command, f"llama-quantize {OUR_TENSORS}")
    _check_types(llama, gguf, path, kept)
    return path, kept


def _ours_options(kept: dict[str, int]) -> list[str]:
    """llama-quantize's options for ``OUR_TENSORS``, under the base type MXFP4_MOE: --tensor-type applies only under
    a quantized base type (a BF16 base ignores it), and its first matching pattern wins, so the names kept bf16 come
    first and a catch-all bf16 last (the base would make every other matrix Q8_0). Tensors it never quantizes
    (norms, routers, conv1d, 1-D) stay as the bf16 GGUF has them."""
    patterns = [f"^{re.escape(name)}$=bf16" for name in kept]
    patterns += [f"{OUR_MXFP4.pattern}=mxfp4", ".=bf16"]
    options = ["--output-tensor-type", "bf16", "--token-embedding-type", "bf16"]
    for pattern in patterns:
        options += ["--tensor-type", pattern]
    return options


def _check_types(llama: LlamaCpp, bf16: str, path: str, kept: dict[str, int]) -> None:
    """Stops unless every tensor of ``path`` has the type planned: MXFP4 for OUR_MXFP4 (but ``kept``), else the
    bf16 GGUF's."""
    planned = {t.name: t.tensor_type.name for t in _tensors(llama, bf16)}
    for name in planned:
        if OUR_MXFP4.search(name) and name not in kept:
            planned[name] = "MXFP4"
    got = {t.name: t.tensor_type.name for t in _tensors(llama, path)}
    wrong = [f"{n} {got.get(n)} (planned {t})" for n, t in planned.items() if got.get(n) != t]
    if wrong or len(got) != len(planned):
        raise SystemExit(
            f"llama-quantize {OUR_TENSORS} wrote other types: {', '.join(wrong) or 'extra tensors'}"
        )


def _kept_line(kept: dict[str, int]) -> str:
    """Which matrices of ours MXFP4 stayed bf16 in llama.cpp, per layer kind."""
    if not kept:
        return "every matrix MXFP4 in ours MXFP4 here too"
    kinds = {re.sub(r"blk\.\d+\.", "blk.*.", name): row for name, row in kept.items()}
    listed = ", ".join(f"{kind} (rows of {row})" for kind, row in kinds.items())
    return f"kept bf16, rows that are not whole MXFP4 blocks of GGUF: {listed}"


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
    """A GGUF file's parameters by tensor type."""
    types = Counter()
    for tensor in _tensors(llama, path):
        types[tensor.tensor_type.name.lower()] += int(tensor.n_elements)
    return types


def _tensors(llama: LlamaCpp, path: str) -> list:
    """A GGUF file's tensors (gguf-py's ReaderTensor: name, type, shape innermost first), read with llama.cpp's
    own gguf-py."""
    _import_gguf(llama)
    from gguf import GGUFReader

    return list(GGUFReader(path).tensors)


def _mxfp4_block(llama: LlamaCpp) -> int:
    """How many values of a row one MXFP4 block of GGUF holds (rows are whole blocks)."""
    _import_gguf(llama)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType.MXFP4][0]


def _import_gguf(llama: LlamaCpp) -> None:
    gguf_py = os.path.join(llama.source, "gguf-py")
    if gguf_py not in sys.path:
        sys.path.insert(0, gguf_py)


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
