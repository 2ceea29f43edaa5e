"""Tiny random transformers Qwen3.5 checkpoints (dense and MoE) and their transformers greedy outputs; the built-in
tokenizer and a grammar cache for the grammar tests."""

from __future__ import annotations

import os

import pytest
import torch

SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,  # 3 Gated DeltaNet layers, then 1 gated full-attention layer
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    initializer_range=0.1,  # wider logits than the default 0.02: fewer near-ties for the greedy comparison
)
MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
DENSE = dict(intermediate_size=96)


class TinyCheckpoint:
    """A saved random transformers model plus a memo of its greedy continuations."""

    def __init__(self, kind: str, root: str) -> None:
        from transformers import (
            Qwen3_5ForCausalLM,
            Qwen3_5MoeForCausalLM,
            Qwen3_5MoeTextConfig,
            Qwen3_5TextConfig,
        )

        torch.manual_seed(1234 if kind == "moe" else 4321)
        if kind == "moe":
            self.model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**SIZES, **MOE))
        else:
            self.model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SIZES, **DENSE))
        self.model.eval()
        self.path = os.path.join(root, kind)
        self.model.save_pretrained(self.path)
        self.kind = kind
        self._memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def _generate(self, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=0,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """transformers ``generate`` of this prompt alone (no padding), ignoring eos."""
        key = (tuple(prompt), max_new_tokens)
        if key not in self._memo:
            self._memo[key] = self._generate(*key)
        return list(self._memo[key])


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyCheckpoint]:
    root = str(tmp_path_factory.mktemp("tiny_qwen3_5"))
    return {kind: TinyCheckpoint(kind, root) for kind in ("moe", "dense")}


def random_prompts(lengths: list[int], vocab: int = 256, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


# ---- grammars on the built-in model's tokenizer (its vocabulary: 4096) -----------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    from sglang_lite.tokenizer import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="module")
def cache(tokenizer):
    """A grammar cache with its checker processes, shut down after the module."""
    from sglang_lite.sampling.grammar import GrammarCache

    cache = GrammarCache(tokenizer, 4096)
    yield cache
    cache.shutdown()
