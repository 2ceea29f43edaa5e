"""What a forward's logits become: each request's next token (sampled with fault isolation), its text
(detokenised, stop strings matched), log-probabilities, streaming outputs, and finishing on a stop or the length
limit. A request whose sampling, detokenising or stop matching raises ends alone."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.scheduler.batch import ScheduleBatch
from sglang_lite.scheduler.faults import breaks_the_device
from sglang_lite.scheduler.finish import RequestEnder
from sglang_lite.scheduler.forks import ForkManager
from sglang_lite.scheduler.load_report import ThroughputMeter
from sglang_lite.scheduler.pd_side.base import DisaggSide
from sglang_lite.scheduler.request import FinishReason, Req
from sglang_lite.scheduler.sampling import StepSampler


@dataclass
class Argmaxes:
    """A prefill's next tokens already found as each request's argmax (``Runner.extend_greedy``, for requests that
    are all plain greedy): what sampling their logits would give. Indexed as the logits' rows are."""

    tokens: torch.Tensor  # int64 [B]

    def __getitem__(self, index: list[int]) -> Argmaxes:
        return Argmaxes(self.tokens[index])


class OutputProcessor:
    def __init__(
        self,
        config: SchedulerConfig,
        sampler: StepSampler,
        ender: RequestEnder,
        forks: ForkManager,
        disagg: DisaggSide,
    ) -> None:
        self.config = config
        self.sampler = sampler
        self.ender = ender
        self.forks = forks
        self.disagg = disagg
        self.throughput = ThroughputMeter(start=time.monotonic())

    def process(self, batch: ScheduleBatch, logits: torch.Tensor | Argmaxes) -> list[bool]:
        """Samples the requests whose last uncomputed token ran (their logits are ``logits``' rows, in batch
        order, or their tokens already); returns which those were, for a request that prefilled for its prompt
        log-probabilities only (``max_new_tokens`` 0) is finished here instead."""
        completes = batch.completes
        for req, done in zip(batch.reqs, completes):
            if done and req.max_new_tokens == 0:  # prefilled for its prompt log-probabilities
                self.ender.finish(req, FinishReason("length", length=0))
        completes = [done and r.max_new_tokens > 0 for r, done in zip(batch.reqs, completes)]
        sampled = [r for r, done in zip(batch.reqs, completes) if done]
        if not sampled:
            return completes
        rows = logits
        if len(sampled) < len(batch.reqs):
            rows = logits[[i for i, done in enumerate(completes) if done]]
        forked = [(i, child) for i, req in enumerate(sampled) for child in self.forks.fork(req)]
        if forked:  # parallel samples draw their first tokens from their parent's logits
            rows = rows[list(range(len(sampled))) + [i for i, _ in forked]]
            sampled = sampled + [child for _, child in forked]
        kept = [(r, t) for r, t in zip(sampled, self._sample(sampled, rows)) if t is not None]
        if not batch.is_decode:  # PD prefill: the first token goes to the decode side with the KV
            kept = [(r, t) for r, t in kept if not self.disagg.on_prefilled(r, t)]
        self.append_tokens([r for r, _ in kept], [t for _, t in kept])
        return completes

    def sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """Samples each request's next token from its row of ``logits`` and appends it (a decode step's)."""
        kept = [(r, t) for r, t in zip(reqs, self._sample(reqs, logits)) if t is not None]
        self.append_tokens([r for r, _ in kept], [t for _, t in kept])

    def _sample(self, reqs: list[Req], logits: torch.Tensor | Argmaxes) -> list[int | None]:
        """Each request's next token; None for a request whose sampling failed (it is failed here). The batch is
        sampled at once; only when that raises is each row sampled alone, to find the culprits."""
        if isinstance(logits, Argmaxes):
            return logits.tokens.tolist()
        try:
            return self.sampler.sample(reqs, logits).tolist()
        except Exception as error:
            if breaks_the_device(error):
                raise
            return [self._sample_one(req, logits[i : i + 1]) for i, req in enumerate(reqs)]

    def _sample_one(self, req: Req, logits: torch.Tensor) -> int | None:
        try:
            return int(self.sampler.sample([req], logits)[0])
        except Exception as error:
            self.ender.fail_request(req, error)
            return None

    def append_tokens(self, reqs: list[Req], token_ids: list[int]) -> None:
        now = time.monotonic()
        self.sampler.on_sampled(reqs, token_ids)
        for req, token in zip(reqs, token_ids):
            req.first_token_time = req.first_token_time or now
            req.output_ids.append(token)
            req.unsent_ids.append(token)
            try:
                self._update_text_and_finish(req, token)
            except (
                Exception
            ) as error:  # detokenising or stop matching raised: this request's fault alone
                self.ender.fail_request(req, error)
            if (
                not req.finished
                and req.stream
                and len(req.unsent_ids) >= self.config.stream_interval
            ):
                self.ender.emit(req)
        self.throughput.record(now, len(reqs))

    def _update_text_and_finish(self, req: Req, token: int) -> None:
        if req.grammar is not None:
            req.grammar.accept(token)
        if token in req.stop_token_ids or (req.grammar is not None and req.grammar.terminated):
            self.ender.finish(req, FinishReason("stop", matched=token))
            return
        self.ender.add_text(req, req.detokenizer.push([token]) if req.detokenizer else "")
        if req.stop_matcher is not None and req.stop_matcher.matched is not None:
            self.ender.finish(req, FinishReason("stop", matched=req.stop_matcher.matched))
        elif len(req.output_ids) >= req.max_new_tokens:
            self.ender.finish(req, FinishReason("length", length=len(req.output_ids)))
