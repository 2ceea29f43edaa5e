"""A PD fault run's pieces: clients sending greedy requests through a PD router all the while, the faults (a DP rank
killed and restarted, a server stopped for a while), and what the outcomes say: answers that differ from the plain
engine's (corrupted), failures that are not clean HTTP errors, requests that hung.

``benchmarks/bench_pd_faults.py`` runs the whole fault run and ``tests/router/test_pd_faults.py`` one fault at a
time. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

CLEAN_STATUSES = (
    502,
    503,
)  # what a fault may cost a request: its PD pair failed it, or its rank died


@dataclass
class Outcome:
    prompt: int  # index into the load's prompts
    status: int  # -1: no HTTP answer (the connection failed or the client's timeout passed)
    body: dict
    started: float
    ended: float

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass
class Load:
    """Clients sending ``prompts`` (token ids) round and round to ``url``'s ``/generate`` until ``stop`` is set."""

    url: str
    prompts: list[list[int]]
    params: dict[str, Any]
    timeout_s: float = 120.0
    outcomes: list[Outcome] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, s: aiohttp.ClientSession, i: int, step: int) -> None:
        n = i
        while not self.stop.is_set():
            await self.once(s, n % len(self.prompts))
            n += step

    async def once(self, s: aiohttp.ClientSession, prompt: int) -> Outcome:
        started = time.monotonic()
        body = {"input_ids": self.prompts[prompt], "sampling_params": self.params}
        try:
            async with s.post(
                self.url + "/generate",
                json=body,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as response:
                status, reply = response.status, await response.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
            status, reply = -1, {"error": repr(error)}
        outcome = Outcome(prompt, status, reply, started, time.monotonic())
        self.outcomes.append(outcome)
        return outcome

    async def completed(self, n: int) -> bool:
        return sum(o.status == 200 for o in self.outcomes) >= n

    async def every_prompt(self, s: aiohttp.ClientSession) -> list[Outcome]:
        """Each prompt once, all at once."""
        return list(await asyncio.gather(*(self.once(s, i) for i in range(len(self.prompts)))))


async def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    """Polls an async predicate until true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(interval)
    return await predicate()


async def scheduler_pids(s: aiohttp.ClientSession, url: str) -> list[int]:
    async with s.get(url + "/server_info") as response:
        return (await response.json())["scheduler_pids"]


async def healthy(s: aiohttp.ClientSession, *urls: str) -> bool:
    for url in urls:
        try:
            async with s.get(url + "/health") as response:
                if response.status != 200:
                    return False
        except aiohttp.ClientError:
            return False
    return True


async def kill_rank(s: aiohttp.ClientSession, url: str, rank: int, restart_s: float) -> float:
    """kill -9 of a server's DP rank; returns once the server has restarted it (a new pid) and is healthy, with
    the time of the kill."""
    victim = (await scheduler_pids(s, url))[rank]
    os.kill(victim, signal.SIGKILL)
    struck = time.monotonic()

    async def restarted() -> bool:
        pids = await scheduler_pids(s, url)
        return pids[rank] not in (victim, None, 0) and await healthy(s, url)

    if not await wait_for(restarted, timeout=restart_s, interval=0.5):
        raise RuntimeError(f"{url}: DP rank {rank} was not restarted within {restart_s:g} s")
    return struck


async def stop_for(pid: int, seconds: float, group: bool = False) -> float:
    """SIGSTOP of ``pid`` (its whole process group: a server with its ranks) for ``seconds``, then SIGCONT; the
    time it was stopped."""
    send = os.killpg if group else os.kill
    send(pid, signal.SIGSTOP)
    struck = time.monotonic()
    try:
        await asyncio.sleep(seconds)
    finally:
        send(pid, signal.SIGCONT)
    return struck


def verdicts(outcomes: list[Outcome], references: list[list[int]], hung_s: float) -> dict[str, Any]:
    """What the outcomes say: how many completed, how many differ from the references (corrupted), failures by
    status, failures that are not clean (a status outside CLEAN_STATUSES, or no JSON error), and requests that
    took longer than ``hung_s``."""
    ok = [o for o in outcomes if o.status == 200]
    corrupted = [o for o in ok if o.body.get("output_ids") != references[o.prompt]]
    failures = [o for o in outcomes if o.status != 200]
    unclean = [
        o
        for o in failures
        if o.status not in CLEAN_STATUSES
        or not (isinstance(o.body.get("error"), dict) and o.body["error"].get("message"))
    ]
    statuses: dict[int, int] = {}
    for o in failures:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    return {
        "requests": len(outcomes),
        "completed": len(ok),
        "corrupted": corrupted,
        "failed": statuses,
        "unclean": unclean,
        "hung": [o for o in outcomes if o.seconds > hung_s],
        "slowest_s": max((o.seconds for o in outcomes), default=0.0),
    }
