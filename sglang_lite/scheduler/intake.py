"""A new request's way in: its parameters checked (``protocol.requests``), its rid and PD room checked against
the unfinished ones, its ``Req`` built (seed, stop tokens, detokeniser, stop strings), and its grammar, if it has
one, compiled before it may wait."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from sglang_lite.multimodal.inputs import ImageInputs
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.protocol.requests import fork_rids, validate_request
from sglang_lite.sampling.grammar import ReasoningGrammar, RequestGrammar
from sglang_lite.sampling.logprobs import LogprobParams
from sglang_lite.sampling.params import SamplingParams
from sglang_lite.sampling.sampler import make_generator
from sglang_lite.scheduler.request import Req
from sglang_lite.tokenizer.detokenizer import IncrementalDetokenizer, StopStringMatcher


class RequestIntake:
    def __init__(self, config: SchedulerConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._seeds = random.Random(config.random_seed)

    def make(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        logprob: LogprobParams | None,
        stream: bool,
        in_use: Callable[[str], bool],
        check_more: Callable[[], None],
        images: ImageInputs | None = None,
    ) -> Req:
        """The request, checked; raises ValueError naming the field, having drawn no seed. ``in_use``: whether a
        rid is taken; ``check_more``: the checks of the rank's PD side; ``images``: its prompt's images."""
        validate_request(
            input_ids, params, self.config, self.tokenizer is not None, logprob, images
        )
        rids = fork_rids(rid, params.n)
        for used in rids:
            if in_use(used):
                raise ValueError(f"rid {used!r} is already in use by an unfinished request")
        check_more()
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        req = self.new_req(rid, list(input_ids), params, seed)
        if params.n > 1:
            req.forks = rids[1:]
            req.fork_seed = seed
        req.logprob = logprob
        req.stream = stream
        return req

    def new_req(self, rid: str, input_ids: list[int], params: SamplingParams, seed: int) -> Req:
        eos = set() if params.ignore_eos else set(self.config.eos_token_ids)
        tokenizer = self.tokenizer
        detokenizer = None
        if tokenizer:
            detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        return Req(
            rid=rid,
            input_ids=input_ids,
            sampling_params=params,
            max_new_tokens=min(
                params.max_new_tokens, self.config.max_request_tokens - len(input_ids)
            ),
            stop_token_ids=frozenset(set(params.stop_token_ids) | eos),
            generator=make_generator(seed, self.config.device),
            seed=seed,
            detokenizer=detokenizer,
            stop_matcher=StopStringMatcher(params.stop) if params.stop else None,
        )

    def grammar_of(self, req: Req, compiled: Any) -> RequestGrammar | ReasoningGrammar:
        """The grammar ends at the request's stop tokens (the model's eos ones under ``ignore_eos``); with
        ``require_reasoning`` it starts after the reasoning's end. Each of its masks and accepted tokens may take
        ``grammar_mask_budget_ms``."""
        grammar = RequestGrammar(
            compiled,
            sorted(req.stop_token_ids) or list(self.config.eos_token_ids),
            self.config.grammar_mask_budget_ms / 1000,
        )
        if req.sampling_params.require_reasoning:
            return ReasoningGrammar(grammar, self.config.think_end_ids)
        return grammar
