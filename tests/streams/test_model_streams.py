"""Per-run toggles, shared-expert fusion equality, and overlap as a no-op on the CPU."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest
import torch

import sglang_lite
from sglang_lite import load_model
from sglang_lite.server_args import ServerArgs, get_global_server_args, set_global_server_args
from sglang_lite.streams.runtime import overlap
from tests.hf_checkpoints import make_hf_model, save_checkpoint

FUSABLE = dict(moe_intermediate_size=24, shared_expert_intermediate_size=24)


@pytest.fixture(scope="module")
def fusable_checkpoint(tmp_path_factory):
    hf = make_hf_model(moe=True, seed=21, **FUSABLE)
    return hf, save_checkpoint(hf, str(tmp_path_factory.mktemp("fusable")))


def test_every_module_imports_without_server_args_or_flags(monkeypatch):
    for name in [v.name for v in sglang_lite.envs.ALL]:
        monkeypatch.delenv(name, raising=False)
    set_global_server_args(None)
    names = [m.name for m in pkgutil.walk_packages(sglang_lite.__path__, "sglang_lite.")]
    assert "sglang_lite.streams.plan" in names and "sglang_lite.models.qwen3_5" in names
    for name in names:
        if not name.endswith("__main__"):
            importlib.import_module(name)
    with pytest.raises(RuntimeError, match="Global server args is not set yet"):
        get_global_server_args()


def test_fused_and_unfused_moe_give_equal_logits(fusable_checkpoint):
    hf, path = fusable_checkpoint
    fused = load_model(path, server_args=ServerArgs(disable_shared_experts_fusion=False))
    plain = load_model(path, server_args=ServerArgs(disable_shared_experts_fusion=True))
    block = fused.model.layers[0].mlp
    assert (
        block.fuse_shared_expert
        and block.experts.w13.shape[0] == 9
        and not hasattr(block, "shared_expert")
    )
    assert not plain.model.layers[0].mlp.fuse_shared_expert
    ids = torch.randint(
        0, hf.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = hf(ids).logits
    for model in (fused, plain):
        assert ((model(ids) - expected).abs().max() / expected.abs().max()) < 1e-4


def test_fusion_falls_back_when_shapes_differ(tmp_path, caplog):
    path = save_checkpoint(
        make_hf_model(moe=True, seed=2), str(tmp_path)
    )  # shared 16 != experts 24
    with caplog.at_level("WARNING"):
        model = load_model(path)
    assert not model.model.layers[0].mlp.fuse_shared_expert
    assert (
        "shared-expert fusion off: shared_expert_intermediate_size (16) != moe_intermediate_size (24)"
        in caplog.text
    )


def test_two_models_in_one_process_follow_their_own_flags_and_args(monkeypatch, fusable_checkpoint):
    _, path = fusable_checkpoint
    monkeypatch.setenv("SGLANG_GDN_QKVZ_BA_ALT_STREAM", "1")
    monkeypatch.setenv("SGLANG_QK_NORM_ALT_STREAM", "0")
    set_global_server_args(ServerArgs(disable_shared_experts_fusion=True))
    try:
        first = load_model(path)
        monkeypatch.setenv("SGLANG_GDN_QKVZ_BA_ALT_STREAM", "no")
        monkeypatch.delenv("SGLANG_QK_NORM_ALT_STREAM")
        set_global_server_args(ServerArgs(disable_shared_experts_fusion=False))
        second = load_model(path)
    finally:
        set_global_server_args(None)
    assert first.streams.flags.gdn_qkvz_ba and first.streams.flags.qk_norm is False
    assert not second.streams.flags.gdn_qkvz_ba and second.streams.flags.qk_norm is None
    assert (
        not first.model.layers[0].mlp.fuse_shared_expert
        and second.model.layers[0].mlp.fuse_shared_expert
    )
    # as the same decisions would come out on ROCm with its alternate stream (on CUDA both overlaps are always on):
    for model in (first, second):
        model.streams.platform = "rocm"
        model.streams.flags = dataclasses.replace(model.streams.flags, alt_stream=True)
    a, b = first.streams.plan(True, 8), second.streams.plan(True, 8)
    assert (a.gdn_qkvz_ba, a.qk_norm, a.moe_shared_routed) == (True, False, True)
    assert (b.gdn_qkvz_ba, b.qk_norm, b.moe_shared_routed) == (False, False, False)


def test_bad_flag_fails_model_construction_naming_it(monkeypatch, fusable_checkpoint):
    monkeypatch.setenv("SGLANG_ALT_STREAM", "sometimes")
    with pytest.raises(ValueError, match="SGLANG_ALT_STREAM='sometimes'"):
        load_model(fusable_checkpoint[1])


def test_overlap_is_plain_execution_on_the_cpu():
    x = torch.randn(4, 8)
    calls = []
    main_out, side_out = overlap(
        lambda: calls.append("main") or x * 2, lambda: calls.append("side") or x + 1, None, True, x
    )
    assert (
        calls == ["main", "side"] and torch.equal(main_out, x * 2) and torch.equal(side_out, x + 1)
    )


def test_overlapped_plan_on_cpu_gives_identical_logits(monkeypatch, fusable_checkpoint):
    _, path = fusable_checkpoint
    args = ServerArgs(disable_shared_experts_fusion=True)
    plain = load_model(path, server_args=args)
    monkeypatch.setenv("SGLANG_ALT_STREAM_EAGER", "1")
    monkeypatch.setenv("SGLANG_GDN_QKVZ_BA_ALT_STREAM", "1")
    overlapped = load_model(path, server_args=args)
    overlapped.streams.platform = (
        "cuda"  # every site takes its overlap branch; with no CUDA stream it runs in order
    )
    assert overlapped.streams.plan(False, 16).any_overlap
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(3))
    assert torch.equal(plain(ids), overlapped(ids))


def test_mxfp4_runs_the_shared_expert_apart_and_the_plan_overlaps_it(
    monkeypatch, fusable_checkpoint, caplog
):
    """With MXFP4 weights the shared expert is not fused (as upstream), even where the shapes allow it, so the
    alt-stream plan may run it beside the routed experts; overlapped on the CPU, the logits are the plain order's."""
    _, path = fusable_checkpoint
    args = ServerArgs(quantization="mxfp4")
    with caplog.at_level("WARNING"):
        plain = load_model(path, server_args=args, quantized_weights=True)
    assert not plain.model.layers[0].mlp.fuse_shared_expert
    assert "shared-expert fusion off: mxfp4 weights run the shared expert beside" in caplog.text
    monkeypatch.setenv("SGLANG_ALT_STREAM_EAGER", "1")
    overlapped = load_model(path, server_args=args, quantized_weights=True)
    overlapped.streams.platform = "cuda"
    assert overlapped.streams.plan(False, 16).moe_shared_routed
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(4))
    assert torch.equal(plain(ids), overlapped(ids))
