"""The HTTP side of PD disaggregation: bootstrap fields, the prefill server's bootstrap server, and the relay of a
decode rank's reservation to it.

The router sends one body, with ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``, to a prefill and a
decode server. The decode rank reserves memory and answers ``Reserved``; its server POSTs the destination to
``http://bootstrap_host:bootstrap_port/pd/target``, the prefill server's bootstrap server, which hands it to the
prefill rank running that room (``TransferTarget``), or keeps it until the room's request arrives. The prefill rank
then writes the request's KV, states and first token into the decode rank's memory (``scheduler/disagg.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from sglang_lite.runtime.messages import AbortRequest, Reserved, TransferTarget

if TYPE_CHECKING:
    from sglang_lite.server.tokenizer_manager import GenerateInput, RequestStream, TokenizerManager

logger = logging.getLogger(__name__)
ROOM_LIMIT = 2**63
TARGET_PATH = "/pd/target"
POST_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Bootstrap:
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
    per_prompt = {}
    for name, value in fields.items():
        values = value if isinstance(value, list) else [value] * n
        if len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
        per_prompt[name] = values
    out = []
    for h, p, r in zip(
        per_prompt["bootstrap_host"], per_prompt["bootstrap_port"], per_prompt["bootstrap_room"]
    ):
        if not 0 < p < 65536:
            raise ValueError(f"bootstrap_port must be a TCP port, got {p}")
        if not 0 <= r < ROOM_LIMIT:
            raise ValueError(f"bootstrap_room must be in [0, 2**63), got {r}")
        out.append(Bootstrap(h, p, r))
    if len({b.room for b in out}) != len(out):
        raise ValueError("bootstrap_room: the prompts of one request need distinct rooms")
    return out


class PDFrontEnd:
    """A prefill or decode server's share of PD: rooms in use, destinations waiting for their request (prefill),
    reservations relayed to the prefill side (decode)."""

    def __init__(self, manager: TokenizerManager) -> None:
        self.manager, self.args = manager, manager.args
        self.mode = self.args.disaggregation_mode
        self.rooms: dict[int, RequestStream] = {}
        self.pending: dict[
            int, tuple[dict[str, Any], float]
        ] = {}  # prefill: destinations before their request
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._posts: set[asyncio.Task] = set()

    async def start(self) -> None:
        if self.mode == "prefill":
            app = web.Application()
            app.router.add_post(TARGET_PATH, self._target)
            app.router.add_get("/health", lambda _: web.json_response({"status": "ok"}))
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            await web.TCPSite(
                self._runner, self.args.host, self.args.disaggregation_bootstrap_port
            ).start()
            logger.info(
                "bootstrap server on %s:%d", self.args.host, self.args.disaggregation_bootstrap_port
            )
        elif self.mode == "decode":
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=POST_TIMEOUT_S)
            )

    async def shutdown(self) -> None:
        for task in list(self._posts):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ---- requests ----------------------------------------------------------------------------------------------
    def check(self, request: GenerateInput) -> None:
        """A PD server takes only requests with bootstrap fields, each room once (ValueError names the field)."""
        if self.mode == "null":
            return
        if request.bootstrap is None:
            raise ValueError(
                f"bootstrap_room: a {self.mode} server takes requests with bootstrap_host, "
                "bootstrap_port and bootstrap_room (send them through a PD router)"
            )
        if request.bootstrap.room in self.rooms:
            raise ValueError(
                f"bootstrap_room {request.bootstrap.room} is already in use by an unfinished request"
            )

    def room_of(self, request: GenerateInput) -> int | None:
        return (
            request.bootstrap.room
            if self.mode != "null" and request.bootstrap is not None
            else None
        )

    def on_submitted(self, stream: RequestStream, bootstrap: Bootstrap | None) -> None:
        if self.mode == "null" or bootstrap is None:
            return
        stream.bootstrap = bootstrap
        self.rooms[bootstrap.room] = stream
        if self.mode == "prefill" and bootstrap.room in self.pending:
            target, _ = self.pending.pop(bootstrap.room)
            self.manager.client.send(stream.rank, TransferTarget(bootstrap.room, target))

    def on_released(self, stream: RequestStream) -> None:
        bootstrap = getattr(stream, "bootstrap", None)
        if bootstrap is not None and self.rooms.get(bootstrap.room) is stream:
            del self.rooms[bootstrap.room]

    # ---- prefill: the bootstrap server -------------------------------------------------------------------------
    async def _target(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            room, target = body["room"], body["target"]
            if (
                not isinstance(room, int)
                or not 0 <= room < ROOM_LIMIT
                or not isinstance(target, dict)
            ):
                raise ValueError("room must be an integer in [0, 2**63) and target an object")
        except (ValueError, KeyError, TypeError) as error:
            return web.json_response({"error": f"bad destination: {error}"}, status=400)
        self._expire(time.monotonic())
        if room in self.pending:
            return web.json_response(
                {"error": f"bootstrap_room {room} already has a destination"}, status=409
            )
        stream = self.rooms.get(room)
        if stream is None:
            self.pending[room] = (target, time.monotonic())
        elif getattr(stream, "target_sent", False):
            return web.json_response(
                {"error": f"bootstrap_room {room} already has a destination"}, status=409
            )
        else:
            stream.target_sent = True
            self.manager.client.send(stream.rank, TransferTarget(room, target))
        return web.json_response({"ok": True})

    def _expire(self, now: float) -> None:
        timeout = self.args.disaggregation_transfer_timeout
        for room in [r for r, (_, seen) in self.pending.items() if seen + timeout < now]:
            del self.pending[room]

    # ---- decode: relay each reservation ------------------------------------------------------------------------
    def on_reserved(self, reserved: Reserved) -> None:
        stream = self.manager.streams.get(reserved.rid)
        if stream is None or getattr(stream, "bootstrap", None) is None:
            return  # its client left: the abort is on its way to the rank
        task = asyncio.get_running_loop().create_task(self._relay(stream, reserved))
        self._posts.add(task)
        task.add_done_callback(self._posts.discard)

    async def _relay(self, stream: RequestStream, reserved: Reserved) -> None:
        bootstrap = stream.bootstrap
        url = f"http://{bootstrap.host}:{bootstrap.port}{TARGET_PATH}"
        try:
            async with self._session.post(
                url, json={"room": reserved.room, "target": reserved.target}
            ) as response:
                if response.status == 200:
                    return
                why = f"answered {response.status}: {(await response.text())[:200]}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            why = f"is unreachable ({type(error).__name__}: {error})"
        message = (
            f"the prefill server's bootstrap server at {bootstrap.host}:{bootstrap.port} {why}"
        )
        logger.warning("PD request %s fails: %s", reserved.rid, message)
        if self.manager.live[stream.rank]:
            self.manager.client.send(stream.rank, AbortRequest(reserved.rid, error=message))
