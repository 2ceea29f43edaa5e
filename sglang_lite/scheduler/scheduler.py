"""The continuous-batching scheduler of one model replica: requests in, outputs out, one forward per step.

Each ``step()`` reads schedule -> run -> process results. Scheduling prefers prefill: the request being chunked
continues, then waiting requests join while the token budget, the request rows and the KV pool allow. Otherwise
every decoding request runs one token; when the KV pool cannot hold that step, the newest requests are retracted
(everything they hold is freed and they wait again, with their output so far kept for re-prefill).
The scheduler is single-threaded and knows nothing of HTTP or threads; a driver feeds it and collects outputs.
Failures stay as small as they can (``faults.py``): a request whose sampling, detokenising or stop matching raises
ends alone (finish reason abort, status 500, the error as its message) and frees what it held; a forward that raises
ends its batch; only ``RankBroken`` (a broken device, out-of-memory step after step) leaves ``step``.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from typing import Any

import torch

from sglang_lite.distributed import get_parallel_state
from sglang_lite.forward_batch import ForwardMode, build_forward_batch
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.mem_cache.radix_cache import RadixCache
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.protocol.loads import SchedulerLoads, utc_timestamp
from sglang_lite.protocol.outputs import INTERNAL_ERROR, ReqOutput
from sglang_lite.protocol.requests import fork_rids, validate_request
from sglang_lite.sampling.grammar import GrammarCache, GrammarQueue, RequestGrammar, grammar_key
from sglang_lite.sampling.logprobs import LogprobParams
from sglang_lite.sampling.params import SamplingParams
from sglang_lite.sampling.sampler import make_generator
from sglang_lite.scheduler.batch import ScheduleBatch
from sglang_lite.scheduler.disagg import DecodeSide, PrefillSide
from sglang_lite.scheduler.faults import (
    MemoryFailures,
    RankBroken,
    breaks_the_device,
    describe,
    is_out_of_memory,
)
from sglang_lite.scheduler.loads import ThroughputMeter
from sglang_lite.scheduler.policy import (
    NewTokenRatio,
    PrefillBudget,
    order_waiting,
    plan_prefill,
    reserved_decode_tokens,
    snapshot_aligned_chunk,
)
from sglang_lite.scheduler.request import FinishReason, Req, ReqStatus
from sglang_lite.scheduler.sampling import StepSampler
from sglang_lite.tokenizer.detokenizer import IncrementalDetokenizer, StopStringMatcher

GB = 1024**3
logger = logging.getLogger(__name__)


def _weight_bytes(model: Any) -> int:
    """Bytes of the weights of an nn.Module, or of the module a runner wraps as ``.model``."""
    module = model if hasattr(model, "parameters") else getattr(model, "model", None)
    return (
        sum(p.numel() * p.element_size() for p in module.parameters()) if module is not None else 0
    )


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        model: Any,
        pools: ModelPools,
        tokenizer: Any = None,
        disagg: PrefillSide | DecodeSide | None = None,
    ) -> None:
        self.config = config
        self.disagg = (
            disagg  # PD disaggregation: this rank's side, None when it serves whole requests
        )
        if disagg is not None:
            disagg.bind(self)
        self.num_prefill_tokens = 0  # prompt (and re-prefill) tokens run through extend forwards
        # the prefix cache, when the pools keep state snapshots for it (``--disable-radix-cache`` keeps none)
        self.cache = (
            RadixCache(pools, pools.states.snapshots) if pools.states.snapshots.size else None
        )
        self.prompt_tokens_admitted = self.prompt_tokens_cached = 0
        self.model = model
        self.pools = pools
        self.tokenizer = tokenizer
        self.waiting: list[Req] = []
        self.running: list[Req] = []  # decoding
        self.chunked: Req | None = None  # part-way through its prefill
        self.new_token_ratio = NewTokenRatio.from_conservativeness(config.schedule_conservativeness)
        self.num_retractions = 0
        self._outputs: list[ReqOutput] = []
        self._admissions = 0
        self._seeds = random.Random(config.random_seed)
        self._throughput = ThroughputMeter(start=time.monotonic())
        self._weight_bytes = _weight_bytes(model)
        self._memory_failures = MemoryFailures()
        self.sampler = StepSampler(
            config.vocab_size, pools.req_to_token.allocator.size, config.device
        )
        # structured output: requests wait here while their grammar compiles on worker threads; the ranks of one
        # attention group must admit alike, so there each grammar is awaited at the next step
        self.grammar_queue = GrammarQueue(
            GrammarCache(tokenizer, config.vocab_size), wait=get_parallel_state().attn_tp_size > 1
        )

    # ---- requests in, outputs out ----------------------------------------------------------------------------
    def add_request(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams | dict | None,
        bootstrap_room: int | None = None,
        logprob: LogprobParams | dict | None = None,
        stream: bool = True,
    ) -> None:
        """Queues a request; raises ValueError (naming the field) and leaves the scheduler untouched if invalid.
        ``bootstrap_room``: the PD transfer's id, required on a prefill or decode rank (ignored otherwise).
        ``logprob``: the log-probabilities to report in ``meta_info``. ``stream``: outputs every
        ``stream_interval`` tokens, else one output when the request finishes."""
        params = SamplingParams.from_dict(sampling_params)
        logprob = LogprobParams.from_dict(logprob)
        validate_request(input_ids, params, self.config, self.tokenizer is not None, logprob)
        for used in fork_rids(rid, params.n):
            if self._find(used) is not None or self._fork_parent(used) is not None:
                raise ValueError(f"rid {used!r} is already in use by an unfinished request")
        if self.disagg is not None:
            self._check_room(bootstrap_room)
            if params.n > 1:
                raise ValueError(
                    "n: parallel samples (n > 1) are not supported with PD disaggregation"
                )
            if (
                logprob is not None and logprob.return_logprob
            ):  # the first token is sampled on the other server
                raise ValueError(
                    "return_logprob: log-probabilities are not supported with PD disaggregation"
                )
        seed = self._seed_of(params)
        req = self._new_req(rid, list(input_ids), params, seed)
        if params.n > 1:
            req.forks, req.fork_seed = fork_rids(rid, params.n)[1:], seed
        if self.disagg is not None:
            req.bootstrap_room = bootstrap_room
        req.logprob, req.stream = logprob, stream
        grammar = grammar_key(params)
        if req.max_new_tokens == 0 and not (logprob is not None and logprob.wants_input):
            self._finish(req, FinishReason("length", length=0))
        elif self.disagg is not None:
            if grammar is not None:  # a PD side hands its requests on at once: compiled here
                req.grammar = self._request_grammar(req, self.grammar_queue.cache.compile(grammar))
            self.disagg.add(req)
        elif grammar is not None:
            self.grammar_queue.add(req, grammar)
        else:
            self.waiting.append(req)

    def _take_compiled(self) -> None:
        """Requests whose grammar has compiled join the waiting queue; one whose grammar failed fails alone."""
        for req, compiled in self.grammar_queue.take_ready():
            if isinstance(compiled, Exception):
                self._fail(req, compiled)
            else:
                req.grammar = self._request_grammar(req, compiled)
                self.waiting.append(req)

    def _request_grammar(self, req: Req, compiled: Any) -> RequestGrammar:
        """The grammar ends at the request's stop tokens (the model's eos ones under ``ignore_eos``)."""
        return RequestGrammar(
            compiled, sorted(req.stop_token_ids) or list(self.config.eos_token_ids)
        )

    def _check_room(self, room: int | None) -> None:
        if room is None:
            raise ValueError(
                f"bootstrap_room: a {self.disagg.mode} server takes requests with bootstrap_host, "
                "bootstrap_port and bootstrap_room (send them through a PD router)"
            )
        if room in self.disagg.rooms() or any(
            r.bootstrap_room == room for r in self.waiting + self.holders
        ):
            raise ValueError(f"bootstrap_room {room} is already in use by an unfinished request")

    def abort(self, rid: str, message: str = "aborted", failed: bool = False) -> bool:
        """Ends a request wherever it is and frees all it holds; False if no such unfinished request. ``failed``:
        it failed (status 500, the message its error), not a client's abort."""
        req = self._find(rid)
        reason = FinishReason(
            "abort", message=message, status_code=INTERNAL_ERROR if failed else None
        )
        parent = self._fork_parent(rid) if req is None else None
        if parent is not None:  # a parallel sample not forked yet: it will not be
            parent.forks.remove(rid)
            self._emit_unforked(parent, rid, reason)
            return True
        if req is None:
            return False
        if self.disagg is not None and self.disagg.abort(req, reason):
            return True
        if failed:
            self._end(req, reason)
            self._drop_finished()
            return True
        try:
            self._finish(req, FinishReason("abort", message=message))
        except (
            Exception
        ) as error:  # its detokeniser failed on the last text: it still ends, with the error
            self._fail(req, error)
        self._drop_finished()
        return True

    def step(self, must_forward: bool = False) -> list[ReqOutput]:
        """One schedule -> run -> process results. A failure fails only the requests it touches (see ``faults``);
        ``RankBroken`` (or a BaseException) means the process cannot go on. ``must_forward``: DP attention, where
        every rank of the world runs exactly one forward per step; with no batch it runs an idle one."""
        if self.disagg is not None:
            self.disagg.poll()
        if self.grammar_queue:
            self._take_compiled()
        batch = self.schedule()
        if batch is not None:
            self._run_batch(batch)
        elif must_forward:
            self._run_idle()
        return self._take_outputs()

    def _run_idle(self) -> None:
        """An empty forward that joins the world's MoE collectives; a rank that fails one cannot go on."""
        forward_idle = getattr(self.model, "forward_idle", None)
        if (
            forward_idle is None
        ):  # a runner without it: the model has no cross-rank collectives to join
            return
        try:
            forward_idle()
        except Exception as error:
            raise RankBroken(describe(error)) from error

    def _run_batch(self, batch: ScheduleBatch) -> None:
        kv_used = self.pools.kv.allocator.num_used
        try:
            logits = self.run(batch)
        except Exception as error:
            if (
                self.pools.kv.allocator.num_used == kv_used + batch.num_tokens
            ):  # its new tokens hold KV slots now
                _advance(batch)
            self._fail_step(batch.reqs, error)
            return
        try:
            self.process_results(batch, logits)
        except (
            Exception
        ) as error:  # not one request's fault (those are isolated inside): the batch fails
            self._fail_step(batch.reqs, error)
            return
        self._memory_failures.on_step_ok()

    def _fail_step(self, reqs: list[Req], error: Exception) -> None:
        if breaks_the_device(error):
            raise RankBroken(describe(error)) from error
        if is_out_of_memory(error):
            self._memory_failures.on_out_of_memory(
                error
            )  # raises RankBroken when it keeps happening
        logger.exception("a step failed; its %d requests fail, the rank goes on", len(reqs))
        for req in reqs:
            if not req.finished:
                self._fail(req, error)
        self._drop_finished()

    @property
    def has_work(self) -> bool:
        pd = self.disagg is not None and self.disagg.has_work
        return bool(
            self.waiting
            or self.running
            or self.chunked
            or self._outputs
            or pd
            or self.grammar_queue
        )

    @property
    def only_waiting_on_transfers(self) -> bool:
        """Nothing to run until a PD transfer or destination arrives, or a grammar compiles (a driver may wait a
        little)."""
        return not (self.waiting or self.running or self.chunked or self._outputs) and self.has_work

    # ---- schedule ----------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduleBatch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked is None:
            return None
        plan = plan_prefill(
            self.chunked, order_waiting(self.waiting, self.config.schedule_policy), self._budget()
        )
        if not plan:
            return None
        for req, _ in plan:
            if not req.holds_memory:
                self._admit(req)
        # a prefix-cache hit at admission leaves fewer tokens to run than were planned
        counts = [min(n, r.num_uncached) for r, n in plan]
        if (
            self.cache is not None
        ):  # only the last request of a batch may stop part-way (it becomes the chunked one)
            last = plan[-1][0]
            counts[-1] = snapshot_aligned_chunk(last.num_cached, last.seq_len, counts[-1])
        return ScheduleBatch(ForwardMode.EXTEND, [r for r, _ in plan], counts)

    def reserved_decode_tokens(self) -> int:
        """KV slots the running requests are expected to need for their remaining output."""
        ratio = self.new_token_ratio.value
        return sum(reserved_decode_tokens(r, ratio) for r in self.running)

    def _budget(self) -> PrefillBudget:
        ratio = self.new_token_ratio.value
        reserved = self.reserved_decode_tokens()
        if self.chunked is not None:
            reserved += self.chunked.num_uncached + reserved_decode_tokens(self.chunked, ratio)
        kv_free = self.pools.kv.allocator.num_free + (
            self.cache.evictable_tokens if self.cache else 0
        )
        return PrefillBudget(
            kv_free=kv_free,
            admit_free=kv_free - reserved,
            batch_tokens=self.config.max_prefill_tokens,
            chunk_size=self.config.chunk_size,
            free_rows=min(
                self.pools.req_to_token.allocator.num_free, self.pools.states.allocator.num_free
            ),
            new_token_ratio=ratio,
        )

    def _admit(self, req: Req) -> None:
        (row,) = self.pools.req_to_token.allocator.alloc(1)
        (slot,) = self.pools.states.alloc(1)
        self.waiting.remove(req)
        req.req_row, req.state_slot, req.num_cached = row, slot, 0
        req.status = ReqStatus.PREFILLING
        self.note_admission(req)
        self.sampler.on_admit(req)
        if self.cache is not None:
            self._reuse_prefix(req)

    def _reuse_prefix(self, req: Req) -> None:
        """Starts the request from the longest cached prefix that ends at a state snapshot (at least one token is
        left to run, for the logits): its KV slots are read in place, the snapshot copied into its own slot."""
        limit = StepSampler.prefix_limit(
            req
        )  # prompt log-probabilities need their positions' logits
        hit, node, kv = self.cache.match(req.fill_ids, req.seq_len - 1 if limit is None else limit)
        prompt = len(req.input_ids)
        if req.num_retractions == 0:  # a re-admission is not a new prompt
            self.prompt_tokens_admitted += prompt
            self.prompt_tokens_cached += min(hit, prompt)
            req.cached_tokens = min(hit, prompt)
        if hit == 0:
            return
        self.cache.lock(node)
        table = self.pools.req_to_token.req_to_token
        table[req.req_row, :hit] = torch.tensor(kv, dtype=table.dtype, device=table.device)
        self.pools.states.copy_slot(node.snapshot, req.state_slot)
        req.num_cached = req.cached_len = hit
        req.cache_node = node

    def _cache_prefix(self, req: Req) -> None:
        """Hands the request's cached positions to the prefix cache, with a snapshot of its state: they stay for
        later requests after this one ends. The request then owns none of them (duplicates are freed)."""
        if self.cache is None or req.num_cached <= req.cached_len:
            return
        table = self.pools.req_to_token.req_to_token
        n = req.num_cached
        inserted = self.cache.insert(
            req.fill_ids[:n], table[req.req_row, :n].tolist(), req.state_slot
        )
        if (
            inserted is None
        ):  # no snapshot slot to be had: nothing cached, the request keeps what it owns
            return
        node, slots, duplicates = inserted
        if duplicates:  # positions the cache already held: read its slots, free ours
            table[req.req_row, :n] = torch.tensor(slots, dtype=table.dtype, device=table.device)
            self.pools.kv.allocator.free(duplicates)
        self.cache.lock(node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node, req.cached_len = node, n

    def _make_room(self, num_tokens: int) -> None:
        """Evicts unused cached prefixes until ``num_tokens`` KV slots are free (or nothing more can go)."""
        if self.cache is not None and self.pools.kv.allocator.num_free < num_tokens:
            self.cache.evict(num_tokens)

    def note_admission(self, req: Req) -> None:
        """Admission order (retraction takes the newest)."""
        req.admit_seq = self._admissions
        self._admissions += 1

    def _schedule_decode(self) -> ScheduleBatch | None:
        if not self.running:
            return None
        self._make_room(
            len(self.running)
        )  # unused cached prefixes go before any request is retracted
        while self.pools.kv.allocator.num_free < len(self.running):
            self._retract(self._retraction_victim())
        return ScheduleBatch.decode(self.running)

    def _retraction_victim(self) -> Req:
        """The newest request holding memory, keeping at least one decoding request."""
        candidates = (
            self.holders
            if len(self.running) > 1
            else [r for r in self.holders if r is self.chunked]
        )
        assert candidates, "one request alone always fits the KV pool (validated at admission)"
        return max(candidates, key=lambda r: r.admit_seq)

    def _retract(self, req: Req) -> None:
        self._release(req)
        if req is self.chunked:
            self.chunked = None
        else:
            self.running.remove(req)
        req.status, req.num_retractions = ReqStatus.WAITING, req.num_retractions + 1
        self.waiting.append(req)
        self.num_retractions += 1
        self.new_token_ratio.on_retraction()

    # ---- run ---------------------------------------------------------------------------------------------------
    def run(self, batch: ScheduleBatch) -> torch.Tensor:
        """One forward; logits [B, vocab] of each request's last new token."""
        self._make_room(batch.num_tokens)
        forward_batch = build_forward_batch(
            self.pools,
            batch.mode,
            batch.new_token_ids(),
            batch.prefix_lens,
            [r.req_row for r in batch.reqs],
            [r.state_slot for r in batch.reqs],
            self.config.device,
        )
        if not batch.is_decode:
            self.num_prefill_tokens += forward_batch.num_tokens
        with torch.inference_mode():
            if batch.is_decode or not any(
                r.logprob is not None and r.logprob.wants_input for r in batch.reqs
            ):
                return self.model.forward_batch(forward_batch)
            logits = self.model.forward_batch(forward_batch, all_logits=True)
            self.sampler.record_prompt(batch.reqs, batch.extend_lens, batch.prefix_lens, logits)
            return logits[forward_batch.last_token_indices]

    # ---- process results ---------------------------------------------------------------------------------------
    def process_results(self, batch: ScheduleBatch, logits: torch.Tensor) -> None:
        completes = batch.completes()
        _advance(batch)
        for req in [r for r, done in zip(batch.reqs, completes) if done and r.max_new_tokens == 0]:
            self._finish(
                req, FinishReason("length", length=0)
            )  # prefilled for its prompt log-probabilities
        completes = [done and r.max_new_tokens > 0 for r, done in zip(batch.reqs, completes)]
        sampled = [r for r, done in zip(batch.reqs, completes) if done]
        if sampled:
            rows = (
                logits
                if len(sampled) == len(batch.reqs)
                else logits[[i for i, d in enumerate(completes) if d]]
            )
            forked = [
                (i, child)
                for i, req in enumerate(sampled)
                if req.forks
                for child in self._fork(req)
            ]
            if forked:  # parallel samples draw their first tokens from their parent's logits
                rows = rows[list(range(len(sampled))) + [i for i, _ in forked]]
                sampled = sampled + [child for _, child in forked]
            kept = [(r, t) for r, t in zip(sampled, self._sample(sampled, rows)) if t is not None]
            if (
                isinstance(self.disagg, PrefillSide) and not batch.is_decode
            ):  # PD: to the decode side, not decoded
                for req, token in [(r, t) for r, t in kept if r.bootstrap_room is not None]:
                    self.disagg.on_prefilled(req, token)
                kept = [
                    (r, t) for r, t in kept if r.bootstrap_room is None
                ]  # a re-prefill after retraction
            self._append_tokens([r for r, _ in kept], [t for _, t in kept])
        if batch.is_decode:
            self.new_token_ratio.on_decode_step()
        else:
            self._place_prefilled(batch.reqs, completes)
        self._drop_finished()

    def _sample(self, reqs: list[Req], logits: torch.Tensor) -> list[int | None]:
        """Each request's next token; None for a request whose sampling failed (it is failed here). The batch is
        sampled at once; only when that raises is each row sampled alone, to find the culprits."""
        try:
            return self._sample_rows(reqs, logits).tolist()
        except Exception as error:
            if breaks_the_device(error):
                raise
            return [self._sample_one(req, logits[i : i + 1]) for i, req in enumerate(reqs)]

    def _sample_one(self, req: Req, logits: torch.Tensor) -> int | None:
        try:
            return int(self._sample_rows([req], logits)[0])
        except Exception as error:
            self._fail_request(req, error)
            return None

    def _sample_rows(self, reqs: list[Req], logits: torch.Tensor) -> torch.Tensor:
        return self.sampler.sample(reqs, logits)

    def _append_tokens(self, reqs: list[Req], token_ids: list[int]) -> None:
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
                self._fail_request(req, error)
            if (
                not req.finished
                and req.stream
                and len(req.unsent_ids) >= self.config.stream_interval
            ):
                self._emit(req)
        self._throughput.record(now, len(reqs))

    def _update_text_and_finish(self, req: Req, token: int) -> None:
        if req.grammar is not None:
            req.grammar.accept(token)
        if token in req.stop_token_ids or (req.grammar is not None and req.grammar.terminated):
            self._finish(req, FinishReason("stop", matched=token))
            return
        self._add_text(req, req.detokenizer.push([token]) if req.detokenizer else "")
        if req.stop_matcher is not None and req.stop_matcher.matched is not None:
            self._finish(req, FinishReason("stop", matched=req.stop_matcher.matched))
        elif len(req.output_ids) >= req.max_new_tokens:
            self._finish(req, FinishReason("length", length=len(req.output_ids)))

    def _add_text(self, req: Req, text: str) -> None:
        req.unsent_text += req.stop_matcher.feed(text) if req.stop_matcher else text

    def _place_prefilled(self, reqs: list[Req], completes: list[bool]) -> None:
        for req, done in zip(reqs, completes):
            if req is self.chunked:
                self.chunked = None
            if req.finished or req.status is ReqStatus.TRANSFERRING:
                continue
            if done:
                req.status = ReqStatus.DECODING
                self.running.append(req)
            else:
                self.chunked = req
            # the KV so far and the state after it, for later requests: at the end of the prompt, and at chunk
            # boundaries (so that a prompt equal to a cached one still finds a snapshot before its last token)
            self._cache_prefix(req)

    # ---- parallel samples (n > 1) ----------------------------------------------------------------------------------
    def _fork(self, parent: Req) -> list[Req]:
        """The parallel samples of a request whose prompt was just prefilled: each gets its own row and state slot,
        the prompt's KV (shared through the prefix cache, else copied) and a copy of the state, and decodes from
        here. One that cannot get memory now waits and prefills like any request."""
        assert not parent.output_ids, "parallel samples fork before the first token"
        self._cache_prefix(
            parent
        )  # the cache then owns the prompt's KV, which every sample reads in place
        forked = []
        for i, rid in enumerate(parent.forks, start=1):
            params = dataclasses.replace(parent.sampling_params, n=1, seed=parent.fork_seed + i)
            child = self._new_req(rid, list(parent.input_ids), params, parent.fork_seed + i)
            child.arrival_time, child.logprob, child.stream = (
                parent.arrival_time,
                parent.logprob,
                parent.stream,
            )
            child.grammar = parent.grammar.restarted() if parent.grammar is not None else None
            child.logprob_record = parent.logprob_record.copy_input()
            if self._share_prompt(parent, child):
                self.note_admission(child)
                self.sampler.on_admit(child)
                child.status, child.cached_tokens = ReqStatus.DECODING, parent.cached_tokens
                self.running.append(child)
                forked.append(child)
            else:
                self.waiting.append(child)
        parent.forks = []
        return forked

    def _share_prompt(self, parent: Req, child: Req) -> bool:
        """Gives ``child`` a row, a state slot and ``parent``'s cached prompt; False (nothing taken) if memory is
        short."""
        rows = self.pools.req_to_token.allocator.alloc(1)
        slots = self.pools.states.alloc(1) if rows else None
        n, shared = parent.num_cached, parent.cached_len
        if slots:
            self._make_room(n - shared)
        kv = self.pools.kv.allocator.alloc(n - shared) if slots else None
        if kv is None:
            if rows:
                self.pools.req_to_token.allocator.free(rows)
            if slots:
                self.pools.states.allocator.free(slots)
            return False
        table = self.pools.req_to_token.req_to_token
        (row,), (slot,) = rows, slots
        table[row, :shared] = table[parent.req_row, :shared]
        if kv:
            self.pools.copy_kv(table[parent.req_row, shared:n].tolist(), kv)
            table[row, shared:n] = torch.tensor(kv, dtype=table.dtype, device=table.device)
        if shared:
            self.cache.lock(parent.cache_node)
            child.cache_node, child.cached_len = parent.cache_node, shared
        self.pools.states.copy_slot(parent.state_slot, slot)
        child.req_row, child.state_slot, child.num_cached = row, slot, n
        return True

    def _fork_parent(self, rid: str) -> Req | None:
        """The unfinished request that will fork the parallel sample ``rid``."""
        return next((r for r in self.waiting + self.holders if rid in r.forks), None)

    def _emit_unforked(self, parent: Req, rid: str, reason: FinishReason) -> None:
        """A parallel sample that ends before it was forked (its parent ended, or it was aborted)."""
        meta = {
            "id": rid,
            "prompt_tokens": len(parent.input_ids),
            "completion_tokens": 0,
            "cached_tokens": 0,
            "finish_reason": reason.to_dict(),
            "num_retractions": 0,
            "e2e_latency": time.monotonic() - parent.arrival_time,
        }
        self._outputs.append(ReqOutput(rid, [], "", True, meta))

    def flush_cache(self) -> int:
        """Drops every cached prefix no request uses; returns the KV slots freed."""
        return self.cache.flush() if self.cache is not None else 0

    # ---- PD disaggregation: what the rank's side asks of the scheduler --------------------------------------------
    def end_request(self, req: Req, reason: FinishReason, keep_memory: bool = False) -> None:
        """Ends a request that sits in a PD queue (``keep_memory``: its reservation is freed later, by the side)."""
        if keep_memory:
            req.status, req.finish_reason = ReqStatus.FINISHED, reason
            self._emit(req)
            return
        if reason.is_internal_error:
            self._end(req, reason)  # no text flush: the request failed
        else:
            self._finish(req, reason)

    def finish_transferred(self, req: Req, token: int) -> None:
        """Prefill side: the decode rank has the request; it ends here with its first token."""
        req.max_new_tokens = 1
        self._append_tokens([req], [token])

    def join_decoding(self, req: Req, token: int) -> None:
        """Decode side: the prompt's KV and state arrived with the first token; the request decodes from here."""
        req.status = ReqStatus.DECODING
        self._append_tokens([req], [token])
        if not req.finished:
            self.running.append(req)

    # ---- finishing and freeing ---------------------------------------------------------------------------------
    def _finish(self, req: Req, reason: FinishReason) -> None:
        if not (reason.kind == "stop" and isinstance(reason.matched, str)):
            self._flush_text(
                req
            )  # a stop string already emitted the text before it and dropped the rest
        self._end(req, reason)

    def _fail_request(self, req: Req, error: Exception) -> None:
        """One request raised: it fails alone, unless the error broke the device (then the rank must go)."""
        if breaks_the_device(error) or is_out_of_memory(error):
            raise error
        logger.warning(
            "request %s failed: %s: %s", req.rid, type(error).__name__, error, exc_info=error
        )
        self._fail(req, error)

    def _fail(self, req: Req, error: Exception) -> None:
        """Ends a request with the error; no text flush (the detokeniser may be what failed)."""
        self._end(req, FinishReason("abort", message=describe(error), status_code=INTERNAL_ERROR))

    def _end(self, req: Req, reason: FinishReason) -> None:
        if req.holds_memory:
            self._release(
                req, cache=not reason.is_internal_error
            )  # a failed step's KV may be half-written
        if req in self.waiting:
            self.waiting.remove(req)
        self.grammar_queue.remove(req)
        req.status, req.finish_reason = ReqStatus.FINISHED, reason
        self._emit(req)
        for rid in req.forks:  # its parallel samples were never forked: they end with it
            self._emit_unforked(req, rid, reason)
        req.forks = []

    def _flush_text(self, req: Req) -> None:
        if req.detokenizer is not None:
            self._add_text(req, req.detokenizer.flush())
        if req.stop_matcher is not None and req.stop_matcher.matched is None:
            req.unsent_text += req.stop_matcher.flush()

    def _release(self, req: Req, cache: bool = True) -> None:
        """Frees what the request holds; with the prefix cache, what it computed is cached first (``cache``)."""
        if cache:
            self._cache_prefix(req)
        self.pools.free_request(req.req_row, req.num_cached, req.state_slot, first=req.cached_len)
        self.sampler.on_release(req)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.req_row = req.state_slot = req.cache_node = None
        req.num_cached = req.cached_len = 0

    def _drop_finished(self) -> None:
        self.running = [r for r in self.running if not r.finished]
        if self.chunked is not None and self.chunked.finished:
            self.chunked = None

    def _emit(self, req: Req) -> None:
        self._outputs.append(
            ReqOutput(req.rid, req.unsent_ids, req.unsent_text, req.finished, self._meta_info(req))
        )
        req.unsent_ids, req.unsent_text = [], ""

    def _meta_info(self, req: Req) -> dict[str, Any]:
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finish_reason.to_dict() if req.finish_reason else None,
            "num_retractions": req.num_retractions,
        }
        if req.finished:
            meta["e2e_latency"] = time.monotonic() - req.arrival_time
        if req.logprob is not None and req.logprob.return_logprob:
            meta.update(req.logprob_record.take(req.logprob))
        return meta

    def _take_outputs(self) -> list[ReqOutput]:
        outputs, self._outputs = self._outputs, []
        return outputs

    # ---- requests ----------------------------------------------------------------------------------------------
    def _seed_of(self, params: SamplingParams) -> int:
        return params.seed if params.seed is not None else self._seeds.getrandbits(63)

    def _new_req(self, rid: str, input_ids: list[int], params: SamplingParams, seed: int) -> Req:
        stop_ids = set(params.stop_token_ids) | (
            set() if params.ignore_eos else set(self.config.eos_token_ids)
        )
        tokenizer = self.tokenizer
        return Req(
            rid=rid,
            input_ids=input_ids,
            sampling_params=params,
            max_new_tokens=min(
                params.max_new_tokens, self.config.max_request_tokens - len(input_ids)
            ),
            stop_token_ids=frozenset(stop_ids),
            generator=make_generator(seed, self.config.device),
            detokenizer=IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
            if tokenizer
            else None,
            stop_matcher=StopStringMatcher(params.stop) if params.stop else None,
        )

    def _find(self, rid: str) -> Req | None:
        req = next(
            (r for r in self.waiting + self.holders + self.grammar_queue.items if r.rid == rid),
            None,
        )
        if req is None and self.disagg is not None:
            req = self.disagg.find(rid)
        return req

    @property
    def holders(self) -> list[Req]:
        """The requests holding memory: decoding, and the one part-way through its prefill."""
        return self.running + ([self.chunked] if self.chunked else [])

    def check_invariants(self) -> None:
        """Exact accounting between steps: the pools hold precisely what the requests say they hold."""
        holders = self.holders
        for req in holders + self.waiting:
            req.check()
        holders = holders + (
            self.disagg.held() if self.disagg is not None else []
        )  # PD: reserved or being sent
        cached = self.cache.num_tokens if self.cache is not None else 0
        owned = sum(r.num_cached - r.cached_len for r in holders)
        assert self.pools.kv.allocator.num_used == owned + cached, "KV slots leaked or lost"
        if self.cache is not None:
            assert self.cache.num_locked_tokens <= self.cache.num_tokens, (
                "prefix-cache locks out of step"
            )
        assert self.pools.req_to_token.allocator.num_used == len(holders), "request rows leaked"
        assert self.pools.states.allocator.num_used == len(holders), "state slots leaked"

    # ---- load figures ------------------------------------------------------------------------------------------
    def _tokens_to_prefill(self) -> int:
        """Prompt tokens not yet in the cache: waiting requests and the rest of the chunked one."""
        return sum(r.num_uncached for r in self.waiting) + (
            self.chunked.num_uncached if self.chunked else 0
        )

    def get_loads(self) -> SchedulerLoads:
        evictable = self.cache.evictable_tokens if self.cache is not None else 0
        used = (
            self.pools.kv.allocator.num_used - evictable
        )  # unused cached prefixes are free space, as upstream
        total = self.config.max_total_tokens
        running = len(self.holders)
        pd = self.disagg.loads() if self.disagg is not None else {}
        pd_waiting = self.disagg.waiting_reqs() if self.disagg is not None else []
        return SchedulerLoads(
            dp_rank=self.config.dp_rank,
            timestamp=utc_timestamp(),
            num_running_reqs=running,
            num_waiting_reqs=len(self.waiting) + len(pd_waiting) + len(self.grammar_queue),
            num_used_tokens=used,
            # PD: a reserved request's KV is in `used` already; one still in prealloc counts its prompt
            num_total_tokens=used
            + self._tokens_to_prefill()
            + sum(len(r.input_ids) for r in pd_waiting if not r.holds_memory),
            max_total_num_tokens=total,
            token_usage=used / total,
            gen_throughput=self._throughput.rate(time.monotonic()),
            cache_hit_rate=self.prompt_tokens_cached / max(self.prompt_tokens_admitted, 1),
            cached_tokens=self.cache.num_tokens if self.cache is not None else 0,
            num_cached_prompt_tokens=self.prompt_tokens_cached,
            utilization=running / self.config.max_running_requests,
            max_running_requests=self.config.max_running_requests,
            weight_gb=self._weight_bytes / GB,
            kv_cache_gb=(self.pools.kv.bytes + self.pools.states.bytes) / GB,
            token_capacity=total,
            waiting=len(self.waiting),
            paused=0,
            retracted=sum(1 for r in self.waiting if r.num_retractions),
            num_retractions=self.num_retractions,
            num_prefill_tokens=self.num_prefill_tokens,
            mode=self.disagg.mode if self.disagg is not None else "null",
            decode_retracted_queue_reqs=sum(1 for r in self.waiting if r.num_retractions)
            if pd
            else 0,
            **pd,
        )


def _advance(batch: ScheduleBatch) -> None:
    """The batch's new tokens are in the cache (their KV slots are recorded in the requests' rows)."""
    for req, n in zip(batch.reqs, batch.extend_lens):
        req.num_cached += n
