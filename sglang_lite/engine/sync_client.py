"""The Engine's side of the client core: blocking calls from any thread, outputs routed to per-request queues.

Why a scheduler process and not a thread: torch ops issued from a second thread of a process whose first thread has
already used OpenMP run far slower (libgomp throttles its spin-waits once it manages more pool threads than there
are CPUs: on 2 cores the offline benchmark ran 1.6-1.9x slower from a thread), and the caller's own Python would
compete for the GIL with every step.

A receiver thread dispatches replies: outputs go to their request's queue; an error for a request (refused, failed
inside the rank, or the process died) is put there as an exception, and a query's answer completes its future.
The Engine's one rank is not restarted: once its process dies, every request fails and the Engine is unusable.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any

from sglang_lite.multimodal.inputs import ImageInputs
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.protocol.outputs import BAD_REQUEST, ReqOutput, request_failure
from sglang_lite.protocol.requests import fork_rids
from sglang_lite.runtime.client import POLL_MS, SchedulerClient
from sglang_lite.runtime.messages import (
    REFUSED,
    AbortRequest,
    Ack,
    AddRequest,
    QueryReply,
    Ready,
    Reserved,
)
from sglang_lite.sampling.logprobs import LogprobParams
from sglang_lite.sampling.params import SamplingParams
from sglang_lite.server_args import ServerArgs

logger = logging.getLogger(__name__)
RANK = 0  # the Engine runs one DP rank


class SyncClient:
    def __init__(self, args: ServerArgs) -> None:
        self.core = SchedulerClient(args)
        self.core.wait_ready()
        self._lock = threading.Lock()
        self._streams: dict[str, queue.Queue] = {}
        self._queries: dict[int, Future] = {}
        self._error: BaseException | None = None
        self._closing = False
        self._receiver = threading.Thread(
            target=self._receive_loop, name="sglang-lite-receiver", daemon=True
        )
        self._receiver.start()

    @property
    def config(self) -> SchedulerConfig:
        return self.core.config

    # ---- called from any thread --------------------------------------------------------------------------------
    def submit(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        logprob: LogprobParams | None = None,
        stream: bool = True,
        images: ImageInputs | None = None,
    ) -> queue.Queue:
        """Queues a request; its ReqOutputs (or an exception) arrive on the returned queue, those of all its
        parallel samples (``params.n``) too, each under its own rid (``fork_rids``); ``stream=False``: only the
        finished one."""
        outputs: queue.Queue = queue.Queue()
        with self._lock:
            self._check_alive()
            for sample_rid in fork_rids(rid, params.n):
                self._streams[sample_rid] = outputs
        message = AddRequest(rid, input_ids, params, None, logprob, stream, images=images)
        self.core.send(RANK, message)
        return outputs

    def abort(self, rid: str) -> None:
        """Ends a request wherever it is; nothing to do once the process is gone."""
        with self._lock:
            if self._closing or self._error is not None:
                return
        self.core.send(RANK, AbortRequest(rid))

    def ask(self, query_type: Any, *fields: Any) -> QueryReply:
        """Sends ``query_type(query_id, *fields)`` and waits for its reply, which follows every command sent before."""
        future: Future = Future()
        with self._lock:
            self._check_alive()
            query_id = self.core.next_query_id()
            self._queries[query_id] = future
        if not self.core.send(RANK, query_type(query_id, *fields)):
            with self._lock:
                self._queries.pop(query_id, None)
            raise RuntimeError("the scheduler process is not taking commands (its queue is full)")
        return future.result()

    def shutdown(self) -> None:
        """Stops the process (unfinished requests fail) and releases the sockets; safe to call twice."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._receiver.join()
        self.core.shutdown()
        self._fail_all(RuntimeError("the engine was shut down before the request finished"))

    # ---- the receiver thread -----------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        while not self._closing:
            try:
                reply = self.core.receive(POLL_MS)
            except ValueError:  # an unreadable reply; the requests it may have carried wait on
                logger.exception("bad reply from the scheduler process")
                continue
            if reply is not None:
                self.core.dispatch(reply, self)
            elif RANK in self.core.exited_ranks():
                code = self.core.exited_ranks()[RANK]
                self._fail_all(RuntimeError(f"the scheduler process died (exit code {code})"))
                return

    def on_outputs(self, rank: int, outputs: list[ReqOutput]) -> None:
        for output in outputs:
            with self._lock:
                streams = self._streams
                stream = (
                    streams.pop(output.rid, None) if output.finished else streams.get(output.rid)
                )
            failure = request_failure(output)
            if stream is not None:
                stream.put(_failed(*failure) if failure else output)

    def on_ack(self, ack: Ack) -> None:
        if ack.queued:
            return
        with self._lock:
            stream = self._streams.pop(ack.rid, None)
            for sample_rid in [
                r for r, s in self._streams.items() if s is stream
            ]:  # its parallel samples
                del self._streams[sample_rid]
        if stream is not None:
            stream.put((ValueError if ack.status == REFUSED else RuntimeError)(ack.message))

    def on_query_reply(self, reply: QueryReply) -> None:
        with self._lock:
            future = self._queries.pop(reply.query_id, None)
        if future is not None:
            future.set_result(reply)

    def on_ready(self, ready: Ready) -> None:  # the Engine never respawns its rank
        pass

    def on_reserved(
        self, reserved: Reserved
    ) -> None:  # the Engine runs no PD side (disaggregation_mode null)
        logger.warning("unexpected PD reservation for %s", reserved.rid)

    def on_fatal(self, rank: int, message: str) -> None:
        self._fail_all(RuntimeError(f"the scheduler process failed: {message}"))

    # ---- internals ---------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._closing or self._error is not None:
            raise RuntimeError("the engine is shut down") from self._error

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            self._error = self._error or error
            streams, self._streams = list(self._streams.values()), {}
            queries, self._queries = list(self._queries.values()), {}
        for stream in streams:
            stream.put(error)
        for future in queries:
            future.set_exception(error)


def _failed(status: int, message: str) -> Exception:
    """A request that failed in the scheduler: by its own fault (a ValueError, as a refused request) or not."""
    if status == BAD_REQUEST:
        return ValueError(message)
    return RuntimeError(f"the request failed in the scheduler: {message}")
