"""Per-request sampling parameters (SGLang names) and their validation."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Treated as greedy: below this temperature sampling is argmax (avoids dividing logits by ~0).
GREEDY_TEMPERATURE = 1e-6


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

    @classmethod
    def from_dict(cls, params: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        """Builds from a request's dict; unknown keys are an error naming them. Does not validate values."""
        if isinstance(params, SamplingParams):
            return dataclasses.replace(params)
        params = dict(params or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        if isinstance(params.get("stop"), str):
            params["stop"] = [params["stop"]]
        for key in ("stop", "stop_token_ids"):
            if params.get(key) is None:
                params.pop(key, None)
            elif isinstance(params[key], (list, tuple)):
                params[key] = list(params[key])
            else:
                raise ValueError(f"sampling parameter {key} must be a list, got {params[key]!r}")
        return cls(**params)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises ValueError naming the first bad field."""
        for name in ("max_new_tokens", "min_new_tokens"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 0, name, "an integer >= 0", value)
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0", self.temperature)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", "-1 (off) or >= 1", self.top_k)
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _check(self.seed is None or _is_int(self.seed), "seed", "an integer or None", self.seed)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        ids_ok = all(_is_int(t) and t >= 0 and (vocab_size is None or t < vocab_size) for t in self.stop_token_ids)
        _check(ids_ok, "stop_token_ids", f"token ids in [0, {vocab_size})", self.stop_token_ids)


def _check(ok: bool, name: str, expected: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"sampling parameter {name} must be {expected}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
