"""The hostile battery's exchanges over a raw socket: bytes no HTTP client would send, slow, stalled, truncated and
idle connections, a request smuggled in another's body, a flood of idle connections. Each returns an ``Exchange``:
the server's answer (status 0 when it closed the connection without one) or what went wrong; ``hostile.py`` judges
the answer."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

# (status, body, what went wrong or ""); status 0: the server closed the connection without an answer
Exchange = tuple[int, bytes, str]
DRIP_INTERVAL_S = 0.5  # slowloris: one byte of the headers this often
FLOOD_CONNECTIONS = 300
FLOOD_ANSWER_S = 5.0  # a valid request beside the flood is answered within this
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"


async def send_raw(url: httpx.URL, method: str, path: str, body: bytes, headers: dict) -> Exchange:
    """``body`` is the whole request, sent as it is on a fresh connection: it must be answered."""
    reader, writer = await connect(url)
    try:
        writer.write(body)
        await writer.drain()
        status, answer = await read_response(reader)
    finally:
        writer.close()
    return status, answer, "" if status else f"no HTTP answer: {answer!r}"


async def slow_body(url: httpx.URL, method: str, path: str, body: bytes, headers: dict) -> Exchange:
    """The headers, then the body a few bytes a second for a few seconds, then the rest: it must be answered."""
    reader, writer = await connect(url)
    try:
        writer.write(request_head(url, method, path, len(body), headers))
        for i in range(0, 12, 3):
            writer.write(body[i : i + 3])
            await writer.drain()
            await asyncio.sleep(0.5)
        writer.write(body[12:])
        await writer.drain()
        status, answer = await read_response(reader)
    finally:
        writer.close()
    return status, answer, "" if status else "no HTTP answer"


async def truncated(url: httpx.URL, method: str, path: str, body: bytes, headers: dict) -> Exchange:
    """A body shorter than its Content-Length, then the connection closed: nothing to answer."""
    reader, writer = await connect(url)
    writer.write(request_head(url, method, path, len(body) + 1000, headers) + body)
    await writer.drain()
    writer.close()
    return 0, b"", ""


async def idle(url: httpx.URL, method: str, path: str, body: bytes, headers: dict) -> Exchange:
    """A connection opened and left silent for a while, then closed."""
    reader, writer = await connect(url)
    await asyncio.sleep(2.0)
    writer.close()
    return 0, b"", ""


async def slow_headers(
    url: httpx.URL, method: str, path: str, body: bytes, headers: dict
) -> Exchange:
    """Slowloris: the request's headers one byte every ``DRIP_INTERVAL_S``, never finished in time. The server
    must give up on it (a 408, or a plain close) within its header timeout, well before the headers end."""
    head = request_head(url, method, path, len(body), headers) + b"X-Pad: " + b"p" * 200
    reader, writer = await connect(url)

    async def drip() -> None:
        with contextlib.suppress(ConnectionError):
            for byte in head:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(DRIP_INTERVAL_S)

    dripping = asyncio.ensure_future(drip())
    try:
        status, answer = await read_response(reader)
    finally:
        dripping.cancel()
        writer.close()
    return status, answer, ""


async def stalled_body(
    url: httpx.URL, method: str, path: str, body: bytes, headers: dict
) -> Exchange:
    """The headers and half the body, then nothing, the connection left open: the server must give up on it
    (a 408, or a plain close) within its body timeout."""
    reader, writer = await connect(url)
    try:
        writer.write(request_head(url, method, path, len(body), headers) + body[: len(body) // 2])
        await writer.drain()
        status, answer = await read_response(reader)
    finally:
        writer.close()
    return status, answer, ""


async def smuggled(url: httpx.URL, method: str, path: str, body: bytes, headers: dict) -> Exchange:
    """A request with both Content-Length and Transfer-Encoding whose chunked body ends early and carries
    ``SMUGGLED`` after it: it must be refused, and nothing more answered on the connection."""
    payload = b"0\r\n\r\n" + SMUGGLED
    head = request_head(url, method, path, len(payload), headers, keep_alive=True)
    reader, writer = await connect(url)
    try:
        writer.write(head.replace(b"\r\n\r\n", b"\r\nTransfer-Encoding: chunked\r\n\r\n") + payload)
        await writer.drain()
        status, answer = await read_response(reader)
        after = await reader.read(65536) if status else b""
    finally:
        writer.close()
    if after:
        return status, answer, f"the smuggled request was answered: {after[:120]!r}"
    return status, answer, "" if status else "no HTTP answer"


async def idle_flood(
    url: httpx.URL, method: str, path: str, body: bytes, headers: dict
) -> Exchange:
    """``FLOOD_CONNECTIONS`` idle connections held open, then the case's request on one more: it must be answered
    within ``FLOOD_ANSWER_S``."""
    flood = []
    try:
        for _ in range(FLOOD_CONNECTIONS):
            flood.append((await connect(url))[1])
        start = time.monotonic()
        status, answer, why = await send_raw(
            url, method, path, _whole(url, method, path, body, headers), {}
        )
        seconds = time.monotonic() - start
    finally:
        for writer in flood:
            writer.close()
    if not why and seconds > FLOOD_ANSWER_S:
        why = f"answered after {seconds:.1f} s beside {FLOOD_CONNECTIONS} idle connections"
    return status, answer, why


def _whole(url: httpx.URL, method: str, path: str, body: bytes, headers: dict) -> bytes:
    return request_head(url, method, path, len(body), headers) + body


EXCHANGES = {
    "raw": send_raw,
    "slow_body": slow_body,
    "truncated": truncated,
    "idle": idle,
    "slow_headers": slow_headers,
    "stalled_body": stalled_body,
    "smuggle": smuggled,
    "idle_flood": idle_flood,
}


# ---- the socket ----------------------------------------------------------------------------------------------------
async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 answer with a Content-Length, or (0, what came) for anything else."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as error:
        return 0, getattr(error, "partial", b"")[:200]
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    body = await reader.readexactly(int(fields.get("content-length", "0")))
    return int(lines[0].split(" ", 2)[1]), body


async def connect(url: httpx.URL) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(url.host, url.port)


def request_head(
    url: httpx.URL,
    method: str,
    path: str,
    length: int,
    headers: dict[str, str],
    keep_alive: bool = False,
) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        f"Host: {url.host}",
        "Content-Type: application/json",
        f"Content-Length: {length}",
        *([] if keep_alive else ["Connection: close"]),
        *[f"{k}: {v}" for k, v in headers.items()],
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()
