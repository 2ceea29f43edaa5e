"""The HTTP process's side of generation: the tokenizer manager, a facade over the parts that do the work.

- ``InputProcessor`` (``input_processor.py``): tokenises prompts and validates requests with the ranks' limits.
- ``StreamRegistry`` (``request_streams.py``): the streams of dispatched requests, outputs routed to them, aborts,
  per-request metrics, and the queries asked of the ranks.
- ``RankSupervisor`` (``supervisor.py``): each rank's health, restarts with backoff.
- ``PDFront`` (``pd_front.py``): the PD part (bootstrap rooms, destinations, reservations); ``NoPD`` on a plain server.

The manager itself dispatches: validate, pick a rank, register the streams, send, and wait for the rank's answer.
It is also what the scheduler client hands replies to, and it keeps the names the endpoints and tests use.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sglang_lite.multimodal.inputs import ImageInputs
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.protocol.outputs import ReqOutput, join_outputs
from sglang_lite.protocol.requests import fork_rids
from sglang_lite.runtime.client import SchedulerClient
from sglang_lite.runtime.messages import UNAVAILABLE, Ack, AddRequest, QueryReply
from sglang_lite.runtime.spawn import SpawnedRanks
from sglang_lite.server.dp_controller import DPController, InvalidRank
from sglang_lite.server.images import ImageIntake
from sglang_lite.server.input_processor import InputProcessor
from sglang_lite.server.io_struct import ChatPrompt, GenerateInput, RequestError, bad_request
from sglang_lite.server.metrics import ServerMetrics
from sglang_lite.server.pd_front import create_pd_front
from sglang_lite.server.request_streams import RequestStream, StreamRegistry
from sglang_lite.server.supervisor import (
    DOWN,
    FAILED,
    STARTING,
    UP,
    RankHealth,
    RankSupervisor,
)
from sglang_lite.server_args import ServerArgs
from sglang_lite.tokenizer.hf_tokenizer import load_server_tokenizer

__all__ = [
    "DOWN",
    "FAILED",
    "STARTING",
    "UP",
    "ChatPrompt",
    "GenerateInput",
    "RankHealth",
    "RequestError",
    "RequestStream",
    "TokenizerManager",
    "bad_request",
]

logger = logging.getLogger(__name__)


class TokenizerManager:
    """Dispatches requests to the ranks over its parts (inputs, registry, supervisor, PD), which it wires."""

    def __init__(self, args: ServerArgs, spawned: SpawnedRanks | None = None) -> None:
        """``spawned``: ranks launch_server started before importing this module (start() then takes them)."""
        self.args = args
        self._spawned = spawned
        self.dp = DPController(args.dp_size, args.load_balance_method)
        self.metrics = ServerMetrics()
        self.ranks = [RankHealth(state=STARTING) for _ in range(args.dp_size)]
        self.inputs = InputProcessor(args)
        self.registry = StreamRegistry(args.dp_size, self.metrics, self.ranks)
        self.supervisor = RankSupervisor(args, self.ranks, self.registry.fail_rank)
        self.pd = create_pd_front(args, self.registry)
        self._tasks: list[asyncio.Task] = []
        # The parts' state and operations under the names the endpoints, the client's dispatch and tests use.
        self.streams = self.registry.streams
        self.in_flight = self.registry.in_flight
        self.encode = self.inputs.encode
        self.encode_chat = self.inputs.encode_chat
        self.images = ImageIntake(args)
        self.token_texts = self.inputs.token_texts
        self.check_prompt_count = self.inputs.check_prompt_count
        self.sampling_params = self.inputs.sampling_params
        self.check_grammar = self.inputs.check_grammar
        self.abort = self.registry.abort
        self.abort_all = self.registry.abort_all
        self.record_output = self.registry.record_output
        self.get_loads = self.registry.get_loads
        self.flush_cache = self.registry.flush_cache
        self.on_outputs = self.registry.on_outputs
        self.on_ack = self.registry.on_ack
        self.on_reserved = self.pd.on_reserved
        self.on_fatal = self.supervisor.on_fatal
        self.on_ready = self.supervisor.on_ready
        self.rank_states = self.supervisor.rank_states
        self._check_ranks = self.supervisor.check_ranks

    # ---- lifetime ----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        # The ranks first (spawned from the event loop's thread, which outlives them, unless launch_server spawned
        # them already): they import and load while this process loads the tokenizer (~1 s) and a grammar worker
        # imports xgrammar. A failure after this stops them (shutdown).
        self.client = SchedulerClient(self.args, self._spawned)
        if not self.args.skip_tokenizer_init:  # grammars need a tokenizer
            self.inputs.grammars.prestart()
        self.tokenizer = load_server_tokenizer(self.args)
        await asyncio.to_thread(self.client.wait_ready)
        self.inputs.set_config(self.client.config)
        self.supervisor.all_up()
        self._tasks = [
            asyncio.create_task(self._receive_loop()),
            asyncio.create_task(self.supervisor.run()),
        ]
        await self.pd.start()

    async def shutdown(self) -> None:
        await self.pd.shutdown()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.inputs.shutdown()
        if self.client is not None:
            self.client.shutdown()

    @property
    def client(self) -> SchedulerClient | None:
        return self.registry.client

    @client.setter
    def client(self, client: SchedulerClient | None) -> None:
        self.registry.client = client
        self.supervisor.client = client

    @property
    def config(self) -> SchedulerConfig | None:
        """Every rank's limits, but dp_rank."""
        return self.inputs.config

    @config.setter
    def config(self, config: SchedulerConfig | None) -> None:
        self.inputs.config = config

    @property
    def tokenizer(self) -> Any:
        return self.inputs.tokenizer

    async def attach_images(self, ids: list[int], urls: list[str]) -> tuple[list[int], ImageInputs]:
        """A rendered prompt's ids with its image placeholders expanded, and its images (``images.py``)."""
        return await self.images.attach(ids, urls, self.config)

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        self.inputs.tokenizer = tokenizer

    @property
    def live(self) -> list[bool]:
        return self.supervisor.live

    @property
    def rank_pids(self) -> list[int]:
        return [ready.pid for ready in self.client.ready]

    @property
    def alt_stream_plan(self) -> dict[str, Any] | None:
        return self.client.ready[0].alt_stream_plan

    # ---- requests ----------------------------------------------------------------------------------------------
    def validate(self, request: GenerateInput) -> None:
        self.inputs.validate(request)
        self.pd.check(request)

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
        self.registry.register(streams)
        try:
            room = self.pd.room_of(request)
            self.registry.send(
                rank,
                AddRequest(
                    request.rid,
                    request.input_ids,
                    request.sampling_params,
                    room,
                    request.logprob,
                    local=request.local,
                    images=request.images,
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
        self.registry.release(stream)
        self.pd.on_released(stream)

    async def run_all(
        self, inputs: list[GenerateInput], timeout: float | None = None
    ) -> list[ReqOutput]:
        """Runs requests to the end, each joined into one output (``n`` of them in a row for one with parallel
        samples); every one is dispatched before any is awaited, and all abort on failure."""
        self.inputs.check_sample_count(inputs)
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

    # ---- replies from the ranks --------------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        while True:
            try:
                self.client.dispatch(await self.client.receive_async(), self)
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad reply must not stop every request
                logger.exception("bad reply from a rank")

    def on_query_reply(self, reply: QueryReply) -> None:
        if not self.supervisor.on_probe_reply(reply):
            self.registry.on_query_reply(reply)


async def _joined(stream: RequestStream) -> ReqOutput:
    return join_outputs([output async for output in stream])
