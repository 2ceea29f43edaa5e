"""A battery of hostile and edge-case requests (``hostile_cases.py``) and how to run it against a server or a
router: each case must end within ``CASE_TIMEOUT_S`` as a 4xx or as a 200 whose body is right, and afterwards the
server must hold nothing, its ranks must be the same processes, and every rid a case used must be free again.

Used by ``benchmarks/bench_soak.py`` (interleaved with valid traffic) and by ``tests/server/test_hostile_battery.py``
(all at once against a ``--dp-size 2`` server with the Qwen3.5 parsers). A case is data: a path and a body (a JSON
value, sent as Python's json writes it, NaN and Infinity included, or bytes sent as they are), what is acceptable
(``expect``), and for the actions a plain request cannot express (disconnects, slow or truncated bodies, aborts,
rid clashes) an ``action``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.tools.hostile_sockets import EXCHANGES

CASE_TIMEOUT_S = 30.0
REFUSED = "4xx"  # a 4xx with the JSON error body
ANSWERED = "ok"  # a 200 whose body ``check`` accepts
EITHER = "any"  # a refusal or a right answer


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Any = None
    expect: str = REFUSED
    stream: bool = False
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    # for a 200: the parsed body (a JSON value, or a stream's list of JSON events) -> None if right, else why
    check: Callable[[Any], str | None] | None = None
    # send | disconnect | abort | rid_clash, or an exchange over a raw socket (hostile_sockets.EXCHANGES)
    action: str = "send"
    rids: tuple[str, ...] = ()  # rids the case uses: free again afterwards


@dataclass
class Outcome:
    case: Case
    status: int | None
    ok: bool
    why: str = ""
    seconds: float = 0.0
    message: str = ""  # a refusal's error message

    def __str__(self) -> str:
        verdict = f"ok {self.message[:100]}" if self.ok else f"FAILED: {self.why}"
        return f"{self.case.name}: {self.status} in {self.seconds:.1f} s, {verdict}"


def encode(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


async def run_case(client: httpx.AsyncClient, case: Case, headers: dict[str, str]) -> Outcome:
    """Runs one case against ``client``'s base URL within ``CASE_TIMEOUT_S``."""
    start = time.monotonic()
    try:
        action = _ACTIONS[case.action](client, case, headers)
        answer = await asyncio.wait_for(action, CASE_TIMEOUT_S)
    except asyncio.TimeoutError:
        answer = (None, f"no answer within {CASE_TIMEOUT_S:g} s", "")
    except Exception as error:  # a transport error the case did not ask for
        answer = (None, f"{type(error).__name__}: {error}", "")
    status, why = answer[:2]
    return Outcome(case, status, not why, why, time.monotonic() - start, answer[2])


async def run_battery(
    base_url: str,
    cases: list[Case],
    concurrency: int = 8,
    headers: dict[str, str] | None = None,
) -> list[Outcome]:
    """Every case, ``concurrency`` at a time; outcomes in the cases' order."""
    headers = headers or {}
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2 + 4)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=CASE_TIMEOUT_S, limits=limits
    ) as client:

        async def one(case: Case) -> Outcome:
            async with gate:
                return await run_case(client, case, headers)

        return list(await asyncio.gather(*(one(case) for case in cases)))


# ---- judging an answer ---------------------------------------------------------------------------------------------
def _answer(case: Case, status: int, body: Any) -> tuple[int, str, str]:
    """(status, why it is wrong or "", the refusal's message)."""
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message", "") if isinstance(error, dict) else ""
    return status, judge(case, status, body), str(message)


def judge(case: Case, status: int, body: Any) -> str:
    """Why an answer is wrong for ``case`` ("" when right)."""
    if 400 <= status < 500:
        if case.expect == ANSWERED:
            return f"refused a request that should be answered: {str(body)[:300]}"
        return _error_body_problem(body)
    if status != 200:
        return f"status {status}: {str(body)[:300]}"
    if case.expect == REFUSED:
        return f"answered a request that should be refused: {str(body)[:300]}"
    problem = case.check(body) if case.check is not None else None
    return problem or ""


def _error_body_problem(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return f"a refusal without the JSON error body: {str(body)[:300]}"
    return ""


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw[:300].decode(errors="replace")


def sse_events(lines: list[str]) -> list[Any]:
    """A stream's events: JSON objects, "[DONE]", or an error object as sent."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else _parse(data.encode()))
    return events


# ---- actions -------------------------------------------------------------------------------------------------------
async def _send(
    client: httpx.AsyncClient, case: Case, headers: dict[str, str]
) -> tuple[int, str, str]:
    merged = {"content-type": "application/json", **headers, **case.headers}
    content = None if case.body is None else encode(case.body)
    if not case.stream:
        response = await client.request(case.method, case.path, content=content, headers=merged)
        return _answer(case, response.status_code, _parse(response.content))
    async with client.stream(case.method, case.path, content=content, headers=merged) as response:
        if response.status_code != 200:
            raw = await response.aread()
            return _answer(case, response.status_code, _parse(raw))
        lines = [line async for line in response.aiter_lines()]
    events = sse_events(lines)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if errors:
        return 200, f"the stream sent an error event: {str(errors[0])[:300]}", ""
    return _answer(case, 200, events)


async def _disconnect(
    client: httpx.AsyncClient, case: Case, headers: dict[str, str]
) -> tuple[int, str, str]:
    """Hangs up after the first streamed event (or, not streaming, after half a second)."""
    merged = {"content-type": "application/json", **headers}
    if not case.stream:
        try:
            await asyncio.wait_for(
                client.post(case.path, content=encode(case.body), headers=merged), 0.5
            )
        except asyncio.TimeoutError:
            pass
        return 0, "", ""
    async with client.stream(
        "POST", case.path, content=encode(case.body), headers=merged
    ) as response:
        async for _ in response.aiter_lines():
            break
        return response.status_code, "" if response.status_code == 200 else "refused", ""


async def _abort(
    client: httpx.AsyncClient, case: Case, headers: dict[str, str]
) -> tuple[int, str, str]:
    """Streams the request, aborts its rid after the first event: the stream must end, finished or aborted."""
    merged = {"content-type": "application/json", **headers}
    rid = case.body["rid"]
    lines: list[str] = []
    async with client.stream(
        "POST", case.path, content=encode(case.body), headers=merged
    ) as response:
        if response.status_code != 200:
            return response.status_code, f"refused: {(await response.aread())[:200]!r}", ""
        async for line in response.aiter_lines():
            lines.append(line)
            if len(lines) == 1:
                await client.post("/abort_request", json={"rid": rid}, headers=headers)
    events = [e for e in sse_events(lines) if isinstance(e, dict)]
    if not events or "error" in events[-1]:
        return 200, f"the aborted stream ended badly: {lines[-3:]}", ""
    reason = (events[-1].get("meta_info") or {}).get("finish_reason") or {}
    return (
        200,
        "" if reason.get("type") in ("abort", "length", "stop") else f"ended with {reason}",
        "",
    )


async def _rid_clash(
    client: httpx.AsyncClient, case: Case, headers: dict[str, str]
) -> tuple[int, str, str]:
    """The same rid twice at once: the first (a long stream) is served, the second refused while the first runs;
    then the first is aborted."""
    merged = {"content-type": "application/json", **headers}
    async with client.stream("POST", case.path, content=encode(case.body), headers=merged) as first:
        if first.status_code != 200:
            raw = (await first.aread())[:300].decode(errors="replace")
            return first.status_code, f"the first request was refused: {raw}", ""
        lines = first.aiter_lines()
        await anext(lines)  # it runs
        second = await client.post(
            case.path, content=encode({**case.body, "stream": False}), headers=merged
        )
        await client.post("/abort_request", json={"rid": case.body["rid"]}, headers=headers)
        async for _ in lines:
            pass
    if second.status_code != 400 or "in use" not in second.text:
        return second.status_code, f"the clashing rid was not refused: {second.text[:200]}", ""
    return 200, "", ""


async def _over_socket(
    client: httpx.AsyncClient, case: Case, headers: dict[str, str]
) -> tuple[int, str, str]:
    """The case's exchange over a raw socket (``hostile_sockets.py``); an answer is judged like any other."""
    exchange = EXCHANGES[case.action]
    body = b"" if case.body is None else encode(case.body)
    status, answer, why = await exchange(client.base_url, case.method, case.path, body, headers)
    if why or not status:
        return status, why, ""
    return _answer(case, status, _parse(answer))


_ACTIONS = {
    "send": _send,
    "disconnect": _disconnect,
    "abort": _abort,
    "rid_clash": _rid_clash,
    **dict.fromkeys(EXCHANGES, _over_socket),
}


# ---- afterwards ----------------------------------------------------------------------------------------------------
async def wait_idle(client: httpx.AsyncClient, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Polls ``/v1/loads`` until every rank holds nothing; raises past ``timeout_s`` with the last loads."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = (await client.get("/v1/loads")).json()["loads"]
        if all(_idle_load(load) for load in loads):
            return loads
        if time.monotonic() > deadline:
            raise AssertionError(f"ranks still busy after {timeout_s:g} s: {loads}")
        await asyncio.sleep(0.2)


def _idle_load(load: dict[str, Any]) -> bool:
    return load["num_running_reqs"] == load["num_waiting_reqs"] == load["num_used_tokens"] == 0


async def rids_reusable(
    client: httpx.AsyncClient, rids: list[str], headers: dict[str, str]
) -> list[str]:
    """The rids that a small request can no longer use (empty when all are free again)."""
    taken = []
    for rid in rids:
        body = {"text": "hi", "rid": rid, "sampling_params": {"max_new_tokens": 1}}
        response = await client.post("/generate", json=body, headers=headers)
        if response.status_code != 200:
            taken.append(f"{rid!r}: {response.status_code} {response.text[:120]}")
    return taken


def used_rids(cases: list[Case]) -> list[str]:
    return sorted({rid for case in cases for rid in case.rids})
