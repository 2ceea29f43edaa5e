"""Malformed checkpoints raise CheckpointError naming the tensor, the shapes and the file."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_lite import load_model
from sglang_lite.models.weights import CheckpointError
from tests.hf_checkpoints import make_hf_model, save_checkpoint


@pytest.fixture()
def checkpoint(tmp_path):
    path = save_checkpoint(make_hf_model(moe=True), str(tmp_path))
    file = os.path.join(path, "model.safetensors")
    return path, file, load_file(file)


def test_missing_tensor(checkpoint):
    path, file, tensors = checkpoint
    name = "model.layers.1.linear_attn.in_proj_z.weight"
    del tensors[name]
    save_file(tensors, file)
    message = (
        rf"missing tensor '{name}' \(expected shape \(40, 48\), found none\) in checkpoint {path}"
    )
    with pytest.raises(CheckpointError, match=message):
        load_model(path)


def test_unexpected_tensor(checkpoint):
    path, file, tensors = checkpoint
    name = "model.layers.0.mlp.experts.8.up_proj.weight"
    tensors[name] = torch.zeros(24, 48)
    save_file(tensors, file)
    message = rf"unexpected tensor '{name}' \(shape \(24, 48\)\) in .*model.safetensors"
    with pytest.raises(CheckpointError, match=message):
        load_model(path)


def test_shape_mismatch(checkpoint):
    path, file, tensors = checkpoint
    name = "model.layers.3.self_attn.k_proj.weight"
    tensors[name] = torch.zeros(40, 48)
    save_file(tensors, file)
    message = (
        rf"shape mismatch for tensor '{name}' in {file}: expected \(48, 48\), found \(40, 48\)"
    )
    with pytest.raises(CheckpointError, match=message):
        load_model(path)


def test_no_weights_at_all(tmp_path):
    path = save_checkpoint(make_hf_model(moe=False), str(tmp_path))
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(path)


def test_dummy_weights_are_seeded(tmp_path):
    path = save_checkpoint(make_hf_model(moe=True), str(tmp_path))
    ids = torch.tensor([[1, 2, 3, 4]])
    a, b = (
        load_model(path, load_format="dummy", seed=1),
        load_model(path, load_format="dummy", seed=1),
    )
    c = load_model(path, load_format="dummy", seed=2)
    assert torch.equal(a(ids), b(ids)) and not torch.allclose(a(ids), c(ids))


def test_unknown_load_format(tmp_path):
    with pytest.raises(ValueError, match="load_format"):
        load_model(str(tmp_path), load_format="pt")
