"""What the router reads from a request body: the prompt text (for cache_aware) and the batch size (for PD)."""

from __future__ import annotations

import json

from .policies import RequestInfo


def parse_body(raw: bytes) -> dict:
    """Parse a JSON object body; raises ValueError with a message fit for a 400."""
    try:
        body = json.loads(raw) if raw else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body


def prompt_text(body: dict) -> str:
    """Text for prefix matching: the first prompt of /generate or /v1/completions, or the chat messages."""
    for key in ("text", "prompt", "input_ids"):
        if key in body:
            return _as_text(body[key])
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(_as_text(m.get("content", "")) for m in messages if isinstance(m, dict))
    return ""


def _as_text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[0], (list, str)):
        return _as_text(value[0])  # a batch: route by its first prompt
    if isinstance(value, list):
        # token ids, or chat content parts
        return "".join(p.get("text", "") if isinstance(p, dict) else f"{p}," for p in value)
    return ""


def batch_size(body: dict) -> int | None:
    """Number of prompts in a batched /generate request; None for a single prompt."""
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def request_info(body: dict | None, headers) -> RequestInfo:
    return RequestInfo(text=prompt_text(body) if body else "", headers=headers)
