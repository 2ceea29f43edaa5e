"""Tiny random transformers Qwen3.5 models saved as checkpoints in the layouts real ones use."""

from __future__ import annotations

import json
import os
import tempfile

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


def add_mtp_head(model: torch.nn.Module, path: str, seed: int = 0) -> torch.nn.Module:
    """Adds a random MTP head (``mtp.*`` tensors, as released checkpoints name them; ``mtp_num_hidden_layers``
    1 in the config) to the checkpoint of ``model`` saved at ``path`` (any ``save_checkpoint`` layout).

    transformers has no MTP module, so the head's decoder layer and final norm are those of a one-layer
    full-attention transformers model sharing ``model``'s embedding and LM head, which is returned: fed
    ``inputs_embeds = fc([norm_e(embed(next token)) | norm_h(hidden)])`` it is the head, a reference for it; its
    ``mtp_fc`` and ``mtp_pre_fc_norms`` attributes hold the rest."""
    torch.manual_seed(seed)
    config = model.config.to_dict()
    config.update(num_hidden_layers=1, layer_types=["full_attention"])
    head = type(model)(type(model.config)(**config)).eval()
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        head.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        head.lm_head.weight.copy_(model.lm_head.weight)
    head.mtp_fc = torch.randn(hidden, 2 * hidden) * (2 * hidden) ** -0.5
    head.mtp_pre_fc_norms = (torch.randn(hidden) * 0.1, torch.randn(hidden) * 0.1)
    with tempfile.TemporaryDirectory() as tmp:  # the layout save_pretrained writes, as the model's
        head.save_pretrained(tmp)
        state = load_file(os.path.join(tmp, "model.safetensors"))
    tensors = {
        f"mtp.{k[len('model.') :]}": v
        for k, v in state.items()
        if k.startswith("model.layers.0.") or k == "model.norm.weight"
    }
    tensors["mtp.fc.weight"] = head.mtp_fc
    tensors["mtp.pre_fc_norm_embedding.weight"] = head.mtp_pre_fc_norms[0]
    tensors["mtp.pre_fc_norm_hidden.weight"] = head.mtp_pre_fc_norms[1]
    _append_tensors(path, tensors)
    return head


def mtp_reference_logits(head: torch.nn.Module, hidden: torch.Tensor, next_ids: list[int]):
    """The head's logits [T, vocab] over one sequence: position i takes the main model's final hidden state
    ``hidden[i]`` (after its norm) and the token ``next_ids[i]`` that follows it."""
    eps = head.config.rms_norm_eps

    def gemma_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)

    embedded = head.model.embed_tokens(torch.tensor(next_ids))
    norm_e, norm_h = head.mtp_pre_fc_norms
    joined = torch.cat([gemma_norm(embedded, norm_e), gemma_norm(hidden, norm_h)], dim=-1)
    with torch.no_grad():
        out = head(inputs_embeds=(joined @ head.mtp_fc.T).unsqueeze(0))
    return out.logits[0]


def _append_tensors(path: str, extra: dict) -> None:
    """Adds ``extra`` to the checkpoint at ``path`` (experts fused when its are; the config says 1 MTP layer)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for file in files:
        tensors.update(load_file(os.path.join(path, file)))
        os.remove(os.path.join(path, file))
    if os.path.exists(index):
        os.remove(index)
    if any(k.endswith("mlp.experts.gate_up_proj") for k in tensors):
        extra = _fuse_experts(extra)
    tensors.update(extra)
    _write_tensors(path, tensors, shards=len(files))
    config = _read_config(path)
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
    _write_config(path, config)
