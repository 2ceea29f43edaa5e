"""uvicorn's HTTP/1.1 protocol (h11) with the server's edge rules:

- a request uvicorn cannot parse (a bad ``Content-Length``, a broken request line) gets the server's JSON error body
  (uvicorn itself answers those in plain text, before the app sees them);
- a request framed twice (``Content-Length`` and ``Transfer-Encoding``, RFC 9112 section 6.1) is a 400 and the
  connection is closed, so bytes smuggled in its body are never read as a request;
- a request's headers must arrive within ``--http-header-timeout-s`` and its body within ``--http-body-timeout-s``
  (past either a 408 and the connection is closed), and idle keep-alive connections are closed by uvicorn after
  ``--http-keep-alive-timeout-s``;
- at most ``--max-connections`` are open (``connections.py``).

Every bound is a timer on the event loop: nothing here blocks it.
"""

from __future__ import annotations

import asyncio
import http
import json
from typing import Any

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

from sglang_lite.server.connections import ConnectionTable
from sglang_lite.server.responses import error_body
from sglang_lite.server_args import ServerArgs

LINGER_S = 5.0  # the longest a connection answered with an error and half-closed stays open (see reply_and_close)
READ_TIMEOUTS = {"headers": "http_header_timeout_s", "body": "http_body_timeout_s"}
FRAMED_TWICE = (
    "the request has both Content-Length and Transfer-Encoding (RFC 9112 section 6.1: a request framed two ways "
    "is refused and its connection closed)"
)


def error_bytes(status: int, message: str, headers: tuple[str, ...] = ()) -> bytes:
    """A whole HTTP/1.1 answer with the JSON error body that closes its connection, written past h11 (its state
    no longer matters once the connection closes)."""
    body = json.dumps(error_body(status, message)).encode()
    head = [
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *headers,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class SingleFramingConnection(h11.Connection):
    """h11 frames a request with both headers by Transfer-Encoding; this refuses it instead."""

    refusal: str | None = None

    def next_event(self) -> Any:
        event = super().next_event()
        if isinstance(event, h11.Request) and _framed_twice(event.headers):
            self.refusal = FRAMED_TWICE
            raise h11.RemoteProtocolError(FRAMED_TWICE)
        return event


def _framed_twice(headers: Any) -> bool:
    names = {name for name, _ in headers}  # h11 lowercases header names
    return b"content-length" in names and b"transfer-encoding" in names


class JsonErrorH11Protocol(H11Protocol):
    """uvicorn's protocol whose own refusals (a request it cannot parse) carry the JSON error body."""

    def send_400_response(self, msg: str) -> None:
        refusal = getattr(self.conn, "refusal", None)
        message = refusal or f"the HTTP request could not be parsed: {msg}"
        self.reply_and_close(400, message)

    lingering = False  # answered and half-closed: what the client still sends is read and dropped

    def reply_and_close(
        self, status: int, message: str, headers: tuple[str, ...] = (), linger: bool = True
    ) -> None:
        """Answers and closes. ``linger``: a staged close (RFC 9112 section 9.6), since closing a socket with the
        client's bytes unread makes the kernel reset the connection, and a reset can discard the answer before the
        client reads it. The answer and a FIN go out at once; the socket closes when the client closes its side
        or LINGER_S after the answer, its late bytes dropped meanwhile."""
        if self.transport.is_closing() or self.lingering:
            return
        self.transport.write(error_bytes(status, message, headers))
        if not (linger and self.transport.can_write_eof()):
            self.transport.close()
            return
        self.lingering = True
        self.transport.write_eof()
        self.transport.resume_reading()  # uvicorn's flow control may have paused it
        self.loop.call_later(LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if not self.lingering:
            super().data_received(data)

    def shutdown(self) -> None:
        """The server stops: a lingering connection just closes (h11 may be in its error state)."""
        if self.lingering:
            self.transport.close()
        else:
            super().shutdown()


class EdgeH11Protocol(JsonErrorH11Protocol):
    """One connection under the edge's timeouts and cap. One read timer at a time: the header timer from the
    connection's opening (or a request's first byte after an idle keep-alive wait) until the request's headers are
    in, then the body timer until its body is in. ``edge_protocol`` sets the class attributes."""

    args: ServerArgs
    table: ConnectionTable

    def __init__(self, config: Any, *rest: Any, **options: Any) -> None:
        super().__init__(config, *rest, **options)
        size = config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        self.conn = SingleFramingConnection(h11.SERVER, size)
        self.read_timer: asyncio.TimerHandle | None = None
        self.reading: str | None = None  # "headers" or "body" while its timer runs
        self.waiting = True  # for a request (closable to make room), not serving one

    # ---- uvicorn's hooks ---------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.table.opened(self):
            message = f"the server holds --max-connections ({self.args.max_connections}) connections, all busy"
            self.reply_and_close(503, message, ("retry-after: 1",), linger=False)
            return
        self._start_reading("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_reading()
        self.table.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return
        if self.reading is None and self.conn.their_state is h11.IDLE:
            self._start_reading("headers")  # the first byte after a keep-alive wait
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()

    def close_idle(self) -> None:
        """Closed to make room under --max-connections: a request begun gets a 503, an idle or lingering socket
        just closes. Neither lingers: the table no longer counts it."""
        if self.conn.trailing_data[0] and not self.lingering:
            message = (
                f"the server holds --max-connections ({self.args.max_connections}) connections"
            )
            self.reply_and_close(503, message, ("retry-after: 1",), linger=False)
        else:
            self.transport.close()

    def reply_and_close(
        self, status: int, message: str, headers: tuple[str, ...] = (), linger: bool = True
    ) -> None:
        was_lingering = self.lingering
        super().reply_and_close(status, message, headers, linger)
        if self.lingering and not was_lingering:
            self._stop_reading()
            self.waiting = True
            self.table.linger(self)

    # ---- the read timers ---------------------------------------------------------------------------------------
    def _follow_request(self) -> None:
        """Moves the timers and the table along with h11's view of the client's request."""
        if self.lingering:
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self.reading != "body":
                self._start_reading("body")
        elif state is h11.IDLE:
            if self.reading == "body":  # answered before its body, which then came in full
                self._stop_reading()
            if self.reading is None and self.conn.trailing_data[0]:
                self._start_reading("headers")  # a pipelined request begun
        else:
            self._stop_reading()
        waiting = state is h11.IDLE
        if waiting != self.waiting:
            self.waiting = waiting
            (self.table.wait if waiting else self.table.serve)(self)

    def _start_reading(self, part: str) -> None:
        self._stop_reading()
        self.reading = part
        seconds = getattr(self.args, READ_TIMEOUTS[part])
        self.read_timer = self.loop.call_later(seconds, self._read_timed_out)

    def _stop_reading(self) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
        self.read_timer = None
        self.reading = None

    def _read_timed_out(self) -> None:
        part = self.reading
        self.read_timer = None
        self.reading = None
        if self.transport.is_closing() or self.lingering:
            return
        if part == "headers" and not self.conn.trailing_data[0]:
            self.transport.close()  # it sent nothing: nothing to answer
            return
        if part == "body" and self.cycle is not None:
            if self.cycle.response_started:
                self.transport.close()  # answered before its body came
                return
            self.cycle.disconnected = True  # the app reads a disconnect and sends nothing
        name = READ_TIMEOUTS[part]
        seconds = getattr(self.args, name)
        flag = "--" + name.replace("_", "-")
        self.reply_and_close(
            408, f"the request's {part} did not arrive within {seconds:g} s ({flag})"
        )


def edge_protocol(args: ServerArgs) -> type[EdgeH11Protocol]:
    """The protocol class uvicorn instantiates per connection, bound to the server's arguments and one table."""
    table = ConnectionTable(args.max_connections)
    return type("EdgeH11Protocol", (EdgeH11Protocol,), {"args": args, "table": table})
