"""The registry of dispatched requests: one ``RequestStream`` per request until its consumer is done, the rank's
outputs routed to it, aborts, per-request metrics, and the queries asked of the ranks (loads, cache flushes).

A stream is registered when its request is sent and forgotten when its consumer closes it (``release``); while a
rank is down nothing is sent to it (its requests have already failed). The registry reads the rank supervisor's
health table; ``fail_rank`` is how the supervisor ends a dead rank's requests and queries.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sglang_lite.protocol.loads import LOAD_SECTIONS
from sglang_lite.protocol.outputs import ReqOutput, request_failure
from sglang_lite.runtime.client import SchedulerClient
from sglang_lite.runtime.messages import (
    UNAVAILABLE,
    AbortRequest,
    Ack,
    FlushCache,
    LoadsQuery,
    Message,
    QueryReply,
)
from sglang_lite.server.io_struct import Bootstrap, RequestError
from sglang_lite.server.metrics import ServerMetrics
from sglang_lite.server.supervisor import RankHealth

LOADS_TIMEOUT_S = 5.0


class StreamOwner(Protocol):
    """What a stream tells as its outputs are read and when it is closed."""

    def record_output(self, stream: RequestStream, output: ReqOutput) -> None: ...

    def release(self, stream: RequestStream) -> None: ...


@dataclass
class RequestStream:
    """The outputs of one dispatched request, in order; closing it early aborts the request on its rank."""

    owner: StreamOwner
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
            self.owner.record_output(self, item)
            yield item

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.owner.release(self)


class StreamRegistry:
    """The streams of the requests in flight, by rid, and the answers awaited from the ranks, by query id."""

    def __init__(self, dp_size: int, metrics: ServerMetrics, ranks: Sequence[RankHealth]) -> None:
        self.dp_size = dp_size
        self.metrics = metrics
        self.ranks = ranks  # the supervisor's health table, read only
        self.client: SchedulerClient | None = None  # set at start
        self.streams: dict[str, RequestStream] = {}
        self.in_flight = [0] * dp_size
        self._queries: dict[
            int, tuple[asyncio.Future, int]
        ] = {}  # id -> (its answer, the rank asked)

    # ---- streams -----------------------------------------------------------------------------------------------
    def register(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            self.streams[stream.rid] = stream
            self.in_flight[stream.rank] += 1

    def send(self, rank: int, message: Message) -> None:
        self.client.send(rank, message)

    def abort_on(
        self,
        rank: int,
        rid: str,
        error: str | None = None,
        status: int = 500,
        settled: bool = False,
    ) -> None:
        """Aborts ``rid`` on its rank (``error``: it fails with that message and ``status``; ``settled``: PD, its
        other side will write nothing more for it); nothing is sent to a rank that is down, whose requests have
        already failed."""
        if self.ranks[rank].up:
            self.client.send(
                rank, AbortRequest(rid, error=error, status_code=status, settled=settled)
            )

    def release(self, stream: RequestStream) -> None:
        """A stream's consumer is done: abort it on its rank unless it finished, and forget it."""
        if not stream.finished:
            self.abort_on(stream.rank, stream.rid)
        if self.streams.get(stream.rid) is stream:
            del self.streams[stream.rid]
            self.in_flight[stream.rank] -= 1

    def abort(self, rid: str) -> bool:
        stream = self.streams.get(rid)
        if stream is None:
            return False
        self.abort_on(stream.rank, rid)
        return True

    def abort_all(self) -> int:
        for stream in list(self.streams.values()):
            self.abort_on(stream.rank, stream.rid)
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
            self.metrics.finished[stream.rank, finish_kind(output)] += 1
            self.metrics.observe("e2e_request_latency_seconds", stream.rank, now - stream.arrival)

    def fail_rank(self, rank: int, message: str) -> None:
        """The rank is gone: its requests and the queries asked of it end with a 503."""
        error = RequestError(503, message, {"Retry-After": "1"})
        for stream in [s for s in self.streams.values() if s.rank == rank]:
            if not stream.ack.done():
                stream.ack.set_result(Ack(rank, stream.rid, UNAVAILABLE, error.message))
            stream.queue.put_nowait(error)
        for future, asked in list(self._queries.values()):
            if asked == rank and not future.done():
                future.set_exception(error)

    # ---- replies -----------------------------------------------------------------------------------------------
    def on_outputs(self, rank: int, outputs: list[ReqOutput]) -> None:
        for output in outputs:
            output.meta_info["dp_rank"] = rank
            stream = self.streams.get(output.rid)
            failure = request_failure(output)
            if (
                stream is not None and failure is not None
            ):  # it failed inside the rank, which goes on
                self.metrics.finished[rank, finish_kind(output)] += 1
                stream.queue.put_nowait(RequestError(*failure))
            elif stream is not None:
                stream.queue.put_nowait(output)
            elif output.finished:  # its client left; the rank confirms the abort
                self.metrics.finished[rank, finish_kind(output)] += 1

    def on_ack(self, ack: Ack) -> None:
        stream = self.streams.get(ack.rid)
        if stream is not None and not stream.ack.done():
            stream.ack.set_result(ack)

    def on_query_reply(self, reply: QueryReply) -> None:
        future, _ = self._queries.get(reply.query_id, (None, None))
        if future is not None and not future.done():
            future.set_result(reply)

    # ---- queries -----------------------------------------------------------------------------------------------
    async def get_loads(
        self, ranks: list[int] | None = None, sections: tuple[str, ...] = LOAD_SECTIONS
    ) -> list[dict[str, Any]]:
        """Each rank's load figures, asked of the rank now (after every command sent before this call)."""
        ranks = list(range(self.dp_size)) if ranks is None else ranks
        dead = [r for r in ranks if not self.ranks[r].up]
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

    async def flush_cache(self) -> int:
        """Drops every live rank's unused cached prefixes; returns the KV slots freed."""
        waiters = [
            self._ask(rank, FlushCache) for rank in range(self.dp_size) if self.ranks[rank].up
        ]
        try:
            replies = await asyncio.wait_for(asyncio.gather(*waiters), LOADS_TIMEOUT_S)
        except asyncio.TimeoutError as error:
            raise RequestError(
                503, f"DP ranks did not flush their caches within {LOADS_TIMEOUT_S} s"
            ) from error
        return sum(reply.freed_tokens for reply in replies)

    def _ask_loads(self, rank: int, sections: tuple[str, ...]) -> asyncio.Future:
        return self._ask(rank, lambda query_id: LoadsQuery(query_id, sections))

    def _ask(self, rank: int, query: Callable[[int], Message]) -> asyncio.Future:
        """Sends ``query(query_id)`` to a rank; the future gets its reply."""
        query_id = self.client.next_query_id()
        future = asyncio.get_running_loop().create_future()
        self._queries[query_id] = future, rank
        future.add_done_callback(lambda _: self._queries.pop(query_id, None))
        self.client.send(rank, query(query_id))
        return future


def finish_kind(output: ReqOutput) -> str:
    return (output.meta_info.get("finish_reason") or {}).get("type", "unknown")
