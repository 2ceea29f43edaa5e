"""What the HTTP side's parts pass each other: a request ready to dispatch (``GenerateInput``, with its PD bootstrap
fields), a rendered chat prompt, and the refusal every part raises (``RequestError``, an HTTP status and message)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_lite.multimodal.inputs import ImageInputs
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
    port: int | None  # None: the decode server's own --disaggregation-bootstrap-port
    room: int


def bootstrap_of(host: Any, port: Any, room: Any, n: int) -> list[Bootstrap | None]:
    """Each prompt's bootstrap fields (lists give one per prompt; host and room, or none); ValueError naming the
    field. A null ``bootstrap_port`` (routers send it when the prefill server was given without one) stays None:
    the decode server then uses its own ``--disaggregation-bootstrap-port``, as upstream does."""
    fields = {"bootstrap_host": host, "bootstrap_room": room}
    if all(v is None for v in fields.values()) and port is None:
        return [None] * n
    missing = [k for k, v in fields.items() if v is None]
    if missing:
        raise ValueError(f"{missing[0]}: PD requests carry bootstrap_host and bootstrap_room")
    columns = [per_prompt(v, n, k) for k, v in (("bootstrap_host", host), ("bootstrap_port", port))]
    columns.append(per_prompt(room, n, "bootstrap_room"))
    out = []
    for h, p, r in zip(*columns):
        if p is not None and not 0 < p < 65536:
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
    # served whole by the rank, with no bootstrap fields, even on a PD server (the health generation)
    local: bool = False
    # the prompt's images, whose tokens it holds (``multimodal.inputs``)
    images: ImageInputs | None = None


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat prompt: its text (the output parsers read how it ends) and its token ids."""

    text: str
    ids: list[int]
