"""What a rank calls on its model: the ``Runner`` interface between the scheduler and the model executor.

``ModelRunner`` is the one implementation (eager forwards, CUDA-graph replays, the CPU's fused kernels); tests
wrap or replace it through this interface. The scheduler, the rank process and the factory speak of a ``Runner``
and of nothing else of the model.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from sglang_lite.forward_batch import ForwardBatch, VerifyStates
from sglang_lite.multimodal.inputs import ImageInputs


class Runner(Protocol):
    def forward_batch(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        """Logits of a prefill or decode batch: [B, vocab] of each request's last new token, or [T, vocab] of
        every new token with ``all_logits``."""
        ...

    def decode_greedy(
        self,
        batch: ForwardBatch,
        out_cache_loc: torch.Tensor,
        stop_ids: torch.Tensor,
        wake_fd: int = -1,
    ) -> torch.Tensor | None:
        """Greedy decode steps back to back from the decode ``batch`` (its first step) in one call, where the model
        has one (the CPU's C++ decode layers): each step's argmax the next step's input, one position further, its
        KV into the next row of ``out_cache_loc`` [steps, B]; the run ends after the step in which a row's token is
        one of its ``stop_ids`` [B, S] (int64, -1 padding), or after a step at whose end the file descriptor
        ``wake_fd`` (-1: none; the scheduler's command inbox) is readable. Tokens [steps run, B]; None where there
        is no such call (the caller steps the forwards itself)."""
        ...

    def extend_greedy(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Each request's first token of the prefill ``batch`` when every request takes its row's argmax: tokens [B]
        (int64) where the model finds them without the logits (the CPU's one decode call: the LM head's greedy
        screen), the same as the argmax of ``forward_batch``'s logits; None where it does not (nothing ran)."""
        ...

    def forward_idle(self) -> None:
        """An empty forward: under DP attention a rank with nothing to run joins the other ranks' MoE layers."""
        ...

    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The final hidden state [T, hidden] of every new token (what a draft model continues from)."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over hidden states [T, hidden]."""
        ...

    def forward_verify(
        self, batch: ForwardBatch, counts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, VerifyStates]:
        """Speculation's verify forward, one row a token (``counts[i]`` tokens of request i): hidden [T, hidden],
        logits [T, vocab] and the Gated DeltaNet states after each token."""
        ...

    def encode_images(self, images: ImageInputs) -> torch.Tensor:
        """The vision tower's output for a request's images: [image tokens, hidden], in prompt order."""
        ...

    def forward_mtp(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The checkpoint's MTP head over ``batch`` (loaded for NEXTN only): its hidden state [T, hidden]."""
        ...

    def weight_bytes(self) -> int:
        """Bytes of the model's weights on the device."""
        ...

    def graph_bytes(self) -> int:
        """Bytes the captured CUDA graphs took (0 without graphs)."""
        ...

    def stream_plan(self) -> dict[str, Any] | None:
        """The alternate-stream plan of the model (``streams/plan.py``), or None when it has none."""
        ...
