"""The LM head's int8 screen (``kernels/cpu/csrc/greedy_head.h``): a row it decides is the argmax of the logits
``linear`` computes for that row alone (float32 and bf16 heads stored either way, every bf16 mode, K not a multiple
of 32, a vocabulary not a multiple of 8); near ties, equal rows and non-finite inputs come back undecided (-1) or
right, never wrong."""

from __future__ import annotations

import pytest
import torch

from sglang_lite.kernels import cpu

MODES = (0, 1, 2)  # widen, auto, vdpbf16ps (the kernels widen where the CPU lacks it)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    cpu.require()


def _head(V: int, K: int, dtype: torch.dtype, layout: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(V, K, generator=gen) * 0.02).to(dtype)
    return (
        w.t().contiguous().t() if layout == "in_out" else w
    )  # [in, out]: what weight_layout stores


def _rows(n: int, K: int, seed: int = 1) -> torch.Tensor:
    """Rows of different scales, some with a few large features (a normed hidden state's outliers)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, K, generator=gen) * torch.rand(n, 1, generator=gen) * 3
    x[::3, :4] *= 20
    return x


def _whole_head_argmax(x: torch.Tensor, w: torch.Tensor, mode: int, run: int = 1) -> torch.Tensor:
    """Runs of ``run`` rows through ``linear`` (a decode step's rows), then each row's argmax."""
    logits = [
        cpu._ops().linear_rows(x[i : i + run].contiguous(), w, None, [], mode)
        for i in range(0, len(x), run)
    ]
    return cpu.argmax_rows(torch.cat(logits))


@pytest.mark.parametrize("shape", [(1000, 64), (4103, 100), (6000, 256)])
@pytest.mark.parametrize("layout", ["in_out", "out_in"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_decided_row_is_the_whole_heads_argmax(shape, layout, dtype):
    V, K = shape
    w = _head(V, K, dtype, layout)
    x = _rows(48, K)
    for mode in MODES:
        # the screen takes runs of 8 rows: linear's runs of 8 (vdpbf16ps or not as for 8) and of 1 agree here
        got = cpu.greedy_head_argmax(x, w, mode)
        decided = got >= 0
        for run in (8, 1):
            want = _whole_head_argmax(x, w, mode, run)
            assert torch.equal(got[decided], want[decided]), (mode, run, got, want)
        assert decided.float().mean() >= 0.9, (mode, decided.sum())  # the screen decides
    # a run of 3 rows alone, and rows of a strided view
    got = cpu.greedy_head_argmax(x[5:8], w, 1)
    assert torch.equal(got[got >= 0], _whole_head_argmax(x[5:8], w, 1, 3)[got >= 0])
    wide = torch.cat([x, x], dim=1)[:, :K]
    assert torch.equal(cpu.greedy_head_argmax(wide[:3], w, 1), cpu.greedy_head_argmax(x[:3], w, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_near_ties_and_equal_rows_are_never_decided_wrong(dtype):
    """Near copies of a row's top row of the head (relative changes of 1e-2 down to 1e-7, at or below float32's
    rounding of a logit) put a few candidates within a hair of each other: each is decided right or left
    undecided, and both happen. An exact copy at a later index leaves it undecided (the whole head's first of the
    two then wins)."""
    V, K = 2000, 64
    x = _rows(24, K)
    outcomes = set()
    for i in range(len(x)):
        w = _head(V, K, torch.float32, "out_in", seed=i)
        top = int(_whole_head_argmax(x[i : i + 1], w, 0)[0])
        gen = torch.Generator().manual_seed(100 + i)
        copies = torch.randperm(V, generator=gen)[:8]
        for j, row in enumerate(copies.tolist()):
            eps = 10.0 ** -(2 + 5 * j / 7)
            w[row] = w[top] * (1 + eps * torch.randn(K, generator=gen))
        w = w.to(dtype)
        for mode in MODES:
            want = int(_whole_head_argmax(x[i : i + 1], w, mode)[0])
            got = int(cpu.greedy_head_argmax(x[i : i + 1], w, mode)[0])
            assert got in (want, -1), (i, mode, got, want)
            outcomes.add(got == want)
    assert outcomes == {True, False}
    x1 = _rows(1, K, seed=9)
    w2 = _head(V, K, dtype, "in_out")
    top = int(_whole_head_argmax(x1, w2, 0)[0])
    w2[V - 1] = w2[top]
    assert int(cpu.greedy_head_argmax(x1, w2, 0)[0]) == -1
    assert int(_whole_head_argmax(x1, w2, 0)[0]) == min(top, V - 1)


def test_rows_it_cannot_decide_come_back_undecided():
    K = 64
    w = _head(3000, K, torch.bfloat16, "in_out")
    x = _rows(4, K)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    x[2] = 0.0  # every logit 0: every row a candidate
    assert cpu.greedy_head_argmax(x, w, 1)[:3].tolist() == [-1, -1, -1]
    assert int(cpu.greedy_head_argmax(x, w, 1)[3]) == int(_whole_head_argmax(x[3:], w, 1)[0])
    bad = w.clone()
    bad[17, 2] = float("inf")  # no screen of a head that holds a non-finite value
    assert cpu.greedy_head_argmax(x[3:], bad, 1).tolist() == [-1]


@pytest.mark.parametrize("V", [1, 5, 13])
def test_a_vocabulary_below_a_group_of_eight(V):
    w = _head(V, 40, torch.float32, "out_in")
    x = _rows(8, 40)
    got = cpu.greedy_head_argmax(x, w, 1)
    want = _whole_head_argmax(x, w, 1)
    assert torch.equal(got[got >= 0], want[got >= 0]) and (got >= 0).all()


def test_a_head_that_does_not_match_the_rows_is_an_error():
    with pytest.raises(RuntimeError, match=r"the head must be \[V, 64\]"):
        cpu.greedy_head_argmax(torch.zeros(1, 64), torch.zeros(10, 32), 1)
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        cpu.greedy_head_argmax(torch.zeros(1, 64), torch.zeros(10, 64, dtype=torch.float16), 1)
