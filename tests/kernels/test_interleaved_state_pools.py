"""State pools that keep a slot's states of every GDN layer together (``LinearStatePool``: [slots, layers, ...], each
layer a view whose slots are strided), as a PD transfer writes them in one block per kind: the conv and the gated
delta rule kernels of every backend give what they give on a packed pool and touch only their own layer's states,
whether a batch's slots are consecutive (updated in place) or scattered (gathered)."""

from __future__ import annotations

import pytest
import torch

from sglang_lite.kernels import conv1d
from sglang_lite.kernels import gated_delta_rule as gdn
from sglang_lite.kernels.cpu import available as native_available

from .utils import assert_rel_close

LAYERS, LAYER = 3, 1  # the kernels run on layer 1's view
SLOTS = {"consecutive": [1, 2, 3], "scattered": [4, 1, 3]}
BACKENDS = ["torch", "triton", "native"]


def _interleaved(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the buffer [slots, layers, ...], layer LAYER's view of it holding ``packed``'s values)."""
    gen = torch.Generator().manual_seed(1)
    buffer = torch.randn(packed.shape[0], LAYERS, *packed.shape[1:], generator=gen)
    buffer[:, LAYER] = packed
    return buffer, buffer[:, LAYER]


def _skip_unbuilt(backend: str) -> None:
    if backend == "native" and not native_available():
        pytest.fail("the fused C++ CPU kernels did not build")


def _others(buffer: torch.Tensor) -> torch.Tensor:
    return torch.cat([buffer[:, i] for i in range(LAYERS) if i != LAYER])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slots", SLOTS.values(), ids=SLOTS.keys())
def test_recurrent_step_on_an_interleaved_pool(nan_allocations, backend, slots):
    _skip_unbuilt(backend)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(3, 1, 20, generator=gen) for _ in range(2))
    v = torch.randn(3, 2, 48, generator=gen)
    g, beta = -torch.rand(3, 2, generator=gen), torch.rand(3, 2, generator=gen)
    packed = 0.1 * torch.randn(5, 2, 20, 48, generator=gen)
    buffer, view = _interleaved(packed.clone())
    others = _others(buffer).clone()
    index = torch.tensor(slots)
    want = gdn.fused_recurrent_gated_delta_rule(q, k, v, g, beta, packed, index, backend="torch")
    got = gdn.fused_recurrent_gated_delta_rule(q, k, v, g, beta, view, index, backend=backend)
    assert_rel_close(got, want, torch.float32)
    assert_rel_close(view, packed, torch.float32, "state pool")
    assert torch.equal(_others(buffer), others), "another layer's states changed"


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_on_an_interleaved_pool(nan_allocations, backend):
    _skip_unbuilt(backend)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(22, 1, 20, generator=gen) for _ in range(2))
    v = torch.randn(22, 2, 48, generator=gen)
    g, beta = -torch.rand(22, 2, generator=gen), torch.rand(22, 2, generator=gen)
    packed = 0.1 * torch.randn(5, 2, 20, 48, generator=gen)
    buffer, view = _interleaved(packed.clone())
    others = _others(buffer).clone()
    args = (torch.tensor([3, 1]), torch.tensor([0, 17, 22], dtype=torch.int32))  # lengths 17, 5
    want = gdn.chunk_gated_delta_rule(q, k, v, g, beta, packed, *args, backend="torch")
    got = gdn.chunk_gated_delta_rule(q, k, v, g, beta, view, *args, backend=backend)
    assert_rel_close(got, want, torch.float32)
    assert_rel_close(view, packed, torch.float32, "state pool")
    assert torch.equal(_others(buffer), others), "another layer's states changed"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slots", SLOTS.values(), ids=SLOTS.keys())
def test_conv_on_an_interleaved_pool(nan_allocations, backend, slots):
    _skip_unbuilt(backend)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 4, generator=gen)
    packed = torch.randn(5, 24, 3, generator=gen)
    buffer, view = _interleaved(packed.clone())
    others = _others(buffer).clone()
    index = torch.tensor(slots)
    x = torch.randn(3, 24, generator=gen)
    want = conv1d.causal_conv1d_update(x, weight, packed, index, backend="torch")
    got = conv1d.causal_conv1d_update(x, weight, view, index, backend=backend)
    assert_rel_close(got, want, torch.float32)
    assert_rel_close(view, packed, torch.float32, "conv pool")
    prefill = torch.randn(9, 24, generator=gen)
    cu = torch.tensor([0, 4, 6, 9], dtype=torch.int32)
    want = conv1d.causal_conv1d_fn(prefill, weight, packed, index, cu, backend="torch")
    got = conv1d.causal_conv1d_fn(prefill, weight, view, index, cu, backend=backend)
    assert_rel_close(got, want, torch.float32)
    assert_rel_close(view, packed, torch.float32, "conv pool")
    assert torch.equal(_others(buffer), others), "another layer's states changed"
