"""A causal LM's whole-sequence forward without a cache (``Qwen3_5ForCausalLM.forward``), the prompt's images
included: what transformers' ``forward`` computes, for scripts, tests and users who want logits.

Each row of ``input_ids`` runs as one request of a fresh pool. With images, the vision tower (``model.visual``:
``load_model(..., with_vision=True)``) embeds ``pixel_values``; the image placeholder tokens of the rows take those
embeddings in order (row after row, each run of placeholders the next images of ``image_grid_thw``) and the rows
rotate by their M-RoPE positions (``models/mrope.py``), as the scheduler's prefill does."""

from __future__ import annotations

from typing import Any

import torch

from sglang_lite.forward_batch import ForwardBatch, ForwardMode, build_forward_batch
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.models.mrope import mrope_positions


@torch.no_grad()
def full_forward(
    model: Any,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
) -> torch.Tensor:
    """input_ids [B, T] (and the images of its placeholders) -> logits [B, T, vocab]."""
    num_seqs, seq_len = input_ids.shape
    pools = ModelPools.create(
        model.config, num_seqs * seq_len, num_seqs, seq_len, model.compute_dtype, input_ids.device
    )
    rows = pools.req_to_token.allocator.alloc(num_seqs)
    slots = pools.states.alloc(num_seqs)
    batch = build_forward_batch(
        pools,
        ForwardMode.EXTEND,
        input_ids.tolist(),
        [0] * num_seqs,
        rows,
        slots,
        input_ids.device,
        pools.alloc_kv(rows, [0] * num_seqs, [seq_len] * num_seqs),
    )
    if pixel_values is not None or image_grid_thw is not None:
        _add_images(model, batch, input_ids, pixel_values, image_grid_thw)
    return model.forward_batch(batch, all_logits=True).view(num_seqs, seq_len, -1)


def _add_images(
    model: Any,
    batch: ForwardBatch,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
) -> None:
    vision = model.config.vision
    if vision is None or getattr(model, "visual", None) is None:
        raise ValueError(
            "pixel_values: the model has no vision tower (load a VL checkpoint with "
            "load_model(..., with_vision=True))"
        )
    if pixel_values is None or image_grid_thw is None:
        raise ValueError("pixel_values and image_grid_thw come together")
    grids = [tuple(int(v) for v in grid) for grid in image_grid_thw.tolist()]
    merge = vision.spatial_merge_size
    is_image = input_ids == vision.image_token_id
    # each row takes the next images whose tokens its placeholders hold
    positions, taken = [], 0
    for row, count in zip(input_ids.tolist(), is_image.sum(dim=1).tolist()):
        first = taken
        while count > 0 and taken < len(grids):
            count -= grids[taken][0] * grids[taken][1] * grids[taken][2] // merge**2
            taken += 1
        positions.append(mrope_positions(row, grids[first:taken], vision.image_token_id, merge)[0])
    if taken < len(grids):
        raise ValueError(
            f"image_grid_thw: {len(grids) - taken} image(s) have no placeholder tokens in input_ids"
        )
    device = input_ids.device
    grid = torch.tensor(grids, dtype=torch.int64, device=device)
    weight = next(model.visual.parameters())
    embeds = model.visual(pixel_values.to(weight.device, weight.dtype), grid)
    batch.mrope_positions = torch.cat(positions, dim=1).to(device)
    batch.image_rows = is_image.flatten().nonzero().squeeze(1)
    batch.image_embeds = embeds.to(model.compute_dtype)
