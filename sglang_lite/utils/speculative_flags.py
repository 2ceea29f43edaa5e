"""The speculative-decoding section of the server arguments (SGLang's flag names): the algorithms, the flags each
takes, their combinations and the draft tokens they mean. ``server_args.py`` holds the fields; this module owns
what they mean together, and the list of algorithms that ``scheduler/speculative/`` builds drafters from.

Adding an algorithm: a drafter module in ``scheduler/speculative/`` and its name here (``ALGORITHMS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Algorithm:
    """A speculative algorithm: the module of ``scheduler/speculative/`` that holds its drafter (as ``DRAFTER``),
    and whether it drafts with the checkpoint's MTP head (loaded, with its KV layer in the pools)."""

    module: str
    uses_mtp_head: bool
    default_steps: int


# EAGLE is accepted as NEXTN's alias for Qwen3.5: its MTP head is the draft model either way
ALGORITHMS = {
    "NEXTN": Algorithm("mtp", uses_mtp_head=True, default_steps=3),
    "EAGLE": Algorithm("mtp", uses_mtp_head=True, default_steps=3),
    "NGRAM": Algorithm("ngram", uses_mtp_head=False, default_steps=6),
}
SPECULATIVE_ALGORITHMS = tuple(ALGORITHMS)
FLAGS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
NGRAM_FLAGS = ("speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size")
# SGLang's longest window; the shortest is 2, not its 1: a one-token match drafts poorly (docs/performance.md)
DEFAULT_NGRAM_WINDOW = (2, 12)
HELP = {
    "speculative_algorithm": "Speculative decoding, verified by the model in one forward (greedy output "
    "unchanged): NEXTN (alias EAGLE) drafts with the checkpoint's MTP head; NGRAM drafts by prompt lookup, "
    "continuing the latest earlier occurrence of the request's last tokens in its own prompt and output (no draft "
    "model); unset: off.",
    "speculative_num_steps": "Tokens drafted per decode step (default 3 for NEXTN, 6 for NGRAM, or "
    "--speculative-num-draft-tokens - 1).",
    "speculative_eagle_topk": "Drafts per step of the chain; only 1 (a chain) is supported.",
    "speculative_num_draft_tokens": "Tokens one verify forward runs per request: --speculative-num-steps + 1.",
    "speculative_ngram_min_match_window_size": "NGRAM: the shortest suffix of the request's tokens matched "
    f"against its earlier tokens (default {DEFAULT_NGRAM_WINDOW[0]}).",
    "speculative_ngram_max_match_window_size": "NGRAM: the longest suffix tried first (default "
    f"{DEFAULT_NGRAM_WINDOW[1]}); the longest one that occurred before gives the drafts.",
}


def check(args: Any) -> None:
    """Raises ValueError (one line: the launcher exits with status 2) for a bad value or combination."""
    if args.speculative_algorithm is None:
        given = [
            f"--{f.replace('_', '-')}" for f in FLAGS + NGRAM_FLAGS if getattr(args, f) is not None
        ]
        if given:
            raise ValueError(f"{', '.join(given)} need --speculative-algorithm")
        return
    if args.speculative_algorithm not in ALGORITHMS:
        raise ValueError(
            f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, got "
            f"{args.speculative_algorithm!r}"
        )
    for name in FLAGS + NGRAM_FLAGS:
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"{name} must be positive, got {getattr(args, name)}")
    if args.speculative_eagle_topk not in (None, 1):
        raise ValueError(
            "speculative_eagle_topk must be 1 (drafts are a chain), got "
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
    _check_ngram(args)
    _check_not_combined(args)


def _check_ngram(args: Any) -> None:
    given = [f"--{f.replace('_', '-')}" for f in NGRAM_FLAGS if getattr(args, f) is not None]
    if args.speculative_algorithm != "NGRAM":
        if given:
            raise ValueError(f"{', '.join(given)} need --speculative-algorithm NGRAM")
        return
    low, high = ngram_window(args)
    if low > high:
        raise ValueError(
            f"speculative_ngram_min_match_window_size ({low}) must not exceed "
            f"speculative_ngram_max_match_window_size ({high})"
        )


def _check_not_combined(args: Any) -> None:
    blockers = {
        "enable_dp_attention": args.enable_dp_attention,
        "disaggregation_mode prefill/decode": args.disaggregation_mode != "null",
    }
    blocked = [name for name, on in blockers.items() if on]
    if blocked:
        raise ValueError(f"speculative decoding does not run with {', '.join(blocked)} yet")


def draft_steps(args: Any) -> int:
    """Tokens drafted per decode step: the steps, else draft tokens - 1, else the algorithm's default (0: off)."""
    if args.speculative_algorithm is None:
        return 0
    if args.speculative_num_steps is not None:
        return args.speculative_num_steps
    if args.speculative_num_draft_tokens is not None:
        return args.speculative_num_draft_tokens - 1
    return ALGORITHMS[args.speculative_algorithm].default_steps


def uses_mtp_head(args: Any) -> bool:
    """Whether the algorithm drafts with the checkpoint's MTP head (which is then loaded, its KV in the pools)."""
    algorithm = ALGORITHMS.get(args.speculative_algorithm)
    return algorithm is not None and algorithm.uses_mtp_head


def ngram_window(args: Any) -> tuple[int, int]:
    """NGRAM's (shortest, longest) suffix matched, the flags' or the defaults."""
    low = args.speculative_ngram_min_match_window_size or DEFAULT_NGRAM_WINDOW[0]
    high = args.speculative_ngram_max_match_window_size or DEFAULT_NGRAM_WINDOW[1]
    return low, high
