"""uvicorn's HTTP/1.1 protocol (h11) with the server's JSON error body for requests it cannot parse (a bad
``Content-Length``, a broken request line): uvicorn itself answers those in plain text, before the app sees them."""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from sglang_lite.server.responses import error_body


class JsonErrorH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_body(400, f"the HTTP request could not be parsed: {msg}")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()
