"""What loading a block-FP8 checkpoint does with the tensors around the weights: scales nothing here uses are
skipped with one warning (any other unexpected tensor is still refused), and each file's header is read once
however many tensors it holds."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_lite import load_model
from sglang_lite.models import checkpoint, quant_loading, weights
from sglang_lite.models.weights import CheckpointError
from tests.hf_checkpoints import make_hf_model
from tests.models.test_fp8 import make_fp8_checkpoint

PREFIX = "model.language_model.layers"
UNUSED = {  # as some FP8 exports carry them: KV-cache, static activation and per-tensor weight scales
    f"{PREFIX}.3.self_attn.k_proj.k_scale": torch.tensor(0.02),
    f"{PREFIX}.3.self_attn.v_proj.v_scale": torch.tensor(0.03),
    f"{PREFIX}.3.self_attn.k_scale": torch.tensor(0.02),
    f"{PREFIX}.3.self_attn.q_proj.input_scale": torch.tensor(0.5),
    f"{PREFIX}.0.linear_attn.out_proj.weight_scale": torch.tensor([0.01]),
    f"{PREFIX}.0.mlp.experts.1.down_proj.input_scale": torch.tensor([0.25]),
}
LOGGER = "sglang_lite.models.quant_loading"


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fp8"))
    return make_fp8_checkpoint(make_hf_model(moe=True, seed=3), path, "vl")


def copy_with(source: str, dest: str, extra: dict[str, torch.Tensor]) -> str:
    os.makedirs(dest)
    tensors = load_file(os.path.join(source, "model.safetensors")) | extra
    save_file(tensors, os.path.join(dest, "model.safetensors"))
    with open(os.path.join(source, "config.json")) as f, open(f"{dest}/config.json", "w") as g:
        g.write(f.read())
    return dest


def logits(path: str) -> torch.Tensor:
    return load_model(path)(torch.tensor([[3, 17, 42, 99, 150, 7, 61, 88]]))


def test_unused_scales_are_skipped_with_one_warning(fp8_checkpoint, tmp_path, caplog):
    path = copy_with(fp8_checkpoint, str(tmp_path / "scales"), UNUSED)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with_scales = logits(path)
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("skipping 6 scale tensors no kernel here uses (")
    assert sum(name in warnings[0] for name in UNUSED) == quant_loading.NAMES_SHOWN
    assert "KV cache is kept in the model dtype" in warnings[0]
    assert torch.equal(with_scales, logits(fp8_checkpoint))


@pytest.mark.parametrize(
    "name,tensor",
    [
        # a per-block weight_scale is no per-tensor scale
        (f"{PREFIX}.0.linear_attn.out_proj.weight_scale", torch.ones(2, 2)),
        # a scale of a layer the model does not have
        (f"{PREFIX}.9.self_attn.k_proj.k_scale", torch.tensor(0.1)),
        (f"{PREFIX}.0.linear_attn.out_proj.bias", torch.zeros(48)),
    ],
    ids=["per-block-weight-scale", "other-layer-k-scale", "bias"],
)
def test_other_unexpected_tensors_are_still_refused(fp8_checkpoint, tmp_path, name, tensor):
    path = copy_with(fp8_checkpoint, str(tmp_path / "bad"), UNUSED | {name: tensor})
    with pytest.raises(CheckpointError, match=f"unexpected tensor '{name}'"):
        load_model(path)


def shard(path: str, files: int) -> None:
    """The checkpoint's one file as ``files`` files with an index, each scale apart from its weight."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    weight_map = {}
    for i in range(files):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = sorted(tensors)[i::files]
        save_file({n: tensors[n] for n in part}, os.path.join(path, file))
        weight_map |= dict.fromkeys(part, file)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)


def test_each_file_header_is_read_once(fp8_checkpoint, tmp_path, monkeypatch):
    path = copy_with(fp8_checkpoint, str(tmp_path / "sharded"), {})
    shard(path, 3)
    headers, opens = [], []
    read_header, safe_open = checkpoint.read_header, weights.safe_open

    def counted_read_header(file):
        headers.append(file)
        return read_header(file)

    def counted_safe_open(file, *args, **kwargs):
        opens.append(file)
        return safe_open(file, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "read_header", counted_read_header)
    monkeypatch.setattr(weights, "safe_open", counted_safe_open)
    monkeypatch.setattr(quant_loading, "safe_open", counted_safe_open)
    sharded = logits(path)
    assert sorted(headers) == sorted(set(headers)) and len(headers) == 3
    # one open to read the scales, one to read the weights: not one per tensor
    assert all(opens.count(file) <= 2 for file in headers) and len(opens) <= 6
    assert torch.equal(sharded, logits(fp8_checkpoint))
