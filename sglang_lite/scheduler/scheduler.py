"""The continuous-batching scheduler of one model replica: requests in, outputs out, one forward per step.

Each ``step()`` reads receive -> schedule -> run -> process results, and hands each part to its owner:

- ``intake.RequestIntake``: checks a new request and builds its ``Req``;
- ``queues.RequestQueues``: where each unfinished request is (waiting, chunked, running);
- ``prefill.PrefillManager``: admission and prefill batches (around the pure ``policy``), prefix-cache hits;
- ``decode.DecodeManager``: decode batches and retraction;
- ``mem_cache.request_memory.RequestMemory``: every row, state slot and KV slot a request holds, and what it
  hands to the prefix cache (one place allocates, one place releases);
- ``output.OutputProcessor``: sampling, text, stop strings, log-probabilities, streaming outputs;
- ``forks.ForkManager``: parallel samples (``n > 1``); ``finish.RequestEnder``: ending and reporting;
- ``disagg``: the rank's PD side (a ``NullSide`` when it serves whole requests); ``loads``: load figures.

The scheduler is single-threaded and knows nothing of HTTP or threads; a driver feeds it and collects outputs.
Failures stay as small as they can (``faults.py``): a request whose sampling, detokenising or stop matching raises
ends alone (finish reason abort, status 500, the error as its message) and frees what it held; a forward that raises
ends its batch; only ``RankBroken`` (a broken device, out-of-memory step after step) leaves ``step``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from sglang_lite.distributed import get_parallel_state
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.mem_cache.radix_cache import RadixCache
from sglang_lite.mem_cache.request_memory import RequestMemory
from sglang_lite.model_executor import Runner
from sglang_lite.multimodal.inputs import ImageInputs
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.protocol.loads import SchedulerLoads
from sglang_lite.protocol.outputs import ReqOutput
from sglang_lite.sampling.grammar import GrammarCache, GrammarQueue, grammar_key
from sglang_lite.sampling.logprobs import LogprobParams
from sglang_lite.sampling.params import SamplingParams
from sglang_lite.scheduler.batch import ScheduleBatch
from sglang_lite.scheduler.decode import AdmissionOrder, Arrivals, DecodeManager
from sglang_lite.scheduler.faults import (
    MemoryFailures,
    RankBroken,
    breaks_the_device,
    describe,
    is_out_of_memory,
)
from sglang_lite.scheduler.finish import RequestEnder
from sglang_lite.scheduler.forks import ForkManager
from sglang_lite.scheduler.images import RequestImages, extend_images
from sglang_lite.scheduler.intake import RequestIntake
from sglang_lite.scheduler.load_report import LoadInputs, report_loads
from sglang_lite.scheduler.output import Argmaxes, OutputProcessor
from sglang_lite.scheduler.pd_side import DisaggSide, NullSide
from sglang_lite.scheduler.prefill import PrefillManager
from sglang_lite.scheduler.queues import RequestQueues
from sglang_lite.scheduler.request import FinishReason, Req, ReqStatus
from sglang_lite.scheduler.sampling import StepSampler
from sglang_lite.scheduler.speculative import create_speculation
from sglang_lite.scheduler.speculative.null import NullSpeculation

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        runner: Runner,
        pools: ModelPools,
        tokenizer: Any = None,
        disagg: DisaggSide | None = None,
        memory: RequestMemory | None = None,
    ) -> None:
        """``memory``: the owner of the requests' memory over ``pools`` (one is made when not given; a PD side
        built beforehand shares it). ``disagg``: this rank's PD side. ``runner``: what runs the model's
        forwards."""
        self.config = config
        self.runner = runner
        self.pools = pools
        self.tokenizer = tokenizer
        self.sampler = StepSampler(
            config.vocab_size, pools.req_to_token.allocator.size, config.device
        )
        self.memory = memory or create_request_memory(pools)
        self.memory.listeners = (AdmissionOrder(), self.sampler)
        self.queues = RequestQueues()
        # structured output: requests wait here while their grammar compiles on worker threads; the ranks of one
        # attention group must admit alike, so there each grammar is awaited at the next step
        self.grammar_queue = GrammarQueue(
            GrammarCache(tokenizer, config.vocab_size),
            wait=get_parallel_state().attn_tp_size > 1,
        )
        self.intake = RequestIntake(config, tokenizer)
        self.prefill = PrefillManager(config, self.queues, self.memory)
        self.ender = RequestEnder(
            self.memory, self.queues, self.grammar_queue, config.speculative_algorithm is not None
        )
        self.forks = ForkManager(self.queues, self.memory, self.intake.new_req)
        self.disagg = disagg or NullSide()
        self.output = OutputProcessor(config, self.sampler, self.ender, self.forks, self.disagg)
        self.speculation = create_speculation(config, runner, pools, self.memory, self.output)
        self.decode = DecodeManager(
            config, self.queues, self.memory, self.speculation.tokens_per_step
        )
        self.disagg.bind(_PDHost(self))
        self.num_prefill_tokens = 0  # prompt (and re-prefill) tokens run through extend forwards
        self._memory_failures = MemoryFailures()
        self._weight_bytes = runner.weight_bytes()
        self._graph_bytes = runner.graph_bytes()

    # ---- requests in --------------------------------------------------------------------------------------------
    def add_request(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams | dict | None,
        bootstrap_room: int | None = None,
        logprob: LogprobParams | dict | None = None,
        stream: bool = True,
        local: bool = False,
        images: ImageInputs | None = None,
    ) -> None:
        """Queues a request; raises ValueError (naming the field) and leaves the scheduler untouched if invalid.
        ``bootstrap_room``: the PD transfer's id, required on a prefill or decode rank (ignored otherwise).
        ``logprob``: the log-probabilities to report in ``meta_info``. ``stream``: outputs every
        ``stream_interval`` tokens, else one output when the request finishes. ``local``: served whole here even
        on a PD rank (the server's health generation). ``images``: the prompt's images, whose tokens it holds
        (``multimodal.inputs``)."""
        params = SamplingParams.from_dict(sampling_params)
        logprob = LogprobParams.from_dict(logprob)
        pd = self.disagg.takes_requests and not local

        def check_pd() -> None:
            if pd:
                self.disagg.check(
                    bootstrap_room, params, logprob, len(input_ids), self._queued_rooms
                )

        req = self.intake.make(
            rid, input_ids, params, logprob, stream, self._in_use, check_pd, images
        )
        if images is not None:
            req.images = RequestImages(images, req.input_ids, self.config)
        req.bootstrap_room = bootstrap_room if pd else None
        grammar = grammar_key(params)
        if req.max_new_tokens == 0 and not (logprob is not None and logprob.wants_input):
            self.ender.finish(req, FinishReason("length", length=0))
        elif pd:
            if grammar is not None:  # a PD side hands its requests on at once: compiled here
                compiled = self.grammar_queue.cache.compile(grammar)
                req.grammar = self.intake.grammar_of(req, compiled)
            self.disagg.add(req)
        elif grammar is not None:
            self.grammar_queue.add(req, grammar)
        else:
            self.queues.waiting.append(req)

    def _take_compiled(self) -> None:
        """Requests whose grammar has compiled join the waiting queue; one whose grammar failed fails alone."""
        for req, compiled in self.grammar_queue.take_ready():
            if isinstance(compiled, Exception):
                self.ender.fail(req, compiled)
            else:
                req.grammar = self.intake.grammar_of(req, compiled)
                self.queues.waiting.append(req)

    def abort(
        self, rid: str, message: str = "aborted", status: int | None = None, settled=False
    ) -> bool:
        """Ends a request wherever it is and frees all it holds; False if no such unfinished request. ``status``:
        it failed (500, or 400 / 502 for a PD pair's failure; the message its error), not a client's abort.
        ``settled``: PD, its other side will write nothing more for it."""
        req = self._find(rid)
        failed = status is not None
        reason = FinishReason("abort", message=message, status_code=status)
        parent = self.forks.parent_of(rid) if req is None else None
        if parent is not None:  # a parallel sample not forked yet: it will not be
            parent.forks.remove(rid)
            self.ender.emit_unforked(parent, rid, reason)
            return True
        if req is None:
            return False
        if self.disagg.abort(req, reason, settled):
            return True
        if failed:
            self.ender.end(req, reason)
        else:
            try:
                self.ender.finish(req, reason)
            except (
                Exception
            ) as error:  # its detokeniser failed on the last text: it still ends, with it
                self.ender.fail(req, error)
        self.queues.drop_finished()
        return True

    def watch_arrivals(self, arrivals: Arrivals) -> None:
        """Commands arriving at the rank (its loop's inbox) end a run of decode steps at the step they arrive in, and
        runs without a streaming request go on past the time budget (``DecodeManager._steps``)."""
        self.decode.arrivals = arrivals
        if isinstance(self.speculation, NullSpeculation):
            self.speculation.arrivals = arrivals

    # ---- the loop -----------------------------------------------------------------------------------------------
    def poll(self) -> None:
        """Takes what arrived without a forward: PD reservations, transfers and destinations, compiled grammars."""
        self.disagg.poll()
        if self.grammar_queue:
            self._take_compiled()

    def step(self, must_forward: bool = False) -> list[ReqOutput]:
        """One receive -> schedule -> run -> process results. A failure fails only the requests it touches (see
        ``faults``); ``RankBroken`` (or a BaseException) means the process cannot go on. ``must_forward``: DP
        attention, where every rank of the world runs exactly one forward per step; with no batch it runs an
        idle one."""
        self.poll()
        self.execute(self.schedule(), must_forward)
        return self.take_outputs()

    def execute(self, batch: ScheduleBatch | None, must_forward: bool = False) -> None:
        """Runs a scheduled batch (an idle forward instead when there is none and ``must_forward``)."""
        if batch is not None:
            self._run_batch(batch)
        elif must_forward:
            self._run_idle()

    def take_outputs(self) -> list[ReqOutput]:
        return self.ender.take_outputs()

    def schedule(self) -> ScheduleBatch | None:
        # a decode step's usual case: spares the reservation's sum
        if not self.prefill.has_candidates:
            return self.decode.schedule(back_to_back=True)
        reserved = self.decode.reserved_decode_tokens()
        ratio = self.decode.new_token_ratio.value
        return self.prefill.schedule(reserved, ratio) or self.decode.schedule()

    def _run_batch(self, batch: ScheduleBatch) -> None:
        # a decode step runs each request's last token and the drafts it verifies (speculation)
        counts = batch.extend_lens
        if batch.is_decode:
            counts = [self.speculation.tokens_per_step(r) * batch.steps for r in batch.reqs]
        try:
            kv_slots = self.memory.alloc_kv(batch.reqs, counts)
        except Exception as error:
            self._fail_step(batch.reqs, error)
            return
        if batch.is_decode:
            self._run_decode(batch, kv_slots)
            return
        try:
            logits = self.run(batch, kv_slots)
        except Exception as error:
            self.memory.free_kv(kv_slots)  # computed nothing: the requests fail without them
            self._fail_step(batch.reqs, error)
            return
        batch.advance()
        try:
            self.process_results(batch, logits)
        except (
            Exception
        ) as error:  # not one request's fault (those are isolated inside): the batch fails
            self._fail_step(batch.reqs, error)
            return
        self._memory_failures.on_step_ok()

    def _run_decode(self, batch: ScheduleBatch, kv_slots: list[int]) -> None:
        """A decode step (``speculation.run_decode``: plain, or drafts verified): it samples and appends itself."""
        start = time.perf_counter()
        try:
            self.speculation.run_decode(batch, kv_slots)
        except Exception as error:
            # what the step kept is unknown: the requests fail, their memory (verified slots too) freed
            self._fail_step(batch.reqs, error)
            return
        self.decode.on_step(batch.steps, time.perf_counter() - start)
        self.queues.drop_finished()
        self._memory_failures.on_step_ok()

    def run(self, batch: ScheduleBatch, kv_slots: list[int]) -> torch.Tensor | Argmaxes:
        """A prefill forward over KV slots allocated for it; logits [B, vocab] of each request's last new token, or
        their argmaxes where every request takes its argmax and the runner finds those without the logits."""
        forward_batch = batch.forward_batch(self.pools, self.config.device, kv_slots)
        images = extend_images(batch.reqs, batch.extend_lens, self.runner.encode_images)
        if images is not None:
            mrope, rows, embeds = images
            device = forward_batch.positions.device
            forward_batch.mrope_positions = mrope.to(device)
            forward_batch.image_rows = rows.to(device) if rows is not None else None
            forward_batch.image_embeds = embeds
        self.num_prefill_tokens += forward_batch.num_tokens
        wants_input = any(r.logprob is not None and r.logprob.wants_input for r in batch.reqs)
        with torch.inference_mode():
            if not wants_input and self.sampler.all_plain_greedy(batch.reqs):
                tokens = self.speculation.extend_greedy(forward_batch)
                if tokens is not None:
                    return Argmaxes(tokens)
            logits = self.speculation.forward_extend(forward_batch, wants_input)
        if not wants_input:
            return logits
        self.sampler.record_prompt(batch.reqs, batch.extend_lens, batch.prefix_lens, logits)
        return logits[forward_batch.last_token_indices]

    def process_results(self, batch: ScheduleBatch, logits: torch.Tensor | Argmaxes) -> None:
        """A prefill forward's results: sampled where complete, the requests placed, then drafts for them."""
        completes = self.output.process(batch, logits)
        self.prefill.place_prefilled(batch.reqs, completes)
        self.speculation.after_extend(batch.reqs)
        self.queues.drop_finished()

    def _run_idle(self) -> None:
        """An empty forward that joins the world's MoE collectives; a rank that fails one cannot go on."""
        try:
            self.runner.forward_idle()
        except Exception as error:
            raise RankBroken(describe(error)) from error

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
                self.ender.fail(req, error)
        self.queues.drop_finished()

    # ---- what a driver asks -------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        pending = self.queues or self.ender.outputs or self.grammar_queue
        return bool(pending or self.disagg.has_work)

    @property
    def has_runnable_work(self) -> bool:
        """A forward to run or outputs to send now (not only PD transfers or grammars to wait for)."""
        return bool(self.queues or self.ender.outputs)

    @property
    def only_waiting_on_transfers(self) -> bool:
        """Nothing to run until a PD transfer or destination arrives, or a grammar compiles (a driver may wait a
        little)."""
        return not self.has_runnable_work and self.has_work

    def flush_cache(self) -> int:
        """Drops every cached prefix no request uses; returns the KV slots freed."""
        return self.memory.flush_cache()

    def check_invariants(self) -> None:
        """Exact accounting between steps: the pools hold precisely what the requests say they hold."""
        for req in self.queues.unfinished:
            req.check()
        # PD: reserved or being sent
        self.memory.check(self.queues.holders + self.disagg.held())

    def get_loads(self) -> SchedulerLoads:
        queues = self.queues
        pd_waiting = self.disagg.waiting_reqs()
        retracted = sum(1 for r in queues.waiting if r.num_retractions)
        inputs = LoadInputs(
            running=len(queues.holders),
            waiting=len(queues.waiting),
            retracted=retracted,
            compiling=len(self.grammar_queue),
            tokens_to_prefill=self.prefill.tokens_to_prefill(),
            pd_waiting=len(pd_waiting),
            pd_waiting_tokens=sum(len(r.input_ids) for r in pd_waiting if not r.holds_memory),
            num_retractions=self.decode.num_retractions,
            num_prefill_tokens=self.num_prefill_tokens,
            cache_hit_rate=self.prefill.cache_hit_rate,
            prompt_tokens_cached=self.prefill.prompt_tokens_cached,
            gen_throughput=self.output.throughput.rate(time.monotonic()),
            accept_length=self.speculation.stats.accept_length,
            accept_rate=self.speculation.stats.accept_rate,
        )
        pd = self.disagg.loads()
        return report_loads(
            self.config,
            self.memory,
            self._weight_bytes,
            inputs,
            self.disagg.mode,
            pd,
            self._graph_bytes,
        )

    def _find(self, rid: str) -> Req | None:
        req = self.queues.find(rid)
        if req is None:
            req = next((r for r in self.grammar_queue.items if r.rid == rid), None)
        return req if req is not None else self.disagg.find(rid)

    def _queued_rooms(self) -> set[int]:
        return {r.bootstrap_room for r in self.queues.unfinished}

    def _in_use(self, rid: str) -> bool:
        return self._find(rid) is not None or self.forks.parent_of(rid) is not None


def create_request_memory(pools: ModelPools) -> RequestMemory:
    """The owner of a rank's request memory, with the prefix cache when the pools keep state snapshots for it
    (``--disable-radix-cache`` keeps none)."""
    snapshots = pools.states.snapshots
    cache = RadixCache(pools, snapshots) if snapshots.size else None
    return RequestMemory(pools, cache)


class _PDHost:
    """What the rank's PD side may ask of the scheduler (``pd_side.base.SideHost``)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._queues = scheduler.queues
        self._ender = scheduler.ender
        self._decode = scheduler.decode
        self._output = scheduler.output

    def enqueue(self, req: Req) -> None:
        self._queues.waiting.append(req)

    def end(self, req: Req, reason: FinishReason, keep_memory: bool = False) -> None:
        if keep_memory:
            self._ender.end_keeping_memory(req, reason)
        elif reason.is_internal_error:
            self._ender.end(req, reason)  # no text flush: the request failed
        else:
            self._ender.finish(req, reason)

    def finish_transferred(self, req: Req, token: int) -> None:
        req.max_new_tokens = 1
        self._output.append_tokens([req], [token])

    def join_decoding(self, req: Req, token: int) -> None:
        req.status = ReqStatus.DECODING
        self._output.append_tokens([req], [token])
        if not req.finished:
            self._decode.join(req)

    def reserved_decode_tokens(self) -> int:
        return self._decode.reserved_decode_tokens()
