"""Online FP8: ``--quantization fp8`` on a bf16 / float32 checkpoint without quantization_config quantizes, at load,
every linear projection and expert the block-FP8 checkpoints quantize (not the LM head, the routers or the GDN a/b
projections) into 128x128 e4m3 blocks laid over each checkpoint tensor, as the export of such a checkpoint does.
So the model is the one the exported FP8 checkpoint gives: on the CPU dequantized at load (equal logits), kept FP8
in memory (the GPU layout, run here with the PyTorch reference) the same blocks the CPU dequantizes."""

from __future__ import annotations

import pytest
import torch

from sglang_lite import load_model
from sglang_lite.config import ModelConfig, quantization_config_in_use, quantization_in_use
from sglang_lite.kernels.quant import dequantize_blocks
from sglang_lite.layers.quant import QuantLinear, QuantSparseMoeBlock
from sglang_lite.models.weights import CheckpointError
from tests.hf_checkpoints import make_hf_model, save_checkpoint
from tests.models.test_fp8 import make_fp8_checkpoint, relative_error

# every packed size a multiple of 128 (as in the released models): the FP8 blocks fit the parameters
ALIGNED_128 = dict(
    moe=True,
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    num_experts=4,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
)
CASES = {  # name -> (make_hf_model options, checkpoint dtype, layout)
    "moe-vl-float32": (dict(moe=True, seed=5), torch.float32, "vl"),
    "moe-bfloat16": (
        dict(moe=True, seed=6, shared_expert_intermediate_size=24),
        torch.bfloat16,
        "text",
    ),
    "dense-tied-bfloat16": (
        dict(moe=False, seed=7, tie_word_embeddings=True),
        torch.bfloat16,
        "text",
    ),
}


def checkpoints(tmp_path, options: dict, dtype: torch.dtype, layout: str = "text"):
    """(the plain checkpoint in ``dtype``, its FP8 export, transformers with the export's dequantized weights)."""
    hf = make_hf_model(**options).to(dtype)
    plain = save_checkpoint(hf, str(tmp_path / "plain"), layout)
    reference = hf.float()
    exported = make_fp8_checkpoint(reference, str(tmp_path / "fp8"), layout)
    return plain, exported, reference


def token_ids(vocab_size: int, seq_len: int = 33) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", sorted(CASES))
def test_online_fp8_equals_the_exported_fp8_checkpoint(tmp_path, case):
    options, dtype, layout = CASES[case]
    plain, exported, reference = checkpoints(tmp_path, options, dtype, layout)
    online = load_model(plain, quantization="fp8")
    assert not any(isinstance(m, QuantLinear) for m in online.modules()), (
        "the CPU dequantizes at load"
    )
    ids = token_ids(reference.config.vocab_size)
    logits = online(ids)
    with torch.no_grad():
        assert relative_error(logits, reference(ids).logits) < 1e-4
    assert torch.equal(logits, load_model(exported)(ids))
    assert not torch.equal(logits, load_model(plain)(ids)), "the weights were quantized"
    config = ModelConfig.from_hf(plain)
    assert (
        quantization_in_use(config, "fp8") == "fp8" and quantization_in_use(config, None) == "none"
    )
    assert quantization_config_in_use(config, "fp8").describe() == (
        "fp8 (e4m3, 128x128 weight blocks, dynamic activation scales, quantized at load)"
    )


def test_online_fp8_in_memory_holds_what_the_cpu_dequantizes(tmp_path):
    plain, exported, reference = checkpoints(tmp_path, ALIGNED_128, torch.bfloat16)
    fp8 = load_model(plain, quantization="fp8", quantized_weights=True)
    dequantized = dict(load_model(plain, quantization="fp8").named_parameters())
    layers = [m for m in fp8.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    assert all(isinstance(layer.mlp, QuantSparseMoeBlock) for layer in fp8.model.layers)
    gdn, mlp = fp8.model.layers[0].linear_attn, fp8.model.layers[0].mlp
    assert isinstance(gdn.in_proj_qkvz, QuantLinear) and not isinstance(gdn.in_proj_ba, QuantLinear)
    assert not isinstance(mlp.gate, QuantLinear) and not isinstance(fp8.lm_head, QuantLinear)
    for name, param in fp8.named_parameters():
        if param.dtype == torch.float8_e4m3fn:
            scales = fp8.get_parameter(name + "_scale_inv")
            assert torch.equal(dequantize_blocks(param, scales, (128, 128)), dequantized[name]), (
                name
            )
    ids = token_ids(reference.config.vocab_size)
    logits = fp8(ids)
    assert torch.equal(logits, load_model(exported, quantized_weights=True)(ids))
    with torch.no_grad():
        expected = reference(ids).logits
    # activations are quantized to FP8 per group of 128 columns: within their rounding of the dequantized model
    assert relative_error(logits, expected) < 0.25


def test_online_fp8_in_memory_refuses_packed_sizes_that_cut_a_block(tmp_path):
    """A tiny model's q/k/v and z rows share 128-row blocks of the packed parameter: as for an FP8 checkpoint."""
    plain = save_checkpoint(make_hf_model(moe=True), str(tmp_path))
    with pytest.raises(
        CheckpointError, match=r"in_proj_qkv.weight' \(88, 48\) .* loads as block-FP8"
    ):
        load_model(plain, quantization="fp8", quantized_weights=True)
