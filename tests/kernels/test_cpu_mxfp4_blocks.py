"""Decode steps on the CPU in one C++ call per block, or one for the whole model, with MXFP4 projections and experts
(``kernels/cpu/blocks.py``, ``model_executor/decode_blocks.py``): the same logits every step and the same pools after
it as the modules, which run each MXFP4 product on its own (``kernels.linear`` / ``fused_moe`` with
``weight_format="mxfp4"``). Every projection of the layers is MXFP4 here (the Gated DeltaNet's and attention's, the
shared expert's, the dense MLP's; only the routers stay float32), at the tiny model's awkward widths (48 inputs: a
group and a half; experts of 24). And the blocks stay off, saying why, where they cannot run MXFP4 layers.

The layers hand each MXFP4 weight to the blocks with its scales (``kernels.cpu.Weight.of`` and ``experts_of``, read
by ``layers/linear.py``'s ``weight_of`` and the MoE block's gathering).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_lite import load_model
from sglang_lite.kernels import cpu
from sglang_lite.kernels.quant import mxfp4
from sglang_lite.layers.quant import convert, quantizable_parameters
from sglang_lite.model_executor.decode_blocks import enable_decode_blocks
from sglang_lite.model_executor.weight_layout import store_input_major
from sglang_lite.quantization.mxfp4 import Mxfp4Scheme
from tests.hf_checkpoints import make_hf_model, save_checkpoint
from tests.kernels.utils import assert_rel_close
from tests.models.test_decode_blocks import _run

ROUTERS = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    cpu.require()


def _mxfp4_layers(model: torch.nn.Module) -> None:
    """Every projection and expert of the layers made MXFP4, quantized from its float32 weights (routers stay)."""
    names = {
        name
        for name in quantizable_parameters(model)
        if ".layers." in name and not name.endswith(ROUTERS)
    }
    originals = {name: p.detach().clone() for name, p in model.named_parameters() if name in names}
    convert(model, dict.fromkeys(names, Mxfp4Scheme()), "cpu")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in names:
            packed, scales = mxfp4.quantize(originals[name])
            params[name].copy_(packed)
            params[f"{name}_scale"].copy_(scales)


def _model(path: str, blocks: bool) -> torch.nn.Module:
    model = load_model(path)
    _mxfp4_layers(model)
    store_input_major(model)
    if blocks:
        assert enable_decode_blocks(model, torch_compile=False) == "on"
    return model


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_mxfp4_decode_blocks_match_the_modules(tmp_path, moe, page_size):
    path = save_checkpoint(make_hf_model(moe=moe, seed=5), str(tmp_path))
    modules = _model(path, blocks=False)
    layer = modules.model.layers[0]
    assert layer.linear_attn.out_proj.weight.dtype == torch.uint8
    assert (layer.mlp.experts.w13 if moe else layer.mlp.down_proj.weight).dtype == torch.uint8
    want, want_pools = _run(modules, page_size)
    got, got_pools = _run(_model(path, blocks=True), page_size)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_rel_close(g, w, torch.float32, f"logits of step {step}")
    for name in ("conv_buffer", "ssm_buffer"):
        g, w = getattr(got_pools.states, name), getattr(want_pools.states, name)
        assert_rel_close(g, w, torch.float32, name)
    assert_rel_close(got_pools.kv.buffer, want_pools.kv.buffer, torch.float32, "kv")


def test_mxfp4_whole_model_in_one_call_equals_a_call_per_block(tmp_path, monkeypatch):
    path = save_checkpoint(make_hf_model(moe=True, seed=6), str(tmp_path))
    model = _model(path, blocks=True)
    got, pools = _run(model, page_size=16)
    assert model.model._decode_layers.built[0] is pools
    monkeypatch.setattr(type(model.model), "decode_layers", lambda self, pools: None)
    want, _ = _run(model, page_size=16)
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"logits of step {step}"


@pytest.fixture
def mxfp4_path(tmp_path) -> str:
    return save_checkpoint(make_hf_model(moe=True, seed=7), str(tmp_path))


def test_mxfp4_blocks_stay_off_for_w4a4(mxfp4_path):
    """Activations quantized too (W4A4) are the modules' own step."""
    model = _model(mxfp4_path, blocks=False)
    proj = model.model.layers[3].self_attn.o_proj
    proj.scheme = dataclasses.replace(proj.scheme, activations=True)
    status = enable_decode_blocks(model, torch_compile=False)
    assert status == "off (model.layers.3.self_attn.o_proj: MXFP4 activations (W4A4))"


def test_a_quark_checkpoint_runs_in_the_blocks(tmp_path):
    """A Quark MXFP4 export kept packed (the engine's CPU load) runs its decode steps in the blocks."""
    from tests.models.test_mxfp4 import export

    path = export(make_hf_model(moe=True, seed=8), str(tmp_path))
    model = load_model(path, quantized_weights=True)
    store_input_major(model)
    assert enable_decode_blocks(model, torch_compile=False) == "on"
