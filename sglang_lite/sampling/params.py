"""Per-request sampling parameters (SGLang names) and their validation.

``validate`` is the one check of every value, for both HTTP APIs (through the tokenizer manager) and for the
scheduler (``validate_request``): each field has a type and a range that the sampler, the scheduler's counters
and the msgpack transport can carry, so a request that passes can never break a rank.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

# Treated as greedy: below this temperature sampling is argmax (avoids dividing logits by ~0).
GREEDY_TEMPERATURE = 1e-6
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The limits (docs/reliability.md). Token counts fit the scheduler's int32 counters (it clips max_new_tokens to
# what the context and the KV pool leave); temperatures far above 1 are already uniform sampling, and any value
# must stay finite once the sampler turns it into float32.
MAX_NEW_TOKENS = INT32_MAX
MAX_TEMPERATURE = 1e4
# The stop-string matcher runs on the rank's one thread for every token: its work grows with the count and the
# square of each string's length, so both are bounded.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # all stop strings together
MAX_STOP_TOKEN_IDS = 256
MAX_N = 64  # parallel samples of one prompt (each holds its own KV and state once forked)
# OpenAI's ranges (SGLang's too): frequency and presence penalties in [-2, 2], repetition in (0, 2], biases in
# [-100, 100] (a bias of 100 makes a token all but certain, -100 all but impossible).
MAX_PENALTY = 2.0
MAX_REPETITION_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_REPR_CHARS = 60  # of a bad value quoted in an error message
# Structured output: the grammar fields (at most one per request) and the longest text one may hold.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
MAX_GRAMMAR_CHARS = 65536


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1  # parallel samples: one prefill, then n continuations, the i-th seeded with seed + i
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id (a decimal string, as in JSON) -> bias added to its logit
    logit_bias: dict[str, float] | None = None
    # structured output (at most one of the four): a JSON schema, as text
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None  # xgrammar's EBNF (GBNF), root rule `root`
    structural_tag: str | None = (
        None  # SGLang's structural tag, as JSON (sampling/grammar_compile.py)
    )
    # the output starts inside a reasoning section: the grammar constrains only what follows its end (SGLang's
    # require_reasoning; needs a rank with a reasoning parser)
    require_reasoning: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        """Builds from a request's dict; unknown keys are an error naming them. Does not validate values."""
        if isinstance(params, SamplingParams):
            return dataclasses.replace(params)
        params = dict(params or {})
        if "sampling_seed" in params:  # SGLang's name for the seed
            alias = params.pop("sampling_seed")
            if alias is not None and params.get("seed") not in (None, alias):
                raise ValueError(
                    "sampling parameters seed and sampling_seed differ: give one of them"
                )
            params["seed"] = alias if alias is not None else params.get("seed")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {_short(unknown)}; known: {sorted(known)}"
            )
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        for key in ("stop", "stop_token_ids"):
            if params.get(key) is None:
                params.pop(key, None)
            elif isinstance(params[key], (list, tuple)):
                params[key] = list(params[key])
            else:
                raise ValueError(
                    f"sampling parameter {key} must be a list, got {_short(params[key])}"
                )
        if params.get("logit_bias") is None:
            params.pop("logit_bias", None)
        # int keys (Python callers) as JSON's strings: one key type
        elif isinstance(params["logit_bias"], dict):
            params["logit_bias"] = {
                str(k) if _is_int(k) else k: v for k, v in params["logit_bias"].items()
            }
        else:
            raise ValueError(
                f"sampling parameter logit_bias must be a map, got {_short(params['logit_bias'])}"
            )
        return cls(**params)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises ValueError naming the first bad field."""
        _check_int(self.max_new_tokens, "max_new_tokens", 0, MAX_NEW_TOKENS)
        _check_int(self.min_new_tokens, "min_new_tokens", 0, MAX_NEW_TOKENS)
        _check_int(self.n, "n", 1, MAX_N)
        _check_float(self.temperature, "temperature", 0.0, MAX_TEMPERATURE)
        _check(
            _is_finite(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            "a finite number in (0, 1]",
            self.top_p,
        )
        _check_float(self.min_p, "min_p", 0.0, 1.0)
        top_k_max = vocab_size or INT32_MAX
        top_k_ok = _is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k <= top_k_max)
        _check(top_k_ok, "top_k", f"-1 (off) or an integer in [1, {top_k_max}]", self.top_k)
        if self.seed is not None:
            _check_int(self.seed, "seed", INT64_MIN, INT64_MAX)
        for name in ("ignore_eos", "skip_special_tokens", "require_reasoning"):
            _check(
                isinstance(getattr(self, name), bool), name, "true or false", getattr(self, name)
            )
        self._validate_stop()
        self._validate_stop_token_ids(vocab_size)
        self._validate_penalties(vocab_size)
        self._validate_grammar()

    def _validate_stop(self) -> None:
        stop = self.stop
        _check(
            isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS,
            "stop",
            f"a list of at most {MAX_STOP_STRINGS} strings",
            _count(stop),
        )
        _check(
            all(isinstance(s, str) and s and is_utf8(s) for s in stop),
            "stop",
            "non-empty UTF-8 strings",
            stop,
        )
        total = sum(len(s) for s in stop)
        _check(
            total <= MAX_STOP_CHARS,
            "stop",
            f"at most {MAX_STOP_CHARS} characters in all",
            _Said(f"{total}"),
        )

    def _validate_stop_token_ids(self, vocab_size: int | None) -> None:
        ids, top = self.stop_token_ids, (vocab_size or INT32_MAX + 1) - 1
        _check(
            isinstance(ids, list) and len(ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"a list of at most {MAX_STOP_TOKEN_IDS} token ids",
            _count(ids),
        )
        _check(
            all(_is_int(t) and 0 <= t <= top for t in ids),
            "stop_token_ids",
            f"token ids in [0, {top}]",
            ids,
        )

    def _validate_grammar(self) -> None:
        named = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(named) > 1:
            raise ValueError(
                f"sampling parameters {', '.join(named)}: at most one of {', '.join(GRAMMAR_FIELDS)} "
                "may be set"
            )
        for name in named:
            text = getattr(self, name)
            ok = isinstance(text, str) and 0 < len(text) <= MAX_GRAMMAR_CHARS and is_utf8(text)
            _check(
                ok,
                name,
                f"a non-empty UTF-8 string of at most {MAX_GRAMMAR_CHARS} characters",
                text,
            )

    def _validate_penalties(self, vocab_size: int | None) -> None:
        _check_float(self.frequency_penalty, "frequency_penalty", -MAX_PENALTY, MAX_PENALTY)
        _check_float(self.presence_penalty, "presence_penalty", -MAX_PENALTY, MAX_PENALTY)
        repetition = self.repetition_penalty
        _check(
            _is_finite(repetition) and 0 < repetition <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"a finite number in (0, {MAX_REPETITION_PENALTY:g}]",
            repetition,
        )
        bias, top = self.logit_bias, (vocab_size or INT32_MAX + 1) - 1
        if bias is None:
            return
        _check(isinstance(bias, dict), "logit_bias", "a map of token ids to biases", bias)
        _check(
            all(_is_token_key(k, top) for k in bias),
            "logit_bias",
            f"keyed by token ids in [0, {top}]",
            list(bias),
        )
        _check(
            all(_is_finite(v) and abs(v) <= MAX_LOGIT_BIAS for v in bias.values()),
            "logit_bias",
            f"biases that are finite numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            list(bias.values()),
        )


def _check(ok: bool, name: str, expected: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"sampling parameter {name} must be {expected}, got {_short(value)}")


def _check_int(value: Any, name: str, low: int, high: int) -> None:
    _check(_is_int(value) and low <= value <= high, name, f"an integer in [{low}, {high}]", value)


def _check_float(value: Any, name: str, low: float, high: float) -> None:
    _check(
        _is_finite(value) and low <= value <= high,
        name,
        f"a finite number in [{low:g}, {high:g}]",
        value,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_key(key: Any, top: int) -> bool:
    """A logit_bias key: a token id, or its decimal string (JSON object keys are strings)."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= len(str(top)):
        key = int(key)
    return _is_int(key) and 0 <= key <= top


def _is_finite(value: Any) -> bool:
    """A number that stays finite as a float (JSON allows Infinity, NaN and integers of any size)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def is_utf8(text: str) -> bool:
    """Whether the text can be encoded as UTF-8: JSON can carry lone surrogates, which msgpack and tokenizers cannot."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class _Said(str):
    """Text quoted in an error message as it is."""

    def __repr__(self) -> str:
        return str(self)


def _count(value: Any) -> Any:
    return _Said(f"{len(value)} entries") if isinstance(value, list) else value


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer beyond Python's digit limit for str()
        return "an integer too large to print"
    return text if len(text) <= MAX_REPR_CHARS else text[:MAX_REPR_CHARS] + "..."
