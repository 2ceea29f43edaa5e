"""Tiny random transformers Qwen3.5 models saved as checkpoints in the layouts real ones use."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

BASE = dict(
    vocab_size=160,
    hidden_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    linear_key_head_dim=12,
    linear_value_head_dim=10,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
)
MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=16,
)
DENSE = dict(intermediate_size=40)


def make_hf_model(moe: bool = True, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random transformers model whose norms and gates are perturbed so that every weight matters."""
    torch.manual_seed(seed)
    options = {**BASE, **(MOE if moe else DENSE), **overrides}
    config = Qwen3_5MoeTextConfig(**options) if moe else Qwen3_5TextConfig(**options)
    model = (Qwen3_5MoeForCausalLM if moe else Qwen3_5ForCausalLM)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def greedy_tokens(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers ``generate``'s greedy continuation of one prompt, exactly ``new_tokens`` long."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def save_checkpoint(model: torch.nn.Module, path: str, layout: str = "text") -> str:
    """Saves ``model`` to ``path`` in one of the layouts a loader meets in practice.

    text: save_pretrained as is (``model.`` prefix, per-expert weights);
    vl: the VL wrapper (``model.language_model.`` prefix, a config with ``text_config``, vision and MTP tensors);
    fused_experts: experts stored as ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I];
    sharded: two safetensors files with ``model.safetensors.index.json``.
    """
    model.save_pretrained(path)
    if layout == "text":
        return path
    tensors = load_file(os.path.join(path, "model.safetensors"))
    if layout == "vl":
        tensors, config = _to_vl(tensors, _read_config(path))
        _write_config(path, config)
    elif layout == "fused_experts":
        tensors = _fuse_experts(tensors)
    os.remove(os.path.join(path, "model.safetensors"))
    _write_tensors(path, tensors, shards=2 if layout == "sharded" else 1)
    return path


def _read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _write_config(path: str, config: dict) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _to_vl(tensors: dict, text_config: dict) -> tuple[dict, dict]:
    renamed = {
        (f"model.language_model.{k[len('model.') :]}" if k.startswith("model.") else k): v
        for k, v in tensors.items()
    }
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2)
    renamed["mtp.fc.weight"] = torch.zeros(4, 4)
    wrapper_type = text_config["model_type"].removesuffix("_text")
    config = {
        "model_type": wrapper_type,
        "architectures": ["VLWrapperForTest"],
        "text_config": text_config,
        "tie_word_embeddings": text_config.get("tie_word_embeddings", False),
    }
    return renamed, config


def _fuse_experts(tensors: dict) -> dict:
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    layers = sorted({k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k})
    for layer in layers:
        count = len(
            {
                k
                for k in tensors
                if k.startswith(f"{layer}.mlp.experts.") and k.endswith("down_proj.weight")
            }
        )
        experts = [f"{layer}.mlp.experts.{e}" for e in range(count)]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [
                torch.cat([tensors[f"{e}.gate_proj.weight"], tensors[f"{e}.up_proj.weight"]])
                for e in experts
            ]
        )
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack(
            [tensors[f"{e}.down_proj.weight"] for e in experts]
        )
    return out


def _write_tensors(path: str, tensors: dict, shards: int) -> None:
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n].contiguous() for n in part}, os.path.join(path, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
