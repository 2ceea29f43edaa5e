"""A request's images on its rank: their M-RoPE positions, and the vision tower's output where a prefill needs it.

The text model's rotary takes three positions a token (temporal, height, width): a text token has the same one
three times, an image token its place in its image's grid (``models/mrope.py``). Past the prompt every token is text,
at its index plus the prompt's ``delta`` (a decode step's positions are offset by it: ``position_offsets``). The
vision tower runs at the first prefill chunk that holds one of a request's image tokens; its output stays with the
request until the prompt is prefilled (a retracted request that prefills again runs it again).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from sglang_lite.models.mrope import mrope_positions
from sglang_lite.multimodal.inputs import ImageInputs
from sglang_lite.protocol.config import SchedulerConfig


class RequestImages:
    """One request's images: its prompt's positions [3, P], their ``delta``, where its image tokens are, and the
    vision tower's output for them (rows in prompt order) once computed."""

    def __init__(self, inputs: ImageInputs, input_ids: list[int], config: SchedulerConfig) -> None:
        vocab_size, image_token = config.vocab_size, config.image_token_id
        ids = [image_token if t >= vocab_size else t for t in input_ids]
        positions, delta = mrope_positions(
            ids, list(inputs.grid_thw), image_token, config.image_merge_size
        )
        self.inputs = inputs
        self.positions = positions
        self.delta = int(delta)
        self.prompt_len = len(input_ids)
        self.image_at = np.flatnonzero(np.asarray(input_ids, dtype=np.int64) >= vocab_size)
        self.embeds: torch.Tensor | None = None

    def positions_of(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of tokens ``start..end`` (past the prompt: text at index + delta)."""
        inside = self.positions[:, start : min(end, self.prompt_len)]
        if end <= self.prompt_len:
            return inside
        after = torch.arange(max(start, self.prompt_len), end, dtype=torch.int64) + self.delta
        return torch.cat([inside, after.expand(3, -1)], dim=1)

    def image_tokens_in(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(token index, embedding row) of this request's image tokens among tokens ``start..end``."""
        first, last = np.searchsorted(self.image_at, [start, end])
        return self.image_at[first:last], np.arange(first, last)


def extend_images(
    reqs: list, extend_lens: list[int], encode: Callable[[ImageInputs], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """For a prefill batch whose requests (``reqs[i]`` running ``extend_lens[i]`` tokens from its ``num_computed``)
    hold images: the batch's M-RoPE positions [3, T], the rows of its image tokens and their embeddings (``encode``:
    the vision tower; None, None when the batch runs no image token); None when none of them has images."""
    if all(r.images is None for r in reqs):
        return None
    positions: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    embeds: list[torch.Tensor] = []
    offset = 0
    for req, count in zip(reqs, extend_lens):
        start, end = req.num_computed, req.num_computed + count
        images: RequestImages | None = req.images
        if images is None:
            positions.append(torch.arange(start, end, dtype=torch.int64).expand(3, -1))
        else:
            positions.append(images.positions_of(start, end))
            tokens, which = images.image_tokens_in(start, end)
            if len(tokens):
                if images.embeds is None:
                    images.embeds = encode(images.inputs)
                rows.append(torch.from_numpy(tokens - start + offset))
                embeds.append(images.embeds[torch.from_numpy(which)])
            if end >= images.prompt_len:
                # the prompt is prefilled: its images' rows are in the KV cache now
                images.embeds = None
        offset += count
    if not rows:
        return torch.cat(positions, dim=1), None, None
    return torch.cat(positions, dim=1), torch.cat(rows), torch.cat(embeds)
