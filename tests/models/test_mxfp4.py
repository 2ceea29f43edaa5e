"""AMD Quark MXFP4 checkpoints (``quant_method: "quark"``, fp4 per 32-group with e8m0 scales) load to the logits
and greedy tokens of transformers running the dequantized weights; W4A4 rounds activations too; what a config asks
for and this code does not serve is refused at load, naming the field.

The checkpoints are tiny transformers models exported by ``quantization/quark_export.py`` (experts, shared experts
and full-attention projections MXFP4; routers, linear attention, embeddings and lm_head excluded), and the
reference is the same transformers model with the exported weights dequantized and loaded back.
"""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from sglang_lite import Engine, load_model
from sglang_lite.kernels.quant import mxfp4
from sglang_lite.layers.quant import QuantLinear, QuantSparseMoeBlock
from sglang_lite.models.weights import CheckpointError
from sglang_lite.quantization import quark_export
from sglang_lite.server_args import ServerArgs
from tests.hf_checkpoints import greedy_tokens, make_hf_model, save_checkpoint

CASES = {  # name -> (make_hf_model options, checkpoint layout)
    "moe-text": (dict(moe=True), "text"),
    "moe-vl": (dict(moe=True, seed=3, hidden_size=64, moe_intermediate_size=32), "vl"),
    "moe-fused-experts": (dict(moe=True, seed=5), "fused_experts"),
}
PROMPT = [3, 17, 42, 9, 101, 5, 77]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (
        (actual.double() - expected.double()).abs().max() / expected.double().abs().max()
    ).item()


def export(hf: torch.nn.Module, path: str, layout: str = "text", w4a4: bool = False) -> str:
    """``hf`` saved in ``layout`` and exported as Quark MXFP4 into ``path``/mxfp4; ``hf`` then holds the
    dequantized weights (the reference)."""
    plain = os.path.join(path, "plain")
    save_checkpoint(hf, plain, layout)
    out = quark_export.export(plain, os.path.join(path, "mxfp4"), w4a4=w4a4)
    load_dequantized(hf, out)
    return out


def load_dequantized(hf: torch.nn.Module, path: str) -> None:
    """Copies each quantized tensor of the export, dequantized, into transformers' parameter it came from."""
    tensors = {}
    for file in os.listdir(path):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, file)))
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, scales in tensors.items():
            if name.endswith("_scale"):
                weight = name.removesuffix("_scale")
                value = mxfp4.dequantize(tensors[weight], scales)
                _hf_matrix(params, weight.replace("model.language_model.", "model.")).copy_(value)


def _hf_matrix(params: dict, name: str) -> torch.Tensor:
    """transformers' parameter (or the part of its fused experts) a checkpoint matrix is."""
    if ".experts." not in name or name.endswith(("gate_up_proj", "down_proj")):
        return params[name].data
    layer, expert, proj, _ = name.rsplit(".", 3)
    if proj == "down_proj":
        return params[f"{layer}.down_proj"].data[int(expert)]
    fused = params[f"{layer}.gate_up_proj"].data[int(expert)]
    inter = fused.shape[0] // 2
    return fused[:inter] if proj == "gate_proj" else fused[inter:]


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    options, layout = CASES[request.param]
    hf = make_hf_model(**options)
    path = export(hf, str(tmp_path_factory.mktemp(request.param)), layout)
    return hf, path


def test_checkpoint_is_quark_mxfp4(checkpoint):
    _, path = checkpoint
    tensors = load_file(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["quantization_config"]["quant_method"] == "quark"
    q_proj = next(k for k in tensors if k.endswith("self_attn.q_proj.weight"))
    assert tensors[q_proj].dtype == torch.uint8 and tensors[q_proj + "_scale"].dtype == torch.uint8
    assert not any(k.endswith("linear_attn.in_proj_qkv.weight_scale") for k in tensors)


@pytest.mark.parametrize("kept", [True, False], ids=["kept-mxfp4", "dequantized"])
@pytest.mark.parametrize("seq_len", [1, 65])
def test_float32_logits_match_dequantized_transformers(checkpoint, kept, seq_len):
    hf, path = checkpoint
    model = load_model(path, dtype=torch.float32, quantized_weights=kept)
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert bool(quantized) == kept
    if kept:
        assert all(m.weight.dtype == torch.uint8 and m.weight_format == "mxfp4" for m in quantized)
        assert all(isinstance(layer.mlp, QuantSparseMoeBlock) for layer in model.model.layers)
        assert not model.model.layers[0].mlp.fuse_shared_expert, (
            "MXFP4 runs the shared expert apart"
        )
    ids = torch.randint(
        0, hf.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seq_len)
    )
    with torch.no_grad():
        expected = hf(ids).logits
    assert relative_error(model(ids), expected) < 1e-4


def test_engine_greedy_tokens_match_dequantized_transformers(checkpoint):
    hf, path = checkpoint
    expected = greedy_tokens(hf, PROMPT, 12)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with Engine(
        path, skip_tokenizer_init=True, max_total_tokens=512, max_running_requests=4
    ) as engine:
        out = engine.generate(input_ids=PROMPT, sampling_params=params)
    assert out["output_ids"] == expected


def test_online_mxfp4_is_the_export(tmp_path):
    """``--quantization mxfp4`` on the high-precision checkpoint quantizes at load exactly what the export holds."""
    hf = make_hf_model(moe=True, seed=7)
    plain = save_checkpoint(hf, str(tmp_path / "plain"))
    exported = quark_export.export(plain, str(tmp_path / "mxfp4"))
    ids = torch.tensor([PROMPT])
    for kept in (True, False):
        online = load_model(plain, quantization="mxfp4", quantized_weights=kept)
        assert any(isinstance(m, QuantLinear) for m in online.modules()) == kept
        assert torch.equal(online(ids), load_model(exported, quantized_weights=kept)(ids))


def test_w4a4_rounds_activations_through_mxfp4(tmp_path):
    hf = make_hf_model(moe=True, seed=2)
    w4a16 = export(hf, str(tmp_path / "a16"))
    w4a4 = quark_export.export(str(tmp_path / "a16" / "plain"), str(tmp_path / "a4"), w4a4=True)
    model = load_model(w4a4, quantized_weights=True)
    layer = next(m for m in model.modules() if isinstance(m, QuantLinear))
    assert layer.scheme.activations
    x = torch.randn(3, layer.in_features)
    expected = F.linear(
        mxfp4.quantize_dequantize(x), mxfp4.dequantize(layer.weight, layer.weight_scale)
    )
    assert relative_error(layer(x), expected) < 1e-5
    ids = torch.tensor([PROMPT])
    logits, weight_only = model(ids), load_model(w4a16, quantized_weights=True)(ids)
    assert not torch.equal(logits, weight_only), "the activations are quantized"
    assert relative_error(logits, weight_only) < 0.5


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda q: q["global_quant_config"]["weight"].update(dtype="fp6_e3m2"), "weight.dtype"),
        (lambda q: q["global_quant_config"]["weight"].update(group_size=16), "weight.group_size"),
        (
            lambda q: q["global_quant_config"].update(input_tensors=_static_fp4()),
            "input_tensors.is_dynamic",
        ),
        (lambda q: q["global_quant_config"].update(output_tensors=_static_fp4()), "output_tensors"),
        (lambda q: q["global_quant_config"].update(bias=_static_fp4()), "bias"),
        (lambda q: q.update(kv_cache_quant_config={"*k_proj": {"dtype": "fp8_e4m3"}}), "kv_cache"),
        (lambda q: q.update(quant_method="awq"), "quant_method"),
    ],
    ids=["fp6", "group-16", "static-inputs", "outputs", "bias", "kv-cache", "method"],
)
def test_unsupported_quark_configs_are_refused_naming_the_field(
    checkpoint, tmp_path, change, field
):
    _, path = checkpoint
    changed = str(tmp_path / "changed")
    os.makedirs(changed)
    for entry in os.listdir(path):
        os.symlink(os.path.join(path, entry), os.path.join(changed, entry))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    quant = config["quantization_config"]
    change(quant)
    os.remove(os.path.join(changed, "config.json"))
    with open(os.path.join(changed, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=field):
        load_model(changed)


def _static_fp4() -> dict:
    return quark_export.fp4_spec(dynamic=False)


def test_packed_weight_without_scales_is_refused(tmp_path):
    hf = make_hf_model(moe=True, seed=1)
    path = export(hf, str(tmp_path))
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    name = next(k for k in tensors if k.endswith("self_attn.o_proj.weight"))
    del tensors[name + "_scale"]
    from safetensors.torch import save_file

    save_file(tensors, file)
    with pytest.raises(CheckpointError, match=f"'{name}' .* packed MXFP4 .* no '{name}_scale'"):
        load_model(path)


def test_quark_on_a_plain_checkpoint_is_refused():
    with pytest.raises(ValueError, match="--quantization quark runs a checkpoint's own quark"):
        load_model(None, load_format="dummy", quantization="quark")


def test_mxfp4_on_an_fp8_request_is_refused(checkpoint):
    _, path = checkpoint
    with pytest.raises(ValueError, match="--quantization fp8 on a checkpoint quantized as 'quark'"):
        load_model(path, server_args=ServerArgs(quantization="fp8"))


def test_dummy_weights_quantize_as_a_checkpoint_would(tmp_path):
    """``load_format="dummy"`` with MXFP4 kept (the benchmarks' models) quantizes the random weights: the same
    logits as the dummy high-precision model after a round trip through an export of it."""
    dummy = load_model(None, load_format="dummy", quantization="mxfp4", quantized_weights=True)
    layers = [m for m in dummy.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.weight_format == "mxfp4" for m in layers)
    assert not dummy.model.layers[0].mlp.fuse_shared_expert
    plain = load_model(
        None, load_format="dummy", server_args=ServerArgs(disable_shared_experts_fusion=True)
    )
    ids = torch.tensor([PROMPT])
    assert relative_error(dummy(ids), plain(ids)) < 0.5
    assert not torch.equal(dummy(ids), plain(ids)), "the weights went through MXFP4"


def test_server_info_and_models_say_mxfp4(checkpoint):
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from sglang_lite.server.model_info import server_info_of
    from sglang_lite.server.openai_serving import add_routes

    _, path = checkpoint
    limits = SimpleNamespace(context_length=64, max_total_tokens=64, max_running_requests=1)
    manager = SimpleNamespace(config=limits, rank_pids=[], alt_stream_plan=None)
    args = ServerArgs(model_path=path)
    info = server_info_of(manager, args)
    assert info["quantization"] == "mxfp4"
    assert info["quantization_config"].startswith("quark (mxfp4 (e2m1 weights, e8m0 scales per 32")
    online = server_info_of(manager, ServerArgs(quantization="mxfp4"))  # quantized at load
    assert (
        online["quantization"] == "mxfp4" and "quantized at load" in online["quantization_config"]
    )
    app = FastAPI()
    add_routes(app, manager, args)
    model = TestClient(app).get("/v1/models").json()["data"][0]
    assert (
        model["quantization"] == "mxfp4"
        and model["quantization_config"] == info["quantization_config"]
    )


def _w4a4_reference(hf: torch.nn.Module) -> None:
    """Rounds the inputs of ``hf``'s MXFP4 products through MXFP4 (Quark's W4A4 at run time): the attention and
    shared-expert projections' by a pre-hook, the routed experts' (x and each gated intermediate) by running their
    forward with ``F.linear`` rounding its input."""
    for name, module in hf.named_modules():
        if name.endswith(("_proj",)) and ("self_attn" in name or "shared_expert." in name):
            module.register_forward_pre_hook(lambda _, args: (mxfp4.quantize_dequantize(args[0]),))
        if name.endswith("mlp.experts"):
            # the loop over experts through F.linear
            module.config._experts_implementation = "eager"
            module.forward = _rounding_linear_inputs(module.forward)


def _rounding_linear_inputs(forward):
    def run(*args, **kwargs):
        linear = F.linear
        rounded = lambda x, w, b=None: linear(mxfp4.quantize_dequantize(x), w, b)  # noqa: E731
        with mock.patch.object(torch.nn.functional, "linear", rounded):
            return forward(*args, **kwargs)

    return run


def test_w4a4_logits_match_transformers_with_rounded_activations(tmp_path):
    """A W4A4 export (kept packed whatever the device: its layers round the activations) against transformers on its
    dequantized weights with every MXFP4 product's inputs rounded through MXFP4."""
    hf = make_hf_model(moe=True, seed=9)
    plain = save_checkpoint(hf, str(tmp_path / "plain"))
    path = quark_export.export(plain, str(tmp_path / "w4a4"), w4a4=True)
    load_dequantized(hf, path)
    _w4a4_reference(hf)
    model = load_model(path, dtype=torch.float32)
    assert any(isinstance(m, QuantLinear) for m in model.modules()), "W4A4 keeps its layers"
    ids = torch.randint(
        0, hf.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = hf(ids).logits
    assert relative_error(model(ids), expected) < 1e-4
    with pytest.raises(ValueError, match="input_tensors"):
        load_model(path, quantized_weights=False)
