"""Scheduler configuration: what one scheduler (one DP rank) needs, resolved from the server arguments."""

from __future__ import annotations

from dataclasses import dataclass

from sglang_lite.config import ModelConfig
from sglang_lite.server_args import ServerArgs
from sglang_lite.utils import schedule_flags, speculative_flags


@dataclass(frozen=True)
class SchedulerConfig:
    max_total_tokens: int  # KV pool size
    max_running_requests: int  # request rows and linear-attention state slots
    context_length: int  # longest prompt + output
    chunk_size: int  # longest prefill chunk of one request
    max_prefill_tokens: int  # token budget of one prefill forward
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    # with a reasoning parser: the reasoning's end (``</think>``) as the tokenizer encodes it
    think_end_ids: tuple[int, ...] = ()
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    stream_interval: int = 1
    # decode steps run back to back while nothing waits (``--num-continuous-decode-steps``, where the rank may)
    decode_steps: int = 1
    random_seed: int = 0
    device: str = "cpu"
    dp_rank: int = 0
    # speculative decoding: the algorithm (``utils/speculative_flags.ALGORITHMS``; None: off), the tokens it drafts
    # per decode step, and NGRAM's (shortest, longest) suffix matched
    speculative_algorithm: str | None = None
    speculative_steps: int = 0
    ngram_window: tuple[int, int] = speculative_flags.DEFAULT_NGRAM_WINDOW
    # CPU time one request's grammar may take per token mask or accepted token (past it the request fails, 400)
    grammar_mask_budget_ms: float = ServerArgs.grammar_mask_budget_ms
    # a VL checkpoint's image placeholder token and patch merge size (merge size 0: the model takes text only)
    image_token_id: int = -1
    image_merge_size: int = 0

    def __post_init__(self) -> None:
        assert self.max_total_tokens > 0 and self.max_running_requests > 0, (
            "pools must not be empty"
        )
        assert self.context_length > 1 and self.chunk_size > 0 and self.max_prefill_tokens > 0, (
            "bad limits"
        )

    @property
    def max_request_tokens(self) -> int:
        """Prompt + output of one request: it must fit the context and, alone, the KV pool."""
        return min(self.context_length, self.max_total_tokens)

    @classmethod
    def from_dict(cls, fields: dict) -> SchedulerConfig:
        """Back from ``dataclasses.asdict`` after a trip through msgpack (which turns tuples into lists)."""
        names = ("eos_token_ids", "think_end_ids", "ngram_window")
        tuples = {k: tuple(fields[k]) for k in names if k in fields}
        return cls(**dict(fields, **tuples))

    @classmethod
    def from_server_args(
        cls,
        args: ServerArgs,
        model: ModelConfig,
        max_total_tokens: int,
        eos_token_ids: tuple[int, ...],
        think_end_ids: tuple[int, ...] = (),
    ) -> SchedulerConfig:
        return cls(
            max_total_tokens=max_total_tokens,
            max_running_requests=args.max_running_requests,
            context_length=args.context_length or model.max_position_embeddings,
            chunk_size=min(args.effective_prefill_chunk, args.max_prefill_tokens),
            max_prefill_tokens=args.max_prefill_tokens,
            vocab_size=model.vocab_size,
            eos_token_ids=eos_token_ids,
            think_end_ids=think_end_ids,
            schedule_policy=args.schedule_policy,
            schedule_conservativeness=args.schedule_conservativeness,
            stream_interval=args.stream_interval,
            decode_steps=schedule_flags.decode_steps(args),
            random_seed=args.random_seed,
            device=args.device,
            speculative_algorithm=args.speculative_algorithm,
            speculative_steps=args.speculative_steps,
            ngram_window=speculative_flags.ngram_window(args),
            grammar_mask_budget_ms=args.grammar_mask_budget_ms,
            image_token_id=model.vision.image_token_id if model.vision else -1,
            image_merge_size=model.vision.spatial_merge_size if model.vision else 0,
        )
