"""The HTTP side's grammar checker: compiles in worker processes, a compile past its budget killed (its core freed,
the worker started again), a worker that ends fails only the grammar it was compiling, a bounded queue."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from sglang_lite.sampling.grammar import GrammarBusy, GrammarKey
from sglang_lite.sampling.grammar_process import GrammarChecker, xgrammar_tables
from sglang_lite.tokenizer import load_tokenizer

VOCAB = 4096
# 1500 optional properties: xgrammar's grammar grows with their square (600 take seconds, this far longer)
WIDE = GrammarKey(
    "json_schema",
    json.dumps(
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1500)}}
    ),
)


def wait_until(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_grammars_are_checked_in_processes_and_cached(tokenizer):
    checker = GrammarChecker(lambda: xgrammar_tables(tokenizer, VOCAB), budget_s=60.0)
    try:
        good = GrammarKey("regex", "[0-9]+")
        assert checker.submit(good).result(120) is None
        assert checker.submit(good) is checker.submit(good)
        for key, needle in [
            (GrammarKey("regex", "(ab"), "sampling parameter regex does not compile"),
            (GrammarKey("ebnf", 'root ::= "a" root'), "sampling parameter ebnf admits no output"),
        ]:
            with pytest.raises(ValueError, match=needle):
                checker.compile(key)
        pids = {w._process.pid for w in checker._workers if w._process is not None}
        assert pids and os.getpid() not in pids
    finally:
        checker.shutdown()


def test_a_compile_past_its_budget_is_killed_and_the_next_grammar_compiles(tokenizer):
    checker = GrammarChecker(lambda: xgrammar_tables(tokenizer, VOCAB), budget_s=0.5, workers=1)
    try:
        checker.compile(GrammarKey("regex", "a"))  # the worker has started
        (worker,) = checker._workers
        first = worker._process
        with pytest.raises(ValueError, match="sampling parameter json_schema is too complex"):
            checker.submit(WIDE).result(120)
        assert checker.killed == 1 and first.poll() is not None, "its process is gone"
        assert checker.submit(GrammarKey("regex", "b")).result(120) is None
        assert worker._process is not first and worker._process.poll() is None
    finally:
        checker.shutdown()


def test_a_worker_that_ends_fails_only_its_grammar(tokenizer):
    checker = GrammarChecker(lambda: xgrammar_tables(tokenizer, VOCAB), budget_s=600.0, workers=1)
    try:
        checker.compile(GrammarKey("regex", "a"))
        (worker,) = checker._workers
        future = checker.submit(WIDE)
        wait_until(lambda: checker._queued == 0)  # the worker took it
        os.kill(worker._process.pid, signal.SIGKILL)
        with pytest.raises(ValueError, match="json_schema could not be compiled: .*ended"):
            future.result(120)
        assert checker.submit(GrammarKey("regex", "c")).result(120) is None
    finally:
        checker.shutdown()


def test_grammars_beyond_the_queue_bound_are_refused_as_busy(tokenizer):
    checker = GrammarChecker(
        lambda: xgrammar_tables(tokenizer, VOCAB), budget_s=600.0, workers=1, max_queued=1
    )
    try:
        checker.compile(GrammarKey("regex", "a"))
        slow = checker.submit(WIDE)
        wait_until(lambda: checker._queued == 0)
        waiting = checker.submit(GrammarKey("regex", "x"))
        with pytest.raises(GrammarBusy):
            checker.submit(GrammarKey("regex", "y"))
        checker._workers[0].stop()  # ends the slow compile
        with pytest.raises(ValueError):
            slow.result(120)
        assert waiting.result(120) is None
    finally:
        checker.shutdown()
