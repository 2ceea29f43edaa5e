"""The vision tower and the M-RoPE positions equal transformers' on tiny random VL checkpoints (MoE
and dense)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import apply_rotary_pos_emb

from sglang_lite.layers.rotary import RotaryEmbedding
from sglang_lite.models.mrope import apply_rotary, mrope_positions
from sglang_lite.models.qwen3_5_vision import (
    Qwen3_5VisionModel,
    VisionConfig,
    load_vision_weights,
)
from tests.hf_checkpoints import BASE, DENSE, MOE

VISION = dict(
    depth=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    out_hidden_size=BASE["hidden_size"],
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
)
# head_dim 24, rotary 12 (6 frequencies): unequal sections, so each axis's share is visible
ROPE = dict(
    rope_type="default",
    rope_theta=10000.0,
    partial_rotary_factor=0.5,
    mrope_section=[3, 2, 1],
    mrope_interleaved=True,
)
TWO_GRIDS = [[1, 4, 6], [1, 8, 4]]


def make_vl_model(moe: bool, seed: int = 0) -> torch.nn.Module:
    """A random transformers VL model whose vision weights have a trained model's scale (matrices
    for unit-variance outputs, biases and norms perturbed), so that every weight, and the rotary,
    matters."""
    torch.manual_seed(seed)
    text = {**BASE, **(MOE if moe else DENSE), "rope_parameters": ROPE}
    # the special tokens inside the text model's vocabulary, so that the whole model runs
    vocab = text["vocab_size"]
    special = dict(
        image_token_id=vocab - 1,
        video_token_id=vocab - 2,
        vision_start_token_id=vocab - 3,
        vision_end_token_id=vocab - 4,
    )
    if moe:
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=VISION, **special)
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    else:
        config = transformers.Qwen3_5Config(text_config=text, vision_config=VISION, **special)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():
        for param in model.model.visual.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn_like(param) * param[0].numel() ** -0.5)
            else:
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=["moe", "dense"])
def checkpoint(request, tmp_path_factory) -> tuple[torch.nn.Module, str]:
    model = make_vl_model(moe=request.param == "moe")
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    return model, path


def load_ours(path: str) -> Qwen3_5VisionModel:
    with open(os.path.join(path, "config.json")) as f:
        config = VisionConfig.from_dict(json.load(f)["vision_config"])
    model = Qwen3_5VisionModel(config)
    load_vision_weights(model, path)
    return model.eval()


def random_pixels(grids: list[list[int]]) -> torch.Tensor:
    patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(patches, 3 * 2 * 16 * 16)


@pytest.mark.parametrize("grids", [[[1, 6, 4]], TWO_GRIDS, [[2, 4, 4], [1, 2, 2]]])
def test_vision_tower_equals_transformers(checkpoint, grids):
    hf, path = checkpoint
    ours = load_ours(path)
    pixels = random_pixels(grids)
    grid_thw = torch.tensor(grids)
    with torch.no_grad():
        expected = hf.model.visual(pixels, grid_thw).pooler_output
        got = ours(pixels, grid_thw)
    assert got.shape == (sum(t * h * w for t, h, w in grids) // 4, BASE["hidden_size"])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_images_do_not_attend_to_each_other(checkpoint):
    _, path = checkpoint
    ours = load_ours(path)
    pixels = random_pixels(TWO_GRIDS)
    first = TWO_GRIDS[0][1] * TWO_GRIDS[0][2]
    with torch.no_grad():
        both = ours(pixels, torch.tensor(TWO_GRIDS))
        alone = ours(pixels[:first], torch.tensor(TWO_GRIDS[:1]))
    torch.testing.assert_close(both[: first // 4], alone, rtol=1e-5, atol=1e-5)


def prompt_with_images(config, grids: list[list[int]]) -> tuple[list[int], list[int]]:
    """Text, then each image between vision_start and vision_end, then text; and the tokens'
    types."""
    ids = [5, 6, 7]
    for t, h, w in grids:
        ids += [config.vision_start_token_id]
        ids += [config.image_token_id] * (t * h * w // 4)
        ids += [config.vision_end_token_id, 8, 9]
    ids += [10, 11]
    return ids, [int(i == config.image_token_id) for i in ids]


@pytest.mark.parametrize("grids", [TWO_GRIDS, [[2, 4, 6]], [[1, 2, 8], [1, 6, 2]]])
def test_mrope_positions_equal_get_rope_index(checkpoint, grids):
    hf, _ = checkpoint
    ids, types = prompt_with_images(hf.config, grids)
    expected, expected_delta = hf.model.get_rope_index(
        torch.tensor([ids]), torch.tensor([types]), image_grid_thw=torch.tensor(grids)
    )
    positions, delta = mrope_positions(ids, [tuple(g) for g in grids], hf.config.image_token_id, 2)
    assert positions.dtype == torch.int64
    assert torch.equal(positions, expected[:, 0])
    assert delta == int(expected_delta)


def test_adjacent_images_without_separators_take_their_own_grids():
    image = 99
    ids = [1] + [image] * (6 + 8) + [2]
    positions, delta = mrope_positions(ids, [(1, 4, 6), (1, 8, 4)], image, 2)
    first, _ = mrope_positions([1] + [image] * 6, [(1, 4, 6)], image, 2)
    assert torch.equal(positions[:, :7], first)
    # the second image starts where the first ends: 1 + max(2, 3)
    assert positions[:, 7].tolist() == [4, 4, 4]
    assert delta == int(positions.max()) + 1 - len(ids)


def test_mrope_positions_refuse_tokens_and_grids_that_disagree():
    with pytest.raises(ValueError, match="needs 6 image tokens"):
        mrope_positions([1, 9, 9, 9, 2], [(1, 4, 6)], 9, 2)
    with pytest.raises(ValueError, match="more image tokens"):
        mrope_positions([1, 9, 9, 9, 9, 9, 9, 9, 2], [(1, 4, 6)], 9, 2)
    with pytest.raises(ValueError, match="1 image grid"):
        mrope_positions([1, 2], [(1, 4, 6)], 9, 2)


def test_mrope_table_and_rotation_equal_transformers(checkpoint):
    hf, _ = checkpoint
    ids, types = prompt_with_images(hf.config, TWO_GRIDS)
    position_ids, _ = hf.model.get_rope_index(
        torch.tensor([ids]), torch.tensor([types]), image_grid_thw=torch.tensor(TWO_GRIDS)
    )
    rotary = hf.model.language_model.rotary_emb
    x = torch.zeros(1, dtype=torch.float32)
    expected_cos, expected_sin = rotary(x, position_ids)
    positions = position_ids[:, 0]
    # the text model's table (what a prompt with images rotates by), its cos | sin halves in rotate-half layout
    ours = RotaryEmbedding(12, 4096, ROPE["rope_theta"], tuple(ROPE["mrope_section"]))
    cos_half, sin_half = ours.mrope_table(positions).chunk(2, dim=-1)
    cos, sin = torch.cat([cos_half, cos_half], dim=-1), torch.cat([sin_half, sin_half], dim=-1)
    assert cos.shape == (len(ids), 12)
    torch.testing.assert_close(cos, expected_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, expected_sin[0], rtol=0, atol=0)

    heads, head_dim = 4, BASE["head_dim"]
    q = torch.randn(len(ids), heads, head_dim)
    k = torch.randn(len(ids), 2, head_dim)
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], expected_cos, expected_sin
    )
    q_ours, k_ours = apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1), rtol=0, atol=0)
    assert torch.equal(q_ours[..., 12:], q[..., 12:])


def test_a_misshapen_checkpoint_tensor_is_named(tmp_path):
    make_vl_model(moe=True).save_pretrained(tmp_path)
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(file)
    name = "model.visual.blocks.1.attn.qkv.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, file)
    with pytest.raises(ValueError, match=rf"{name}.*\(191, 64\).*\(192, 64\)"):
        load_ours(str(tmp_path))


def test_missing_and_extra_tensors_are_named(tmp_path):
    make_vl_model(moe=True).save_pretrained(tmp_path)
    file = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.visual.merger.norm.bias"]
    save_file(tensors, file)
    with pytest.raises(ValueError, match="merger.norm.bias"):
        load_ours(str(tmp_path))
    tensors["model.visual.merger.norm.bias"] = torch.zeros(64)
    tensors["model.visual.deepstack_merger_list.0.norm.weight"] = torch.zeros(4)
    save_file(tensors, file)
    with pytest.raises(ValueError, match="deepstack_merger_list.0.norm.weight"):
        load_ours(str(tmp_path))


def test_weights_load_in_the_module_dtype_from_a_sharded_visual_prefix(tmp_path):
    torch.manual_seed(0)
    config = VisionConfig.from_dict(VISION)
    source = Qwen3_5VisionModel(config)
    state = {f"visual.{k}": v for k, v in source.state_dict().items()}
    names = sorted(state)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, os.path.join(tmp_path, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(tmp_path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    target = Qwen3_5VisionModel(config).to(torch.bfloat16)
    load_vision_weights(target, str(tmp_path))
    for name, param in target.named_parameters():
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, source.state_dict()[name].to(torch.bfloat16)), name


@pytest.mark.parametrize(
    "field, value",
    [
        ("hidden_act", "relu"),
        ("patch_size", [16, 16]),
        ("num_heads", 3),
        ("num_position_embeddings", 60),
        ("rope_parameters", {"rope_type": "default"}),
        ("deepstack_visual_indexes", [1]),
    ],
)
def test_unsupported_config_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        VisionConfig.from_dict({**VISION, field: value})


def test_config_defaults_are_transformers(checkpoint):
    hf, _ = checkpoint
    ours = VisionConfig.from_dict({})
    theirs = type(hf.config.vision_config)()
    for field in ("depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads"):
        assert getattr(ours, field) == getattr(theirs, field)
    for field in (
        "patch_size",
        "temporal_patch_size",
        "num_position_embeddings",
        "out_hidden_size",
    ):
        assert getattr(ours, field) == getattr(theirs, field)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]


@pytest.mark.parametrize("grids", [TWO_GRIDS, [[2, 4, 6]]], ids=["two-images", "two-frames"])
def test_causal_lm_forward_with_images_equals_transformers(checkpoint, grids):
    """``load_model(..., with_vision=True)``'s forward takes a prompt's images as transformers' does
    (``pixel_values``, ``image_grid_thw``): the same logits at every position."""
    from sglang_lite import load_model

    hf, path = checkpoint
    ids, types = prompt_with_images(hf.config, grids)
    input_ids, pixels, grid_thw = torch.tensor([ids]), random_pixels(grids), torch.tensor(grids)
    with torch.no_grad():
        want = hf(
            input_ids,
            pixel_values=pixels,
            image_grid_thw=grid_thw,
            mm_token_type_ids=torch.tensor([types]),
        ).logits
    ours = load_model(path, with_vision=True)
    got = ours(input_ids, pixel_values=pixels, image_grid_thw=grid_thw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    text_only = load_model(path)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only(input_ids, pixel_values=pixels, image_grid_thw=grid_thw)
    with pytest.raises(ValueError, match="image_grid_thw"):
        ours(input_ids[:, :4], pixel_values=pixels, image_grid_thw=grid_thw)
