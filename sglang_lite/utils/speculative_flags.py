"""The speculative-decoding flags of the server arguments (SGLang's names): their combinations and the draft
steps they mean. Kept apart from ``server_args.py`` so that one stays short; it reads the arguments duck-typed."""

from __future__ import annotations

from typing import Any

# EAGLE is accepted as NEXTN's alias for Qwen3.5: its MTP head is the draft model either way
SPECULATIVE_ALGORITHMS = ("NEXTN", "EAGLE")
DEFAULT_SPECULATIVE_STEPS = 3
FLAGS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
HELP = {
    "speculative_algorithm": "Speculative decoding: NEXTN (alias EAGLE) drafts with the checkpoint's MTP head, "
    "verified by the model in one forward (greedy output unchanged); unset: off.",
    "speculative_num_steps": "Tokens the MTP head drafts one after another per decode step (default "
    f"{DEFAULT_SPECULATIVE_STEPS}, or --speculative-num-draft-tokens - 1).",
    "speculative_eagle_topk": "Drafts per step of the chain; only 1 (a chain) is supported.",
    "speculative_num_draft_tokens": "Tokens one verify forward runs per request: --speculative-num-steps + 1.",
}


def check(args: Any) -> None:
    """Raises ValueError (one line: the launcher exits with status 2) for a bad value or combination."""
    if args.speculative_algorithm is None:
        given = [f"--{f.replace('_', '-')}" for f in FLAGS if getattr(args, f) is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --speculative-algorithm NEXTN")
        return
    if args.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
        raise ValueError(
            f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, got "
            f"{args.speculative_algorithm!r}"
        )
    for name in FLAGS:
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(args, name)}")
    if args.speculative_eagle_topk not in (None, 1):
        raise ValueError(
            "speculative_eagle_topk must be 1 (the MTP head drafts a chain), got "
            f"{args.speculative_eagle_topk}"
        )
    steps, draft_tokens = args.speculative_num_steps, args.speculative_num_draft_tokens
    if steps is not None and draft_tokens is not None and draft_tokens != steps + 1:
        raise ValueError(
            f"speculative_num_draft_tokens ({draft_tokens}) must be speculative_num_steps + 1 "
            f"({steps + 1}) with a chain of drafts (topk 1)"
        )
    if draft_tokens == 1:
        raise ValueError("speculative_num_draft_tokens must be >= 2 (a draft and the last token)")
    _check_not_combined(args)


def _check_not_combined(args: Any) -> None:
    blockers = {
        "enable_dp_attention": args.enable_dp_attention,
        "disaggregation_mode prefill/decode": args.disaggregation_mode != "null",
    }
    blocked = [name for name, on in blockers.items() if on]
    if blocked:
        raise ValueError(f"speculative decoding does not run with {', '.join(blocked)} yet")


def draft_steps(args: Any) -> int:
    """Tokens the MTP head drafts per decode step: the steps, else draft tokens - 1, else the default (0: off)."""
    if args.speculative_algorithm is None:
        return 0
    if args.speculative_num_steps is not None:
        return args.speculative_num_steps
    if args.speculative_num_draft_tokens is not None:
        return args.speculative_num_draft_tokens - 1
    return DEFAULT_SPECULATIVE_STEPS
