"""The HTTP process's side of generation: tokenise, validate, route to a rank, stream outputs back per request.

Scheduler processes detokenise (their outputs carry text deltas); this side only encodes prompts. Every request
is validated here, with the ranks' own limits, before it is sent, so bad input is a 400 and never reaches a rank.

The manager also supervises the ranks (``_supervise``, once a second): a rank whose process exited, that reported
``Fatal``, or that leaves a loads query unanswered for ``--rank-hang-timeout-s`` (hung: it is killed) is down; its
requests fail at once with 503, and it is restarted after a backoff (1 s, doubling, at most 30 s) up to
``--rank-max-restarts`` times, then stays failed. A rank whose world has several processes (``--tp-size`` > 1) is
never restarted: when any process of the world dies, every DP rank of the world fails at once, for good. A request
that failed inside its rank ends with a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.protocol.loads import LOAD_SECTIONS
from sglang_lite.protocol.outputs import ReqOutput, internal_error, join_outputs
from sglang_lite.protocol.requests import fork_rids, validate_request
from sglang_lite.runtime.client import SchedulerClient
from sglang_lite.runtime.inputs import max_prompt_chars
from sglang_lite.runtime.messages import (
    UNAVAILABLE,
    AbortRequest,
    Ack,
    AddRequest,
    FlushCache,
    LoadsQuery,
    QueryReply,
    Ready,
    Reserved,
)
from sglang_lite.sampling.grammar import GrammarCache, grammar_key
from sglang_lite.sampling.logprobs import LogprobParams
from sglang_lite.sampling.params import SamplingParams, is_utf8
from sglang_lite.server.disagg import Bootstrap, PDFrontEnd
from sglang_lite.server.dp_controller import DPController, InvalidRank
from sglang_lite.server.metrics import ServerMetrics
from sglang_lite.server_args import ServerArgs
from sglang_lite.tokenizer.loader import load_server_tokenizer

logger = logging.getLogger(__name__)
LOADS_TIMEOUT_S = 5.0
WATCH_INTERVAL_S = 1.0
RESTART_BACKOFF_S, RESTART_BACKOFF_MAX_S = 1.0, 30.0
RESTART_TIMEOUT_S = 300.0  # a restarted rank not ready by then counts as a failed restart
UP, STARTING, DOWN, FAILED = (
    "up",
    "starting",
    "down",
    "failed",
)  # FAILED: down for good (no restarts left)
# Sampling keys other engines and sglang-router send; accepted at their neutral value, refused otherwise.
MAX_RID_CHARS = 256
NEUTRAL_SAMPLING = {"no_stop_trim": False, "spaces_between_special_tokens": True}


class RequestError(Exception):
    """A request the server refuses: HTTP status, message, extra headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def bad_request(message: str) -> RequestError:
    return RequestError(400, message)


@dataclass(frozen=True)
class GenerateInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    requested_rank: int | None = None
    bootstrap: Bootstrap | None = (
        None  # PD disaggregation: the prefill server and the transfer's room
    )
    logprob: LogprobParams | None = None  # the log-probabilities to report in meta_info


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat prompt: its text (the output parsers read how it ends) and its token ids."""

    text: str
    ids: list[int]


@dataclass
class RankHealth:
    """What the supervisor knows of one rank."""

    state: str = UP
    restarts: int = 0
    since: float = field(default_factory=time.monotonic)  # of the state
    next_restart: float = 0.0
    probe: tuple[int, float] | None = None  # the unanswered loads query: id, when sent
    why: str = ""  # of the last death

    def set(self, state: str, now: float) -> None:
        self.state, self.since, self.probe = state, now, None

    def backoff(self) -> float:
        return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2**self.restarts)


@dataclass
class RequestStream:
    """The outputs of one dispatched request, in order; closing it early aborts the request on its rank."""

    manager: TokenizerManager
    rid: str
    rank: int
    prompt_tokens: int
    ack: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    last_token_time: float | None = None
    finished: bool = False
    closed: bool = False
    bootstrap: Bootstrap | None = None  # PD: set once the request is dispatched
    target_sent: bool = False  # PD prefill: its destination went to the rank

    def __aiter__(self) -> AsyncIterator[ReqOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[ReqOutput]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, RequestError):
                raise item
            self.finished = item.finished
            self.manager.record_output(self, item)
            yield item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.manager.release(self)


class TokenizerManager:
    _prompt_chars_limit: int | None = None  # of a text prompt; from the tokenizer, on first use

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.tokenizer: Any = None
        self.grammars: GrammarCache | None = (
            None  # set at start, with the tokenizer and the vocabulary
        )
        self.client: SchedulerClient | None = None
        self.config: SchedulerConfig | None = None  # every rank's, but dp_rank
        self.dp = DPController(args.dp_size, args.load_balance_method)
        self.metrics = ServerMetrics()
        self.streams: dict[str, RequestStream] = {}
        self.in_flight = [0] * args.dp_size
        self.ranks = [RankHealth(state=STARTING) for _ in range(args.dp_size)]
        self._queries: dict[
            int, tuple[asyncio.Future, int]
        ] = {}  # query id -> (its answer, the rank asked)
        self._probes: dict[int, int] = {}  # the supervisor's loads queries: id -> rank
        self._tasks: list[asyncio.Task] = []
        self.pd = PDFrontEnd(self)

    # ---- lifetime ----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.tokenizer = load_server_tokenizer(self.args)
        self.client = SchedulerClient(
            self.args
        )  # spawned from the event loop's thread, which outlives the ranks
        await asyncio.to_thread(self.client.wait_ready)
        self.config = self.client.config
        self.grammars = GrammarCache(
            self.tokenizer, self.config.vocab_size
        )  # compiles only to check grammars
        for health in self.ranks:
            health.set(UP, time.monotonic())
        self._tasks = [
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self._supervise()),
        ]
        await self.pd.start()

    @property
    def live(self) -> list[bool]:
        return [health.state == UP for health in self.ranks]

    def rank_states(self) -> list[dict[str, Any]]:
        """Each rank's state for ``/health``."""
        return [
            {
                "dp_rank": rank,
                "state": h.state,
                "restarts": h.restarts,
                "pid": self.client.processes[rank].pid,
                "last_error": h.why or None,
            }
            for rank, h in enumerate(self.ranks)
        ]

    @property
    def rank_pids(self) -> list[int]:
        return [ready.pid for ready in self.client.ready]

    @property
    def alt_stream_plan(self) -> dict[str, Any] | None:
        return self.client.ready[0].alt_stream_plan

    async def shutdown(self) -> None:
        await self.pd.shutdown()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.client is not None:
            self.client.shutdown()

    # ---- requests ----------------------------------------------------------------------------------------------
    async def encode(
        self, text: str, name: str = "text", add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of a text prompt, tokenised on a worker thread so a long text never stalls the event loop."""
        if self.tokenizer is None:
            raise bad_request(
                "text prompts need a tokenizer (the server skipped tokenizer init); pass input_ids"
            )
        self._check_prompt_chars(len(text), name)
        options = {} if add_special_tokens else {"add_special_tokens": False}
        return await asyncio.to_thread(self._tokenize, text, name, options)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None = None,
    ) -> ChatPrompt:
        """The chat template's prompt (``tools``: OpenAI tool definitions, rendered by the template)."""
        if self.tokenizer is None:
            raise bad_request("chat needs a tokenizer (the server skipped tokenizer init)")
        chars = sum(len(m.get("content") or "") for m in messages) + len(
            json.dumps(tools) if tools else ""
        )
        self._check_prompt_chars(chars, "messages")
        return await asyncio.to_thread(self._encode_chat, messages, template_kwargs, tools)

    def _encode_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None,
    ) -> ChatPrompt:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True, **template_kwargs
            )
        except Exception as error:  # a template rejecting the conversation is the request's fault
            raise bad_request(f"messages: the chat template failed: {error}") from error
        return ChatPrompt(text, self._tokenize(text, "messages", {"add_special_tokens": False}))

    def _tokenize(self, text: str, name: str, options: dict[str, Any]) -> list[int]:
        if not is_utf8(
            text
        ):  # JSON can carry lone surrogates, which the tokenizer refuses with a TypeError
            raise bad_request(f"{name}: the text is not valid Unicode (it holds a lone surrogate)")
        return self.tokenizer.encode(text, **options)

    def _check_prompt_chars(self, chars: int, name: str) -> None:
        """The cheap check before tokenising: a text that cannot fit in the context is a 400 at once."""
        if self._prompt_chars_limit is None:
            self._prompt_chars_limit = max_prompt_chars(
                self.tokenizer, self.config.max_request_tokens
            )
        if chars > self._prompt_chars_limit:
            raise bad_request(
                f"{name}: the prompt has {chars} characters, more than the context length "
                f"({self.config.max_request_tokens} tokens) can hold"
            )

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (empty without a tokenizer), for log-probability entries."""
        if self.tokenizer is None:
            return ["" for _ in ids]
        return self.tokenizer.batch_decode([[token] for token in ids])

    def check_prompt_count(self, count: int, name: str) -> None:
        """A batched request carries at most ``--max-queued-requests`` prompts: more could never be queued."""
        if count > self.args.max_queued_requests:
            raise bad_request(
                f"{name}: {count} prompts in one request, more than --max-queued-requests "
                f"({self.args.max_queued_requests})"
            )

    def sampling_params(self, raw: dict[str, Any] | None) -> SamplingParams:
        """SGLang sampling parameters from a request, validated; None values mean the default."""
        if raw is not None and not isinstance(raw, dict):
            raise bad_request("sampling_params must be an object")
        params = {k: v for k, v in (raw or {}).items() if v is not None}
        for key in [k for k in params if k in NEUTRAL_SAMPLING]:
            if params.pop(key) != NEUTRAL_SAMPLING[key]:
                raise bad_request(
                    f"sampling parameter {key} is not supported (only {NEUTRAL_SAMPLING[key]!r})"
                )
        for key in ("stop", "stop_token_ids"):
            if not isinstance(params.get(key, []), (str, list)):
                kind = type(params[key]).__name__
                raise bad_request(
                    f"sampling parameter {key} must be a string or a list, got {kind}"
                )
        try:
            result = SamplingParams.from_dict(params)
            result.validate(self.config.vocab_size)
        except (ValueError, TypeError) as error:
            raise bad_request(str(error)) from error
        return result

    def validate(self, request: GenerateInput) -> None:
        if not _valid_rid(request.rid):
            raise bad_request(f"rid must be a UTF-8 string of 1 to {MAX_RID_CHARS} characters")
        try:
            validate_request(
                request.input_ids,
                request.sampling_params,
                self.config,
                self.tokenizer is not None,
                request.logprob,
            )
            self.pd.check(request)
        except (ValueError, TypeError) as error:
            raise bad_request(str(error)) from error

    async def check_grammar(self, request: GenerateInput) -> None:
        """A grammar that cannot compile is a 400 naming its field (compiled on worker threads, once per text; the
        rank compiles it again, for its own use)."""
        key = grammar_key(request.sampling_params)
        if key is None:
            return
        try:
            await asyncio.wrap_future(self.grammars.submit(key))
        except ValueError as error:
            raise bad_request(str(error)) from error

    async def submit(self, request: GenerateInput) -> RequestStream:
        """Validates and dispatches one request; returns once its rank queued it (or raises RequestError)."""
        if request.sampling_params.n > 1:
            raise bad_request("n: a stream carries one sample (n = 1)")
        (stream,) = await self.submit_samples(request)
        return stream

    async def submit_samples(self, request: GenerateInput) -> list[RequestStream]:
        """``submit`` for a request with ``n`` parallel samples: one stream per sample, in order (``fork_rids``)."""
        self.validate(request)
        await self.check_grammar(request)
        rids = fork_rids(request.rid, request.sampling_params.n)
        used = [rid for rid in rids if rid in self.streams]
        if used:
            raise bad_request(f"rid {used[0]!r} is already in use")
        rank = self._pick_rank(request.requested_rank)
        streams = [RequestStream(self, rid, rank, len(request.input_ids)) for rid in rids]
        for stream in streams:
            self.streams[stream.rid] = stream
        self.in_flight[rank] += len(streams)
        try:
            room = self.pd.room_of(request)
            self.client.send(
                rank,
                AddRequest(
                    request.rid, request.input_ids, request.sampling_params, room, request.logprob
                ),
            )
        except (
            BaseException
        ):  # never sent: nothing to abort on the rank, but nothing may stay registered
            for stream in streams:
                stream.finished = True
                stream.close()
            raise
        stream = streams[0]
        self.pd.on_submitted(stream, request.bootstrap)
        ack = await self._acked(stream, streams[1:])
        if not ack.queued:
            headers = {"Retry-After": "1"} if ack.status == UNAVAILABLE else {}
            raise RequestError(ack.status, ack.message, headers)
        self.metrics.routed[rank, "balanced" if request.requested_rank is None else "named"] += 1
        self.metrics.tokens[rank, "prompt"] += stream.prompt_tokens
        return streams

    async def _acked(self, stream: RequestStream, samples: list[RequestStream]) -> Ack:
        """The rank's answer to ``stream``'s request, which its parallel ``samples`` share."""
        try:
            ack = await stream.ack
        except BaseException:
            for each in [stream, *samples]:
                each.close()
            raise
        for sample in samples:
            if not sample.ack.done():
                sample.ack.set_result(ack)
        if not ack.queued:
            for each in [stream, *samples]:
                each.finished = True  # nothing runs on the rank: closing sends no abort
                each.close()
        return ack

    def _pick_rank(self, requested: int | None) -> int:
        live = [r for r in range(self.args.dp_size) if self.live[r]]
        if not live:
            raise RequestError(503, "no DP rank is alive", {"Retry-After": "5"})
        try:
            rank = self.dp.pick(requested, live, self.in_flight)
        except InvalidRank as error:
            raise bad_request(str(error)) from error
        if not self.live[rank]:
            raise RequestError(503, f"DP rank {rank} is not alive", {"Retry-After": "5"})
        return rank

    def release(self, stream: RequestStream) -> None:
        """A stream's consumer is done: abort it on its rank unless it finished, and forget it."""
        if not stream.finished and self.live[stream.rank]:
            self.client.send(stream.rank, AbortRequest(stream.rid))
        if self.streams.get(stream.rid) is stream:
            del self.streams[stream.rid]
            self.in_flight[stream.rank] -= 1
        self.pd.on_released(stream)

    def abort(self, rid: str) -> bool:
        """Aborts a request on its rank; a request of a rank that is down has already failed, nothing is sent."""
        stream = self.streams.get(rid)
        if stream is None:
            return False
        if self.live[stream.rank]:
            self.client.send(stream.rank, AbortRequest(rid))
        return True

    def abort_all(self) -> int:
        for stream in list(self.streams.values()):
            if self.live[stream.rank]:
                self.client.send(stream.rank, AbortRequest(stream.rid))
        return len(self.streams)

    def record_output(self, stream: RequestStream, output: ReqOutput) -> None:
        now, n = time.monotonic(), len(output.new_token_ids)
        if n and stream.last_token_time is None:
            self.metrics.observe("time_to_first_token_seconds", stream.rank, now - stream.arrival)
        elif n:
            for _ in range(n):
                self.metrics.observe(
                    "inter_token_latency_seconds", stream.rank, (now - stream.last_token_time) / n
                )
        stream.last_token_time = now if n else stream.last_token_time
        self.metrics.tokens[stream.rank, "generation"] += n
        if output.finished:
            self.metrics.finished[stream.rank, _finish_kind(output)] += 1
            self.metrics.observe("e2e_request_latency_seconds", stream.rank, now - stream.arrival)

    async def run_all(
        self, inputs: list[GenerateInput], timeout: float | None = None
    ) -> list[ReqOutput]:
        """Runs requests to the end, each joined into one output (``n`` of them in a row for one with parallel
        samples); every one is dispatched before any is awaited, and all abort on failure."""
        for request in inputs:
            self.validate(request)
            await self.check_grammar(request)
        streams: list[RequestStream] = []
        try:
            for request in inputs:
                streams += await self.submit_samples(request)
            return list(
                await asyncio.wait_for(asyncio.gather(*(_joined(s) for s in streams)), timeout)
            )
        finally:
            for stream in streams:
                stream.close()

    # ---- loads -------------------------------------------------------------------------------------------------
    async def get_loads(
        self, ranks: list[int] | None = None, sections: tuple[str, ...] = LOAD_SECTIONS
    ) -> list[dict[str, Any]]:
        """Each rank's load figures, asked of the rank now (after every command sent before this call)."""
        ranks = list(range(self.args.dp_size)) if ranks is None else ranks
        dead = [r for r in ranks if not self.live[r]]
        if dead:
            raise RequestError(503, f"DP rank(s) {dead} are not alive", {"Retry-After": "5"})
        waiters = [self._ask_loads(rank, sections) for rank in ranks]
        try:
            replies = await asyncio.wait_for(asyncio.gather(*waiters), LOADS_TIMEOUT_S)
        except asyncio.TimeoutError as error:
            raise RequestError(
                503, f"DP ranks did not report loads within {LOADS_TIMEOUT_S} s"
            ) from error
        return [reply.loads for reply in replies]

    def _ask_loads(self, rank: int, sections: tuple[str, ...]) -> asyncio.Future:
        return self._ask(rank, lambda query_id: LoadsQuery(query_id, sections))

    def _ask(self, rank: int, query: Any) -> asyncio.Future:
        """Sends ``query(query_id)`` to a rank; the future gets its reply."""
        query_id = self.client.next_query_id()
        future = asyncio.get_running_loop().create_future()
        self._queries[query_id] = future, rank
        future.add_done_callback(lambda _: self._queries.pop(query_id, None))
        self.client.send(rank, query(query_id))
        return future

    async def flush_cache(self) -> int:
        """Drops every live rank's unused cached prefixes; returns the KV slots freed."""
        waiters = [
            self._ask(rank, FlushCache) for rank in range(self.args.dp_size) if self.live[rank]
        ]
        try:
            replies = await asyncio.wait_for(asyncio.gather(*waiters), LOADS_TIMEOUT_S)
        except asyncio.TimeoutError as error:
            raise RequestError(
                503, f"DP ranks did not flush their caches within {LOADS_TIMEOUT_S} s"
            ) from error
        return sum(reply.freed_tokens for reply in replies)

    # ---- replies from the ranks --------------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        while True:
            try:
                self.client.dispatch(await self.client.receive_async(), self)
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad reply must not stop every request
                logger.exception("bad reply from a rank")

    def on_outputs(self, rank: int, outputs: list[ReqOutput]) -> None:
        for output in outputs:
            output.meta_info["dp_rank"] = rank
            stream = self.streams.get(output.rid)
            error = internal_error(output)
            if stream is not None and error is not None:  # it failed inside the rank, which goes on
                self.metrics.finished[rank, _finish_kind(output)] += 1
                stream.queue.put_nowait(RequestError(500, error))
            elif stream is not None:
                stream.queue.put_nowait(output)
            elif output.finished:  # its client left; the rank confirms the abort
                self.metrics.finished[rank, _finish_kind(output)] += 1

    def on_reserved(self, reserved: Reserved) -> None:
        self.pd.on_reserved(reserved)

    def on_ack(self, ack: Ack) -> None:
        stream = self.streams.get(ack.rid)
        if stream is not None and not stream.ack.done():
            stream.ack.set_result(ack)

    def on_query_reply(self, reply: QueryReply) -> None:
        rank = self._probes.pop(reply.query_id, None)
        if rank is not None:
            health = self.ranks[rank]
            if health.probe is not None and health.probe[0] == reply.query_id:
                health.probe = None
            return
        future, _ = self._queries.get(reply.query_id, (None, None))
        if future is not None and not future.done():
            future.set_result(reply)

    def on_fatal(self, rank: int, message: str) -> None:
        if self.ranks[rank].state == STARTING:
            self._restart_failed(rank, f"failed to start: {message}")
        elif self.ranks[rank].state == UP:
            self._rank_died(rank, message)

    def on_ready(self, ready: Ready) -> None:
        health = self.ranks[ready.rank]
        if health.state == STARTING:
            logger.warning(
                "DP rank %d is back (restart %d, pid %d)", ready.rank, health.restarts, ready.pid
            )
            health.set(UP, time.monotonic())

    # ---- the supervisor ----------------------------------------------------------------------------------------
    async def _supervise(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            try:
                self._check_ranks(time.monotonic())
            except Exception:  # the supervisor must outlive any one mistake
                logger.exception("the rank supervisor failed a round")

    def _check_ranks(self, now: float) -> None:
        exited = self.client.exited_ranks()
        for rank, health in enumerate(self.ranks):
            code = exited.get(rank)
            if health.state == UP:
                self._check_up(rank, health, code, now)
            elif health.state == STARTING and (
                code is not None or now - health.since > RESTART_TIMEOUT_S
            ):
                self._restart_failed(
                    rank, f"exit code {code}" if code is not None else "not ready in time"
                )
            elif health.state == DOWN and now >= health.next_restart:
                self._restart(rank, health, now)

    def _check_up(self, rank: int, health: RankHealth, code: int | None, now: float) -> None:
        timeout = self.args.rank_hang_timeout_s
        if code is not None:
            self._rank_died(rank, f"exit code {code}")
        elif health.probe is not None and now - health.probe[1] > timeout:
            self._rank_died(rank, f"hung: no answer to a loads query in {timeout:g} s")
        elif health.probe is None:
            query_id = self.client.next_query_id()
            health.probe, self._probes[query_id] = (query_id, now), rank
            self.client.send(
                rank, LoadsQuery(query_id, ("core",))
            )  # unsent (queue full): it times out, as hung

    def _restart(self, rank: int, health: RankHealth, now: float) -> None:
        if health.restarts >= self.args.rank_max_restarts:
            logger.error("DP rank %d stays down: %d restarts used", rank, health.restarts)
            health.set(FAILED, now)
            return
        health.restarts += 1
        logger.warning(
            "restarting DP rank %d (restart %d of %d)",
            rank,
            health.restarts,
            self.args.rank_max_restarts,
        )
        health.set(STARTING, now)
        self.client.respawn(rank)

    def _restart_failed(self, rank: int, why: str) -> None:
        logger.error("DP rank %d did not come back: %s", rank, why)
        self._mark_down(rank, why)

    def _mark_down(self, rank: int, why: str) -> None:
        health, now = self.ranks[rank], time.monotonic()
        self.client.kill(rank)  # a hung process answers nothing; a dead one is reaped
        self._probes = {q: r for q, r in self._probes.items() if r != rank}
        health.why = why
        health.set(DOWN, now)
        health.next_restart = now + health.backoff()

    def _rank_died(self, rank: int, why: str) -> None:
        logger.error("DP rank %d died: %s", rank, why)
        if self.args.world_size > 1:
            self._world_failed(rank, why)
            return
        self._mark_down(rank, why)
        self._fail_requests(rank, f"DP rank {rank} died: {why}")

    def _world_failed(self, rank: int, why: str) -> None:
        """A process of a multi-process world died: every DP rank of that world fails for good (no restart: its
        ranks may live on other nodes)."""
        self.client.kill(rank)  # what is left of it on this node
        world = self.args.world_of(rank)
        message = f"DP rank {rank} died: {why}; its world ({self.args.world_size} processes) cannot be restarted"
        for dp in self.args.world_dp_ranks(world):
            health = self.ranks[dp]
            if health.state == FAILED:
                continue
            self._probes = {q: r for q, r in self._probes.items() if r != dp}
            health.why = message
            health.set(FAILED, time.monotonic())
            self._fail_requests(dp, message)

    def _fail_requests(self, rank: int, message: str) -> None:
        error = RequestError(503, message, {"Retry-After": "1"})
        for stream in [s for s in self.streams.values() if s.rank == rank]:
            if not stream.ack.done():
                stream.ack.set_result(Ack(rank, stream.rid, UNAVAILABLE, error.message))
            stream.queue.put_nowait(error)
        for future, asked in list(self._queries.values()):
            if asked == rank and not future.done():
                future.set_exception(error)


async def _joined(stream: RequestStream) -> ReqOutput:
    return join_outputs([output async for output in stream])


def _finish_kind(output: ReqOutput) -> str:
    return (output.meta_info.get("finish_reason") or {}).get("type", "unknown")


def _valid_rid(rid: Any) -> bool:
    """The msgpack transport carries UTF-8 only, and a rid is a key, not a payload."""
    return isinstance(rid, str) and 0 < len(rid) <= MAX_RID_CHARS and is_utf8(rid)
