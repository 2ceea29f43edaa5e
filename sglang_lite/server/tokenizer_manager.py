"""The HTTP process's side of generation: tokenise, validate, route to a rank, stream outputs back per request.

Scheduler processes detokenise (their outputs carry text deltas); this side only encodes prompts. Every request
is validated here, with the ranks' own limits, before it is sent, so bad input is a 400 and never reaches a rank.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from sglang_lite.engine.launch import load_server_tokenizer
from sglang_lite.sampling.params import SamplingParams
from sglang_lite.scheduler.config import SchedulerConfig
from sglang_lite.scheduler.request import ReqOutput
from sglang_lite.scheduler.scheduler import validate_request
from sglang_lite.server.dp_controller import DPController, InvalidRank
from sglang_lite.server.ipc import ipc_addresses, pack, remove_ipc_files, unpack
from sglang_lite.server.metrics import ServerMetrics
from sglang_lite.server.scheduler_process import spawn_scheduler_process
from sglang_lite.server_args import ServerArgs
from sglang_lite.utils.process import stop_processes

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 600.0
LOADS_TIMEOUT_S = 5.0
# Sampling keys other engines and sglang-router send; accepted at their neutral value, refused otherwise.
NEUTRAL_SAMPLING = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1,
                    "no_stop_trim": False, "spaces_between_special_tokens": True, "logit_bias": {}}


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
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.tokenizer: Any = None
        self.config: SchedulerConfig | None = None  # every rank's, but dp_rank
        self.rank_info: list[dict[str, Any]] = []
        self.dp = DPController(args.dp_size, args.load_balance_method)
        self.metrics = ServerMetrics()
        self.streams: dict[str, RequestStream] = {}
        self.in_flight = [0] * args.dp_size
        self.live = [False] * args.dp_size
        self.processes: list[subprocess.Popen] = []
        self._loads_waiters: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []

    # ---- lifetime ----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.tokenizer = load_server_tokenizer(self.args)
        self.command_addresses, self.reply_address = ipc_addresses(self.args.dp_size)
        self.zmq = zmq.asyncio.Context()
        self.replies = self.zmq.socket(zmq.PULL)
        self.replies.bind(self.reply_address)
        self.commands = [self._command_socket(a) for a in self.command_addresses]
        self.processes = [self._spawn(rank) for rank in range(self.args.dp_size)]
        await self._wait_ready()
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._watch_processes())]

    def _command_socket(self, address: str) -> zmq.Socket:
        socket = zmq.Context.instance().socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)  # never drop or block: a rank's inbox is bounded by admission instead
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        return socket

    def _spawn(self, rank: int) -> subprocess.Popen:
        return spawn_scheduler_process(self.args, rank, self.command_addresses[rank], self.reply_address)

    async def _wait_ready(self) -> None:
        infos: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(infos) < self.args.dp_size:
            self._check_started(deadline)
            if not await self.replies.poll(500):
                continue
            message = unpack(await self.replies.recv())
            if message[0] == "fatal":
                raise RuntimeError(f"DP rank {message[1]} failed to start: {message[2]}")
            if message[0] == "ready":
                infos[message[1]] = message[2]
        self.rank_info = [infos[r] for r in range(self.args.dp_size)]
        self.config = SchedulerConfig.from_dict(self.rank_info[0]["config"])
        self.live = [True] * self.args.dp_size

    def _check_started(self, deadline: float) -> None:
        dead = [rank for rank, p in enumerate(self.processes) if p.poll() is not None]
        if dead:
            raise RuntimeError(f"the scheduler process(es) of DP rank(s) {dead} exited during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError(f"DP ranks not ready after {STARTUP_TIMEOUT_S} s")

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for socket in getattr(self, "commands", []):
            _send(socket, ["stop"])
        stop_processes(self.processes)
        for socket in getattr(self, "commands", []):
            socket.close(0)
        if hasattr(self, "zmq"):
            self.zmq.destroy(linger=0)
            remove_ipc_files([*self.command_addresses, self.reply_address])

    # ---- requests ----------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("text prompts need a tokenizer (the server skipped tokenizer init); pass input_ids")
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("chat needs a tokenizer (the server skipped tokenizer init)")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
        except Exception as error:  # a template rejecting the conversation is the request's fault
            raise bad_request(f"messages: the chat template failed: {error}") from error
        return self.tokenizer.encode(text, add_special_tokens=False)

    def sampling_params(self, raw: dict[str, Any] | None) -> SamplingParams:
        """SGLang sampling parameters from a request, validated; None values mean the default."""
        if raw is not None and not isinstance(raw, dict):
            raise bad_request("sampling_params must be an object")
        params = {k: v for k, v in (raw or {}).items() if v is not None}
        for key in [k for k in params if k in NEUTRAL_SAMPLING]:
            if params.pop(key) != NEUTRAL_SAMPLING[key]:
                raise bad_request(f"sampling parameter {key} is not supported (only {NEUTRAL_SAMPLING[key]!r})")
        for key in ("stop", "stop_token_ids"):
            if not isinstance(params.get(key, []), (str, list)):
                raise bad_request(f"sampling parameter {key} must be a string or a list, got {params[key]!r}")
        try:
            result = SamplingParams.from_dict(params)
            result.validate(self.config.vocab_size)
        except (ValueError, TypeError) as error:
            raise bad_request(str(error)) from error
        return result

    def validate(self, request: GenerateInput) -> None:
        try:
            validate_request(request.input_ids, request.sampling_params, self.config, self.tokenizer is not None)
        except (ValueError, TypeError) as error:
            raise bad_request(str(error)) from error

    async def submit(self, request: GenerateInput) -> RequestStream:
        """Validates and dispatches one request; returns once its rank queued it (or raises RequestError)."""
        self.validate(request)
        if request.rid in self.streams:
            raise bad_request(f"rid {request.rid!r} is already in use")
        rank = self._pick_rank(request.requested_rank)
        stream = RequestStream(self, request.rid, rank, len(request.input_ids))
        self.streams[request.rid] = stream
        self.in_flight[rank] += 1
        params = dataclasses.asdict(request.sampling_params)
        _send(self.commands[rank], ["add", request.rid, request.input_ids, params])
        status, message = await self._acked(stream)
        if status != 200:
            headers = {"Retry-After": "1"} if status == 503 else {}
            raise RequestError(status, message, headers)
        self.metrics.routed[rank, "balanced" if request.requested_rank is None else "named"] += 1
        self.metrics.tokens[rank, "prompt"] += stream.prompt_tokens
        return stream

    async def _acked(self, stream: RequestStream) -> tuple[int, str]:
        try:
            status, message = await stream.ack
        except BaseException:
            stream.close()
            raise
        if status != 200:
            stream.finished = True  # nothing runs on the rank: closing sends no abort
            stream.close()
        return status, message

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
            _send(self.commands[stream.rank], ["abort", stream.rid])
        if self.streams.get(stream.rid) is stream:
            del self.streams[stream.rid]
            self.in_flight[stream.rank] -= 1

    def abort(self, rid: str) -> bool:
        stream = self.streams.get(rid)
        if stream is None:
            return False
        _send(self.commands[stream.rank], ["abort", rid])
        return True

    def abort_all(self) -> int:
        for stream in list(self.streams.values()):
            _send(self.commands[stream.rank], ["abort", stream.rid])
        return len(self.streams)

    def record_output(self, stream: RequestStream, output: ReqOutput) -> None:
        now, n = time.monotonic(), len(output.new_token_ids)
        if n and stream.last_token_time is None:
            self.metrics.observe("time_to_first_token_seconds", stream.rank, now - stream.arrival)
        elif n:
            for _ in range(n):
                self.metrics.observe("inter_token_latency_seconds", stream.rank, (now - stream.last_token_time) / n)
        stream.last_token_time = now if n else stream.last_token_time
        self.metrics.tokens[stream.rank, "generation"] += n
        if output.finished:
            self.metrics.finished[stream.rank, _finish_kind(output)] += 1
            self.metrics.observe("e2e_request_latency_seconds", stream.rank, now - stream.arrival)

    # ---- loads -------------------------------------------------------------------------------------------------
    async def get_loads(self, ranks: list[int] | None = None) -> list[dict[str, Any]]:
        """Each rank's load figures, asked of the rank now (after every command sent before this call)."""
        ranks = list(range(self.args.dp_size)) if ranks is None else ranks
        dead = [r for r in ranks if not self.live[r]]
        if dead:
            raise RequestError(503, f"DP rank(s) {dead} are not alive", {"Retry-After": "5"})
        waiters = [self._ask_loads(rank) for rank in ranks]
        try:
            return list(await asyncio.wait_for(asyncio.gather(*waiters), LOADS_TIMEOUT_S))
        except asyncio.TimeoutError as error:
            raise RequestError(503, f"DP ranks did not report loads within {LOADS_TIMEOUT_S} s") from error

    def _ask_loads(self, rank: int) -> asyncio.Future:
        query_id = next(self._query_ids)
        future = asyncio.get_running_loop().create_future()
        self._loads_waiters[query_id] = future
        future.add_done_callback(lambda _: self._loads_waiters.pop(query_id, None))
        _send(self.commands[rank], ["loads", query_id])
        return future

    # ---- replies from the ranks --------------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        while True:
            message = unpack(await self.replies.recv())
            try:
                self._dispatch(message)
            except Exception:  # one bad message must not stop every request
                logger.exception("bad reply from a rank: %r", message[:2])

    def _dispatch(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == "out":
            for rid, new_ids, new_text, finished, meta in message[2]:
                self._deliver(message[1], ReqOutput(rid, new_ids, new_text, finished, dict(meta, dp_rank=message[1])))
        elif kind == "ack":
            stream = self.streams.get(message[2])
            if stream is not None and not stream.ack.done():
                stream.ack.set_result((message[3], message[4]))
        elif kind == "loads":
            future = self._loads_waiters.get(message[2])
            if future is not None and not future.done():
                future.set_result(message[3])
        elif kind == "fatal":
            self._rank_died(message[1], message[2])

    def _deliver(self, rank: int, output: ReqOutput) -> None:
        stream = self.streams.get(output.rid)
        if stream is not None:
            stream.queue.put_nowait(output)
        elif output.finished:  # its client left; the rank confirms the abort
            self.metrics.finished[rank, _finish_kind(output)] += 1

    async def _watch_processes(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for rank, process in enumerate(self.processes):
                if self.live[rank] and process.poll() is not None:
                    self._rank_died(rank, f"exit code {process.returncode}")

    def _rank_died(self, rank: int, why: str) -> None:
        logger.error("DP rank %d died: %s", rank, why)
        self.live[rank] = False
        error = RequestError(503, f"DP rank {rank} died: {why}")
        for stream in [s for s in self.streams.values() if s.rank == rank]:
            if not stream.ack.done():
                stream.ack.set_result((503, error.message))
            stream.queue.put_nowait(error)
        for future in self._loads_waiters.values():
            if not future.done():
                future.set_exception(error)


def _finish_kind(output: ReqOutput) -> str:
    return (output.meta_info.get("finish_reason") or {}).get("type", "unknown")


def _send(socket: zmq.Socket, message: list[Any]) -> None:
    socket.send(pack(message), zmq.NOBLOCK)
