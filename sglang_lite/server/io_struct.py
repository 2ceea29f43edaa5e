"""What the HTTP side's parts pass each other: a request ready to dispatch (``GenerateInput``, with its PD bootstrap
fields), a rendered chat prompt, and the refusal every part raises (``RequestError``, an HTTP status and message)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_lite.runtime.inputs import per_prompt
from sglang_lite.sampling.logprobs import LogprobParams
from sglang_lite.sampling.params import SamplingParams

ROOM_LIMIT = 2**63


class RequestError(Exception):
    """A request the server refuses: HTTP status, message, extra headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def bad_request(message: str) -> RequestError:
    return RequestError(400, message)


@dataclass(frozen=True)
class Bootstrap:
    """PD disaggregation: the prefill server's bootstrap server and the transfer's room."""

    host: str
    port: int
    room: int


def bootstrap_of(host: Any, port: Any, room: Any, n: int) -> list[Bootstrap | None]:
    """Each prompt's bootstrap fields (lists give one per prompt; all three or none); ValueError naming the field."""
    fields = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    if all(v is None for v in fields.values()):
        return [None] * n
    missing = [k for k, v in fields.items() if v is None]
    if missing:
        raise ValueError(
            f"{missing[0]}: PD requests carry bootstrap_host, bootstrap_port and bootstrap_room"
        )
    columns = [per_prompt(value, n, name) for name, value in fields.items()]
    out = []
    for h, p, r in zip(*columns):
        if not 0 < p < 65536:
            raise ValueError(f"bootstrap_port must be a TCP port, got {p}")
        if not 0 <= r < ROOM_LIMIT:
            raise ValueError(f"bootstrap_room must be in [0, 2**63), got {r}")
        out.append(Bootstrap(h, p, r))
    if len({b.room for b in out}) != len(out):
        raise ValueError("bootstrap_room: the prompts of one request need distinct rooms")
    return out


@dataclass(frozen=True)
class GenerateInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    requested_rank: int | None = None
    # PD disaggregation: the prefill server and the transfer's room
    bootstrap: Bootstrap | None = None
    logprob: LogprobParams | None = None  # the log-probabilities to report in meta_info


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat prompt: its text (the output parsers read how it ends) and its token ids."""

    text: str
    ids: list[int]
