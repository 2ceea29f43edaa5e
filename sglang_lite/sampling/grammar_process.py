"""The HTTP side's grammar check, in worker processes that can be killed: a compile past its budget is stopped, not
left to burn a core for minutes, and a compile that crashes xgrammar takes down a worker, never the server.

The HTTP side compiles a grammar only to know whether it compiles (each rank compiles it again for its own use):
``GrammarChecker.submit`` gives a Future of None, or of the ValueError naming the field. Each of ``workers``
threads owns one process (``python -m sglang_lite.sampling.grammar_process``; the server starts one with itself,
``prestart``, the other at need) and hands it one grammar at a time: a compile that overruns ``budget_s`` fails as
"too complex" and its process is killed and started again at once; the other worker goes on meanwhile. After a
compile, the process follows the grammar's first tokens (``grammar_cost.check_mask_cost``): a grammar whose token
mask already takes longer than ``mask_budget_s`` is refused as too expensive, before any rank meets it.
Outcomes are cached per grammar (failures too, the least recently used forgotten); grammars waiting beyond
``max_queued`` are refused with ``GrammarBusy``.

The protocol is one JSON object a line: the parent sends the tokenizer's xgrammar tables and the mask budget
(``{"tables", "mask_budget_s"}``), the worker answers ``{"ready": true}``; then ``{"kind", "text"}`` gets
``{"error": message or null}``.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from sglang_lite.sampling.grammar import (
    COMPILE_THREADS,
    MAX_CACHED_GRAMMARS,
    MAX_QUEUED_COMPILES,
    GrammarBusy,
    GrammarKey,
    too_complex,
)
from sglang_lite.server_args import ServerArgs

WORKER_START_TIMEOUT_S = 300.0  # importing xgrammar (and torch) on a loaded host


def xgrammar_tables(tokenizer: Any, vocab_size: int) -> str:
    """The tokenizer's xgrammar tables, as JSON (what a worker compiles against)."""
    import xgrammar

    return xgrammar.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size
    ).serialize_json()


class GrammarChecker:
    """``tables``: () -> the tokenizer's xgrammar tables (``xgrammar_tables``), called at the first compile.
    ``mask_budget_s``: the CPU time a token mask of a grammar may take as its first tokens are followed (None: not
    followed)."""

    def __init__(
        self,
        tables: Callable[[], str],
        budget_s: float,
        workers: int = COMPILE_THREADS,
        max_queued: int = MAX_QUEUED_COMPILES,
        max_entries: int = MAX_CACHED_GRAMMARS,
        mask_budget_s: float | None = ServerArgs.grammar_mask_budget_ms / 1000,
    ) -> None:
        self.tables = tables
        self.budget_s = budget_s
        self.mask_budget_s = mask_budget_s
        self.max_queued = max_queued
        self.max_entries = max_entries
        self.killed = 0  # compiles stopped past their budget, since start
        self._num_workers = workers
        self._entries: OrderedDict[GrammarKey, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._queued = 0
        self._threads: list[threading.Thread] = []
        self._workers: list[_Worker] = []
        self._tables: str | None = None

    def submit(self, key: GrammarKey) -> Future:
        with self._lock:
            future = self._entries.get(key)
            if future is None:
                if self._queued >= self.max_queued:
                    raise GrammarBusy(
                        f"{self._queued} grammars are waiting to compile; send the request again later"
                    )
                future = self._entries[key] = Future()
                self._queued += 1
                self._jobs.put((key, future))
                self._start_threads()
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            self._entries.move_to_end(key)
            return future

    def prestart(self, count: int = 1) -> None:
        """Starts ``count`` worker processes now, so that the first grammars do not wait for them to import
        xgrammar (seconds)."""
        with self._lock:
            self._start_threads()
        for worker in self._workers[:count]:
            worker.spawn()

    def compile(self, key: GrammarKey) -> None:
        """Blocks until ``key`` is checked; raises ValueError naming the field when it does not compile."""
        self.submit(key).result()

    def shutdown(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for worker in self._workers:
            worker.stop()

    def _start_threads(self) -> None:
        while len(self._threads) < self._num_workers:
            worker = _Worker(self._setup_message)
            thread = threading.Thread(
                target=self._serve, args=(worker,), name="grammar-check", daemon=True
            )
            self._workers.append(worker)
            self._threads.append(thread)
            thread.start()

    def _serve(self, worker: _Worker) -> None:
        while (job := self._jobs.get()) is not None:
            key, future = job
            with self._lock:
                self._queued -= 1
            try:
                error = worker.check(key, self.budget_s)
            except _Overran:
                with self._lock:
                    self.killed += 1
                future.set_exception(ValueError(too_complex(key, self.budget_s)))
            except Exception as failure:  # the worker could not start, or ended on this grammar
                future.set_exception(
                    ValueError(f"sampling parameter {key.kind} could not be compiled: {failure}")
                )
            else:
                _settle(future, error)

    def _setup_message(self) -> dict[str, Any]:
        """The worker's first message: the tables and the mask budget."""
        with self._lock:
            if self._tables is None:
                self._tables = self.tables()
            return {"tables": self._tables, "mask_budget_s": self.mask_budget_s}


def _settle(future: Future, error: str | None) -> None:
    if error:
        future.set_exception(ValueError(error))
    else:
        future.set_result(None)


class _Overran(Exception):
    """The compile ran past its budget (its process is killed)."""


class _Worker:
    """One compile process, started when first needed, and again at once after it was killed (it imports
    xgrammar while nothing waits on it)."""

    def __init__(self, setup: Callable[[], dict[str, Any]]) -> None:
        self._setup = setup
        self._process: subprocess.Popen | None = None
        self._ready = False  # it has the tables and said so
        self._buffer = b""

    def check(self, key: GrammarKey, budget_s: float) -> str | None:
        """The error message of ``key``'s compile, or None; raises _Overran past ``budget_s``."""
        self.spawn()
        if not self._ready:
            self._handshake()
        self._send({"kind": key.kind, "text": key.text})
        reply = self._receive(budget_s)
        if reply is None:
            self.stop()
            self.spawn()
            raise _Overran()
        return reply["error"]

    def spawn(self) -> None:
        """Starts the process unless it runs."""
        if self._process is not None and self._process.poll() is None:
            return
        self._buffer = b""
        self._ready = False
        self._process = subprocess.Popen(
            [sys.executable, "-m", "sglang_lite.sampling.grammar_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def _handshake(self) -> None:
        self._send(self._setup())
        if self._receive(WORKER_START_TIMEOUT_S) is None:
            self.stop()
            raise RuntimeError("the grammar compiler process did not start")
        self._ready = True

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._process.stdin.write(json.dumps(message).encode() + b"\n")
        except OSError as error:
            raise RuntimeError(f"the grammar compiler process ended ({error})") from None

    def _receive(self, timeout_s: float) -> dict[str, Any] | None:
        """The next reply, or None past ``timeout_s``; raises when the process ended."""
        deadline = time.monotonic() + timeout_s
        stdout = self._process.stdout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([stdout], [], [], left)[0]:
                return None
            chunk = os.read(stdout.fileno(), 1 << 16)
            if not chunk:
                code = self._process.wait()
                raise RuntimeError(f"the grammar compiler process ended (exit code {code})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)


def _serve_stdin() -> None:
    """The worker: compiles each grammar it is sent, answers with its error or None, until stdin closes."""
    import xgrammar

    from sglang_lite.sampling.grammar_compile import compile_text
    from sglang_lite.sampling.grammar_cost import check_mask_cost

    # replies go to the pipe the parent reads; anything else printed (xgrammar's warnings) goes to stderr
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    lines = iter(sys.stdin.buffer.readline, b"")
    setup = json.loads(next(lines))
    info = xgrammar.TokenizerInfo.deserialize_json(setup["tables"])
    mask_budget_s = setup.get("mask_budget_s")
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _reply(replies, {"ready": True})
    for line in lines:
        request = json.loads(line)
        try:
            compiled = compile_text(compiler, request["kind"], request["text"])
            if mask_budget_s is not None:
                check_mask_cost(compiled, request["kind"], mask_budget_s)
            error = None
        except ValueError as refused:
            error = str(refused)
        except Exception as failure:  # what xgrammar raised beyond its documented errors
            error = f"sampling parameter {request['kind']} does not compile: {failure}"
        _reply(replies, {"error": error})


def _reply(replies: Any, message: dict[str, Any]) -> None:
    replies.write(json.dumps(message).encode() + b"\n")
    replies.flush()


if __name__ == "__main__":
    _serve_stdin()
