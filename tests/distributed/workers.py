"""Bodies of the ranks the distributed tests start (a module of its own: spawned processes import it)."""

from __future__ import annotations

import os
import traceback

import torch


def run_rank(
    rank: int, port: int, layout: dict, path: str, prompt: list[int] | None, fusion: bool, queue
) -> None:
    """Joins a gloo world, loads ``path`` sharded, and puts (rank, logits of ``prompt``) on ``queue`` (an empty
    forward when ``prompt`` is None, as an idle DP-attention rank runs)."""
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    from sglang_lite.distributed import ParallelConfig, destroy_distributed, init_distributed
    from sglang_lite.forward_batch import ForwardMode, build_forward_batch
    from sglang_lite.mem_cache.pools import ModelPools
    from sglang_lite.models.loader import load_model
    from sglang_lite.server_args import ServerArgs

    try:
        init_distributed(ParallelConfig(**layout), rank, f"127.0.0.1:{port}", "cpu", timeout_s=60)
        model = load_model(path, server_args=ServerArgs(disable_shared_experts_fusion=not fusion))
        if prompt is not None:
            logits = model(torch.tensor([prompt]))[0]
        else:
            pools = ModelPools.create(model.config, 8, 1, 8, torch.float32, "cpu")
            logits = model.forward_batch(
                build_forward_batch(pools, ForwardMode.DECODE, [], [], [], [], "cpu", [])
            )
        # by value: a shared tensor is fetched from this process after it put it, which may have exited by then
        queue.put((rank, logits.detach().numpy().copy()))
    except BaseException:
        queue.put((rank, traceback.format_exc()))
    finally:
        destroy_distributed()
