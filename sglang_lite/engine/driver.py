"""Runs a Scheduler in a background thread: commands go in through an inbox, outputs come back per request.

Only the loop thread touches the scheduler, so the scheduler needs no locks. Each request gets its own output
queue; an error for a request (a bad parameter, a crash of the loop) is put there as an exception.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

from sglang_lite.sampling.params import SamplingParams
from sglang_lite.scheduler.request import ReqOutput
from sglang_lite.scheduler.scheduler import Scheduler

_STOP = object()


class SchedulerThread:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="sglang-lite-scheduler", daemon=True)
        self._thread.start()

    # ---- called from any thread --------------------------------------------------------------------------------
    def submit(self, rid: str, input_ids: list[int], params: SamplingParams) -> queue.Queue:
        """Queues a request; its ReqOutputs (or an exception) arrive on the returned queue."""
        stream: queue.Queue = queue.Queue()
        with self._lock:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError("the engine is shut down") from self._error
            self._streams[rid] = stream
        self._inbox.put(("add", rid, input_ids, params))
        return stream

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def call(self, fn: Callable[[Scheduler], Any]) -> Any:
        """Runs ``fn(scheduler)`` on the loop thread, after every command queued before it."""
        if not self._thread.is_alive():
            raise RuntimeError("the engine is shut down") from self._error
        future: Future = Future()
        self._inbox.put(("call", fn, future))
        return future.result()

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join()

    # ---- the loop thread ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._handle_commands(block=not self.scheduler.has_work):
                for output in self.scheduler.step():
                    self._deliver(output)
            self._fail_all(RuntimeError("the engine was shut down before the request finished"))
        except BaseException as error:  # a crash must not leave callers waiting forever
            self._fail_all(error)

    def _handle_commands(self, block: bool) -> bool:
        """Applies queued commands; False on shutdown."""
        try:
            command = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                return False
            self._apply(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            self._add(*command[1:])
        elif kind == "abort":
            self.scheduler.abort(command[1], message="aborted by the client")
        else:
            self._call(*command[1:])

    def _add(self, rid: str, input_ids: list[int], params: SamplingParams) -> None:
        try:
            self.scheduler.add_request(rid, input_ids, params)
        except ValueError as error:
            self._end_stream(rid, error)

    def _call(self, fn: Callable[[Scheduler], Any], future: Future) -> None:
        try:
            future.set_result(fn(self.scheduler))
        except Exception as error:
            future.set_exception(error)

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
            self._error = error
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.put(error)
        self._fail_pending_calls(error)

    def _fail_pending_calls(self, error: BaseException) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command is not _STOP and command[0] == "call":
                command[2].set_exception(error)
