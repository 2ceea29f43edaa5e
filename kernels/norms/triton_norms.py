"""Triton RMSNorm kernels: Gemma RMSNorm (optional fused residual add), fused q/k Gemma RMSNorm, gated RMSNorm.

Every kernel normalises a tile of rows per program, in fp32, and writes new tensors in the input dtype.
Rows are addressed as (outer, inner) with two strides so that a q that is a head-split view of a wider projection
output is read in place, without a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # rows per program for short rows (head_dim 128): enough work per program
# at most this many elements per tile: 16 x 2048 spilled on sm_90 (benchmarks/triton_resources.py)
TILE = 8192


@triton.jit
def _rms_rows(x, mask, eps, N: tl.constexpr):
    """fp32 ``x * rsqrt(mean(x^2) + eps)`` over the last axis of a [ROWS, BLOCK_N] tile (padding is zero)."""
    x = tl.where(mask, x, 0.0)
    return x * tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)[:, None]


@triton.jit
def _gemma_rows(
    x_ptr,
    w_ptr,
    y_ptr,
    n_rows,
    n_inner,
    stride_outer,
    stride_inner,
    row0,
    eps,
    N: tl.constexpr,
    ROWS_: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Gemma-normalise rows [row0, row0 + ROWS_) of a strided [n_rows, N] view into contiguous y."""
    rows = row0 + tl.arange(0, ROWS_)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    src = (rows // n_inner) * stride_outer + (rows % n_inner) * stride_inner
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = _rms_rows(x, mask, eps, N) * (1.0 + w)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemma_rmsnorm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    n_rows,
    n_inner,
    stride_outer,
    stride_inner,
    eps,
    N: tl.constexpr,
    ROWS_: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    _gemma_rows(
        x_ptr,
        w_ptr,
        y_ptr,
        n_rows,
        n_inner,
        stride_outer,
        stride_inner,
        tl.program_id(0) * ROWS_,
        eps,
        N,
        ROWS_,
        BLOCK_N,
    )


@triton.jit
def _gemma_rmsnorm_residual_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    y_ptr,
    new_r_ptr,
    n_rows,
    stride_x,
    stride_r,
    eps,
    N: tl.constexpr,
    ROWS_: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS_ + tl.arange(0, ROWS_)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
    # Round the sum to the input dtype before normalising: the reference adds in that dtype too.
    summed = (x.to(tl.float32) + r.to(tl.float32)).to(new_r_ptr.dtype.element_ty)
    tl.store(new_r_ptr + rows[:, None] * N + cols[None, :], summed, mask=mask)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = _rms_rows(summed.to(tl.float32), mask, eps, N) * (1.0 + w)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_qk_kernel(
    q_ptr,
    k_ptr,
    qw_ptr,
    kw_ptr,
    q_out_ptr,
    k_out_ptr,
    q_rows,
    q_heads,
    q_stride_t,
    q_stride_h,
    k_rows,
    k_heads,
    k_stride_t,
    k_stride_h,
    q_programs,
    eps,
    N: tl.constexpr,
    ROWS_: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The first q_programs programs normalise q rows, the rest k rows: one launch for both."""
    pid = tl.program_id(0)
    if pid < q_programs:
        row0 = pid * ROWS_
        _gemma_rows(
            q_ptr,
            qw_ptr,
            q_out_ptr,
            q_rows,
            q_heads,
            q_stride_t,
            q_stride_h,
            row0,
            eps,
            N,
            ROWS_,
            BLOCK_N,
        )
    else:
        row0 = (pid - q_programs) * ROWS_
        _gemma_rows(
            k_ptr,
            kw_ptr,
            k_out_ptr,
            k_rows,
            k_heads,
            k_stride_t,
            k_stride_h,
            row0,
            eps,
            N,
            ROWS_,
            BLOCK_N,
        )


@triton.jit
def _gated_rmsnorm_kernel(
    o_ptr,
    z_ptr,
    w_ptr,
    y_ptr,
    n_rows,
    stride_o,
    stride_z,
    eps,
    N: tl.constexpr,
    ROWS_: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS_ + tl.arange(0, ROWS_)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    o = tl.load(o_ptr + rows[:, None] * stride_o + cols[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(
        tl.float32
    )
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = _rms_rows(o, mask, eps, N) * w[None, :] * (z * tl.sigmoid(z))
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------- launchers


def _check_weight(weight: torch.Tensor, n: int, name: str) -> None:
    if weight.shape != (n,) or weight.stride(0) != 1:
        raise ValueError(
            f"{name} must be a contiguous [{n}] tensor, got shape {tuple(weight.shape)}"
        )


def _as_rows(x: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """[rows, n] view of x with a unit last stride (copies only when no such view exists)."""
    if x.shape[-1] != n:
        raise ValueError(f"{name}: last dim must be {n}, got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(
            f"{name}: last dim must be contiguous (stride 1), got strides {x.stride()}"
        )
    return x.reshape(-1, n)


def _tile(n: int) -> dict:
    """Launch shape for rows of n elements: rows per program, padded row width, warps (8 for the widest tiles)."""
    block_n = triton.next_power_of_2(n)
    rows = max(1, min(MAX_ROWS, TILE // block_n))
    return dict(ROWS_=rows, BLOCK_N=block_n, num_warps=8 if rows * block_n >= TILE else 4)


def _grid(rows: int, tile: dict) -> tuple[int]:
    return (triton.cdiv(rows, tile["ROWS_"]),)


def gemma_rmsnorm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    _check_weight(weight, n, "weight")
    x2 = _as_rows(x, n, "x")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    tile = _tile(n)
    common = dict(eps=eps, N=n, **tile)
    if residual is None:
        if x2.numel():
            _gemma_rmsnorm_kernel[_grid(x2.shape[0], tile)](
                x_ptr=x2,
                w_ptr=weight,
                y_ptr=y,
                n_rows=x2.shape[0],
                n_inner=1,
                stride_outer=x2.stride(0),
                stride_inner=0,
                **common,
            )
        return y
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x {tuple(x.shape)} {x.dtype}, "
            f"got {tuple(residual.shape)} {residual.dtype}"
        )
    r2 = _as_rows(residual, n, "residual")
    new_residual = torch.empty_like(y)
    if x2.numel():
        _gemma_rmsnorm_residual_kernel[_grid(x2.shape[0], tile)](
            x_ptr=x2,
            r_ptr=r2,
            w_ptr=weight,
            y_ptr=y,
            new_r_ptr=new_residual,
            n_rows=x2.shape[0],
            stride_x=x2.stride(0),
            stride_r=r2.stride(0),
            **common,
        )
    return y, new_residual


def _as_head_rows(x: torch.Tensor, head_dim: int, name: str) -> torch.Tensor:
    """[tokens, heads, head_dim] view of x: head-split views of a wider projection stay in place."""
    if x.shape[-1] % head_dim:
        raise ValueError(f"{name}: last dim {x.shape[-1]} is not a multiple of head_dim {head_dim}")
    if x.stride(-1) != 1:
        raise ValueError(
            f"{name}: last dim must be contiguous (stride 1), got strides {x.stride()}"
        )
    return x.unflatten(-1, (x.shape[-1] // head_dim, head_dim)).reshape(
        -1, x.shape[-1] // head_dim, head_dim
    )


def fused_qk_gemma_rmsnorm_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_weight(q_weight, head_dim, "q_weight")
    _check_weight(k_weight, head_dim, "k_weight")
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} must match q dtype {q.dtype}")
    q3, k3 = _as_head_rows(q, head_dim, "q"), _as_head_rows(k, head_dim, "k")
    q_rows, k_rows = q3.shape[0] * q3.shape[1], k3.shape[0] * k3.shape[1]
    if k_rows > q_rows:
        raise ValueError(
            f"k has more rows ({k_rows}) than q ({q_rows}); expected GQA with fewer key heads"
        )
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    tile = _tile(head_dim)
    q_programs = _grid(q_rows, tile)[0]
    grid = (q_programs + _grid(k_rows, tile)[0],)
    if grid[0]:
        _fused_qk_kernel[grid](
            q_ptr=q3,
            k_ptr=k3,
            qw_ptr=q_weight,
            kw_ptr=k_weight,
            q_out_ptr=q_out,
            k_out_ptr=k_out,
            q_rows=q_rows,
            q_heads=q3.shape[1],
            q_stride_t=q3.stride(0),
            q_stride_h=q3.stride(1),
            k_rows=k_rows,
            k_heads=k3.shape[1],
            k_stride_t=k3.stride(0),
            k_stride_h=k3.stride(1),
            q_programs=q_programs,
            eps=eps,
            N=head_dim,
            **tile,
        )
    return q_out, k_out


def gated_rmsnorm_triton(
    o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    n = o.shape[-1]
    _check_weight(weight, n, "weight")
    if z.shape != o.shape:
        raise ValueError(f"z shape {tuple(z.shape)} must match o shape {tuple(o.shape)}")
    o2, z2 = _as_rows(o, n, "o"), _as_rows(z, n, "z")
    y = torch.empty(o.shape, dtype=o.dtype, device=o.device)
    if o2.numel():
        tile = _tile(n)
        _gated_rmsnorm_kernel[_grid(o2.shape[0], tile)](
            o_ptr=o2,
            z_ptr=z2,
            w_ptr=weight,
            y_ptr=y,
            n_rows=o2.shape[0],
            stride_o=o2.stride(0),
            stride_z=z2.stride(0),
            eps=eps,
            N=n,
            **tile,
        )
    return y
