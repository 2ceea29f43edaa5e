"""Structured output (SGLang's ``json_schema``, ``regex``, ``ebnf`` and ``structural_tag``): grammars compiled by
xgrammar, one matcher per request, and the token masks they put on a batch's logits.

A grammar is compiled once per (kind, text) for one tokenizer (``GrammarCache``, on its own worker threads, so
neither the scheduler's step nor the HTTP event loop waits on a compile); a text that cannot compile, or whose
language is empty, is a ValueError naming its field (``grammar_compile``). Each request then follows its output
with a ``RequestGrammar``: before sampling it fills its row of the batch's bitmask (``mask_logits`` turns the
disallowed tokens' logits to -inf), after sampling it accepts the token. Once the grammar is complete only the
stop tokens are allowed, and accepting one terminates the matcher: that is where a structured request ends. With
``require_reasoning`` a ``ReasoningGrammar`` leaves the output free until the reasoning's end, then constrains the
answer.

JSON is written on one line with the separators ", " and ": " (xgrammar's ``any_whitespace=False``): with free
whitespace between tokens, a weak model can spend its whole token budget on blanks and never close the object.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from sglang_lite.sampling.grammar_compile import compile_text
from sglang_lite.sampling.grammar_cost import GrammarFault, MaskBudget
from sglang_lite.sampling.params import GRAMMAR_FIELDS, SamplingParams

COMPILE_THREADS = 2
# compiles past their budget that may still run, each on a spare thread of its own
MAX_ABANDONED = 4
MAX_QUEUED_COMPILES = 64
# compiled grammars hold per-token tables: the cache forgets the least recently used
MAX_CACHED_GRAMMARS = 256
# the text that ends the reasoning of each --reasoning-parser (where server/parsers/reasoning.py splits the text)
REASONING_ENDS = {"qwen3": "</think>"}


@dataclass(frozen=True)
class GrammarKey:
    kind: str  # one of GRAMMAR_FIELDS: the sampling parameter that carries the text
    text: str


def grammar_key(params: SamplingParams) -> GrammarKey | None:
    """The grammar a request asks for (``validate`` has checked that at most one field is set), or None."""
    for kind in GRAMMAR_FIELDS:
        text = getattr(params, kind)
        if text is not None:
            return GrammarKey(kind, text)
    return None


def reasoning_end_ids(tokenizer: Any, reasoning_parser: str | None) -> tuple[int, ...]:
    """The reasoning's end as the tokenizer encodes it (empty without a reasoning parser or a tokenizer)."""
    if reasoning_parser is None or tokenizer is None:
        return ()
    return tuple(tokenizer.encode(REASONING_ENDS[reasoning_parser], add_special_tokens=False))


class GrammarBusy(RuntimeError):
    """Too many grammars wait for a compile: the request may be sent again later (a 503, not the request's fault)."""


class GrammarCache:
    """Compiles grammars for one tokenizer, each key once (failures too), at most ``COMPILE_THREADS`` at a time.

    ``budget_s``: a compile that runs longer is abandoned: its key fails with "too complex" (cached like any
    failure) and its slot goes to the next grammar at once, so one slow schema never holds the others back (the
    abandoned compile finishes on a spare thread, ``MAX_ABANDONED`` at most, and is dropped). ``max_queued``:
    grammars waiting for a slot beyond it are refused with ``GrammarBusy``. ``vocab_size`` is the model's (its LM
    head may have more rows than the tokenizer has tokens). xgrammar's tokenizer tables are built on a worker at
    the first compile, so creating a cache costs nothing."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_entries: int = MAX_CACHED_GRAMMARS,
        budget_s: float | None = None,
        max_queued: int = MAX_QUEUED_COMPILES,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self.budget_s = budget_s
        self.max_queued = max_queued
        self._compiler: Any = None
        self._entries: OrderedDict[GrammarKey, Future] = OrderedDict()
        # of the entries: held only for moments, so ``submit`` never waits long
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        self._slots = threading.Semaphore(COMPILE_THREADS)  # compiles running within their budget
        self._queued = 0
        self.abandoned = 0  # compiles past their budget, since start
        self._pool = ThreadPoolExecutor(
            COMPILE_THREADS + MAX_ABANDONED, thread_name_prefix="grammar"
        )

    def submit(self, key: GrammarKey) -> Future:
        """The compile of ``key``: a Future of its compiled grammar, or of a ValueError naming the field. Raises
        GrammarBusy when ``max_queued`` grammars already wait."""
        with self._lock:
            future = self._entries.get(key)
            if future is None:
                if self._queued >= self.max_queued:
                    raise GrammarBusy(
                        f"{self._queued} grammars are waiting to compile; send the request again later"
                    )
                future = self._entries[key] = Future()
                self._queued += 1
                self._pool.submit(self._run, key, future)
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            self._entries.move_to_end(key)
            return future

    def compile(self, key: GrammarKey) -> Any:
        """Blocks until ``key`` is compiled; raises ValueError naming the field when it cannot be."""
        return self.submit(key).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, key: GrammarKey, future: Future) -> None:
        """On a pool thread: waits for a slot, compiles within the budget, settles ``future``."""
        self._slots.acquire()
        with self._lock:
            self._queued -= 1
        slot = _Slot(self._slots)

        def expire() -> None:  # the compile overran: its slot goes to the next grammar now
            if _settle(future, error=ValueError(too_complex(key, self.budget_s))):
                with self._lock:
                    self.abandoned += 1
            slot.release()

        timer = None
        try:
            compiler = self._get_compiler()  # the tokenizer's tables, once: not the grammar's time
            if self.budget_s is not None:
                timer = threading.Timer(self.budget_s, expire)
                timer.daemon = True
                timer.start()
            _settle(future, result=self._compile(compiler, key))
        except Exception as error:
            _settle(future, error=error)
        finally:
            if timer is not None:
                timer.cancel()
            slot.release()

    def _compile(self, compiler: Any, key: GrammarKey) -> Any:
        return compile_text(compiler, key.kind, key.text)

    def _get_compiler(self) -> Any:
        import xgrammar

        with self._compiler_lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


class GrammarQueue:
    """Requests waiting for their grammar (SGLang's grammar queue): each is added with its key, whose compile starts
    at once, and is taken once the compile has ended. ``wait``: take every request at the next look, waiting for
    its compile (the ranks of one attention group must admit the same requests at the same step)."""

    def __init__(self, cache: GrammarCache, wait: bool = False) -> None:
        self.cache, self.wait = cache, wait
        self._pending: dict[Any, Future] = {}  # in arrival order

    def add(self, item: Any, key: GrammarKey) -> None:
        self._pending[item] = self.cache.submit(key)

    def take_ready(self) -> list[tuple[Any, Any]]:
        """The items whose compile has ended, in arrival order, each with its compiled grammar or its ValueError."""
        ready = [item for item, future in self._pending.items() if self.wait or future.done()]
        return [(item, _outcome(self._pending.pop(item))) for item in ready]

    def remove(self, item: Any) -> None:
        self._pending.pop(item, None)

    @property
    def items(self) -> list[Any]:
        return list(self._pending)

    def __len__(self) -> int:
        return len(self._pending)


class _Slot:
    """One compile's hold on a semaphore slot, released once (by the compile or by its budget's timer)."""

    def __init__(self, semaphore: threading.Semaphore) -> None:
        self._semaphore = semaphore
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        with self._lock:
            held = self._held
            self._held = False
        if held:
            self._semaphore.release()


def _settle(future: Future, result: Any = None, error: BaseException | None = None) -> bool:
    """Sets the outcome once (False if it was set already: a compile that ends after its budget is dropped)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        return False
    return True


def too_complex(key: GrammarKey, budget_s: float | None) -> str:
    return (
        f"sampling parameter {key.kind} is too complex: it did not compile within {budget_s:g} s "
        "(simplify the schema or grammar)"
    )


class GrammarDeadEnd(GrammarFault):
    """A request's grammar allows no next token where its output stands (a dead branch of a grammar whose language
    is not empty: ``root ::= "a" [^\\s\\S] | "b"`` after ``a``): the request's fault, so it fails alone with a 400."""


def check_some_token_allowed(logits: torch.Tensor, grammars: list[Any]) -> None:
    """Raises GrammarDeadEnd when a constrained row allows no token at all (-inf everywhere): its request fails
    with that message (the sampler isolates it), instead of sampling a forbidden token or NaN. (A row of NaN, a
    broken forward's, is not the grammar's doing: the draw fails on it, a 500.)"""
    rows = constrained_rows(grammars)
    if rows and bool((logits[rows] == float("-inf")).all(dim=-1).any()):
        raise GrammarDeadEnd(
            "the request's grammar allows no next token: its output entered a part of the grammar that "
            "cannot be completed"
        )


def constrained_rows(grammars: list[Any]) -> list[int]:
    """The rows whose grammar constrains the next token (one still waiting for its reasoning to end does not)."""
    return [i for i, g in enumerate(grammars) if g is not None and g.active]


def _outcome(future: Future) -> Any:
    error = future.exception()
    return error if error is not None else future.result()


class RequestGrammar:
    """One request's place in its grammar. ``stop_token_ids``: the tokens that end it once the grammar is complete
    (the request's stop tokens). ``mask_budget_s``: the CPU time a token mask or an accepted token may take (past
    it GrammarTooExpensive, see ``grammar_cost``); None: no limit."""

    active = True  # it constrains every token of the output

    def __init__(
        self, compiled: Any, stop_token_ids: list[int], mask_budget_s: float | None = None
    ) -> None:
        import xgrammar

        self.vocab_size = compiled.tokenizer_info.vocab_size
        self._compiled, self._stop_token_ids = compiled, stop_token_ids
        self._matcher = xgrammar.GrammarMatcher(
            compiled, override_stop_tokens=stop_token_ids or None
        )
        self._budget = MaskBudget(mask_budget_s)

    def restarted(self) -> RequestGrammar:
        """The same grammar from its start (for a parallel sample forked before any token)."""
        return RequestGrammar(self._compiled, self._stop_token_ids, self._budget.budget_s)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        with self._budget.timed("a token mask"):
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        """Advances past a sampled token; one the mask forbade is an error (of this request alone)."""
        with self._budget.timed("accepting a token"):
            accepted = self._matcher.accept_token(token_id)
        if not accepted:
            raise ValueError(f"token {token_id} breaks the request's grammar")

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return self._matcher.is_terminated()


class ReasoningGrammar:
    """A grammar that constrains only the answer after the reasoning (SGLang's reasoner grammar, for a request
    with ``require_reasoning`` on a rank with a reasoning parser): the output is free until it ends with
    ``end_ids`` (``</think>`` as the tokenizer encodes it; Qwen3.5's is one token), and the grammar starts with
    the next token. An output that never closes its reasoning is never constrained: it ends at a stop token or at
    its length limit, all reasoning."""

    def __init__(self, grammar: RequestGrammar, end_ids: tuple[int, ...]) -> None:
        assert end_ids, "the reasoning's end is at least one token"
        self.grammar = grammar
        self.end_ids = end_ids
        self.vocab_size = grammar.vocab_size
        self.active = False  # the reasoning has ended: the grammar constrains
        self._matched = 0  # how many of end_ids the output ends with

    def restarted(self) -> ReasoningGrammar:
        return ReasoningGrammar(self.grammar.restarted(), self.end_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.active:
            self.grammar.fill_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        if self.active:
            self.grammar.accept(token_id)
            return
        self._matched = _matched_after(self.end_ids, self._matched, token_id)
        self.active = self._matched == len(self.end_ids)

    @property
    def terminated(self) -> bool:
        return self.active and self.grammar.terminated


def _matched_after(end: tuple[int, ...], matched: int, token_id: int) -> int:
    """How much of ``end`` the output ends with once ``token_id`` follows an output that ended with
    ``end[:matched]``: the longest start of ``end`` that is an end of ``end[:matched] + (token_id,)``."""
    tail = end[:matched] + (token_id,)
    for size in range(min(len(tail), len(end)), 0, -1):
        if tail[-size:] == end[:size]:
            return size
    return 0


def mask_logits(logits: torch.Tensor, grammars: list[Any]) -> torch.Tensor:
    """logits [B, V] with each constrained row's disallowed tokens at -inf: the input itself when no row is
    constrained, else a copy (the forward's logits stay as they were). Columns past the grammar's vocabulary are
    disallowed."""
    rows = constrained_rows(grammars)
    if not rows:
        return logits
    import xgrammar

    vocab = grammars[rows[0]].vocab_size
    # on the CPU, where matchers write
    bitmask = xgrammar.allocate_token_bitmask(len(grammars), vocab)
    for i in rows:
        grammars[i].fill_bitmask(bitmask, i)
    logits = logits.clone()
    xgrammar.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), vocab_size=vocab, indices=rows
    )
    if logits.shape[-1] > vocab:
        logits[rows, vocab:] = float("-inf")
    return logits


def keep_possible_bans(
    logits: torch.Tensor, banned: list[list[int]], grammars: list[Any]
) -> list[list[int]]:
    """Drops a constrained row's ban (its stop tokens before ``min_new_tokens``) when the ban would leave no token
    the grammar allows: a complete grammar allows only the stop tokens, and the grammar wins."""
    rows = set(constrained_rows(grammars))
    return [
        [] if ids and row in rows and not _allows_other(logits[row], ids) else ids
        for row, ids in enumerate(banned)
    ]


def _allows_other(logits: torch.Tensor, ids: list[int]) -> bool:
    allowed = logits > float("-inf")
    allowed[ids] = False
    return bool(allowed.any())
