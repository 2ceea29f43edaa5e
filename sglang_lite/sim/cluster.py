"""A PD cluster in virtual time: clients -> router -> prefill servers -> KV transfer -> decode servers.

Event-driven (a heap of (time, seq, handler, arg)); nothing sleeps. Clients are closed-loop: each of
`concurrency` clients runs agentic sessions turn after turn, sending the next turn when the previous one finished.
A request's path: the router picks a prefill server and a decode rank; the decode rank queues it in prealloc and
reserves KV when it fits (bootstrap); only then does the prefill server queue it (SGLang's prefill waits for the
decode side's allocation); after prefill its KV crosses to the decode server (transfers run in parallel, each at
most at a per-request rate, all together at most at the link's bandwidth; so a long prompt arrives after shorter
ones sent later); it joins the rank's running batch at the next step, where its first token reaches the client,
and leaves after output_len - 1 steps.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from sglang_lite.protocol.balance import BalanceStats, balance_stats
from sglang_lite.sim.decode_server import DecodeServer
from sglang_lite.sim.prefill_server import PrefillServer
from sglang_lite.sim.router_sim import SimRouter
from sglang_lite.sim.sim_config import SimConfig
from sglang_lite.sim.sim_request import SimRequest
from sglang_lite.sim.traces import TraceRequest, iter_agentic_sessions

# ~ a request's wait before it decodes (1.7 s at ~13 ms a step), for `lasting`
LASTING_HORIZON_STEPS = 130


@dataclass
class SimResult:
    config: SimConfig
    balance: BalanceStats
    # output tokens/s per GPU (prefill and decode GPUs) in the window
    output_throughput_per_gpu: float
    tpot_p50: float
    tpot_p90: float
    ttft_p50: float
    completed: int  # requests finished in the measurement window
    ttft_p90: float = 0.0
    # per rank, the share of its in-flight requests waiting on KV: reserved, prefill or transfer not done
    transfer_share: tuple[float, ...] = ()
    sample_times: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    outstanding: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0)))
    running: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0)))
    kv_tokens: np.ndarray = field(repr=False, default_factory=lambda: np.zeros((0, 0)))
    finish_counts: dict[int, int] = field(repr=False, default_factory=dict)  # rid -> times finished
    admitted: int = 0
    cpu_s: float = 0.0  # process CPU time of the run (wall time on a shared machine says little)

    def row(self) -> dict[str, float]:
        return {
            "output_tok_s_per_gpu": self.output_throughput_per_gpu,
            "tpot_p50_ms": self.tpot_p50 * 1e3,
            "tpot_p90_ms": self.tpot_p90 * 1e3,
            "ttft_p50_s": self.ttft_p50,
            "ttft_p90_s": self.ttft_p90,
            **self.balance.row(),
            "transfer_share": float(np.mean(self.transfer_share or [0.0])),
            "max_busiest_share": max(self.balance.busiest_share),
        }


class Cluster:
    def __init__(
        self, config: SimConfig, sessions: Iterator[list[TraceRequest]] | None = None
    ) -> None:
        self.cfg = config
        cl = config.cluster
        self.prefills = [PrefillServer(i, config.cost, cl) for i in range(cl.num_prefill)]
        self.decodes = [
            DecodeServer(i, i * cl.decode_dp_size, config.cost, cl) for i in range(cl.num_decode)
        ]
        self.ranks = [rank for server in self.decodes for rank in server.ranks]
        self.router = SimRouter(
            config.policy,
            config.prefill_policy,
            cl.num_prefill,
            [(s.index, r) for s in self.decodes for r in range(cl.decode_dp_size)],
            config.seed,
        )
        self.router.work_ahead = self._work_ahead
        self.router.lasting = self._lasting
        self.sessions = (
            sessions if sessions is not None else iter_agentic_sessions(config.seed, config.trace)
        )
        self.sessions_started = 0
        self.events: list[tuple[float, int, Callable, object]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.rids = itertools.count()
        self.client_turns: list[list[TraceRequest]] = [[] for _ in range(config.concurrency)]
        self.finished: list[SimRequest] = []
        self.finish_counts: dict[int, int] = {}
        self.output_tokens = 0  # tokens produced inside the measurement window
        self.samples: list[tuple[float, list[int], list[int], list[int], list[int]]] = []

    # ---- the loop ----------------------------------------------------------------------------------------------
    def at(self, t: float, handler: Callable, arg: object = None) -> None:
        heapq.heappush(self.events, (t, next(self.seq), handler, arg))

    def run(self) -> SimResult:
        for client in range(self.cfg.concurrency):
            self.at(0.0, self._next_turn, client)
        self.at(0.0, self._poll)
        self.at(0.0, self._sample)
        end = self.cfg.duration_s if self.cfg.duration_s is not None else float("inf")
        while self.events:
            t, _, handler, arg = heapq.heappop(self.events)
            if t > end or (self._idle() and handler in (self._poll, self._sample)):
                break
            self.now = t
            handler(arg)
        return self._result(min(end, self.now))

    def _idle(self) -> bool:
        # Only the periodic poll and sample events remain: a finite trace has drained.
        return len(self.events) <= 1

    def _work_ahead(self) -> list[int]:
        dp = self.cfg.cluster.decode_dp_size
        return [rank.steps_ahead(self.decodes[rank.index // dp].step) for rank in self.ranks]

    def _lasting(self) -> list[int]:
        dp, horizon = self.cfg.cluster.decode_dp_size, LASTING_HORIZON_STEPS
        return [
            len(r.prealloc)
            + r.num_transfer
            + len(r.ready)
            + r.running_beyond(self.decodes[r.index // dp].step, horizon)
            for r in self.ranks
        ]

    # ---- clients -----------------------------------------------------------------------------------------------
    def _next_turn(self, client: int) -> None:
        if not self.client_turns[client] and not self._new_session(client):
            return
        trace = self.client_turns[client].pop(0)
        req = SimRequest(next(self.rids), trace, client, self.now, arrival_time=self.now)
        req.prefill_server, req.decode_rank = self.router.dispatch()
        self._to_decode(req)

    def _new_session(self, client: int) -> bool:
        limit = self.cfg.max_sessions
        if limit is not None and self.sessions_started >= limit:
            return False
        self.client_turns[client] = list(next(self.sessions))
        self.sessions_started += 1
        return True

    # ---- decode side: prealloc, transfer, steps ----------------------------------------------------------------
    def _to_decode(self, req: SimRequest) -> None:
        rank = self.ranks[req.decode_rank]
        rank.add(req)
        self._admit(rank)

    def _admit(self, rank) -> None:
        for req in rank.admit():
            self.prefills[req.prefill_server].enqueue(req)
            self._kick_prefill(self.prefills[req.prefill_server])

    def _on_transferred(self, req: SimRequest) -> None:
        self.ranks[req.decode_rank].on_transferred(req)
        self._kick_decode(self.decodes[req.decode_rank // self.cfg.cluster.decode_dp_size])

    def _kick_decode(self, server: DecodeServer) -> None:
        if server.busy:
            return
        duration, joined = server.start_step()
        for req in joined:
            self._first_token(req)
            if req.decode_steps <= 0:
                self._finish(req)
        if duration is not None:
            self.at(self.now + duration, self._decode_step_end, server)

    def _first_token(self, req: SimRequest) -> None:
        req.first_token_time = self.now
        self.router.on_first_token(req.decode_rank)
        self._count_tokens(1)

    def _decode_step_end(self, server: DecodeServer) -> None:
        running = sum(len(r.running) for r in server.ranks)
        for req in server.end_step():
            self._finish(req)
        self._count_tokens(running)
        if self.cfg.check_invariants:
            for rank in server.ranks:
                rank.check()
        for rank in server.ranks:
            if rank.prealloc:
                self._admit(rank)
        self._kick_decode(server)

    def _finish(self, req: SimRequest) -> None:
        req.finish_time, req.finished = self.now, True
        self.finish_counts[req.rid] = self.finish_counts.get(req.rid, 0) + 1
        self.ranks[req.decode_rank].release(req)
        self.router.on_finish(req.decode_rank)
        self.finished.append(req)
        self.at(self.now, self._next_turn, req.client)

    def _count_tokens(self, n: int) -> None:
        if self.now >= self.cfg.warmup_s:
            self.output_tokens += n

    # ---- prefill side ------------------------------------------------------------------------------------------
    def _kick_prefill(self, server: PrefillServer) -> None:
        if server.busy:
            return
        duration = server.start_step()
        if duration is not None:
            self.at(self.now + duration, self._prefill_step_end, server)

    def _prefill_step_end(self, server: PrefillServer) -> None:
        for req in server.end_step():
            self.router.on_prefill_done(server.index)
            decode = self.decodes[req.decode_rank // self.cfg.cluster.decode_dp_size]
            self.at(decode.transfer_done_at(self.now, req.input_len), self._on_transferred, req)
        self._kick_prefill(server)

    # ---- the load monitor and the balance sampler --------------------------------------------------------------
    def _poll(self, _: object = None) -> None:
        self.router.poll([r.num_total_tokens for r in self.ranks])
        self.at(self.now + self.cfg.cluster.poll_interval_s, self._poll)

    def _sample(self, _: object = None) -> None:
        ranks = self.ranks
        self.samples.append(
            (
                self.now,
                [r.outstanding for r in ranks],
                [r.num_running for r in ranks],
                [r.num_total_tokens for r in ranks],
                [r.num_transfer for r in ranks],
            )
        )
        self.at(self.now + self.cfg.cluster.sample_interval_s, self._sample)

    # ---- results -----------------------------------------------------------------------------------------------
    def _result(self, end: float) -> SimResult:
        warm = self.cfg.warmup_s if end > self.cfg.warmup_s else 0.0
        window = [s for s in self.samples if s[0] >= warm] or self.samples
        times = np.array([s[0] for s in window])
        outstanding, running, kv, transfer = (
            np.array([s[i] for s in window]) for i in (1, 2, 3, 4)
        )
        reqs = [r for r in self.finished if r.finish_time >= warm]
        tpots = np.array([t for t in (r.tpot() for r in reqs) if t is not None] or [0.0])
        ttfts = np.array([r.first_token_time - r.arrival for r in reqs] or [0.0])
        gpus = self.cfg.cluster.num_gpus
        return SimResult(
            config=self.cfg,
            balance=balance_stats(outstanding, running, kv),
            output_throughput_per_gpu=self.output_tokens / max(end - warm, 1e-9) / gpus,
            tpot_p50=float(np.percentile(tpots, 50)),
            tpot_p90=float(np.percentile(tpots, 90)),
            ttft_p50=float(np.percentile(ttfts, 50)),
            ttft_p90=float(np.percentile(ttfts, 90)),
            completed=len(reqs),
            transfer_share=tuple(
                float(x) for x in transfer.sum(0) / np.maximum(outstanding.sum(0), 1)
            ),
            sample_times=times,
            outstanding=outstanding,
            running=running,
            kv_tokens=kv,
            finish_counts=self.finish_counts,
            admitted=next(self.rids),
        )


def simulate(config: SimConfig, sessions: Iterator[list[TraceRequest]] | None = None) -> SimResult:
    start = time.process_time()
    result = Cluster(config, sessions).run()
    result.cpu_s = time.process_time() - start
    return result
