"""Runs the Scheduler in its own process, as SGLang's Engine does: commands go out over ZMQ, outputs come back per
request.

Why a process and not a thread: torch ops issued from a second thread of a process whose first thread has already
used OpenMP run far slower (libgomp throttles its spin-waits once it manages more pool threads than there are
CPUs: on 2 cores the offline benchmark ran 1.6-1.9x slower from a thread), and the caller's own Python would
compete for the GIL with every step. The scheduler process is the HTTP server's DP rank process
(``sglang_lite.server.scheduler_process``), speaking the protocol of ``sglang_lite.server.ipc``.

Here, a receiver thread routes each output to its request's queue; an error for a request (refused, or the
process died) is put there as an exception.
"""
from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future
from typing import Any

import zmq

from sglang_lite.scheduler.request import ReqOutput
from sglang_lite.server.ipc import ipc_addresses, pack, remove_ipc_files, unpack
from sglang_lite.server.scheduler_process import spawn_scheduler_process
from sglang_lite.server_args import ServerArgs
from sglang_lite.utils.process import stop_processes

STARTUP_TIMEOUT_S = 600.0
POLL_MS = 200  # how often the receiver checks that the process still lives


class SchedulerProcess:
    """One scheduler process and the client side of its sockets. ``info`` is what the process reported when ready
    (its pid, its ``SchedulerConfig`` as a dict, its alternate-stream plan)."""

    def __init__(self, args: ServerArgs, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        (command_address,), self._reply_address = ipc_addresses(1)
        self._addresses = [command_address, self._reply_address]
        self._context = zmq.Context()
        self._replies = self._context.socket(zmq.PULL)
        self._replies.bind(self._reply_address)
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)  # never drop or block
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.connect(command_address)
        self._send_lock = threading.Lock()  # zmq sockets are not thread-safe; callers may be on several threads
        self._lock = threading.Lock()
        self._streams: dict[str, queue.Queue] = {}
        self._queries: dict[int, Future] = {}
        self._query_ids = itertools.count()
        self._error: BaseException | None = None
        self._closing = False
        self.process = spawn_scheduler_process(args, 0, command_address, self._reply_address)
        try:
            self.info = self._wait_ready(startup_timeout_s)
        except BaseException:
            stop_processes([self.process], grace_s=0.0)
            self._close()
            raise
        self._receiver = threading.Thread(target=self._receive_loop, name="sglang-lite-receiver", daemon=True)
        self._receiver.start()

    # ---- called from any thread --------------------------------------------------------------------------------
    def submit(self, rid: str, input_ids: list[int], params: dict[str, Any]) -> queue.Queue:
        """Queues a request; its ReqOutputs (or an exception) arrive on the returned queue."""
        stream: queue.Queue = queue.Queue()
        with self._lock:
            self._check_alive()
            self._streams[rid] = stream
        self._send(["add", rid, input_ids, params])
        return stream

    def abort(self, rid: str) -> None:
        """Ends a request wherever it is; nothing to do once the process is gone."""
        with self._lock:
            if self._closing or self._error is not None:
                return
        self._send(["abort", rid])

    def ask(self, kind: str, *args: Any) -> Any:
        """Sends a query (``loads`` or ``check``) and waits for its answer, which follows every command sent
        before it."""
        future: Future = Future()
        with self._lock:
            self._check_alive()
            query_id = next(self._query_ids)
            self._queries[query_id] = future
        self._send([kind, query_id, *args])
        return future.result()

    def shutdown(self) -> None:
        """Stops the process (unfinished requests fail) and releases the sockets; safe to call twice."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self.process.poll() is None:
            self._send(["stop"])
        stop_processes([self.process])
        self._receiver.join()
        self._fail_all(RuntimeError("the engine was shut down before the request finished"))
        self._close()

    # ---- internals ---------------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._closing or self._error is not None:
            raise RuntimeError("the engine is shut down") from self._error

    def _send(self, message: list[Any]) -> None:
        with self._send_lock:
            self._commands.send(pack(message))

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        waited_ms = 0.0
        while waited_ms < timeout_s * 1000:
            if self._replies.poll(POLL_MS):
                message = unpack(self._replies.recv())
                if message[0] == "ready":
                    return message[2]
                if message[0] == "fatal":
                    raise RuntimeError(f"the scheduler process failed to start: {message[2]}")
            elif self.process.poll() is not None:
                raise RuntimeError(f"the scheduler process exited during start-up (code {self.process.returncode})")
            waited_ms += POLL_MS
        raise TimeoutError(f"the scheduler process was not ready after {timeout_s} s")

    def _receive_loop(self) -> None:
        while not self._closing:
            if self._replies.poll(POLL_MS):
                self._dispatch(unpack(self._replies.recv()))
            elif self.process.poll() is not None:
                self._fail_all(RuntimeError(f"the scheduler process died (exit code {self.process.returncode})"))
                return

    def _dispatch(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == "out":
            for rid, new_ids, new_text, finished, meta in message[2]:
                self._deliver(ReqOutput(rid, new_ids, new_text, finished, meta))
        elif kind == "ack" and message[3] != 200:
            error_type = ValueError if message[3] == 400 else RuntimeError
            self._end_stream(message[2], error_type(message[4]))
        elif kind in ("loads", "checked"):
            with self._lock:
                future = self._queries.pop(message[2], None)
            if future is not None:
                future.set_result(message[3])
        elif kind == "fatal":
            self._fail_all(RuntimeError(f"the scheduler process failed: {message[2]}"))

    def _deliver(self, output: ReqOutput) -> None:
        with self._lock:
            stream = self._streams.pop(output.rid) if output.finished else self._streams.get(output.rid)
        if stream is not None:
            stream.put(output)

    def _end_stream(self, rid: str, item: Any) -> None:
        with self._lock:
            stream = self._streams.pop(rid, None)
        if stream is not None:
            stream.put(item)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            self._error = self._error or error
            streams, self._streams = list(self._streams.values()), {}
            queries, self._queries = list(self._queries.values()), {}
        for stream in streams:
            stream.put(error)
        for future in queries:
            future.set_exception(error)

    def _close(self) -> None:
        """Releases the sockets and their IPC files; the process is already stopped."""
        self._replies.close(0)
        self._commands.close(0)
        self._context.term()
        remove_ipc_files(self._addresses)
