"""MXFP4 (OCP Microscaling, as AMD Quark exports it): the reference quantization, packing and dequantization.

Layout of a weight W [..., N, K] (K even; the last group may be partial):
- ``packed`` uint8 [..., N, K / 2]: two e2m1 codes a byte, element 2j in the low nibble, 2j + 1 in the high one;
- ``scales`` uint8 [..., N, ceil(K / 32)]: one e8m0 scale per 32 consecutive elements of a row, worth 2^(s - 127).
An e2m1 code is a sign bit (8), two exponent bits and one mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
W = value(code) * 2^(s - 127), exact in float32 (and bf16).

Quantization follows the OCP MX specification: a group's scale exponent is floor(log2(amax)) - 2 (e2m1's largest
exponent), each element divided by the scale rounds to the nearest e2m1 value, ties to the even code, saturating at
6. Quark's default ``scale_calculation_mode`` "even" first rounds amax to two significant bits (amax of 1.75 * 2^e
and up counts as 2^(e + 1)), so that a group's largest element is not clipped from 7 or more to 6; "floor" takes
amax as it is. Activations of W4A4 checkpoints (``quantize_dequantize``) quantize the same way, per 32 columns of a
row.
"""

from __future__ import annotations

import torch

GROUP = 32
E8M0_BIAS = 127
# code -> value; codes 8-15 are the negatives of 0-7 (8 is -0)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_EMAX = 2
SCALE_MODES = ("even", "floor")
# "even": amax's float32 bits plus half of the third significant bit, truncated to the exponent
_EVEN_ROUNDING = 0x200000
_EXPONENT_BITS = 0x7F800000
# |x| above a midpoint rounds up; at a midpoint it rounds to the even code: down at these ...
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
# ... and up at these
_TIES_UP = (0.75, 1.75, 3.5)


def e2m1_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 codes' values, float32 [16]."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """2^(s - 127) for uint8 ``scales``, float32 (255, the NaN code, reads as 2^128 = inf)."""
    return torch.exp2(scales.to(torch.float32) - E8M0_BIAS)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2B] from packed bytes [..., B] (low nibble first)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., B] from uint8 codes [..., 2B] (even index in the low nibble)."""
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def check_shapes(packed: torch.Tensor, scales: torch.Tensor, name: str = "weight") -> int:
    """K (the unpacked columns) of an MXFP4 ``packed`` / ``scales`` pair; ValueError naming ``name`` otherwise."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 {name} and its scales must be uint8, got {packed.dtype} and {scales.dtype}"
        )
    k = 2 * packed.shape[-1]
    expected = (*packed.shape[:-1], -(-k // GROUP))
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"MXFP4 {name} {tuple(packed.shape)} ({k} columns) needs scales {expected}, got "
            f"{tuple(scales.shape)}"
        )
    return k


def dequantize(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W [..., N, K] in ``dtype`` from ``packed`` [..., N, K / 2] and ``scales`` [..., N, ceil(K / 32)]."""
    k = check_shapes(packed, scales)
    values = e2m1_values(packed.device)[unpack(packed).long()]
    per_element = e8m0_to_float(scales).repeat_interleave(GROUP, dim=-1)[..., :k]
    return (values * per_element).to(dtype)


def quantize(w: torch.Tensor, mode: str = "even") -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., N, K / 2], scales uint8 [..., N, ceil(K / 32)]) of w [..., N, K] (K even); ``mode``:
    the scale calculation (``SCALE_MODES``)."""
    k = w.shape[-1]
    if k % 2:
        raise ValueError(f"MXFP4 packs two elements a byte: the last dimension ({k}) must be even")
    groups = _groups(w.float())
    exponent = _scale_exponents(groups, mode)
    scaled = groups * torch.exp2(-exponent.float()).unsqueeze(-1)
    codes = _e2m1_codes(scaled).flatten(-2)[..., :k]
    return pack(codes), (exponent + E8M0_BIAS).to(torch.uint8)


def quantize_dequantize(x: torch.Tensor, mode: str = "even") -> torch.Tensor:
    """x [..., K] rounded through MXFP4 per 32 columns (W4A4's dynamic activation quantization), in x's dtype."""
    groups = _groups(x.float())
    scale = torch.exp2(_scale_exponents(groups, mode).float()).unsqueeze(-1)
    values = e2m1_values(x.device)[_e2m1_codes(groups / scale).long()] * scale
    return values.flatten(-2)[..., : x.shape[-1]].to(x.dtype)


def _groups(w: torch.Tensor) -> torch.Tensor:
    """w [..., K] zero-padded to whole groups, [..., ceil(K / 32), 32]."""
    k = w.shape[-1]
    padded = w.new_zeros(*w.shape[:-1], -(-k // GROUP) * GROUP)
    padded[..., :k] = w
    return padded.unflatten(-1, (-1, GROUP))


def _scale_exponents(groups: torch.Tensor, mode: str) -> torch.Tensor:
    """floor(log2(amax)) - 2 per group (int32), within e8m0's range; an all-zero group takes the smallest."""
    if mode not in SCALE_MODES:
        raise ValueError(f"MXFP4 scale_calculation_mode must be one of {SCALE_MODES}, got {mode!r}")
    amax = groups.abs().amax(dim=-1)
    if mode == "even":
        bits = (amax.view(torch.int32) + _EVEN_ROUNDING) & _EXPONENT_BITS
        amax = bits.view(torch.float32)
    _, exponent = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
    exponent = torch.where(amax > 0, exponent - 1 - E2M1_EMAX, -E8M0_BIAS)
    return exponent.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """The nearest e2m1 code (ties to even, saturating at 6) of each element, uint8."""
    magnitude = scaled.abs()
    down = torch.tensor(_TIES_DOWN, device=scaled.device)
    up = torch.tensor(_TIES_UP, device=scaled.device)
    index = (magnitude.unsqueeze(-1) > down).sum(-1) + (magnitude.unsqueeze(-1) >= up).sum(-1)
    sign = (scaled < 0) & (index > 0)
    return (index + 8 * sign).to(torch.uint8)


def linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` (weight-only MXFP4: x is not quantized), float32 arithmetic, in x's dtype."""
    return (x.float() @ dequantize(packed, scales).t()).to(x.dtype)
