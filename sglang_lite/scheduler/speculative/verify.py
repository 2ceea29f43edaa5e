"""Drafts verified in one forward of the model (``DraftVerify``): what every speculative algorithm shares.

A decode step of a request holding drafts runs, for the whole decode batch at once:

1. KV slots for its last token and its drafts (``1 + len(drafts)`` positions);
2. the drafter's chain (``Drafter.propose``; the MTP head writes its own KV at the positions the verify forward
   fills next, prompt lookup just reads the request's tokens);
3. one verify forward of the model over ``[last token, d1 .. dk]``, one row a token as in a decode step
   (``forward_batch.build_rows_batch``), its Gated DeltaNet layers keeping the states after each token
   (``forward_batch.VerifyStates``);
4. ``sampling.draft_acceptance.verify_chain``: the accepted drafts plus one token, cut where the request would finish
   (its length, a stop token or stop string: ``tokens_to_take``), so nothing is produced past them;
5. the memory brought back to the last kept token: the rejected positions' KV pages freed, the GDN states after
   the last kept token restored; then the tokens appended one by one as a plain decode step appends its one;
6. the drafter over the kept positions (``Drafter.after_verify``): the next step's drafts.

The runner replays CUDA graphs of the verify forward (and of the MTP head's steps) where it captured them
(``model_executor/spec_graph_runner.py``), and runs them eagerly elsewhere.

After each prefill forward the drafter sees the new positions (``Drafter.after_prefill``), so a request enters
decoding with its first drafts. Requests with a grammar are not drafted for: they decode one token a step inside
the same verify forward, sampled as without speculation; so do requests the drafter has nothing for. Penalties
(the drafts before a row counted), logit biases and the min-tokens ban on stop tokens are applied to each verify
row as the sampler would. Output log-probabilities of kept tokens come from the verify forward's raw logits at the
positions that chose them, as a plain step records them. Greedy output is the same as without speculation (up to
the verify forward's rows being computed as a batch of rows, not one at a time); sampled output keeps the model's
distribution.
"""

from __future__ import annotations

import copy
from itertools import accumulate

import torch

from sglang_lite.forward_batch import ForwardBatch, VerifyStates, build_rows_batch
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.model_executor import Runner
from sglang_lite.sampling.draft_acceptance import verify_chain
from sglang_lite.sampling.logprobs import logprob_entries, record_output
from sglang_lite.sampling.penalties import has_count_penalty
from sglang_lite.scheduler.batch import ScheduleBatch
from sglang_lite.scheduler.output import OutputProcessor
from sglang_lite.scheduler.request import Req
from sglang_lite.scheduler.sampling import key_generators
from sglang_lite.scheduler.speculative.base import Drafter, Kept, drafts_for
from sglang_lite.scheduler.speculative.null import NullSpeculation
from sglang_lite.tokenizer.detokenizer import IncrementalDetokenizer


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


class DraftVerify(NullSpeculation):
    """A drafter's chains, verified in one forward of the model; see the module docstring for a step. A step in
    which no request has drafts is the plain step it extends."""

    def __init__(
        self,
        drafter: Drafter,
        steps: int,
        runner: Runner,
        pools: ModelPools,
        memory: RequestMemory,
        output: OutputProcessor,
        device: str,
    ) -> None:
        super().__init__(runner, pools, memory, output, device)
        self.drafter = drafter
        self.steps = steps
        self._prefill: tuple[ForwardBatch, torch.Tensor | None] | None = None
        self._unkept: dict[int, list[int]] = {}

    def tokens_per_step(self, req: Req) -> int:
        """Positions the request's next decode step runs: its last token and its drafts."""
        return 1 + self._num_drafts(req)

    def _num_drafts(self, req: Req) -> int:
        if not drafts_for(req):
            return 0
        # no draft past the request's last token
        return max(0, min(self.steps, self.drafter.num_drafts(req), req.remaining_new_tokens - 1))

    # ---- prefill ------------------------------------------------------------------------------------------------
    def extend_greedy(self, forward_batch: ForwardBatch) -> torch.Tensor | None:
        return None  # the drafter takes the prefill's hidden states or its batch (forward_extend keeps them)

    def forward_extend(self, forward_batch: ForwardBatch, all_logits: bool) -> torch.Tensor:
        """A prefill forward; its hidden states kept for the drafter when it takes them (``after_extend``)."""
        if not self.drafter.keeps_hidden:
            self._prefill = (forward_batch, None)
            return super().forward_extend(forward_batch, all_logits)
        hidden = self.runner.forward_hidden(forward_batch)
        self._prefill = (forward_batch, hidden)
        rows = hidden if all_logits else hidden[forward_batch.last_token_indices]
        return self.runner.logits(rows)

    def after_extend(self, reqs: list[Req]) -> None:
        """The drafter over each drafted request's new positions whose following tokens are known (the prompt's
        next, or the one just sampled): a request that is decoding now gets its first drafts."""
        forward_batch, hidden = self._prefill
        self._prefill = None
        kept = []
        starts = forward_batch.cu_seqlens.tolist()
        for i, req in enumerate(reqs):
            if not (req.holds_memory and drafts_for(req)):
                continue
            prefix, count = forward_batch.prefix_lens[i], forward_batch.extend_lens[i]
            following = req.fill_ids[prefix + 1 : prefix + count + 1]
            if len(following) == count:
                rows = None if hidden is None else hidden[starts[i] : starts[i] + count]
                kept.append(Kept(req, prefix, following, rows))
        self.drafter.after_prefill(kept)

    # ---- a decode step --------------------------------------------------------------------------------------------
    def run_decode(self, batch: ScheduleBatch, kv_slots: list[int]) -> None:
        """One speculative decode step of ``batch`` (its requests' KV slots for their tokens per step are
        ``kv_slots``)."""
        reqs = batch.reqs
        counts = [self.tokens_per_step(r) for r in reqs]
        if max(counts) == 1 and not self.drafter.keeps_hidden:
            self._run_plain(reqs, batch, kv_slots)
            return
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

    def _run_plain(self, reqs: list[Req], batch: ScheduleBatch, kv_slots: list[int]) -> None:
        """A step with no drafts at all, run as a plain decode step (cheaper than a verify forward; a drafter
        that takes the model's hidden states always has drafts, or its requests are ending)."""
        starts = [r.num_computed for r in reqs]
        for req in reqs:  # before the tokens: a request that finishes reports its counts then
            self._count(req, 0, 1)
        super().run_decode(batch, kv_slots)
        self._draft_next(reqs, [1] * len(reqs), starts, [None] * len(reqs))

    def _run(
        self, reqs: list[Req], counts: list[int], per_req: list[list[int]], kv_slots: list[int]
    ) -> None:
        starts = [r.num_computed for r in reqs]
        chains = self.drafter.propose(reqs, counts, starts, per_req)
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
        key_generators([req])
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
        self,
        reqs: list[Req],
        taken: list[int],
        prefixes: list[int],
        hidden: list[torch.Tensor | None],
    ) -> None:
        """The drafter over each running drafted request's kept positions (its ``taken`` newest tokens follow
        them; ``hidden`` the model's states there): the next step's drafts."""
        kept = []
        for req, n, prefix, states in zip(reqs, taken, prefixes, hidden):
            if req.holds_memory and drafts_for(req):
                following = req.output_ids[len(req.output_ids) - n :]
                kept.append(Kept(req, prefix, following, states))
        self.drafter.after_verify(kept)

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


def _split(values: list[int], counts: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in counts:
        out.append(values[start : start + n])
        start += n
    return out
