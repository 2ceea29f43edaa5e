"""A short greedy generation with a model from ``load_model``, no engine: ``python -m sglang_lite.generate``.

It shows the cached mode on its own: one prefill of the prompt, then one decode step per new token.
"""

from __future__ import annotations

import argparse

import torch

from sglang_lite.forward_batch import ForwardMode, build_forward_batch
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.mem_cache.request_memory import Holding, RequestMemory
from sglang_lite.models.loader import load_model
from sglang_lite.tokenizer.hf_tokenizer import load_tokenizer


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int
) -> list[int]:
    """Greedy continuation of one prompt; stops at the model's end-of-sequence tokens."""
    device = model.lm_head.weight.device
    total = len(prompt_ids) + max_new_tokens
    pools = ModelPools.create(model.config, total, 1, total, model.compute_dtype, device)
    memory = RequestMemory(pools)
    holding = Holding(list(prompt_ids))
    memory.admit(holding)
    output: list[int] = []
    new_tokens = list(prompt_ids)
    mode = ForwardMode.EXTEND
    for _ in range(max_new_tokens):
        slots = memory.alloc_kv([holding], [len(new_tokens)])
        batch = build_forward_batch(
            pools,
            mode,
            [new_tokens],
            [holding.num_computed],
            [holding.req_row],
            [holding.state_slot],
            device,
            slots,
        )
        holding.num_computed += len(new_tokens)
        token = int(model.forward_batch(batch)[0].argmax())
        output.append(token)
        holding.tokens.append(token)
        if token in model.config.eos_token_ids:
            break
        new_tokens = [token]
        mode = ForwardMode.DECODE
    memory.release(holding)
    return output


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model-path", default=None, help="checkpoint folder (default: the built-in tiny model)"
    )
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model_path)
    model = load_model(args.model_path)
    ids = tokenizer(args.prompt)["input_ids"]
    output = greedy_generate(model, ids, args.max_new_tokens)
    print(
        f"prompt: {args.prompt!r}\ncompletion ({len(output)} tokens): {tokenizer.decode(output)!r}"
    )


if __name__ == "__main__":
    main()
