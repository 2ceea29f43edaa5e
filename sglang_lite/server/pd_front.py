"""The HTTP side of PD disaggregation: the part the tokenizer manager talks to (``PDFront``; ``NoPD`` on a plain
server), the prefill server's bootstrap server, and the relay of a decode rank's reservation to it.

The router sends one body, with ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``, to a prefill and a
decode server. The decode rank reserves memory and answers ``Reserved``; its server POSTs the destination to
``http://bootstrap_host:bootstrap_port/pd/target``, the prefill server's bootstrap server, which hands it to the
prefill rank running that room (``TransferTarget``), or keeps it until the room's request arrives. The prefill rank
then writes the request's KV, states and first token into the decode rank's memory (``scheduler/pd_side/``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from sglang_lite.protocol.outputs import PD_FAILURE
from sglang_lite.runtime.messages import Reserved, TransferTarget
from sglang_lite.server.io_struct import ROOM_LIMIT, Bootstrap, GenerateInput, bad_request
from sglang_lite.server.request_streams import RequestStream, StreamRegistry
from sglang_lite.server_args import ServerArgs

logger = logging.getLogger(__name__)
TARGET_PATH = "/pd/target"
POST_TIMEOUT_S = 10.0


class PDFront(Protocol):
    """What the tokenizer manager asks of the server's PD part, whatever the disaggregation mode."""

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def check(self, request: GenerateInput) -> None:
        """Refuses (400, naming the field) a request this server cannot take."""

    def room_of(self, request: GenerateInput) -> int | None:
        """The transfer room the rank is told of, if any."""

    def on_submitted(self, stream: RequestStream, bootstrap: Bootstrap | None) -> None: ...

    def on_released(self, stream: RequestStream) -> None: ...

    def on_reserved(self, reserved: Reserved) -> None:
        """A decode rank reserved memory for a request."""

    def fail_rooms(self, rooms: list[int], error: str, status: int, settled: bool) -> int:
        """The router's word that the prefill leg of these rooms failed: their requests fail (``status``,
        ``error``), those still to come as they arrive; how many were running. ``settled``: the prefill side will
        write nothing more for them."""


class NoPD:
    """A plain server's PD part: bootstrap fields are accepted and ignored, and there are no rooms."""

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def check(self, request: GenerateInput) -> None:
        pass

    def room_of(self, request: GenerateInput) -> int | None:
        return None

    def on_submitted(self, stream: RequestStream, bootstrap: Bootstrap | None) -> None:
        pass

    def on_released(self, stream: RequestStream) -> None:
        pass

    def on_reserved(self, reserved: Reserved) -> None:
        pass

    def fail_rooms(self, rooms: list[int], error: str, status: int, settled: bool) -> int:
        return 0


def create_pd_front(args: ServerArgs, registry: StreamRegistry) -> PDFront:
    """The PD part for ``--disaggregation-mode``: none for a plain server."""
    return NoPD() if args.disaggregation_mode == "null" else PDFrontEnd(args, registry)


class PDFrontEnd:
    """A prefill or decode server's share of PD: rooms in use, destinations waiting for their request (prefill),
    reservations relayed to the prefill side (decode). It reaches the ranks through the stream registry."""

    def __init__(self, args: ServerArgs, registry: StreamRegistry) -> None:
        assert args.disaggregation_mode in ("prefill", "decode"), args.disaggregation_mode
        self.args = args
        self.registry = registry
        self.mode = args.disaggregation_mode
        self.rooms: dict[int, RequestStream] = {}
        self.pending: dict[
            int, tuple[dict[str, Any], float]
        ] = {}  # prefill: destinations before their request
        # rooms whose prefill leg failed before their request came: (error, status, settled, when)
        self.failed_rooms: dict[int, tuple[str, int, bool, float]] = {}
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
        """A PD server takes only requests with bootstrap fields, each room once (and its own health
        generation, served whole)."""
        if request.local:
            return
        if request.bootstrap is None:
            raise bad_request(
                f"bootstrap_room: a {self.mode} server takes requests with bootstrap_host, "
                "bootstrap_port and bootstrap_room (send them through a PD router)"
            )
        if request.bootstrap.room in self.rooms:
            raise bad_request(
                f"bootstrap_room {request.bootstrap.room} is already in use by an unfinished request"
            )

    def room_of(self, request: GenerateInput) -> int | None:
        return request.bootstrap.room if request.bootstrap is not None else None

    def on_submitted(self, stream: RequestStream, bootstrap: Bootstrap | None) -> None:
        if bootstrap is None:
            return
        stream.bootstrap = bootstrap
        self.rooms[bootstrap.room] = stream
        failed = self.failed_rooms.pop(bootstrap.room, None)
        if failed is not None:  # its prefill leg failed first
            self.registry.abort_on(stream.rank, stream.rid, *failed[:3])
            return
        if self.mode == "prefill" and bootstrap.room in self.pending:
            target, _ = self.pending.pop(bootstrap.room)
            self.registry.send(stream.rank, TransferTarget(bootstrap.room, target))

    def fail_rooms(self, rooms: list[int], error: str, status: int, settled: bool) -> int:
        now = time.monotonic()
        self._expire(now)
        running = 0
        for room in rooms:
            stream = self.rooms.get(room)
            if stream is None:
                self.failed_rooms[room] = (error, status, settled, now)
            elif not stream.finished:
                running += 1
                self.registry.abort_on(stream.rank, stream.rid, error, status, settled)
        return running

    def on_released(self, stream: RequestStream) -> None:
        bootstrap = stream.bootstrap
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
        elif stream.target_sent:
            return web.json_response(
                {"error": f"bootstrap_room {room} already has a destination"}, status=409
            )
        else:
            stream.target_sent = True
            self.registry.send(stream.rank, TransferTarget(room, target))
        return web.json_response({"ok": True})

    def _expire(self, now: float) -> None:
        timeout = self.args.disaggregation_transfer_timeout
        for room in [r for r, (_, seen) in self.pending.items() if seen + timeout < now]:
            del self.pending[room]
        for room in [r for r, (*_, seen) in self.failed_rooms.items() if seen + timeout < now]:
            del self.failed_rooms[room]

    # ---- decode: relay each reservation ------------------------------------------------------------------------
    def on_reserved(self, reserved: Reserved) -> None:
        stream = self.registry.streams.get(reserved.rid)
        if stream is None or stream.bootstrap is None:
            return  # its client left: the abort is on its way to the rank
        task = asyncio.get_running_loop().create_task(self._relay(stream, reserved))
        self._posts.add(task)
        task.add_done_callback(self._posts.discard)

    async def _relay(self, stream: RequestStream, reserved: Reserved) -> None:
        bootstrap = stream.bootstrap
        port = bootstrap.port or self.args.disaggregation_bootstrap_port
        url = f"http://{bootstrap.host}:{port}{TARGET_PATH}"
        # settled: no connection was made, so the prefill side never saw this destination and will write nothing
        # into it; the reservation is freed at once instead of held twice the transfer timeout
        settled = False
        try:
            async with self._session.post(
                url, json={"room": reserved.room, "target": reserved.target}
            ) as response:
                if response.status == 200:
                    return
                why = f"answered {response.status}: {(await response.text())[:200]}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            settled = isinstance(error, aiohttp.ClientConnectorError)
            why = f"is unreachable ({type(error).__name__}: {error})"
        message = f"the prefill server's bootstrap server at {bootstrap.host}:{port} {why}"
        logger.warning("PD request %s fails: %s", reserved.rid, message)
        self.registry.abort_on(
            stream.rank, reserved.rid, error=message, status=PD_FAILURE, settled=settled
        )
