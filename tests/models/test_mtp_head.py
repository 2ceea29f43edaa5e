"""Loading the MTP head (dense, MoE, VL-prefixed, sharded, fused experts, FP8) and its logits against a
transformers reference built from the same tensors (transformers has no MTP module: see
``tests.hf_checkpoints.add_mtp_head``)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_lite.forward_batch import ForwardMode, build_forward_batch
from sglang_lite.kernels.quant import dequantize_blocks, quantize_blocks
from sglang_lite.layers.quant import QuantLinear
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.models.checkpoint import CheckpointError
from sglang_lite.models.loader import load_model
from tests.hf_checkpoints import (
    add_mtp_head,
    make_hf_model,
    mtp_reference_logits,
    save_checkpoint,
)
from tests.models.test_fp8 import make_fp8_checkpoint, relative_error

LAYOUTS = [
    (True, "text"),
    (True, "vl"),
    (True, "fused_experts"),
    (False, "text"),
    (False, "sharded"),
]


def mtp_logits(model, prompt: list[int], next_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(main logits, head logits) [T, vocab] over ``prompt``: the head at position i takes the token after it."""
    pools = ModelPools.create(model.config, 64, 1, 64, torch.float32, "cpu", draft_layers=1)
    rows, slots = pools.req_to_token.allocator.alloc(1), pools.states.alloc(1)
    kv = pools.alloc_kv(rows, [0], [len(prompt)])
    batch = build_forward_batch(pools, ForwardMode.EXTEND, [prompt], [0], rows, slots, "cpu", kv)
    hidden = model.forward_hidden(batch)
    shifted = prompt[1:] + [next_token]
    mtp_batch = build_forward_batch(
        pools, ForwardMode.EXTEND, [shifted], [0], rows, slots, "cpu", kv
    )
    with torch.no_grad():
        return model.logits(hidden), model.logits(model.mtp(mtp_batch, hidden))


@pytest.mark.parametrize("moe,layout", LAYOUTS)
def test_mtp_head_matches_reference(tmp_path, moe, layout):
    hf = make_hf_model(moe=moe, seed=5)
    path = save_checkpoint(hf, str(tmp_path / "ckpt"), layout)
    head = add_mtp_head(hf, path, seed=6)
    model = load_model(path, with_mtp=True)
    prompt = [5, 17, 99, 3, 42, 8, 150, 77]
    main_logits, head_logits = mtp_logits(model, prompt, next_token=11)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    torch.testing.assert_close(main_logits, out.logits[0], rtol=1e-4, atol=1e-4)
    # transformers' last hidden state is after the final norm, which is what the head takes
    reference = mtp_reference_logits(head, out.hidden_states[-1][0], prompt[1:] + [11])
    torch.testing.assert_close(head_logits, reference, rtol=1e-4, atol=1e-4)


def test_default_loading_skips_the_head(tmp_path):
    hf = make_hf_model(moe=True, seed=5)
    path = save_checkpoint(hf, str(tmp_path / "ckpt"))
    add_mtp_head(hf, path)
    assert not hasattr(load_model(path), "mtp")


def test_missing_and_misshaped_head_tensors_are_named(tmp_path):
    hf = make_hf_model(moe=False, seed=5)
    path = save_checkpoint(hf, str(tmp_path / "ckpt"))
    add_mtp_head(hf, path)
    file = str(tmp_path / "ckpt" / "model.safetensors")
    tensors = load_file(file)
    tensors["mtp.fc.weight"] = tensors["mtp.fc.weight"][:, :10].contiguous()
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match="mtp.fc.weight"):
        load_model(path, with_mtp=True)
    del tensors["mtp.norm.weight"]
    tensors["mtp.fc.weight"] = torch.randn(48, 2 * 48)
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match="missing tensor 'mtp.norm.weight'"):
        load_model(path, with_mtp=True)


def test_a_checkpoint_without_a_head_is_refused(tmp_path):
    path = save_checkpoint(make_hf_model(moe=False, seed=5), str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
        load_model(path, with_mtp=True)


def quantize_head(path: str, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Quantizes the checkpoint's MTP projections (``fc`` too) into e4m3 blocks, as the rest of an FP8
    checkpoint; returns their dequantized values by name."""
    file = f"{path}/model.safetensors"
    tensors = load_file(file)
    dequantized = {}
    for name in [n for n in tensors if n.startswith("mtp.") and tensors[n].dim() == 2]:
        if name.endswith(("gate.weight", "shared_expert_gate.weight")):
            continue  # routers stay high precision (NOT_CONVERTED)
        fp8, scale = quantize_blocks(tensors[name], block, torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = fp8, scale
        dequantized[name] = dequantize_blocks(fp8, scale, block)
    save_file(tensors, file)
    return dequantized


def test_fp8_head_loads_like_its_dequantized_weights(tmp_path):
    block = (8, 16)
    hf = make_hf_model(moe=True, seed=4)
    fp8_path = make_fp8_checkpoint(hf, str(tmp_path / "fp8"), "text", block)
    add_mtp_head(hf, fp8_path, seed=6)
    dequantized = quantize_head(fp8_path, block)
    plain_path = str(tmp_path / "dequantized")
    shutil.copytree(fp8_path, plain_path)
    tensors = load_file(f"{plain_path}/model.safetensors")
    for name, value in dequantized.items():
        tensors[name] = value
        del tensors[name + "_scale_inv"]
    save_file(tensors, f"{plain_path}/model.safetensors")
    prompt = [5, 17, 99, 3, 42, 8, 150, 77]
    _, expected = mtp_logits(load_model(plain_path, with_mtp=True), prompt, 11)
    _, dequantized_at_load = mtp_logits(load_model(fp8_path, with_mtp=True), prompt, 11)
    torch.testing.assert_close(dequantized_at_load, expected, rtol=1e-5, atol=1e-5)
    kept = load_model(fp8_path, with_mtp=True, quantized_weights=True)
    assert isinstance(kept.mtp.fc, QuantLinear)
    _, in_fp8 = mtp_logits(kept, prompt, 11)
    assert relative_error(in_fp8, expected) < 0.05
