"""Block-FP8 checkpoints (Qwen's ``quantization_config``: e4m3 weights in 128x128 blocks with ``weight_scale_inv``)
load to the logits and greedy tokens of transformers running the dequantized weights.

The checkpoints are built here from tiny transformers models: every linear projection but the ones
``modules_to_not_convert`` names is quantized into e4m3 blocks (partial ones: the tiny sizes are not multiples of
the block), and the reference is the same transformers model with the dequantized weights loaded back.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_lite import Engine, load_model
from sglang_lite.kernels.quant import dequantize_blocks, quantize_blocks
from sglang_lite.layers.quant import QuantLinear, QuantSparseMoeBlock
from sglang_lite.models.weights import CheckpointError
from sglang_lite.server_args import ServerArgs
from tests.hf_checkpoints import make_hf_model, save_checkpoint

NOT_CONVERTED = [
    "lm_head",
    "mlp.gate",
    "mlp.shared_expert_gate",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_b",
    "model.visual",
]
CASES = {  # name -> (make_hf_model options, checkpoint layout, weight block)
    "moe-vl-128": (dict(moe=True), "vl", (128, 128)),
    "moe-text-8x16": (dict(moe=True, seed=4), "text", (8, 16)),
    "dense-odd-dims": (
        dict(
            moe=False,
            linear_num_key_heads=1,
            linear_num_value_heads=3,
            linear_key_head_dim=18,
            linear_value_head_dim=14,
            head_dim=40,
            intermediate_size=136,
            hidden_size=144,
            tie_word_embeddings=True,
        ),
        "text",
        (128, 128),
    ),
    "moe-fused-shared-odd": (
        dict(moe=True, shared_expert_intermediate_size=24, hidden_size=136),
        "vl",
        (128, 128),
    ),
}
# the tiny models' packed sizes are all multiples of 8x16 blocks (not of 128x128 ones): the blocks fit the parameters
ALIGNED_BLOCKS = {(8, 16)}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (
        (actual.double() - expected.double()).abs().max() / expected.double().abs().max()
    ).item()


def quantizable(name: str) -> bool:
    """A linear projection's weight that ``NOT_CONVERTED`` does not name."""
    module = name.removesuffix(".weight")
    return "proj" in module.rsplit(".", 1)[-1] and not any(
        f".{p}." in f".{module}." for p in NOT_CONVERTED
    )


def _per_expert(name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' fused expert parameter as the per-expert matrices its checkpoint stores (views of it)."""
    layer, kind = name.rsplit(".", 1)
    if kind == "down_proj":
        return {f"{layer}.{e}.down_proj.weight": param[e] for e in range(param.shape[0])}
    inter = param.shape[1] // 2
    return {
        f"{layer}.{e}.{part}_proj.weight": param[e, rows]
        for e in range(param.shape[0])
        for part, rows in (("gate", slice(0, inter)), ("up", slice(inter, None)))
    }


def make_fp8_checkpoint(
    hf: torch.nn.Module, path: str, layout: str = "text", block: tuple[int, int] = (128, 128)
) -> str:
    """Quantizes ``hf``'s projections into e4m3 blocks, loads the dequantized weights back into ``hf`` (the
    reference) and saves the FP8 checkpoint (``weight`` + ``weight_scale_inv``) in ``layout`` at ``path``."""
    quantized = {}
    with torch.no_grad():
        for name, param in hf.named_parameters():
            matrices = _per_expert(name, param.data) if ".experts." in name else {name: param.data}
            for matrix_name, matrix in matrices.items():
                if quantizable(matrix_name):
                    fp8, scale = quantize_blocks(matrix, block, torch.float8_e4m3fn)
                    quantized[matrix_name] = (fp8, scale)
                    matrix.copy_(dequantize_blocks(fp8, scale, block))
    save_checkpoint(hf, path, layout)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in list(tensors):
        hf_name = name.replace("model.language_model.", "model.")
        if hf_name in quantized:
            tensors[name], tensors[name + "_scale_inv"] = quantized[hf_name]
    save_file(tensors, file)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    # a VL wrapper keeps quantization_config at its top level, as Qwen's FP8 releases do
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": NOT_CONVERTED,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    options, layout, block = CASES[request.param]
    hf = make_hf_model(**options)
    path = make_fp8_checkpoint(hf, str(tmp_path_factory.mktemp(request.param)), layout, block)
    return hf, path, block


def test_checkpoint_is_fp8(checkpoint):
    _, path, _ = checkpoint
    tensors = load_file(os.path.join(path, "model.safetensors"))
    qkv = next(v for k, v in tensors.items() if k.endswith("linear_attn.in_proj_qkv.weight"))
    assert qkv.dtype == torch.float8_e4m3fn
    experts = [k for k in tensors if ".layers.0.mlp.experts.0." in k]
    assert len(experts) in (0, 6) and all(
        tensors[k.removesuffix("_scale_inv")].dtype == torch.float8_e4m3fn for k in experts
    ), "per-expert FP8 weights with their scales"


@pytest.mark.parametrize("seq_len", [1, 65])
def test_float32_logits_match_dequantized_transformers(checkpoint, seq_len):
    hf, path, _ = checkpoint
    model = load_model(path, dtype=torch.float32)
    assert not any(isinstance(m, QuantLinear) for m in model.modules()), (
        "the CPU dequantizes at load"
    )
    ids = torch.randint(
        0, hf.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seq_len)
    )
    with torch.no_grad():
        expected = hf(ids).logits
    assert relative_error(model(ids), expected) < 1e-4


def test_fp8_weights_in_memory_hold_the_checkpoint_blocks(checkpoint):
    """The GPU layout (weights FP8, scales beside them, block GEMM with per-token-group activation scales), run
    on the CPU with the PyTorch reference: logits within FP8 activation rounding of the dequantized model. Packed
    sizes that are not multiples of the block (the 128x128 cases) would put two checkpoint tensors' rows in one
    block of the parameter, which would need a second FP8 rounding: refused, naming the tensor and the sizes."""
    hf, path, block = checkpoint
    if block not in ALIGNED_BLOCKS:
        message = (
            r"tensor '.*linear_attn.in_proj_qkv.weight' \(\d+, \d+\) .* loads as block-FP8 in 128x128 "
            r"blocks, but .*shard size \(\d+, \d+\)\) goes to rows .* of parameter "
            r"'model.layers.0.linear_attn.in_proj_qkvz.weight'"
        )
        with pytest.raises(CheckpointError, match=message):
            load_model(path, quantized_weights=True)
        return
    model = load_model(path, quantized_weights=True)
    fp8 = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert fp8 and all(m.weight.dtype == torch.float8_e4m3fn for m in fp8)
    assert isinstance(
        model.model.layers[0].mlp, QuantSparseMoeBlock
    ) == hf.config.model_type.endswith("moe_text")
    gdn = model.model.layers[0].linear_attn
    assert isinstance(gdn.in_proj_qkvz, QuantLinear) and not isinstance(gdn.in_proj_ba, QuantLinear)
    hf_gdn = hf.model.layers[0].linear_attn
    packed = torch.cat([hf_gdn.in_proj_qkv.weight, hf_gdn.in_proj_z.weight])
    stored = dequantize_blocks(gdn.in_proj_qkvz.weight, gdn.in_proj_qkvz.weight_scale_inv, block)
    assert torch.equal(stored, packed), "the checkpoint's blocks, copied as they are"
    ids = torch.randint(
        0, hf.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        expected = hf(ids).logits
    assert relative_error(model(ids), expected) < 0.1


def test_bfloat16_load_equals_the_dequantized_checkpoint_in_bfloat16(checkpoint, tmp_path):
    """Dequantizing is exact, so rounding to bfloat16 afterwards gives the plain checkpoint's bfloat16 model."""
    hf, path, _ = checkpoint
    plain = save_checkpoint(hf, str(tmp_path))
    ids = torch.randint(
        0, hf.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(2)
    )
    assert torch.equal(
        load_model(path, dtype=torch.bfloat16)(ids), load_model(plain, dtype=torch.bfloat16)(ids)
    )


def test_engine_greedy_tokens_match_dequantized_transformers(tmp_path):
    hf = make_hf_model(moe=True, seed=7)
    path = make_fp8_checkpoint(hf, str(tmp_path), "vl")
    prompts = [[3, 17, 42, 99, 150, 7, 61, 88, 120, 5, 33], [9, 140, 2, 77]]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with Engine(
        path, skip_tokenizer_init=True, max_total_tokens=512, max_running_requests=4
    ) as engine:
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
            )
        assert out["output_ids"] == expected[0, len(prompt) :].tolist()


def test_quantization_none_dequantizes_and_an_unknown_one_is_refused(tmp_path):
    """``none`` dequantizes even where FP8 weights would fit (``fp8`` on a plain checkpoint quantizes it at load:
    tests/models/test_fp8_online.py)."""
    hf = make_hf_model(moe=False, seed=2)
    fp8_path = make_fp8_checkpoint(hf, str(tmp_path / "fp8"))
    model = load_model(
        fp8_path, quantized_weights=True, server_args=ServerArgs(quantization="none")
    )
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(fp8_path, quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        ServerArgs(quantization="int4")


def _rewrite(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


QKV = "model.layers.0.linear_attn.in_proj_qkv.weight"


def test_checkpoint_errors_name_the_tensor(tmp_path):
    hf = make_hf_model(moe=False, seed=2)
    path = make_fp8_checkpoint(hf, str(tmp_path))
    _rewrite(path, lambda t: t.pop(QKV + "_scale_inv"))
    with pytest.raises(CheckpointError, match=f"tensor '{QKV}' .* is FP8 .* no '{QKV}_scale_inv'"):
        load_model(path)
    _rewrite(path, lambda t: t.update({QKV + "_scale_inv": torch.ones(2, 2)}))
    with pytest.raises(
        CheckpointError, match=f"shape mismatch for tensor '{QKV}_scale_inv'.*expected \\(1, 1\\)"
    ):
        load_model(path)
    a_name = "model.layers.0.linear_attn.in_proj_a.weight"
    _rewrite(
        path,
        lambda t: t.update(
            {QKV + "_scale_inv": torch.ones(1, 1), a_name + "_scale_inv": torch.ones(1, 1)}
        ),
    )
    with pytest.raises(CheckpointError, match=f"'{a_name}' .*modules_to_not_convert lists it"):
        load_model(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(
        CheckpointError, match="unexpected tensor .*_scale_inv.* no quantization_config"
    ):
        load_model(path)


def test_server_info_says_the_quantization(tmp_path):
    from types import SimpleNamespace

    from sglang_lite.server.model_info import server_info_of

    path = make_fp8_checkpoint(make_hf_model(moe=False, seed=2), str(tmp_path))
    limits = SimpleNamespace(context_length=64, max_total_tokens=64, max_running_requests=1)
    manager = SimpleNamespace(config=limits, rank_pids=[], alt_stream_plan=None)
    info = server_info_of(manager, ServerArgs(model_path=path))
    assert info["quantization"] == "fp8"
    assert info["quantization_config"].startswith(
        "fp8 (e4m3, 128x128 weight blocks, dynamic activation scales)"
    )
    assert (
        server_info_of(manager, ServerArgs(model_path=path, quantization="none"))["quantization"]
        == "none"
    )
    # the built-in plain model
    assert server_info_of(manager, ServerArgs())["quantization"] == "none"
    online = server_info_of(manager, ServerArgs(quantization="fp8"))  # quantized at load
    assert online["quantization"] == "fp8" and online["quantization_config"].startswith("fp8")
