"""The Qwen3.5 image processor: PIL images into the patches its vision tower takes.

It computes what transformers' ``Qwen2VLImageProcessorPil`` computes (the processor transformers picks for
``qwen3_5`` and ``qwen3_5_moe`` without torchvision), step for step and in the same dtypes, so that the pixel values
equal it:

1. RGB: an image with alpha (an alpha band, or a ``transparency`` entry as palette images carry) is composited onto
   white; any other mode is converted by PIL.
2. Resize in PIL, on the uint8 RGB image, with the bicubic filter, to the size ``smart_resize`` picks.
3. Rescale by 1/255 in float64, then cast to float32; normalize ``(x - mean) / std`` in float32.
4. Patches: the still image is repeated to ``temporal_patch_size`` frames and cut into rows of C*T*P*P values (channel,
   frame, patch row, patch column), ordered merge block by merge block (row-major), then patch by patch within a
   block, so that the merge_size x merge_size patches the merger joins are consecutive rows.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

MAX_ASPECT_RATIO = 200
# preprocessing transformers can switch off; we implement only the switched-on path
REQUIRED_STEPS = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
# preprocessor_config.json's fields read as they are (the pixel bounds are read apart)
CONFIG_FIELDS = (
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "image_mean",
    "image_std",
    "rescale_factor",
    "resample",
)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) for the resize: both multiples of ``factor``, the area within [min_pixels, max_pixels] (sides
    rounded to the nearest multiple, else scaled down and floored, or up and ceiled), the aspect ratio nearly kept.
    Raises ValueError past an aspect ratio of 200:1."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"an image's aspect ratio must be at most {MAX_ASPECT_RATIO}:1, got {width}x{height}"
        )
    rounded_h = round(height / factor) * factor
    rounded_w = round(width / factor) * factor
    if rounded_h * rounded_w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        shrunk_h = max(factor, math.floor(height / scale / factor) * factor)
        return shrunk_h, max(factor, math.floor(width / scale / factor) * factor)
    if rounded_h * rounded_w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        grown_h = math.ceil(height * scale / factor) * factor
        return grown_h, math.ceil(width * scale / factor) * factor
    return rounded_h, rounded_w


def to_rgb(image: Image.Image) -> Image.Image:
    """The image in RGB, any transparency composited onto white."""
    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


@dataclass(frozen=True, eq=False)
class ProcessedImages:
    """The vision tower's input for a list of images: ``pixel_values`` [sum of t*h*w, C*T*P*P] float32 (image 0's
    patches, then image 1's, ...) and ``grid_thw`` [images, 3] int64, each image's patch grid (t, h, w)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    merge_size: int

    @property
    def token_counts(self) -> list[int]:
        """Each image's tokens in the prompt: one per merge_size x merge_size patches."""
        return [t * h * w // self.merge_size**2 for t, h, w in self.grid_thw.tolist()]


@dataclass(frozen=True)
class ImageProcessor:
    """The defaults are the values of Qwen3.5's ``preprocessor_config.json`` (transformers' own class defaults are
    Qwen2-VL's: patch 14, CLIP mean and std, 56*56 to 28*28*1280 pixels). ``resample`` is a PIL filter."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC

    def __post_init__(self) -> None:
        # a config may give a list, or one value for all three channels
        object.__setattr__(self, "image_mean", per_channel(self.image_mean))
        object.__setattr__(self, "image_std", per_channel(self.image_std))

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> ImageProcessor:
        """From the checkpoint's ``preprocessor_config.json``; the defaults where it has none."""
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            return cls()
        return cls.from_config(json.loads(path.read_text()))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ImageProcessor:
        """From a ``preprocessor_config.json``'s fields: ``min_pixels`` / ``max_pixels`` win over ``size``'s
        ``shortest_edge`` / ``longest_edge``, as in transformers."""
        for step in REQUIRED_STEPS:
            if config.get(step) is False:
                raise ValueError(f"preprocessor_config.json: {step}=false is not supported")
        fields: dict[str, Any] = {name: config[name] for name in CONFIG_FIELDS if name in config}
        size = config.get("size") or {}
        for edge, name in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
            value = config.get(name)
            value = size.get(edge) if value is None else value
            if value is not None:
                fields[name] = value
        return cls(**fields)

    @property
    def factor(self) -> int:
        """What both sides of a resized image are multiples of: one merged patch."""
        return self.patch_size * self.merge_size

    def __call__(self, images: Sequence[Image.Image]) -> ProcessedImages:
        if not images:
            raise ValueError("at least one image is required")
        arrays = [self.normalized(image) for image in images]
        grids = [[1, a.shape[1] // self.patch_size, a.shape[2] // self.patch_size] for a in arrays]
        return ProcessedImages(
            pixel_values=torch.cat([self.patchify(a) for a in arrays]),
            grid_thw=torch.tensor(grids, dtype=torch.int64),
            merge_size=self.merge_size,
        )

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image of this size is resized to."""
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def normalized(self, image: Image.Image) -> np.ndarray:
        """The image resized, rescaled and normalized: float32 [C, H, W]."""
        rgb = to_rgb(image)
        height, width = self.resized_size(rgb.height, rgb.width)
        resized = rgb.resize((width, height), resample=self.resample)
        scaled = (np.asarray(resized, dtype=np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std = np.asarray(self.image_std, dtype=np.float32)
        return ((scaled - mean) / std).transpose(2, 0, 1)

    def patchify(self, pixels: np.ndarray) -> torch.Tensor:
        """[C, H, W] into [H/P * W/P, C*T*P*P] rows, merge block by merge block."""
        image = torch.from_numpy(np.ascontiguousarray(pixels))
        channels, height, width = image.shape
        p, m = self.patch_size, self.merge_size
        grid_h, grid_w = height // p, width // p
        blocks = image.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
        # (block row, block column, row in block, column in block, channel, y, x)
        blocks = blocks.permute(1, 4, 2, 5, 0, 3, 6).unsqueeze(5)
        frames = blocks.expand(*blocks.shape[:5], self.temporal_patch_size, p, p)
        return frames.reshape(grid_h * grid_w, channels * self.temporal_patch_size * p * p)


def per_channel(value: float | Sequence[float]) -> tuple[float, ...]:
    """A mean or std as a tuple of one value per RGB channel."""
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    return tuple(float(v) for v in value)
