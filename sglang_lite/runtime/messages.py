"""The messages between a front end (the offline Engine, the HTTP server) and its scheduler processes.

One frozen dataclass per message. ``encode`` and ``decode`` are the only (de)serialisers: a msgpack list
``[kind, *fields]``, where a message that holds a structured value (sampling parameters, outputs, the scheduler
config) says how it is written. The front end sends commands to one rank's inbox; every rank pushes its replies to
the front end's one inbox, and the replies of one rank arrive in the order it sent them, so the answer to a query
reflects every command sent before it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from sglang_lite.multimodal.inputs import ImageInputs
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.protocol.outputs import ReqOutput
from sglang_lite.sampling.logprobs import LogprobParams
from sglang_lite.sampling.params import SamplingParams

# Ack statuses, as HTTP status codes: the server answers with the same code.
# unavailable: the waiting queue or the command queue is full, or the rank died; failed: adding it raised in the rank
QUEUED = 200
REFUSED = 400
FAILED = 500
UNAVAILABLE = 503


class Message:
    """Wire form: the fields in order, each as msgpack writes it; subclasses with structured fields override."""

    kind: ClassVar[str]

    def to_wire(self) -> list[Any]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    @classmethod
    def from_wire(cls, values: list[Any]) -> Message:
        return cls(*values)


# ---- front end -> scheduler process ----------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest(Message):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    # PD disaggregation: the transfer's id (prefill and decode ranks need one)
    bootstrap_room: int | None = None
    logprob: LogprobParams | None = None  # the log-probabilities to report
    # False: the front end reads only the finished output, which is then the one output sent (as SGLang does for a
    # request that does not stream): no per-token message wakes the front end while the rank computes
    stream: bool = True
    # served whole by the rank even on a PD server (the server's own health generation)
    local: bool = False
    images: ImageInputs | None = None  # the prompt's images, preprocessed by the front end

    def to_wire(self) -> list[Any]:
        logprob = dataclasses.asdict(self.logprob) if self.logprob is not None else None
        return [
            self.rid,
            self.input_ids,
            dataclasses.asdict(self.sampling_params),
            self.bootstrap_room,
            logprob,
            self.stream,
            self.local,
            self.images.to_wire() if self.images is not None else None,
        ]

    @classmethod
    def from_wire(cls, values: list[Any]) -> AddRequest:
        rid, input_ids, params, room, logprob, stream, local, images = values
        return cls(
            rid,
            input_ids,
            SamplingParams.from_dict(params),
            room,
            LogprobParams.from_dict(logprob),
            stream,
            local,
            ImageInputs.from_wire(images),
        )


@dataclass(frozen=True)
class AbortRequest(Message):
    rid: str
    # set: the request fails with this message (``status_code``: 500, or 502 / 400 for a PD pair's failure),
    # else a client's abort
    error: str | None = None
    status_code: int = 500
    settled: bool = (
        False  # PD: the other side will write nothing more for it (its reservation is freed now)
    )


@dataclass(frozen=True)
class TransferTarget(Message):
    """PD, to a prefill rank: where the decode rank wants request ``room``'s KV, states and first token."""

    room: int
    target: dict[str, Any]


@dataclass(frozen=True)
class LoadsQuery(Message):
    """Asks for ``Scheduler.get_loads()`` in the named sections, taken between two steps."""

    query_id: int
    sections: tuple[str, ...]

    @classmethod
    def from_wire(cls, values: list[Any]) -> LoadsQuery:
        return cls(values[0], tuple(values[1]))


@dataclass(frozen=True)
class CheckQuery(Message):
    """Asks whether the pools hold exactly what the requests hold."""

    query_id: int


@dataclass(frozen=True)
class FlushCache(Message):
    """Drops every cached prefix no request uses (answered with ``FlushReply``)."""

    query_id: int


@dataclass(frozen=True)
class Stop(Message):
    pass


# ---- scheduler process -> front end ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready(Message):
    """The rank has built its model and pools and takes commands."""

    rank: int
    pid: int
    config: SchedulerConfig
    alt_stream_plan: dict[str, Any] | None

    def to_wire(self) -> list[Any]:
        return [self.rank, self.pid, dataclasses.asdict(self.config), self.alt_stream_plan]

    @classmethod
    def from_wire(cls, values: list[Any]) -> Ready:
        rank, pid, config, plan = values
        return cls(rank, pid, SchedulerConfig.from_dict(config), plan)


@dataclass(frozen=True)
class Ack(Message):
    """The answer to every ``AddRequest``: queued, refused (bad input), failed (the rank raised) or queue full."""

    rank: int
    rid: str
    status: int
    message: str = ""

    @property
    def queued(self) -> bool:
        return self.status == QUEUED


@dataclass(frozen=True)
class StepOutputs(Message):
    """What one scheduler step produced, one ``ReqOutput`` per request that has something new."""

    rank: int
    outputs: list[ReqOutput]

    def to_wire(self) -> list[Any]:
        rows = [[o.rid, o.new_token_ids, o.new_text, o.finished, o.meta_info] for o in self.outputs]
        return [self.rank, rows]

    @classmethod
    def from_wire(cls, values: list[Any]) -> StepOutputs:
        rank, rows = values
        return cls(rank, [ReqOutput(*row) for row in rows])


@dataclass(frozen=True)
class LoadsReply(Message):
    rank: int
    query_id: int
    loads: dict[str, Any]


@dataclass(frozen=True)
class CheckReply(Message):
    rank: int
    query_id: int
    error: str | None  # None: the invariants hold


@dataclass(frozen=True)
class FlushReply(Message):
    rank: int
    query_id: int
    freed_tokens: int  # KV slots the prefix cache gave back


@dataclass(frozen=True)
class Reserved(Message):
    """PD, from a decode rank: memory for request ``rid`` is reserved; ``target`` (its addresses) goes to the
    prefill server's bootstrap server under ``room``."""

    rank: int
    rid: str
    room: int
    target: dict[str, Any]


@dataclass(frozen=True)
class Fatal(Message):
    """The rank failed (at start-up, or its process broke: see ``scheduler.faults``) and exits."""

    rank: int
    message: str


Command = AddRequest | AbortRequest | TransferTarget | LoadsQuery | CheckQuery | FlushCache | Stop
Reply = Ready | Ack | StepOutputs | LoadsReply | CheckReply | FlushReply | Reserved | Fatal
QueryReply = LoadsReply | CheckReply | FlushReply

_KINDS: dict[str, type[Message]] = {}
for _cls in (
    AddRequest,
    AbortRequest,
    TransferTarget,
    LoadsQuery,
    CheckQuery,
    FlushCache,
    Stop,
    Ready,
    Ack,
    StepOutputs,
    LoadsReply,
    CheckReply,
    FlushReply,
    Reserved,
    Fatal,
):
    _cls.kind = _cls.__name__
    _KINDS[_cls.kind] = _cls


def encode(message: Message) -> bytes:
    return msgpack.packb([message.kind, *message.to_wire()], use_bin_type=True)


def decode(frame: bytes) -> Message:
    """The message in ``frame``; ValueError for an unknown kind or fields that do not fit it."""
    kind, *values = msgpack.unpackb(
        frame, raw=False, strict_map_key=False
    )  # the alt-stream plan has int keys
    cls = _KINDS.get(kind)
    if cls is None:
        raise ValueError(f"unknown message kind {kind!r}")
    try:
        return cls.from_wire(values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"malformed {kind} message: {error}") from error
