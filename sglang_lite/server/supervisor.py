"""The rank supervisor: each DP rank's health, and restarts with backoff.

Once a second (``run``) it looks at every rank: a rank whose process exited, that reported ``Fatal``, or that leaves
a loads query unanswered for ``--rank-hang-timeout-s`` (hung: it is killed) is down; its requests fail at once with
503 (``fail_requests``, given by the stream registry), and it is restarted after a backoff (1 s, doubling, at most
30 s) up to ``--rank-max-restarts`` times, then stays failed. A rank whose world has several processes
(``--tp-size`` > 1) is never restarted: when any process of the world dies, every DP rank of the world fails at
once, for good. The supervisor owns the health table (``ranks``); the others only read it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sglang_lite.runtime.client import SchedulerClient
from sglang_lite.runtime.messages import LoadsQuery, QueryReply, Ready
from sglang_lite.server_args import ServerArgs

logger = logging.getLogger(__name__)
WATCH_INTERVAL_S = 1.0
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
RESTART_TIMEOUT_S = 300.0  # a restarted rank not ready by then counts as a failed restart
UP = "up"
STARTING = "starting"
DOWN = "down"
FAILED = "failed"  # down for good (no restarts left)


@dataclass
class RankHealth:
    """What the supervisor knows of one rank."""

    state: str = UP
    restarts: int = 0
    since: float = field(default_factory=time.monotonic)  # of the state
    next_restart: float = 0.0
    probe: tuple[int, float] | None = None  # the unanswered loads query: id, when sent
    why: str = ""  # of the last death

    @property
    def up(self) -> bool:
        return self.state == UP

    def set(self, state: str, now: float) -> None:
        self.state = state
        self.since = now
        self.probe = None

    def backoff(self) -> float:
        return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2**self.restarts)


class RankSupervisor:
    """Watches the ranks of ``ranks`` (the health table it owns) through the scheduler client, set at start."""

    def __init__(
        self,
        args: ServerArgs,
        ranks: list[RankHealth],
        fail_requests: Callable[[int, str], None],
    ) -> None:
        self.args = args
        self.ranks = ranks
        self.client: SchedulerClient | None = None
        # (rank, why): every request on the rank ends with a 503
        self._fail_requests = fail_requests
        self._probes: dict[int, int] = {}  # the supervisor's loads queries: id -> rank

    @property
    def live(self) -> list[bool]:
        return [health.up for health in self.ranks]

    def rank_states(self) -> list[dict[str, Any]]:
        """Each rank's state for ``/health``."""
        return [
            {
                "dp_rank": rank,
                "state": h.state,
                "restarts": h.restarts,
                "pid": self.client.processes[rank].pid,
                "last_error": h.why or None,
            }
            for rank, h in enumerate(self.ranks)
        ]

    def all_up(self) -> None:
        for health in self.ranks:
            health.set(UP, time.monotonic())

    async def run(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            try:
                self.check_ranks(time.monotonic())
            except Exception:  # the supervisor must outlive any one mistake
                logger.exception("the rank supervisor failed a round")

    # ---- what the ranks say ------------------------------------------------------------------------------------
    def on_probe_reply(self, reply: QueryReply) -> bool:
        """Takes the answer to one of the supervisor's own loads queries; False for any other reply."""
        rank = self._probes.pop(reply.query_id, None)
        if rank is None:
            return False
        health = self.ranks[rank]
        if health.probe is not None and health.probe[0] == reply.query_id:
            health.probe = None
        return True

    def on_fatal(self, rank: int, message: str) -> None:
        if self.ranks[rank].state == STARTING:
            self._restart_failed(rank, f"failed to start: {message}")
        elif self.ranks[rank].state == UP:
            self._rank_died(rank, message)

    def on_ready(self, ready: Ready) -> None:
        health = self.ranks[ready.rank]
        if health.state == STARTING:
            logger.warning(
                "DP rank %d is back (restart %d, pid %d)", ready.rank, health.restarts, ready.pid
            )
            health.set(UP, time.monotonic())

    # ---- one round -----------------------------------------------------------------------------------------------
    def check_ranks(self, now: float) -> None:
        exited = self.client.exited_ranks()
        for rank, health in enumerate(self.ranks):
            code = exited.get(rank)
            if health.state == UP:
                self._check_up(rank, health, code, now)
            elif health.state == STARTING and (
                code is not None or now - health.since > RESTART_TIMEOUT_S
            ):
                self._restart_failed(
                    rank, f"exit code {code}" if code is not None else "not ready in time"
                )
            elif health.state == DOWN and now >= health.next_restart:
                self._restart(rank, health, now)

    def _check_up(self, rank: int, health: RankHealth, code: int | None, now: float) -> None:
        timeout = self.args.rank_hang_timeout_s
        if code is not None:
            self._rank_died(rank, f"exit code {code}")
        elif health.probe is not None and now - health.probe[1] > timeout:
            self._rank_died(rank, f"hung: no answer to a loads query in {timeout:g} s")
        elif health.probe is None:
            query_id = self.client.next_query_id()
            health.probe = (query_id, now)
            self._probes[query_id] = rank
            self.client.send(
                rank, LoadsQuery(query_id, ("core",))
            )  # unsent (queue full): it times out, as hung

    def _restart(self, rank: int, health: RankHealth, now: float) -> None:
        if health.restarts >= self.args.rank_max_restarts:
            logger.error("DP rank %d stays down: %d restarts used", rank, health.restarts)
            health.set(FAILED, now)
            return
        health.restarts += 1
        logger.warning(
            "restarting DP rank %d (restart %d of %d)",
            rank,
            health.restarts,
            self.args.rank_max_restarts,
        )
        health.set(STARTING, now)
        self.client.respawn(rank)

    def _restart_failed(self, rank: int, why: str) -> None:
        logger.error("DP rank %d did not come back: %s", rank, why)
        self._mark_down(rank, why)

    def _mark_down(self, rank: int, why: str) -> None:
        health, now = self.ranks[rank], time.monotonic()
        self.client.kill(rank)  # a hung process answers nothing; a dead one is reaped
        self._forget_probes(rank)
        health.why = why
        health.set(DOWN, now)
        health.next_restart = now + health.backoff()

    def _rank_died(self, rank: int, why: str) -> None:
        logger.error("DP rank %d died: %s", rank, why)
        if self.args.world_size > 1:
            self._world_failed(rank, why)
            return
        self._mark_down(rank, why)
        self._fail_requests(rank, f"DP rank {rank} died: {why}")

    def _world_failed(self, rank: int, why: str) -> None:
        """A process of a multi-process world died: every DP rank of that world fails for good (no restart: its
        ranks may live on other nodes)."""
        self.client.kill(rank)  # what is left of it on this node
        world = self.args.world_of(rank)
        message = f"DP rank {rank} died: {why}; its world ({self.args.world_size} processes) cannot be restarted"
        for dp in self.args.world_dp_ranks(world):
            health = self.ranks[dp]
            if health.state == FAILED:
                continue
            self._forget_probes(dp)
            health.why = message
            health.set(FAILED, time.monotonic())
            self._fail_requests(dp, message)

    def _forget_probes(self, rank: int) -> None:
        self._probes = {q: r for q, r in self._probes.items() if r != rank}
