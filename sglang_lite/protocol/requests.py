"""Checks and names a request gets before it is queued: the same for the Engine, the HTTP server and the rank."""

from __future__ import annotations

from sglang_lite.multimodal.inputs import IMAGE_ID_SPAN, ImageInputs
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.sampling.grammar import grammar_key
from sglang_lite.sampling.logprobs import MAX_LOGPROB_ENTRIES, LogprobParams
from sglang_lite.sampling.params import SamplingParams


def fork_rids(rid: str, n: int) -> list[str]:
    """The rids of a request's ``n`` parallel samples: its own, then ``rid.n1`` and so on."""
    return [rid] + [f"{rid}.n{i}" for i in range(1, n)]


def validate_request(
    input_ids: list[int],
    params: SamplingParams,
    config: SchedulerConfig,
    has_tokenizer: bool,
    logprob: LogprobParams | None = None,
    images: ImageInputs | None = None,
) -> None:
    """Raises ValueError naming the bad field; cheap, so a front end can call it before queueing. ``images``: the
    request's images, whose tokens the prompt holds (``multimodal.inputs``)."""
    top = config.vocab_size + (IMAGE_ID_SPAN if images is not None else 0)
    if not input_ids or not all(isinstance(t, int) and 0 <= t < top for t in input_ids):
        raise ValueError(
            f"input_ids must be a non-empty list of token ids in [0, {config.vocab_size})"
        )
    if images is not None:
        _check_images(input_ids, params, config, images, logprob)
    if len(input_ids) >= config.max_request_tokens:
        limit = (
            "context length"
            if config.max_request_tokens == config.context_length
            else "KV pool size"
        )
        raise ValueError(
            f"input_ids: the prompt has {len(input_ids)} tokens, not shorter than the {limit} "
            f"({config.max_request_tokens} tokens)"
        )
    params.validate(config.vocab_size)
    if logprob is not None:
        logprob.validate(config.vocab_size, len(input_ids))
        _check_logprob_entries(len(input_ids), params, logprob, config)
    if params.stop and not has_tokenizer:
        raise ValueError(
            "sampling parameter stop needs a tokenizer (the server skipped tokenizer init)"
        )
    if params.require_reasoning and not config.think_end_ids:
        raise ValueError(
            "sampling parameter require_reasoning needs a reasoning parser (the server's --reasoning-parser)"
        )
    key = grammar_key(params)
    if key is not None and not has_tokenizer:
        raise ValueError(
            f"sampling parameter {key.kind} needs a tokenizer (the server skipped tokenizer init)"
        )


def _check_logprob_entries(
    prompt_len: int, params: SamplingParams, logprob: LogprobParams, config: SchedulerConfig
) -> None:
    output_len = min(params.max_new_tokens, config.max_request_tokens - prompt_len)
    asked = params.n * logprob.entries(prompt_len, output_len)
    if asked > MAX_LOGPROB_ENTRIES:
        raise ValueError(
            f"return_logprob: {asked} log-probability entries asked for (samples x positions x (1 + top "
            f"log-probabilities + token ids)), more than {MAX_LOGPROB_ENTRIES}; ask for fewer positions, top "
            "log-probabilities or samples"
        )


def _check_images(
    input_ids: list[int],
    params: SamplingParams,
    config: SchedulerConfig,
    images: ImageInputs,
    logprob: LogprobParams | None,
) -> None:
    """What a request with images may not ask for yet, and whether its prompt holds its images' tokens."""
    if not config.image_merge_size:
        raise ValueError(
            "images: the served model takes text only (its checkpoint has no vision tower)"
        )
    if config.speculative_algorithm is not None:
        raise ValueError("images: not served with speculative decoding yet")
    if params.n > 1:
        raise ValueError(
            "images: parallel samples (n > 1) of a request with images are not served yet"
        )
    if logprob is not None and logprob.wants_input:
        raise ValueError(
            "images: prompt log-probabilities of a request with images are not served yet"
        )
    images.check(input_ids, config.vocab_size, config.image_merge_size)
