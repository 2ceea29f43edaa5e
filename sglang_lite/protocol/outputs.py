"""What a rank sends back for a request, as the front ends read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_lite.sampling.logprobs import INPUT_KEYS, OUTPUT_KEYS

INTERNAL_ERROR = 500  # the status of a request that failed inside its rank
# the status of a request that failed inside its rank by its own fault (its grammar reached a dead end)
BAD_REQUEST = 400
# PD: the other server of the pair, or the transfer between them, failed the request (not this server: a router
# does not count it against this worker's health)
PD_FAILURE = 502


@dataclass
class ReqOutput:
    """What one step produced for one request: new tokens and text since the last output, and whether it ended."""

    rid: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    meta_info: dict[str, Any]


def request_failure(output: ReqOutput) -> tuple[int, str] | None:
    """(HTTP status, message) of an output whose request failed inside its rank, else None."""
    reason = output.meta_info.get("finish_reason") or {}
    status = reason.get("status_code")
    if (
        not output.finished
        or reason.get("type") != "abort"
        or status not in (BAD_REQUEST, INTERNAL_ERROR, PD_FAILURE)
    ):
        return None
    return status, reason.get("message") or "internal error"


def join_outputs(outputs: list[ReqOutput]) -> ReqOutput:
    """A request's outputs as one: every token, all text and every log-probability in order, the last
    ``meta_info`` otherwise."""
    assert outputs, "a finished request has at least one output"
    ids = [token for output in outputs for token in output.new_token_ids]
    text = "".join(output.new_text for output in outputs)
    last = outputs[-1]
    meta = dict(last.meta_info)
    for key in [k for k in OUTPUT_KEYS + INPUT_KEYS if k in meta]:
        meta[key] = [entry for output in outputs for entry in output.meta_info.get(key, [])]
    return ReqOutput(last.rid, ids, text, last.finished, meta)
