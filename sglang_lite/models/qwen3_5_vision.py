"""The Qwen3.5 vision tower (dense and MoE checkpoints share it): patches -> ViT blocks -> image
tokens.

Each image (``grid_thw`` row t, h, w: its patch grid) is ``t * h * w`` patches of ``C * T * P * P``
pixels, in the order the image processor emits them: frame by frame, each frame in blocks of
``merge x merge`` neighbouring patches (row-major over blocks, then within a block). The patches
get a learned position embedding resampled to the image's grid and a 2-D rotary (height, width) in
every attention layer; attention is full within one frame of one image. The merger then joins each
block of ``merge**2`` patches into one token of the text model's width. Plain PyTorch but for the
attention (``kernels.attention.varlen_attention``: Triton on GPUs), equal to transformers'
``Qwen3_5MoeVisionModel`` (its ``pooler_output``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from sglang_lite.kernels import attention
from sglang_lite.models.checkpoint import TensorInfo, checkpoint_tensors
from sglang_lite.models.mrope import apply_rotary

CHECKPOINT_PREFIXES = ("model.visual.", "visual.")
ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}
# transformers' LayerNorm epsilon for the whole tower (not in the config)
NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A checkpoint's ``vision_config``, with transformers' defaults for what it omits."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionConfig:
        """Reads the fields it knows (others, such as ``model_type``, are ignored); a value this
        tower cannot run raises ValueError naming its field."""
        known = {f.name for f in dataclasses.fields(cls)} - {"rope_theta"}
        values = {k: v for k, v in d.items() if k in known}
        values["rope_theta"] = _rope_theta(d.get("rope_parameters") or {})
        if d.get("deepstack_visual_indexes"):
            raise ValueError(
                "vision_config.deepstack_visual_indexes: deepstack features are not supported"
            )
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int" and (type(value) is not int or value <= 0):
                raise ValueError(
                    f"vision_config.{field.name}: expected a positive int, got {value!r}"
                )
        if str(self.hidden_act) not in ACTIVATIONS:
            raise ValueError(
                f"vision_config.hidden_act: {self.hidden_act!r} is not supported "
                f"(one of {sorted(ACTIVATIONS)})"
            )
        if self.hidden_size % (4 * self.num_heads):
            raise ValueError(
                f"vision_config.num_heads: hidden_size {self.hidden_size} / num_heads "
                f"{self.num_heads} must be a head size divisible by 4 (the rotary splits it "
                "between height and width)"
            )
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(
                "vision_config.num_position_embeddings: "
                f"{self.num_position_embeddings} is not a square grid"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Pixels a patch: channels x frames x patch_size x patch_size."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def _rope_theta(rope: dict[str, Any]) -> float:
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(
            "vision_config.rope_parameters.rope_type: "
            f"{rope['rope_type']!r}, only 'axial' is supported"
        )
    return float(rope.get("rope_theta", 10000.0))


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel is its stride, over one patch each: a linear map of the flattened patch
    (the same weights, stored as the checkpoint's [hidden, C, T, P, P])."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.scale = config.head_dim**-0.5
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(1)
        # the rotary is applied in float32, as transformers does, whatever the weights' dtype
        q_rot, k_rot = apply_rotary(q.float(), k.float(), *rotary)
        q, k = q_rot.to(v.dtype), k_rot.to(v.dtype)
        out = attention.varlen_attention(q, k, v, cu_seqlens, self.scale)
        return self.proj(out.flatten(1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=NORM_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=NORM_EPS)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Normalises each patch, then maps each block of merge**2 patches (concatenated) to one text
    token."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.hidden_size, eps=NORM_EPS)
        self.linear_fc1 = nn.Linear(merged, merged)
        self.linear_fc2 = nn.Linear(merged, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.norm(x).view(-1, self.linear_fc1.in_features)
        # the exact GELU here, whatever the blocks' hidden_act
        return self.linear_fc2(F.gelu(self.linear_fc1(merged)))


class Qwen3_5VisionModel(nn.Module):
    """The vision tower; parameter names are the checkpoint's under ``model.visual.``."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C*T*P*P] and grid_thw [I, 3] (N = sum of t * h * w) -> the images'
        tokens [N / merge**2, out_hidden_size], image by image."""
        grids = [tuple(g) for g in grid_thw.tolist()]
        self._check_inputs(pixel_values, grids)
        x = self.patch_embed(pixel_values)
        x = x + self._position_embeddings(grids).to(x.dtype)
        rotary = self._rotary(grids, x.device)
        # one attention segment a frame of an image
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        cu_seqlens = torch.tensor([0, *lengths], device=x.device).cumsum(0, dtype=torch.int32)
        for block in self.blocks:
            x = block(x, rotary, cu_seqlens)
        return self.merger(x)

    def _check_inputs(self, pixel_values: torch.Tensor, grids: list[tuple[int, ...]]) -> None:
        patches = sum(t * h * w for t, h, w in grids)
        expected = (patches, self.config.patch_dim)
        if tuple(pixel_values.shape) != expected:
            raise ValueError(
                f"pixel_values: shape {tuple(pixel_values.shape)}, "
                f"grid_thw {grids} needs {expected}"
            )
        merge = self.config.spatial_merge_size
        if any(h % merge or w % merge for _, h, w in grids):
            raise ValueError(f"grid_thw {grids}: heights and widths must be multiples of {merge}")

    def _position_embeddings(self, grids: list[tuple[int, ...]]) -> torch.Tensor:
        """The learned square grid of position embeddings resampled (bilinear, corners aligned) to
        each image's grid, in patch order, repeated over the image's frames."""
        side = math.isqrt(self.config.num_position_embeddings)
        table = self.pos_embed.weight.view(side, side, -1)
        out = []
        for t, h, w in grids:
            rows, row_weights = _bilinear_taps(h, side, table.device)
            cols, col_weights = _bilinear_taps(w, side, table.device)
            grid = sum(
                (row_weights[:, i, None, None] * col_weights[None, :, j, None])
                * table[rows[:, i, None], cols[None, :, j]]
                for i in range(2)
                for j in range(2)
            )
            out.append(self._blocks_order(grid).repeat(t, 1))
        return torch.cat(out)

    def _blocks_order(self, grid: torch.Tensor) -> torch.Tensor:
        """A [h, w, ...] grid flattened in patch order: merge x merge blocks row-major, row-major
        within each."""
        m = self.config.spatial_merge_size
        h, w = grid.shape[:2]
        blocks = grid.reshape(h // m, m, w // m, m, *grid.shape[2:]).transpose(1, 2)
        return blocks.reshape(h * w, *grid.shape[2:])

    def _rotary(
        self, grids: list[tuple[int, ...]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, head_dim] (float32) of the 2-D rotary: the first half of the angles from
        a patch's row, the second from its column, the same frequencies for both; repeated for the
        rotate-half layout."""
        quarter = self.config.head_dim // 4
        exponents = torch.arange(quarter, dtype=torch.float32, device=device) / quarter
        inv_freq = 1.0 / self.config.rope_theta**exponents
        rows_cols = []
        for t, h, w in grids:
            rows, cols = torch.meshgrid(
                torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
            )
            rows_cols.append(self._blocks_order(torch.stack([rows, cols], dim=-1)).repeat(t, 1))
        freqs = torch.cat(rows_cols).float()[..., None] * inv_freq
        angles = torch.cat([freqs[:, 0], freqs[:, 1], freqs[:, 0], freqs[:, 1]], dim=-1)
        return angles.cos(), angles.sin()


def _bilinear_taps(size: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``size`` points spread over ``side`` table entries, corners aligned: the two entries each
    point reads [size, 2] and their weights [size, 2]."""
    scale = (side - 1) / max(size - 1, 1)
    source = torch.arange(size, dtype=torch.float32, device=device) * scale
    low = source.floor()
    frac = source - low
    taps = torch.stack([low, low + 1], dim=-1).long().clamp(max=side - 1)
    return taps, torch.stack([1 - frac, frac], dim=-1)


def load_vision_weights(model: Qwen3_5VisionModel, model_dir: str) -> None:
    """Reads the checkpoint's ``model.visual.*`` (or ``visual.*``) tensors at ``model_dir`` into
    ``model``, each in its parameter's dtype; a missing, unexpected or mis-shaped tensor raises
    ValueError naming it."""
    infos: dict[str, TensorInfo] = {}
    for raw, info in checkpoint_tensors(model_dir).items():
        prefix = next((p for p in CHECKPOINT_PREFIXES if raw.startswith(p)), None)
        if prefix is not None:
            infos[raw[len(prefix) :]] = info
    params = dict(model.named_parameters())
    _check_vision_tensors(params, infos, model_dir)
    by_file: dict[str, list[str]] = {}
    for name, info in infos.items():
        by_file.setdefault(info.file, []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(file, "pt", device="cpu") as f:
                for name in names:
                    params[name].copy_(f.get_tensor(infos[name].raw))


def _check_vision_tensors(
    params: dict[str, nn.Parameter], infos: dict[str, TensorInfo], model_dir: str
) -> None:
    missing = sorted(params.keys() - infos.keys())
    if missing:
        raise ValueError(
            f"vision tower: {model_dir} lacks model.visual.{missing[0]} ({len(missing)} missing)"
        )
    extra = sorted(infos.keys() - params.keys())
    if extra:
        raise ValueError(
            f"vision tower: unexpected tensor {infos[extra[0]].raw} in {infos[extra[0]].file}"
        )
    for name, param in params.items():
        info = infos[name]
        if tuple(info.shape) != tuple(param.shape):
            raise ValueError(
                f"vision tower: tensor {info.raw} in {info.file} has shape {tuple(info.shape)}, "
                f"the model expects {tuple(param.shape)}"
            )
