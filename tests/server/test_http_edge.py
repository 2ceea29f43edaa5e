"""The HTTP edge against real servers: connections that hold the server (silent, slowloris headers, a stalled body,
idle keep-alive) are answered 408 or closed within their timeouts, a request framed by both Content-Length and
Transfer-Encoding is refused and its connection closed before the request smuggled in its body is read, and
--max-connections closes the longest-idle connections first so a flood of idle sockets locks no valid client out."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from sglang_lite.server.connections import ConnectionTable
from tests.server.conftest import ServerProcess, start_server

TIMEOUT_S = 1.0  # the fast server's header, body and keep-alive timeouts
BOUND_S = 30.0  # no wait in these tests lasts longer
CAP = 8


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = [
        "--http-header-timeout-s",
        str(TIMEOUT_S),
        "--http-body-timeout-s",
        str(TIMEOUT_S),
        "--http-keep-alive-timeout-s",
        str(TIMEOUT_S),
    ]
    yield from start_server(tmp_path_factory, "edge_fast", flags)


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Timeouts far longer than any test here: only the cap closes connections."""
    flags = ["--max-connections", str(CAP), "--http-header-timeout-s", "120"]
    yield from start_server(
        tmp_path_factory, "edge_capped", [*flags, "--http-body-timeout-s", "120"]
    )


def connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=BOUND_S)


def read_until_closed(conn: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start = time.monotonic()
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def parse(answer: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def is_closed(conn: socket.socket) -> bool:
    """True once the server has closed ``conn`` (waits up to BOUND_S for that); False if it stays open 0.5 s."""
    conn.settimeout(0.5)
    try:
        return conn.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def post(server: ServerProcess, head: bytes) -> tuple[int, dict[str, str], dict]:
    with connect(server) as conn:
        conn.sendall(head)
        return parse(read_until_closed(conn)[0])


GENERATE = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}}).encode()


def generate(server: ServerProcess) -> httpx.Response:
    return httpx.post(f"{server.url}/generate", json=json.loads(GENERATE), timeout=BOUND_S)


def generate_head(length: int, extra: str = "") -> bytes:
    return (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


# ---- timeouts --------------------------------------------------------------------------------------------------
def test_a_silent_connection_is_closed_after_the_header_timeout(fast: ServerProcess) -> None:
    with connect(fast) as conn:
        data, seconds = read_until_closed(conn)
    assert data == b"" and TIMEOUT_S * 0.9 <= seconds < BOUND_S


def test_slowloris_headers_get_a_408_within_the_header_timeout(fast: ServerProcess) -> None:
    with connect(fast) as conn:
        conn.sendall(b"POST /generate HTTP/1.1\r\n")
        answered = threading.Event()

        def drip() -> None:  # a header byte every 0.2 s, for far longer than the timeout
            for byte in b"Host: x\r\nX-Pad: " + b"p" * 500:
                if answered.wait(0.2):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

        dripper = threading.Thread(target=drip)
        dripper.start()
        try:
            answer, seconds = read_until_closed(conn)
        finally:
            answered.set()
            dripper.join(BOUND_S)
    status, headers, body = parse(answer)
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["type"] == "RequestTimeout"
    assert "headers did not arrive within 1 s (--http-header-timeout-s)" in body["error"]["message"]
    assert seconds < BOUND_S


def test_an_answered_connection_reads_late_bytes_instead_of_resetting(fast: ServerProcess) -> None:
    """The 408 and a FIN come first; bytes the client sends after them are read and dropped (a lingering close)
    rather than answered with a reset, which can discard an answer the client has not read yet."""
    with connect(fast) as conn:
        conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # headers that never end
        answer, _ = read_until_closed(conn)
        for _ in range(20):  # a closed socket resets at the first; the second send would then fail
            conn.sendall(b"x" * 64)
        assert conn.recv(1) == b""
    assert parse(answer)[0] == 408


def test_a_stalled_body_gets_a_408_and_the_server_serves_on(fast: ServerProcess) -> None:
    with connect(fast) as conn:
        conn.sendall(generate_head(len(GENERATE)) + GENERATE[:10])
        answer, seconds = read_until_closed(conn)
    status, _, body = parse(answer)
    assert status == 408 and seconds < BOUND_S
    assert "body did not arrive within 1 s (--http-body-timeout-s)" in body["error"]["message"]
    response = generate(fast)
    assert response.status_code == 200 and response.json()["text"] is not None


def test_an_idle_keep_alive_connection_is_closed_quietly(fast: ServerProcess) -> None:
    with connect(fast) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer, _ = read_until_closed(conn)  # the answer, then the keep-alive timeout's close
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1") == 1


def test_a_slow_body_within_the_timeout_is_served(fast: ServerProcess) -> None:
    with connect(fast) as conn:
        conn.sendall(generate_head(len(GENERATE), "Connection: close\r\n") + GENERATE[:10])
        time.sleep(TIMEOUT_S / 4)
        conn.sendall(GENERATE[10:])
        status, _, body = parse(read_until_closed(conn)[0])
    assert status == 200 and "text" in body


# ---- framing ---------------------------------------------------------------------------------------------------
def test_content_length_with_transfer_encoding_is_refused_and_the_smuggled_abort_never_runs(
    fast: ServerProcess,
) -> None:
    stream_body = {
        "text": "hi",
        "stream": True,
        "sampling_params": {"max_new_tokens": 200, "ignore_eos": True},
    }
    smuggled = b'POST /abort_request HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n\r\n{"abort_all": true}\n'
    payload = b"0\r\n\r\n" + smuggled
    attack = generate_head(len(payload), "Transfer-Encoding: chunked\r\n") + payload
    with httpx.stream("POST", f"{fast.url}/generate", json=stream_body, timeout=BOUND_S) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        with connect(fast) as conn:
            conn.sendall(attack)
            answer, _ = read_until_closed(conn)
        rest = [line for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    status, headers, body = parse(answer)
    assert status == 400 and headers["connection"] == "close"
    assert "both Content-Length and Transfer-Encoding" in body["error"]["message"]
    assert answer.count(b"HTTP/1.1") == 1, "the smuggled request was answered"
    last = json.loads((rest or [first])[-1][len("data: ") :])
    assert last["meta_info"]["finish_reason"]["type"] == "length", "the smuggled abort_all ran"


def test_a_chunked_body_alone_is_served(fast: ServerProcess) -> None:
    chunked = f"{len(GENERATE):x}\r\n".encode() + GENERATE + b"\r\n0\r\n\r\n"
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    status, _, body = post(fast, head + chunked)
    assert status == 200 and "text" in body


# ---- the connection cap ----------------------------------------------------------------------------------------
def test_a_flood_of_idle_connections_closes_the_oldest_and_a_valid_request_is_served(
    capped: ServerProcess,
) -> None:
    idle = [connect(capped) for _ in range(3 * CAP)]
    try:
        response = generate(capped)
        assert response.status_code == 200
        assert is_closed(idle[0]), "the longest-idle connection is closed to make room"
        assert not is_closed(idle[-1]), "the newest idle connection stays open"
        assert sum(not is_closed(conn) for conn in idle) <= CAP - 1
    finally:
        for conn in idle:
            conn.close()


def test_when_every_connection_is_busy_a_new_one_gets_503(capped: ServerProcess) -> None:
    stalled = [connect(capped) for _ in range(CAP)]
    try:
        for conn in stalled:  # headers in, the body never: each is being served
            conn.sendall(generate_head(len(GENERATE), "Expect: 100-continue\r\n"))
        for conn in stalled:  # the app asked for the body: the server holds the request
            assert conn.recv(64).startswith(b"HTTP/1.1 100 ")
        with connect(capped) as conn:
            deadline = time.monotonic() + BOUND_S
            answer, _ = read_until_closed(conn)
            assert time.monotonic() < deadline
        status, headers, body = parse(answer)
        assert status == 503 and headers["retry-after"] == "1"
        assert "--max-connections (8)" in body["error"]["message"]
    finally:
        for conn in stalled:
            conn.close()
    deadline = time.monotonic() + BOUND_S
    while httpx.get(f"{capped.url}/health", timeout=BOUND_S).status_code != 200:
        assert time.monotonic() < deadline, "the server did not serve again"
        time.sleep(0.1)


# ---- the table alone -------------------------------------------------------------------------------------------
class Idle:
    def __init__(self) -> None:
        self.closed = False

    def close_idle(self) -> None:
        self.closed = True


def test_the_table_closes_the_longest_waiting_and_never_one_being_served() -> None:
    table = ConnectionTable(limit=3)
    a, b, c, d, e = (Idle() for _ in range(5))
    for conn in (a, b, c):
        assert table.opened(conn)
    table.serve(a)  # a request arrived on a
    table.wait(a)  # ... and was answered: a now waits longest-but-newest
    assert table.opened(d) and b.closed and not a.closed
    table.serve(c)
    table.serve(d)
    table.serve(a)
    assert not table.opened(e), "every other connection is being served"
    assert len(table) == 3 and not any(x.closed for x in (a, c, d, e))
    table.closed(a)
    assert table.opened(e) and len(table) == 3
    table.linger(c)  # c was answered with an error and closes: it goes first, before any idle one
    table.wait(d)
    f = Idle()
    assert table.opened(f) and c.closed and not d.closed
