"""Tiny random Qwen3.5 checkpoints (dense and MoE) with an MTP head, and runs of one scheduler over them.

Two kinds of head: a random one (drafts the model rarely agrees with) and a "repeating" one: ``fc`` passes the
model's hidden state through and the decoder layer adds little, so the head's logits are about the model's own at
the position before, whose argmax is the token the head is given: it drafts that token again. Tiny random models
often fall into repeating a token, so that head's drafts are accepted in part: both the accepted and the rejected
paths run.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_lite.runtime.factory import create_scheduler
from sglang_lite.server_args import ServerArgs
from tests.hf_checkpoints import add_mtp_head, make_hf_model, save_checkpoint

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def repeating_head(path: str, layer_scale: float = 0.1) -> None:
    """Turns the checkpoint's MTP head into one that drafts the token it is given (see the module docstring)."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    hidden = tensors["mtp.fc.weight"].shape[0]
    tensors["mtp.fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
    for name in list(tensors):
        if name.startswith("mtp.layers.0.") and name.endswith(
            ("o_proj.weight", "down_proj.weight")
        ):
            tensors[name] = tensors[name] * layer_scale
    save_file(tensors, file)


def make_spec_checkpoint(root: str, moe: bool, repeating: bool, seed: int = 1) -> str:
    path = os.path.join(root, f"{'moe' if moe else 'dense'}-{'repeat' if repeating else 'random'}")
    hf = make_hf_model(moe=moe, seed=seed)
    save_checkpoint(hf, path)
    add_mtp_head(hf, path, seed=seed + 1)
    if repeating:
        repeating_head(path)
    return path


@pytest.fixture(scope="session")
def spec_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], str]:
    root = str(tmp_path_factory.mktemp("spec"))
    return {
        (kind, head): make_spec_checkpoint(root, kind == "moe", head == "repeat")
        for kind in ("moe", "dense")
        for head in ("repeat", "random")
    }


def scheduler_args(path: str, **overrides) -> ServerArgs:
    args = dict(
        model_path=path,
        skip_tokenizer_init=True,
        max_total_tokens=2048,
        max_running_requests=8,
        chunked_prefill_size=8,
        max_prefill_tokens=16,
    )
    return ServerArgs(**{**args, **overrides})


def run_scheduler(args: ServerArgs, requests: list[tuple[list[int], dict]]):
    """Runs every request to the end on one scheduler; (outputs by index, last meta_info by index, scheduler),
    after checking its accounting at each step and that nothing is held at the end."""
    scheduler = create_scheduler(args)
    for i, (prompt, params) in enumerate(requests):
        scheduler.add_request(str(i), prompt, params)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    metas: dict[int, dict] = {}
    while scheduler.has_work:
        for out in scheduler.step():
            tokens[int(out.rid)].extend(out.new_token_ids)
            metas[int(out.rid)] = out.meta_info
        scheduler.check_invariants()
    assert scheduler.get_loads().num_used_tokens == 0
    return tokens, metas, scheduler
