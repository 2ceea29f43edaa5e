"""From a batch's logits to its next tokens, for one scheduler: everything a request's sampling options ask.

``sample`` keeps the raw logits for log-probabilities (SGLang's default: before temperature, penalties and masks),
then applies penalties and logit biases, grammar masks and the min-tokens ban on stop tokens, and draws with each
request's own generator. ``on_sampled`` tells the per-request state (penalty counts, grammar matchers) which tokens
were taken; ``on_admit`` and ``on_release`` bracket the time a request holds a row. All per-step work is batched
over the rows that need it.
"""

from __future__ import annotations

import torch

from sglang_lite.kernels import batch_invariant
from sglang_lite.sampling.grammar import (
    check_some_token_allowed,
    keep_possible_bans,
    mask_logits,
)
from sglang_lite.sampling.logprobs import logprob_entries, record_input, record_output
from sglang_lite.sampling.penalties import PenaltyBook
from sglang_lite.sampling.sampler import argmax_rows, sample, step_seed
from sglang_lite.scheduler.request import Req


class StepSampler:
    def __init__(self, vocab_size: int, num_rows: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.num_rows = num_rows
        self.device = device
        self.penalties = PenaltyBook(
            num_rows + 1, vocab_size, device
        )  # request rows count from 1 (0 is reserved)

    # ---- a request's lifetime ----------------------------------------------------------------------------------
    def on_admit(self, req: Req) -> None:
        """The request now holds ``req.req_row`` (first admission, or again after a retraction)."""
        self.penalties.admit(req.req_row, req.sampling_params, req.output_ids)

    def on_release(self, req: Req) -> None:
        """The request no longer holds its row."""
        self.penalties.release(req.req_row)

    # ---- each step ---------------------------------------------------------------------------------------------
    def sample(self, reqs: list[Req], logits: torch.Tensor) -> torch.Tensor:
        """Next token ids [B] (int64) for ``reqs`` from their logits [B, vocab]; records the log-probabilities the
        requests asked for. Raises (recording nothing) when any row fails."""
        if self.all_plain_greedy(reqs):
            # what the steps below come to for these rows, without their Python (a decode step's ~1 ms feels it)
            return argmax_rows(logits)
        raw = logits
        logits = self.penalties.apply([r.req_row for r in reqs], logits)
        too_early = [len(r.output_ids) < r.sampling_params.min_new_tokens for r in reqs]
        banned = [sorted(r.stop_token_ids) if early else [] for r, early in zip(reqs, too_early)]
        grammars = [r.grammar for r in reqs]
        # grammar rows: the tokens their grammar forbids at -inf
        logits = mask_logits(logits, grammars)
        check_some_token_allowed(logits, grammars)
        banned = keep_possible_bans(logits, banned, grammars)
        key_generators(reqs)
        tokens = sample(
            logits, [r.sampling_params for r in reqs], [r.generator for r in reqs], banned
        )
        wanted = [
            i for i, r in enumerate(reqs) if r.logprob is not None and r.logprob.return_logprob
        ]
        if wanted:
            index = torch.tensor(wanted, device=raw.device)
            rows = logprob_entries(raw[index], tokens[index], [reqs[i].logprob for i in wanted])
            for i, row in zip(wanted, rows):
                record_output(reqs[i].logprob_record, row)
        return tokens

    def all_plain_greedy(self, reqs: list[Req]) -> bool:
        """Each request's next token is its row's argmax (what ``sample`` comes to), and stays so for its next
        tokens while no request joins: greedy, no penalties, biases, grammar, stop-token ban or log-probabilities."""
        return self.penalties.is_idle and all(_plain_greedy(r) for r in reqs)

    def on_sampled(self, reqs: list[Req], tokens: list[int]) -> None:
        """``tokens[i]`` is now ``reqs[i]``'s newest output token."""
        self.penalties.record([r.req_row for r in reqs], tokens)

    def record_prompt(
        self, reqs: list[Req], extend_lens: list[int], prefix_lens: list[int], logits: torch.Tensor
    ) -> None:
        """Prompt log-probabilities from one extend forward's logits of every token [T, vocab]: the logits at a
        position predict the next prompt token. Only requests that asked for them, from ``logprob_start_len``."""
        start = 0
        for req, n, prefix in zip(reqs, extend_lens, prefix_lens):
            rows, start = slice(start, start + n), start + n
            params, record = req.logprob, req.logprob_record
            if params is None or not params.wants_input:
                continue
            prompt_len, first = len(req.input_ids), max(params.logprob_start_len, record.input_upto)
            # positions p in [prefix, prefix + n) predict token p + 1; report targets in [max(first, 1), prompt_len)
            targets = [
                p + 1 for p in range(prefix, prefix + n) if max(first, 1) <= p + 1 < prompt_len
            ]
            head = req.input_ids[0] if first == 0 and prefix == 0 else None
            entries = []
            if targets:
                positions = (
                    torch.tensor([p - 1 - prefix for p in targets], device=logits.device)
                    + rows.start
                )
                ids = torch.tensor([req.input_ids[p] for p in targets], device=logits.device)
                entries = logprob_entries(logits[positions], ids, [params] * len(targets))
            if entries or head is not None:
                record_input(record, entries, head)
                record.input_upto = max(targets, default=0) + 1

    @staticmethod
    def prefix_limit(req: Req) -> int | None:
        """How many prompt positions the prefix cache may serve: those whose log-probabilities are not needed
        (their logits must be computed); None when any may."""
        params = req.logprob
        if (
            params is None
            or not params.wants_input
            or req.logprob_record.input_upto >= len(req.input_ids)
        ):
            return None
        return max(max(params.logprob_start_len, req.logprob_record.input_upto) - 1, 0)


def _plain_greedy(req: Req) -> bool:
    """A greedy request without a grammar, a stop-token ban (``min_new_tokens`` not yet reached) or logprobs: its
    token is its row's argmax (penalties aside)."""
    return (
        req.sampling_params.is_greedy
        and req.grammar is None
        and (req.logprob is None or not req.logprob.return_logprob)
        and len(req.output_ids) >= req.sampling_params.min_new_tokens
    )


def key_generators(reqs: list[Req]) -> None:
    """Under batch invariance, reseed each sampled request's generator for its next draw (``step_seed`` of its seed
    and output position); otherwise each goes on from its last draw."""
    if not batch_invariant.enabled():
        return
    for req in reqs:
        if req.generator is not None and not req.sampling_params.is_greedy:
            req.generator.manual_seed(step_seed(req.seed, len(req.output_ids)))
