"""Benchmark and GPU-check cases for paged attention (extend, decode), packed variable-length attention (the
vision tower's) and the partial NeoX rotary."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from sglang_lite.kernels import attention, rotary
from sglang_lite.kernels.rotary import naive as naive_rotary

from ._compare import check_row
from ._timing import time_ms


class Batch:
    """Requests with the given prefix and new-token lengths, their keys and values stored in a shuffled pool."""

    def __init__(
        self,
        prefix_lens: list[int],
        extend_lens: list[int],
        heads: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        self.k_cache = torch.randn(sum(lens) + 1, kv_heads, head_dim, device=device, dtype=dtype)
        self.v_cache = torch.randn_like(self.k_cache)
        slots = torch.randperm(sum(lens), device=device) + 1  # slot 0 is the padding slot
        self.req_to_token = torch.zeros(len(lens), max(lens), dtype=torch.int32, device=device)
        starts = [sum(lens[:i]) for i in range(len(lens))]
        for row, (start, n) in enumerate(zip(starts, lens)):
            self.req_to_token[row, :n] = slots[start : start + n].int()
        self.req_pool_indices = torch.arange(len(lens), device=device)
        self.prefix_lens = torch.tensor(prefix_lens, device=device)
        self.extend_lens = torch.tensor(extend_lens, device=device)
        self.seq_lens = self.prefix_lens + self.extend_lens
        self.q = torch.randn(sum(extend_lens), heads, head_dim, device=device, dtype=dtype)
        self.scale = head_dim**-0.5

    def extend(self, backend: str | None = None) -> torch.Tensor:
        return attention.extend_attention(
            self.q,
            self.k_cache,
            self.v_cache,
            self.req_to_token,
            self.req_pool_indices,
            self.prefix_lens,
            self.extend_lens,
            self.scale,
            backend=backend,
        )

    def decode(self, backend: str | None = None) -> torch.Tensor:
        q = self.q[: len(self.seq_lens)]
        return attention.decode_attention(
            q,
            self.k_cache,
            self.v_cache,
            self.req_to_token,
            self.req_pool_indices,
            self.seq_lens,
            self.scale,
            backend=backend,
        )

    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same inputs laid out for transformers (equal lengths only): q [B, H, E, hd], k/v [B, KV, S, hd] and
        the additive causal mask [B, 1, E, S]."""
        batch, extend, seq = len(self.seq_lens), int(self.extend_lens[0]), int(self.seq_lens[0])
        slots = self.req_to_token[:, :seq].long()
        q = self.q.view(batch, extend, *self.q.shape[1:]).transpose(1, 2)
        k, v = self.k_cache[slots].transpose(1, 2), self.v_cache[slots].transpose(1, 2)
        visible = torch.ones(extend, seq, dtype=torch.bool, device=q.device).tril(seq - extend)
        mask = torch.zeros(extend, seq, dtype=q.dtype, device=q.device).masked_fill(
            ~visible, float("-inf")
        )
        return q, k, v, mask.expand(batch, 1, extend, seq)


def _packed_qkv(
    lengths: list[int], heads: int, head_dim: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """q, k, v [T, H, hd] as views of one packed qkv tensor (the vision tower's layout), and cu_seqlens."""
    qkv = torch.randn(sum(lengths), 3, heads, head_dim, device=device, dtype=dtype)
    cu_seqlens = torch.tensor([0, *lengths], device=device).cumsum(0, dtype=torch.int32)
    return (*qkv.unbind(1), cu_seqlens)


def check(device: torch.device) -> list[dict]:
    rows = []
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        batch = Batch([0, 65, 257, 3], [64, 1, 63, 130], 8, 2, 80, device, dtype)
        rows.append(
            check_row(
                f"extend_attention hd80 GQA4 {dtype}",
                batch.extend("triton"),
                batch.extend("torch"),
                tol,
            )
        )
        rows.append(
            check_row(
                f"decode_attention hd80 GQA4 {dtype}",
                batch.decode("triton"),
                batch.decode("torch"),
                tol,
            )
        )
        q = torch.randn(65, 8, 256, device=device, dtype=dtype)
        k = torch.randn(65, 2, 256, device=device, dtype=dtype)
        pos = torch.arange(65, device=device)
        cache = torch.randn(128, 64, device=device)
        got = rotary.apply_rotary(q, k, pos, cache, 64, backend="triton")
        want = naive_rotary.apply_rotary(q, k, pos, cache, 64)
        rows += [
            check_row(f"apply_rotary {n} {dtype}", a, b, tol) for n, a, b in zip("qk", got, want)
        ]
        for head_dim in (64, 80, 128):
            # 576 patches: a 384 x 384 image in 16-pixel patches
            args = (*_packed_qkv([1, 63, 257, 576], 4, head_dim, device, dtype), head_dim**-0.5)
            rows.append(
                check_row(
                    f"varlen_attention hd{head_dim} {dtype}",
                    attention.varlen_attention(*args, backend="triton"),
                    attention.varlen_attention(*args, backend="torch"),
                    tol,
                )
            )
    return rows


def _module(heads: int, kv_heads: int) -> SimpleNamespace:
    return SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False)


def _bench_extend(
    device, dtype, requests, prefix, extend, heads, kv_heads, head_dim, iters
) -> dict:
    batch = Batch(
        [prefix] * requests, [extend] * requests, heads, kv_heads, head_dim, device, dtype
    )
    q, k, v, mask = batch.dense()
    module = _module(heads, kv_heads)
    keys_seen = extend * prefix + extend * (extend + 1) // 2  # per request and head, causal
    shape = f"B={requests} prefix={prefix} extend={extend} H={heads} KV={kv_heads} hd={head_dim}"
    return {
        "kernel": "extend_attention",
        "shape": shape,
        "ours_ms": time_ms(batch.extend, device, iters=iters, warmup=2),
        "ref_name": "HF eager_attention_forward (causal mask)",
        "ref_ms": time_ms(
            lambda: eager_attention_forward(module, q, k, v, mask, batch.scale),
            device,
            iters=iters,
            warmup=2,
        ),
        "flops": 4 * requests * heads * head_dim * keys_seen,
    }


def _bench_decode(device, dtype, requests, seq, heads, kv_heads, head_dim, iters) -> dict:
    batch = Batch([seq - 1] * requests, [1] * requests, heads, kv_heads, head_dim, device, dtype)
    q, k, v, _ = batch.dense()
    module = _module(heads, kv_heads)
    return {
        "kernel": "decode_attention",
        "shape": f"B={requests} S={seq} H={heads} KV={kv_heads} hd={head_dim}",
        "ours_ms": time_ms(batch.decode, device, iters=iters, warmup=2),
        "ref_name": "HF eager_attention_forward",
        "ref_ms": time_ms(
            lambda: eager_attention_forward(module, q, k, v, None, batch.scale),
            device,
            iters=iters,
            warmup=2,
        ),
        "bytes": 2 * requests * seq * kv_heads * head_dim * k.element_size(),
    }


def _bench_varlen(device, dtype, images, patches, heads, head_dim, iters) -> dict:
    q, k, v, cu_seqlens = _packed_qkv([patches] * images, heads, head_dim, device, dtype)
    scale = head_dim**-0.5
    module = _module(heads, heads)
    segments = [t.split(patches) for t in (q, k, v)]

    def per_image() -> list[torch.Tensor]:
        return [
            eager_attention_forward(module, *(t.transpose(0, 1)[None] for t in seg), None, scale)[0]
            for seg in zip(*segments)
        ]

    return {
        "kernel": "varlen_attention",
        "shape": f"images={images} patches={patches} H={heads} hd={head_dim}",
        "ours_ms": time_ms(
            lambda: attention.varlen_attention(q, k, v, cu_seqlens, scale),
            device,
            iters=iters,
            warmup=2,
        ),
        "ref_name": "HF eager_attention_forward per image",
        "ref_ms": time_ms(per_image, device, iters=iters, warmup=2),
        "flops": 4 * images * patches**2 * heads * head_dim,
    }


def _bench_rotary(device, dtype, tokens, heads, kv_heads, head_dim, rotary_dim, iters) -> dict:
    q = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype)
    positions = torch.arange(tokens, device=device)
    cache = torch.randn(tokens, rotary_dim, device=device)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[None].to(dtype), torch.cat([sin, sin], -1)[None].to(dtype)
    q_hf, k_hf = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    return {
        "kernel": "apply_rotary",
        "shape": f"T={tokens} H={heads} KV={kv_heads} hd={head_dim} rot={rotary_dim}",
        "ours_ms": time_ms(
            lambda: rotary.apply_rotary(q, k, positions, cache, rotary_dim),
            device,
            iters=iters,
            warmup=2,
        ),
        "ref_name": "HF apply_rotary_pos_emb",
        "ref_ms": time_ms(
            lambda: apply_rotary_pos_emb(q_hf, k_hf, cos, sin), device, iters=iters, warmup=2
        ),
        "bytes": 2 * (q.numel() + k.numel()) * q.element_size(),
    }


def bench(device: torch.device, quick: bool) -> list[dict]:
    gpu = device.type == "cuda"
    dtype, iters = (torch.bfloat16, 20) if gpu else (torch.float32, 5)
    # GPU: Qwen3.5 full attention, GQA 8, hd 256
    heads, kv_heads, head_dim = (16, 2, 256) if gpu else (8, 2, 128)
    if not gpu:
        extend_cases, decode_cases, rotary_tokens = [(4, 128, 128)], [(16, 512)], 1024
        varlen_cases = [(2, 256)]
    elif quick:
        extend_cases, decode_cases, rotary_tokens = [(4, 1024, 1024)], [(64, 4096)], 8192
        varlen_cases = [(4, 1024)]
    else:
        extend_cases, decode_cases, rotary_tokens = (
            [(4, 1024, 1024), (1, 0, 8192)],
            [(64, 4096), (8, 32768)],
            32768,
        )
        varlen_cases = [(4, 1024), (1, 16384)]
    with torch.no_grad():
        rows = [
            _bench_extend(device, dtype, r, p, e, heads, kv_heads, head_dim, iters)
            for r, p, e in extend_cases
        ]
        rows += [
            _bench_decode(device, dtype, b, s, heads, kv_heads, head_dim, iters)
            for b, s in decode_cases
        ]
        rows.append(
            _bench_rotary(
                device, dtype, rotary_tokens, heads, kv_heads, head_dim, head_dim // 4, iters
            )
        )
        # the vision tower's attention: 16 heads of 72 (hidden 1152); 1024 patches: a 512 x 512 image
        rows += [
            _bench_varlen(device, dtype, images, patches, 16, 72, iters)
            for images, patches in varlen_cases
        ]
    return rows
