"""The image processor gives the vision tower what transformers' ``Qwen2VLImageProcessorPil`` gives it (the class
transformers uses for Qwen3.5 without torchvision): the same pixel values and patch grids for every image mode and
for sizes scaled up, down or kept, and the same settings read from a checkpoint's ``preprocessor_config.json``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from sglang_lite.multimodal.image_processor import ImageProcessor

QWEN3_5 = dict(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    size={"shortest_edge": 65536, "longest_edge": 16777216},
)
# Qwen2-VL's patch 14 and CLIP statistics, with a pixel budget small enough that 200x120 and 640x480 shrink
SMALL_BUDGET = dict(
    patch_size=14,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711],
    size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16},
)
SIZES = [(33, 57), (200, 120), (640, 480), (17, 300), (1, 1), (5, 3)]
MODES = ["RGB", "RGBA", "L", "LA", "P", "P+transparency", "CMYK"]


def ours(config: dict) -> ImageProcessor:
    size = config["size"]
    fields = {k: v for k, v in config.items() if k != "size"}
    return ImageProcessor(
        **fields, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]
    )


def make_image(width: int, height: int, mode: str, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode == "P":
        return rgba.convert("RGB").quantize(16)
    if mode == "P+transparency":
        image = rgba.convert("RGB").quantize(16)
        image.info["transparency"] = 3
        return image
    return rgba.convert(mode)


def assert_same(images: list[Image.Image], config: dict) -> None:
    theirs = Qwen2VLImageProcessorPil(**config)(images, return_tensors="pt")
    mine = ours(config)(images)
    assert mine.pixel_values.dtype == torch.float32
    assert mine.grid_thw.dtype == torch.int64
    assert torch.equal(mine.grid_thw, theirs["image_grid_thw"])
    torch.testing.assert_close(mine.pixel_values, theirs["pixel_values"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("config", [QWEN3_5, SMALL_BUDGET], ids=["qwen3_5", "small_budget"])
@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_pixel_values_and_grid_equal_transformers(size: tuple[int, int], config: dict):
    assert_same([make_image(*size, "RGB")], config)


@pytest.mark.parametrize("mode", MODES)
def test_every_image_mode_equals_transformers(mode: str):
    assert_same([make_image(57, 33, mode, seed=1)], SMALL_BUDGET)


def test_several_images_concatenate_in_order():
    images = [make_image(w, h, mode, seed=i) for i, ((w, h), mode) in enumerate(zip(SIZES, MODES))]
    assert_same(images, SMALL_BUDGET)


def test_token_counts_are_one_per_merged_patch():
    images = [make_image(640, 480, "RGB"), make_image(33, 57, "L")]
    processed = ours(SMALL_BUDGET)(images)
    theirs = Qwen2VLImageProcessorPil(**SMALL_BUDGET)
    expected = [theirs.get_number_of_image_patches(i.height, i.width) // 4 for i in images]
    assert processed.token_counts == expected
    assert sum(processed.token_counts) * 4 == processed.pixel_values.shape[0]


@pytest.mark.parametrize("size", [(1, 300), (300, 1)])
def test_aspect_ratio_past_200_is_refused_as_transformers_does(size: tuple[int, int]):
    image = make_image(*size, "RGB")
    with pytest.raises(ValueError, match="aspect ratio"):
        Qwen2VLImageProcessorPil(**QWEN3_5)([image], return_tensors="pt")
    with pytest.raises(ValueError, match="aspect ratio"):
        ours(QWEN3_5)([image])


def test_from_pretrained_reads_min_and_max_pixels(tmp_path):
    config = dict(QWEN3_5, min_pixels=32 * 32 * 2, max_pixels=32 * 32 * 8)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    processor = ImageProcessor.from_pretrained(str(tmp_path))
    assert (processor.min_pixels, processor.max_pixels) == (2048, 8192)
    theirs = Qwen2VLImageProcessorPil.from_pretrained(str(tmp_path))
    images = [make_image(640, 480, "RGB"), make_image(17, 30, "RGBA")]
    expected = theirs(images, return_tensors="pt")
    processed = processor(images)
    assert torch.equal(processed.grid_thw, expected["image_grid_thw"])
    torch.testing.assert_close(processed.pixel_values, expected["pixel_values"], rtol=0, atol=1e-6)


def test_from_pretrained_reads_what_transformers_saves(tmp_path):
    Qwen2VLImageProcessorPil(**SMALL_BUDGET).save_pretrained(str(tmp_path))
    assert ImageProcessor.from_pretrained(str(tmp_path)) == ours(SMALL_BUDGET)


def test_without_a_config_the_defaults_are_qwen3_5s(tmp_path):
    assert ImageProcessor.from_pretrained(str(tmp_path)) == ours(QWEN3_5)


def test_a_switched_off_step_is_refused():
    with pytest.raises(ValueError, match="do_normalize"):
        ImageProcessor.from_config(dict(QWEN3_5, do_normalize=False))
