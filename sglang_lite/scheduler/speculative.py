"""Speculative decoding with the checkpoint's MTP head (SGLang's NEXTN, a chain of ``steps`` drafts).

A decode step of a request holding drafts runs, for the whole decode batch at once:

1. KV slots for its last token and its drafts (``1 + len(drafts)`` positions);
2. the rest of its chain: the MTP head, one token at a time, from the first draft (``Drafts``) on, writing its
   own KV (a draft layer of the pools) at the positions the verify forward fills next;
3. one verify forward of the model over ``[last token, d1 .. dk]``, one row a token as in a decode step
   (``forward_batch.build_rows_batch``), its Gated DeltaNet layers keeping the states after each token
   (``forward_batch.VerifyStates``);
4. ``sampling.speculative.verify_chain``: the accepted drafts plus one token, cut where the request would finish
   (its length, a stop token or stop string: ``tokens_to_take``), so nothing is produced past them;
5. the memory brought back to the last kept token: the rejected positions' KV pages freed, the GDN states after
   the last kept token restored; then the tokens appended one by one as a plain decode step appends its one;
6. the MTP head over the kept positions (rows again) with the model's own hidden states, which rewrites its KV
   there and drafts the first token of the next step.

The runner replays CUDA graphs of the head's steps and of the verify forward where it captured them
(``model_executor/spec_graph_runner.py``), and runs them eagerly elsewhere.

After each prefill forward the head runs over the new positions, so a request enters decoding with its first
draft. Requests with a grammar are not drafted for: they decode one token a step inside the same verify forward,
sampled as without speculation. Penalties (the drafts before a row counted), logit biases and the min-tokens ban on
stop tokens are applied to each verify row as the sampler would. Output log-probabilities of
kept tokens come from the verify forward's raw logits at the positions that chose them, as a plain step records
them. Greedy output is the same as without speculation; sampled output keeps the model's distribution.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from sglang_lite.forward_batch import (
    ForwardBatch,
    ForwardMode,
    VerifyStates,
    build_forward_batch,
    build_rows_batch,
)
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.sampling.logprobs import logprob_entries, record_output
from sglang_lite.sampling.penalties import has_count_penalty
from sglang_lite.sampling.sampler import argmax_rows
from sglang_lite.sampling.speculative import verify_chain
from sglang_lite.scheduler.batch import ScheduleBatch
from sglang_lite.scheduler.output import OutputProcessor
from sglang_lite.scheduler.request import Req
from sglang_lite.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class Drafts:
    """A request's first draft and the MTP head's hidden state that produced it (the next chain step's input)."""

    token: int
    hidden: torch.Tensor  # [hidden]


@dataclass
class SpecStats:
    """Since start: verify steps (one per request and decode step, with drafts or not), drafts proposed, drafts
    accepted, tokens produced by those steps."""

    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0

    @property
    def accept_length(self) -> float:
        """Tokens per verify step (accepted drafts plus the corrected or bonus token)."""
        return self.tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def drafts_for(req: Req) -> bool:
    """Whether the request may be drafted for: it has no grammar (whose matcher would have to follow the drafts)."""
    return req.grammar is None


def tokens_to_take(req: Req, tokens: list[int]) -> int:
    """How many of ``tokens`` the request takes before it finishes: up to its length limit, a stop token or a
    stop string (matched on copies of its detokeniser and matcher, so nothing of the request changes)."""
    limit = min(len(tokens), req.remaining_new_tokens)
    detokenizer = _copy_detokenizer(req)
    matcher = copy.copy(req.stop_matcher)
    for i, token in enumerate(tokens[:limit]):
        if token in req.stop_token_ids:
            return i + 1
        if detokenizer is not None and matcher is not None:
            matcher.feed(detokenizer.push([token]))
            if matcher.matched is not None:
                return i + 1
    return limit


def _copy_detokenizer(req: Req) -> IncrementalDetokenizer | None:
    """A copy of the request's detokeniser to try tokens on (None when it matches no stop strings)."""
    if req.detokenizer is None or req.stop_matcher is None:
        return None
    detokenizer = copy.copy(req.detokenizer)
    detokenizer.ids = list(req.detokenizer.ids)
    return detokenizer


class NullSpeculation:
    """No speculation: decode steps run one token per request."""

    enabled = False
    stats = SpecStats()

    def tokens_per_step(self, req: Req) -> int:
        return 1


class MtpSpeculation:
    """The MTP head's chain drafts, verified in one forward; see the module docstring for a step."""

    enabled = True

    def __init__(
        self,
        steps: int,
        runner: Any,
        pools: ModelPools,
        memory: RequestMemory,
        output: OutputProcessor,
        device: str,
    ) -> None:
        self.steps = steps
        self.runner = runner
        self.pools = pools
        self.memory = memory
        self.output = output
        self.device = device
        self.stats = SpecStats()
        self._prefill: tuple[ForwardBatch, torch.Tensor] | None = None
        self._unkept: dict[int, list[int]] = {}

    def tokens_per_step(self, req: Req) -> int:
        """Positions the request's next decode step runs: its last token and its drafts."""
        return 1 + self._num_drafts(req)

    def _num_drafts(self, req: Req) -> int:
        if req.drafts is None:
            return 0
        # no draft past the request's last token
        return max(0, min(self.steps, req.remaining_new_tokens - 1))

    # ---- prefill ------------------------------------------------------------------------------------------------
    def forward_extend(self, forward_batch: ForwardBatch, all_logits: bool) -> torch.Tensor:
        """A prefill forward whose hidden states are kept for the MTP head (``after_extend``)."""
        hidden = self.runner.forward_hidden(forward_batch)
        self._prefill = (forward_batch, hidden)
        rows = hidden if all_logits else hidden[forward_batch.last_token_indices]
        return self.runner.logits(rows)

    def after_extend(self, reqs: list[Req]) -> None:
        """The MTP head over each drafted request's new positions; a request that is decoding now gets its
        first draft."""
        forward_batch, hidden = self._prefill
        self._prefill = None
        entries = []
        starts = forward_batch.cu_seqlens.tolist()
        for i, req in enumerate(reqs):
            if not (req.holds_memory and drafts_for(req)):
                continue
            prefix, count = forward_batch.prefix_lens[i], forward_batch.extend_lens[i]
            following = req.fill_ids[prefix + 1 : prefix + count + 1]
            # the token after the last position is known: the prompt's next, or the one just sampled
            if len(following) == count:
                entries.append((req, prefix, following, hidden[starts[i] : starts[i] + count]))
        self._mtp_extend(entries)

    def _mtp_extend(
        self, entries: list[tuple[Req, int, list[int], torch.Tensor]], as_rows: bool = False
    ) -> None:
        """The head at positions ``prefix..`` of each request (tokens ``following``, the model's hidden states
        there): its KV there, and the first draft from its last position. ``as_rows``: one row a token, as a
        verify forward (a decode step's few kept tokens; a prefill's run as an extend)."""
        if not entries:
            return
        table = self.pools.req_to_token
        slots = [
            s
            for req, start, toks, _ in entries
            for s in table.slots(req.req_row, start, start + len(toks))
        ]
        build = build_rows_batch if as_rows else _build_extend
        batch = build(
            self.pools,
            [toks for _, _, toks, _ in entries],
            [start for _, start, _, _ in entries],
            [req.req_row for req, _, _, _ in entries],
            [req.state_slot for req, _, _, _ in entries],
            self.device,
            slots,
        )
        last_rows = torch.tensor(list(accumulate(len(toks) for _, _, toks, _ in entries))) - 1
        with torch.inference_mode():
            out = self.runner.forward_mtp(batch, torch.cat([h for _, _, _, h in entries]))
            last = out[last_rows.to(out.device)]
            tokens = argmax_rows(self.runner.logits(last)).tolist()
        for (req, _, _, _), token, hidden in zip(entries, tokens, last):
            req.drafts = Drafts(token, hidden.clone())  # not a view keeping the whole output alive

    # ---- a decode step --------------------------------------------------------------------------------------------
    def run_decode(self, batch: ScheduleBatch, kv_slots: list[int]) -> None:
        """One speculative decode step of ``batch`` (its requests' KV slots for their tokens per step are
        ``kv_slots``)."""
        reqs = batch.reqs
        counts = [self.tokens_per_step(r) for r in reqs]
        per_req = _split(kv_slots, counts)
        # a request's slots until it keeps its positions: freed if the step fails before
        self._unkept = {id(r): slots for r, slots in zip(reqs, per_req)}
        try:
            self._run(reqs, counts, per_req, kv_slots)
        except BaseException:
            self.memory.free_kv([s for slots in self._unkept.values() for s in slots])
            raise
        finally:
            self._unkept = {}

    def _run(
        self, reqs: list[Req], counts: list[int], per_req: list[list[int]], kv_slots: list[int]
    ) -> None:
        starts = [r.num_computed for r in reqs]
        chains = self._draft(reqs, counts, starts, per_req)
        tokens = [[r.output_ids[-1], *chain] for r, chain in zip(reqs, chains)]
        forward_batch = build_rows_batch(
            self.pools,
            tokens,
            starts,
            [r.req_row for r in reqs],
            [r.state_slot for r in reqs],
            self.device,
            kv_slots,
        )
        with torch.inference_mode():
            hidden, logits, verify = self.runner.forward_verify(forward_batch, counts)
        self._accept(reqs, chains, counts, starts, per_req, verify, hidden, logits)

    def _draft(
        self, reqs: list[Req], counts: list[int], starts: list[int], per_req: list[list[int]]
    ) -> list[list[int]]:
        """Each request's chain of ``counts[i] - 1`` drafts: the first from the last step, the others from the
        MTP head at positions ``start, start + 1, ..`` (its KV in the slots the verify forward fills next)."""
        chains = [[r.drafts.token] if n > 1 else [] for r, n in zip(reqs, counts)]
        hidden = {i: r.drafts.hidden for i, (r, n) in enumerate(zip(reqs, counts)) if n > 1}
        for step in range(1, max(counts) - 1):
            rows = [i for i, n in enumerate(counts) if n - 1 > step]
            batch = build_forward_batch(
                self.pools,
                ForwardMode.DECODE,
                [[chains[i][-1]] for i in rows],
                [starts[i] + step - 1 for i in rows],
                [reqs[i].req_row for i in rows],
                [reqs[i].state_slot for i in rows],
                self.device,
                [per_req[i][step - 1] for i in rows],
            )
            with torch.inference_mode():
                out = self.runner.forward_mtp(batch, torch.stack([hidden[i] for i in rows]))
                drafted = argmax_rows(self.runner.logits(out)).tolist()
            for i, token, state in zip(rows, drafted, out):
                chains[i].append(token)
                hidden[i] = state
        return chains

    def _accept(
        self,
        reqs: list[Req],
        chains: list[list[int]],
        counts: list[int],
        prefixes: list[int],
        per_req: list[list[int]],
        verify: VerifyStates,
        hidden: torch.Tensor,
        logits: torch.Tensor,
    ) -> None:
        """Each request's tokens from the verify forward's logits (``counts[i]`` rows each, request after
        request), its memory brought back to its last kept token (``prefixes[i]`` cached before), then the head
        over what was kept (the next step's first drafts)."""
        starts = [0, *accumulate(counts)]
        drafted = [i for i, n in enumerate(counts) if n > 1]
        plain = [i for i, n in enumerate(counts) if n == 1]
        kept: dict[int, list[int]] = {}
        entries: dict[int, list[dict]] = {}
        for i in drafted:
            rows = logits[starts[i] : starts[i] + counts[i]]
            kept[i] = self._take(reqs[i], rows, chains[i])
            entries[i] = _logprob_entries(reqs[i], rows, kept[i])
            self._keep(reqs[i], i, prefixes[i], len(kept[i]), per_req[i], verify)
        for i, tokens in kept.items():
            for j, token in enumerate(tokens):  # one by one, as a decode step appends its one
                if entries[i]:
                    record_output(reqs[i].logprob_record, entries[i][j])
                self.output.append_tokens([reqs[i]], [token])
        for i in plain:  # sampled as without speculation (penalties, grammars, log-probabilities)
            reqs[i].num_computed += 1
            del self._unkept[id(reqs[i])]
            self._count(reqs[i], 0, 1)
        if plain:
            rows = logits[[starts[i] for i in plain]]
            self.output.sample_and_append([reqs[i] for i in plain], rows)
        taken = [len(kept[i]) if i in kept else 1 for i in range(len(reqs))]
        self._draft_next(reqs, taken, prefixes, [hidden[s : s + n] for s, n in zip(starts, taken)])

    def _take(self, req: Req, logits: torch.Tensor, chain: list[int]) -> list[int]:
        """The accepted drafts and one more token, cut where the request finishes."""
        logits = self._as_sampled(req, logits, chain)
        proposed = verify_chain(logits, chain, req.sampling_params, req.generator)
        kept = proposed[: tokens_to_take(req, proposed)]
        self._count(req, len(chain), len(kept))
        return kept

    def _as_sampled(self, req: Req, logits: torch.Tensor, chain: list[int]) -> torch.Tensor:
        """The verify rows as ``StepSampler`` would sample each, row j after the first j drafts: its penalties
        (the drafts counted while the rows are taken, then taken back) and logit biases, and its stop tokens
        banned while fewer than ``min_new_tokens`` tokens precede."""
        params = req.sampling_params
        if has_count_penalty(params) or params.logit_bias:
            logits = self._penalised(req.req_row, logits, chain)
        too_early = params.min_new_tokens - len(req.output_ids)
        if too_early > 0 and req.stop_token_ids:
            logits = logits.float().clone()
            logits[:too_early, sorted(req.stop_token_ids)] = float("-inf")
        return logits

    def _penalised(self, row: int, logits: torch.Tensor, chain: list[int]) -> torch.Tensor:
        # one row at a time: the book adds a request's biases to one row a call
        penalties = self.output.sampler.penalties
        out = []
        for j, rows in enumerate(logits.split(1)):
            out.append(penalties.apply([row], rows))
            if j < len(chain):
                penalties.record([row], [chain[j]])
        penalties.record([row] * len(chain), chain, count=-1)
        return torch.cat(out)

    def _draft_next(
        self, reqs: list[Req], taken: list[int], prefixes: list[int], hidden: list[torch.Tensor]
    ) -> None:
        """The head over each running drafted request's kept positions (its ``taken`` newest tokens follow
        them; ``hidden`` the model's states there): the next step's first drafts."""
        entries = []
        for req, n, prefix, states in zip(reqs, taken, prefixes, hidden):
            req.drafts = None
            if req.holds_memory and drafts_for(req):
                following = req.output_ids[len(req.output_ids) - n :]
                entries.append((req, prefix, following, states))
        self._mtp_extend(entries, as_rows=True)

    def _keep(
        self,
        req: Req,
        index: int,
        start: int,
        taken: int,
        slots: list[int],
        verify: VerifyStates,
    ) -> None:
        """The request keeps the verify forward's first ``taken`` positions: the KV of the others is freed and
        its GDN states are those after the last kept token."""
        req.num_computed = start + taken
        del self._unkept[id(req)]
        if taken < len(slots):
            self.memory.free_kv(slots[taken:])
            verify.restore(self.pools, index, taken - 1, req.state_slot)

    def _count(self, req: Req, drafted: int, taken: int) -> None:
        req.spec_verify_ct += 1
        req.spec_drafted += drafted
        req.spec_accepted_drafts += taken - 1
        self.stats.verify_steps += 1
        self.stats.drafted += drafted
        self.stats.accepted += taken - 1
        self.stats.tokens += taken


def _logprob_entries(req: Req, logits: torch.Tensor, tokens: list[int]) -> list[dict]:
    """The output log-probabilities of ``tokens`` the request asked for (none if it asked none), from the raw
    logits of the positions that chose them, as ``StepSampler.sample`` records them."""
    if req.logprob is None or not req.logprob.return_logprob:
        return []
    targets = torch.tensor(tokens, device=logits.device)
    return logprob_entries(logits[: len(tokens)], targets, [req.logprob] * len(tokens))


def _build_extend(
    pools: ModelPools,
    token_ids: list[list[int]],
    prefix_lens: list[int],
    req_rows: list[int],
    state_slots: list[int],
    device: str,
    out_cache_loc: list[int],
) -> ForwardBatch:
    return build_forward_batch(
        pools,
        ForwardMode.EXTEND,
        token_ids,
        prefix_lens,
        req_rows,
        state_slots,
        device,
        out_cache_loc,
    )


def _split(values: list[int], counts: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in counts:
        out.append(values[start : start + n])
        start += n
    return out


def create_speculation(
    config: SchedulerConfig,
    runner: Any,
    pools: ModelPools,
    memory: RequestMemory,
    output: OutputProcessor,
) -> MtpSpeculation | NullSpeculation:
    """The rank's speculation: the MTP head's chain drafts when ``speculative_steps`` is set (the model runner
    must hold a model loaded with its head), else none."""
    if config.speculative_steps == 0:
        return NullSpeculation()
    return MtpSpeculation(config.speculative_steps, runner, pools, memory, output, config.device)
