"""A model's decoder layers as one C++ call over its pools (``cpu_kernels.DecodeLayers``), with the step's two ends
(the embedding, the final norm and the LM head) where the model has them: what ``Qwen3_5Model`` runs a CPU decode
step, a greedy run of steps and a prefill's first tokens through."""

from __future__ import annotations

from torch import nn

from sglang_lite.distributed import get_parallel_state
from sglang_lite.kernels import cpu as cpu_kernels
from sglang_lite.layers.norm import GemmaRMSNorm
from sglang_lite.mem_cache.pools import ModelPools


class OneCallLayers:
    """Decoder layers' decode blocks as one C++ call (``cpu_kernels.DecodeLayers``) over some pools: built on
    first use, again for other pools or after ``reset`` (the blocks gathered their weights again); None where
    ranks reduce between the blocks (tensor parallelism)."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self._layers = (layers,)  # a tuple keeps them out of the owning module's children
        self.built: tuple[ModelPools, cpu_kernels.DecodeLayers] | None = None  # (pools, the call)
        # (embedding, final norm, LM head) for ``run_logits``, when the model has them all
        self.ends: tuple[nn.Module, GemmaRMSNorm, nn.Module] | None = None

    def get(self, pools: ModelPools) -> cpu_kernels.DecodeLayers | None:
        if get_parallel_state().world_size > 1:
            return None
        if self.built is None or self.built[0] is not pools:
            layers = cpu_kernels.DecodeLayers()
            for layer in self._layers[0]:
                layer.add_decode_blocks(layers, pools)
            if self.ends is not None:
                embedding, norm, head = self.ends
                layers.set_ends(
                    embedding.weight,
                    cpu_kernels.Norm(norm.weight, norm.eps),
                    cpu_kernels.Weight.of(head),
                )
            self.built = (pools, layers)
        return self.built[1]

    def reset(self) -> None:
        self.built = None
