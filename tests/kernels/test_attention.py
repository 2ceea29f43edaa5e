"""Triton paged attention (interpreted on the CPU) against the PyTorch reference, and the reference against an
explicit per-request softmax(QK^T)V loop. Unused pool slots hold NaN, so reading a wrong slot fails."""

from __future__ import annotations

import pytest
import torch

from sglang_lite.kernels import attention
from sglang_lite.kernels.attention import naive, triton_attention

from .utils import assert_rel_close, poison_


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


class Pool:
    """A NaN-filled KV pool in pages of ``page_size`` slots, each request's pages scattered at random; page 0 stays
    unused (and NaN) and is where padding entries of the page table point, as in SGLang. ``paired``: K and V are
    views of one buffer holding a slot's K and V side by side (strided rows, as ``ModelPools`` lays them out)."""

    def __init__(
        self,
        lens: list[int],
        num_kv: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int = 0,
        page_size: int = 1,
        paired: bool = False,
    ):
        self.page_size = page_size
        counts = [-(-n // page_size) for n in lens]  # pages per request
        num_pages = sum(counts) + 50 // page_size + 2
        shape = (num_pages * page_size, num_kv, head_dim)
        if paired:
            both = poison_(torch.empty(shape[0], 2, *shape[1:], dtype=dtype))
            self.k_cache, self.v_cache = both[:, 0], both[:, 1]
        else:
            self.k_cache = poison_(torch.empty(shape, dtype=dtype))
            self.v_cache = poison_(torch.empty(shape, dtype=dtype))
        gen = torch.Generator().manual_seed(seed)
        pages = torch.randperm(num_pages - 1, generator=gen)[: sum(counts)] + 1
        # request rows are shuffled inside a larger table so that req_pool_indices matter
        self.rows = torch.randperm(len(lens) + 2, generator=gen)[: len(lens)]
        self.page_table = torch.zeros(len(lens) + 2, max(counts, default=0) + 8, dtype=torch.int32)
        for row, n, start in zip(self.rows.tolist(), counts, _starts(counts)):
            self.page_table[row, :n] = pages[start : start + n].int()

    def slots(self, i: int, begin: int, end: int) -> torch.Tensor:
        positions = torch.arange(begin, end)
        pages = self.page_table[self.rows[i], positions // self.page_size].long()
        return pages * self.page_size + positions % self.page_size

    def kwargs(self) -> dict:
        return {"page_size": self.page_size}


# (page_size, paired K and V): token slots; pages of an awkward size; pages of 16 in the engine's layout
PAGINGS = [(1, False), (3, True), (16, True)]


def _starts(lens: list[int]) -> list[int]:
    return torch.tensor([0] + lens[:-1]).cumsum(0).tolist()


def _explicit_attention(q, keys, values, prefix: int, scale: float) -> torch.Tensor:
    """softmax(q k^T) v in fp64 for one request; q [E, H, hd], keys/values [S, KV, hd], query i sees prefix + i."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, E, S]
    visible = torch.arange(k.shape[1])[None, :] <= prefix + torch.arange(q.shape[0])[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1)


def _extend_batch(prefix_lens, extend_lens, heads, num_kv, head_dim, dtype, paging=(1, False)):
    """Pool with every prefix and new token stored through store_kv, and the packed new-token queries."""
    lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool = Pool(lens, num_kv, head_dim, dtype, page_size=paging[0], paired=paging[1])
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        keys = _randn(p + e, num_kv, head_dim, dtype=dtype, seed=i)
        values = _randn(p + e, num_kv, head_dim, dtype=dtype, seed=100 + i)
        attention.store_kv(
            pool.k_cache, pool.v_cache, pool.slots(i, 0, p + e), keys, values, backend="triton"
        )
    q = _randn(sum(extend_lens), heads, head_dim, dtype=dtype, seed=7)
    return pool, q, torch.tensor(prefix_lens), torch.tensor(extend_lens)


# (prefix_lens, extend_lens, heads, kv_heads, head_dim, dtype): lengths 0, 1, 63, 64, 65, 257 mixed in batches
EXTEND_CASES = [
    ([0, 65, 3], [64, 1, 63], 4, 4, 64, torch.float32),
    ([257, 0], [1, 65], 4, 2, 80, torch.bfloat16),
    ([64, 1, 0], [63, 257, 1], 4, 1, 128, torch.float32),
    ([63, 0], [65, 64], 8, 2, 80, torch.float32),
    ([0], [1], 2, 1, 64, torch.bfloat16),
]


@pytest.mark.parametrize("paging", PAGINGS)
@pytest.mark.parametrize("prefix_lens,extend_lens,heads,num_kv,head_dim,dtype", EXTEND_CASES)
def test_extend_attention(
    nan_allocations, prefix_lens, extend_lens, heads, num_kv, head_dim, dtype, paging
):
    pool, q, prefix, extend = _extend_batch(
        prefix_lens, extend_lens, heads, num_kv, head_dim, dtype, paging
    )
    args = (
        q,
        pool.k_cache,
        pool.v_cache,
        pool.page_table,
        pool.rows,
        prefix,
        extend,
        head_dim**-0.5,
    )
    want = attention.extend_attention(*args, **pool.kwargs(), backend="torch")
    got = attention.extend_attention(*args, **pool.kwargs(), backend="triton")
    assert_rel_close(got, want, dtype)
    # the reference itself, request by request, against the explicit softmax(QK^T)V
    for i, (p, e, start) in enumerate(zip(prefix_lens, extend_lens, _starts(extend_lens))):
        slots = pool.slots(i, 0, p + e)
        explicit = _explicit_attention(
            q[start : start + e], pool.k_cache[slots], pool.v_cache[slots], p, head_dim**-0.5
        )
        assert_rel_close(want[start : start + e], explicit, dtype, f"naive request {i}")


def test_extend_attention_varlen_matches_per_request_launches():
    prefix_lens, extend_lens = [65, 0, 1], [63, 64, 65]
    pool, q, prefix, extend = _extend_batch(prefix_lens, extend_lens, 4, 2, 80, torch.float32)
    packed = attention.extend_attention(
        q,
        pool.k_cache,
        pool.v_cache,
        pool.page_table,
        pool.rows,
        prefix,
        extend,
        0.1,
        backend="triton",
    )
    for i, (e, start) in enumerate(zip(extend_lens, _starts(extend_lens))):
        alone = attention.extend_attention(
            q[start : start + e],
            pool.k_cache,
            pool.v_cache,
            pool.page_table,
            pool.rows[i : i + 1],
            prefix[i : i + 1],
            extend[i : i + 1],
            0.1,
            backend="triton",
        )
        torch.testing.assert_close(packed[start : start + e], alone, rtol=0, atol=0)


def test_extend_attention_writes_every_element_of_a_given_out():
    pool, q, prefix, extend = _extend_batch([3, 0], [65, 1], 4, 2, 80, torch.float32)
    out = poison_(torch.empty_like(q))
    got = triton_attention.extend_attention(
        q, pool.k_cache, pool.v_cache, pool.page_table, pool.rows, prefix, extend, 0.1, out=out
    )
    assert got is out
    assert_rel_close(
        out,
        naive.extend_attention(
            q, pool.k_cache, pool.v_cache, pool.page_table, pool.rows, prefix, extend, 0.1
        ),
        torch.float32,
    )


# (seq_lens, heads, kv_heads, head_dim, dtype)
DECODE_CASES = [
    ([1, 63, 64, 65], 4, 4, 64, torch.float32),
    ([257, 1, 600], 4, 2, 80, torch.bfloat16),
    ([64, 65], 8, 2, 128, torch.float32),
    ([7, 257], 4, 1, 80, torch.float32),
    (
        [2000, 1],
        2,
        1,
        64,
        torch.float32,
    ),  # several key blocks per split: the running max must rescale
]


@pytest.mark.parametrize("paging", PAGINGS)
@pytest.mark.parametrize("seq_lens,heads,num_kv,head_dim,dtype", DECODE_CASES)
def test_decode_attention(nan_allocations, seq_lens, heads, num_kv, head_dim, dtype, paging):
    pool = Pool(seq_lens, num_kv, head_dim, dtype, page_size=paging[0], paired=paging[1])
    for i, n in enumerate(seq_lens):
        keys = _randn(n, num_kv, head_dim, dtype=dtype, seed=i)
        values = _randn(n, num_kv, head_dim, dtype=dtype, seed=50 + i)
        attention.store_kv(
            pool.k_cache, pool.v_cache, pool.slots(i, 0, n), keys, values, backend="triton"
        )
    q = _randn(len(seq_lens), heads, head_dim, dtype=dtype, seed=9)
    args = (
        q,
        pool.k_cache,
        pool.v_cache,
        pool.page_table,
        pool.rows,
        torch.tensor(seq_lens),
        head_dim**-0.5,
    )
    want = attention.decode_attention(*args, **pool.kwargs(), backend="torch")
    assert_rel_close(
        attention.decode_attention(*args, **pool.kwargs(), backend="triton"), want, dtype
    )
    # the host-known maximum (what the engine passes) reads the same padded window as the read-back
    assert torch.equal(
        attention.decode_attention(
            *args, **pool.kwargs(), max_seq_len=max(seq_lens), backend="torch"
        ),
        want,
    )
    if dtype == torch.float32:  # the fused C++ kernel serves float32 pools
        assert_rel_close(
            attention.decode_attention(*args, **pool.kwargs(), backend="native"), want, dtype
        )
    for i, n in enumerate(seq_lens):
        slots = pool.slots(i, 0, n)
        explicit = _explicit_attention(
            q[i : i + 1], pool.k_cache[slots], pool.v_cache[slots], n - 1, head_dim**-0.5
        )
        assert_rel_close(want[i : i + 1], explicit, dtype, f"naive request {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_exactly_the_given_slots(dtype):
    k_cache, v_cache = (
        poison_(torch.empty(40, 2, 80, dtype=dtype)),
        poison_(torch.empty(40, 2, 80, dtype=dtype)),
    )
    loc = torch.randperm(40, generator=torch.Generator().manual_seed(0))[:13]
    k, v = _randn(13, 2, 80, dtype=dtype, seed=1), _randn(13, 2, 80, dtype=dtype, seed=2)
    attention.store_kv(k_cache, v_cache, loc, k, v, backend="triton")
    assert torch.equal(k_cache[loc], k) and torch.equal(v_cache[loc], v)
    untouched = torch.ones(40, dtype=torch.bool).index_fill_(0, loc, False)
    assert k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()


def test_store_kv_casts_to_the_pool_dtype():
    k_cache = poison_(torch.empty(20, 2, 64, dtype=torch.bfloat16))
    v_cache = poison_(torch.empty(20, 2, 64, dtype=torch.bfloat16))
    loc, k, v = torch.arange(5, 10), _randn(5, 2, 64, seed=1), _randn(5, 2, 64, seed=2)
    attention.store_kv(k_cache, v_cache, loc, k, v, backend="triton")
    # the interpreter truncates fp32 -> bf16 where a GPU rounds to nearest, hence a tolerance and not equality
    assert_rel_close(k_cache[loc], k, torch.bfloat16, "k")
    assert_rel_close(v_cache[loc], v, torch.bfloat16, "v")


def test_attention_rejects_mismatched_pool():
    q = torch.zeros(3, 4, 64)
    with pytest.raises(ValueError, match="q must be"):
        attention.decode_attention(
            q,
            torch.zeros(8, 3, 64),
            torch.zeros(8, 3, 64),
            torch.zeros(3, 8, dtype=torch.int32),
            torch.arange(3),
            torch.ones(3, dtype=torch.int64),
            0.1,
            backend="triton",
        )
