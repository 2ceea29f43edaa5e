"""bf16 weights on the CPU: a bf16 checkpoint at ``--dtype auto`` keeps its projections' weights bf16 for the C++
kernels, activations float32, and its logits stay within bf16 tolerance of the float32 path (float32 tolerance on
the widening path); ``--dtype float32`` keeps every weight float32."""

from __future__ import annotations

import pytest
import torch

from sglang_lite import Engine, load_model
from sglang_lite.kernels import cpu
from sglang_lite.model_executor.weight_layout import store_input_major
from sglang_lite.runtime.memory import resolve_dtype, resolve_weight_dtype
from sglang_lite.server_args import ServerArgs
from tests.hf_checkpoints import make_hf_model, save_checkpoint
from tests.kernels.utils import assert_rel_close

# Every expert on every token: routing weights then move continuously with the activations. With top-k of more
# experts, a tie broken the other way by any rounding (the model run wholly in bf16 too) swaps an expert and moves
# the logits by up to 10% on these random models, which says nothing of the products' accuracy.
SHAPE = dict(
    hidden_size=128,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=4,
)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    cpu.require()


@pytest.fixture(scope="module", params=["moe", "dense-tied"])
def bf16_checkpoint(request, tmp_path_factory) -> str:
    """A random model saved in bf16, as released checkpoints are (config.json says so)."""
    moe = request.param == "moe"
    shape = SHAPE if moe else dict(hidden_size=128, intermediate_size=96, tie_word_embeddings=True)
    hf = make_hf_model(moe=moe, seed=5, vocab_size=300, **shape).to(torch.bfloat16)
    return save_checkpoint(hf, str(tmp_path_factory.mktemp(request.param)))


def _prepared(path: str, weight_dtype: torch.dtype | None) -> torch.nn.Module:
    """The model as the engine's runner prepares it on the CPU: weights stored [in, out]."""
    model = load_model(path, weight_dtype=weight_dtype)
    store_input_major(model)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (3, 41), generator=torch.Generator().manual_seed(1))


def test_auto_keeps_a_bf16_checkpoint_in_bf16_on_the_cpu(bf16_checkpoint, tmp_path):
    auto = ServerArgs(model_path=bf16_checkpoint)
    assert resolve_dtype(auto) == torch.float32
    assert resolve_weight_dtype(auto, torch.float32) == torch.bfloat16
    explicit = ServerArgs(model_path=bf16_checkpoint, dtype="float32")
    assert resolve_weight_dtype(explicit, resolve_dtype(explicit)) == torch.float32
    fp32 = save_checkpoint(
        make_hf_model(seed=5), str(tmp_path)
    )  # a float32 checkpoint stays float32
    assert resolve_weight_dtype(ServerArgs(model_path=fp32), torch.float32) == torch.float32
    # --dtype bfloat16 on the CPU: bf16 weights, float32 activations (of any checkpoint), as auto's
    bf16 = ServerArgs(model_path=fp32, dtype="bfloat16")
    assert resolve_dtype(bf16) == torch.float32
    assert resolve_weight_dtype(bf16, resolve_dtype(bf16)) == torch.bfloat16
    # deterministic inference computes in float32 at any dtype
    half = ServerArgs(model_path=fp32, dtype="float16", enable_deterministic_inference=True)
    assert resolve_dtype(half) == torch.float32


def test_only_the_projections_weights_are_bf16(bf16_checkpoint):
    model = _prepared(bf16_checkpoint, torch.bfloat16)
    for name, param in model.named_parameters():
        kept = (
            "norm",
            "conv1d",
            "A_log",
            "dt_bias",
            "mlp.gate.",
            "shared_expert_gate",
        )  # routers float32
        projection = not any(part in name for part in kept)
        assert param.dtype == (torch.bfloat16 if projection else torch.float32), name
    assert model.compute_dtype == torch.float32


@pytest.mark.parametrize("mode", ["auto", "widen", "dot"])
def test_bf16_weights_logits_match_float32(bf16_checkpoint, mode, monkeypatch):
    """The same checkpoint loaded in float32 is the reference: the widening path reads exactly those weights with
    float32 activations (float32 tolerance); vdpbf16ps rounds activations to bf16 (bf16 tolerance)."""
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", mode)
    want = _prepared(bf16_checkpoint, None)(_ids())
    got = _prepared(bf16_checkpoint, torch.bfloat16)(_ids())
    rounded = mode != "widen" and cpu.has_dpbf16()
    assert_rel_close(got, want, torch.bfloat16 if rounded else torch.float32, "logits")


def test_engine_on_a_bf16_checkpoint_decodes_as_float32(bf16_checkpoint, monkeypatch):
    """Greedy tokens of the engine at --dtype auto (bf16 weights, the widening path) equal --dtype float32's."""
    monkeypatch.setenv("SGLANG_CPU_BF16_DOT", "widen")
    prompts = _ids().tolist()
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    tokens = {}
    for dtype in ("auto", "float32"):
        with Engine(
            model_path=bf16_checkpoint, dtype=dtype, skip_tokenizer_init=True, max_total_tokens=512
        ) as engine:
            results = engine.generate(input_ids=prompts, sampling_params=params)
            tokens[dtype] = [r["output_ids"] for r in results]
    assert tokens["auto"] == tokens["float32"]
