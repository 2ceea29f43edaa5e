"""Request traces: a JSONL format, a loader, and a seeded generator of input-heavy agentic sessions.

One line per request:
    {"session": "s17", "turn": 3, "arrival": 12.5 | null, "input_len": 23110, "output_len": 96,
     "prefix_group": "s17", "prefix_len": 21950}
`arrival` (seconds from the start) is used by timestamp replay; closed-loop replay ignores it and keeps the
session order (turn t+1 of a session is sent only after turn t finished, as an agent would).
`prefix_len` tokens of the input are shared with the previous request of the same `prefix_group`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator


@dataclass(frozen=True)
class TraceRequest:
    session: str
    turn: int
    input_len: int
    output_len: int
    prefix_group: str = ""
    prefix_len: int = 0
    arrival: float | None = None

    def __post_init__(self) -> None:
        assert self.input_len > 0 and self.output_len > 0, "a request needs input and output tokens"
        assert 0 <= self.prefix_len <= self.input_len, "the shared prefix is part of the input"


@dataclass(frozen=True)
class AgenticTraceConfig:
    """Multi-turn agent sessions: a long first prompt, then each turn appends the last (short) answer and a tool
    result, so contexts grow and most of each prompt is the previous one (a prefix-cache hit on prefill)."""

    first_input_mean: int = 8000
    tool_output_mean: int = 1500
    output_mean: int = 120
    output_max: int = 512
    min_turns: int = 4
    max_turns: int = 24
    max_context: int = 100_000
    sigma: float = 0.6  # lognormal spread of every length


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    # mu chosen so that the distribution's mean is `mean`
    return max(1, int(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def agentic_session(rng: random.Random, name: str, cfg: AgenticTraceConfig) -> list[TraceRequest]:
    turns = rng.randint(cfg.min_turns, cfg.max_turns)
    context = _lognormal(rng, cfg.first_input_mean, cfg.sigma)
    shared = 0
    requests = []
    for turn in range(turns):
        output = min(_lognormal(rng, cfg.output_mean, cfg.sigma), cfg.output_max)
        if context + output > cfg.max_context:
            break
        requests.append(TraceRequest(name, turn, context, output, name, shared))
        shared = context + output  # the next prompt repeats this prompt and its answer
        context = shared + _lognormal(rng, cfg.tool_output_mean, cfg.sigma)
    return requests or [TraceRequest(name, 0, min(context, cfg.max_context - 1), 1, name, 0)]


def iter_agentic_sessions(
    seed: int, cfg: AgenticTraceConfig | None = None
) -> Iterator[list[TraceRequest]]:
    """An endless, seeded stream of sessions (a simulator pulls as many as its clients consume)."""
    cfg = cfg or AgenticTraceConfig()
    rng = random.Random(seed)
    index = 0
    while True:
        yield agentic_session(rng, f"s{index}", cfg)
        index += 1


def agentic_trace(
    num_sessions: int,
    seed: int,
    cfg: AgenticTraceConfig | None = None,
    session_rate: float | None = None,
) -> list[TraceRequest]:
    """`num_sessions` sessions in session order; with `session_rate` (sessions/s) sessions start at Poisson
    times and turns follow at a nominal `turn_gap` of 2 s, so the trace can also be replayed by timestamp."""
    rng = random.Random(seed + 1)
    sessions = iter_agentic_sessions(seed, cfg)
    out: list[TraceRequest] = []
    start = 0.0
    for _ in range(num_sessions):
        session = next(sessions)
        if session_rate:
            start += rng.expovariate(session_rate)
        out.extend(_with_arrival(r, start + 2.0 * r.turn) if session_rate else r for r in session)
    return out


def _with_arrival(r: TraceRequest, t: float) -> TraceRequest:
    return TraceRequest(
        r.session, r.turn, r.input_len, r.output_len, r.prefix_group, r.prefix_len, round(t, 6)
    )


def save_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(asdict(r)) + "\n")


def load_trace(path: str | Path) -> list[TraceRequest]:
    requests = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                requests.append(_parse_line(line, line_no))
    return requests


def _parse_line(line: str, line_no: int) -> TraceRequest:
    try:
        d = json.loads(line)
        return TraceRequest(
            str(d["session"]),
            int(d["turn"]),
            int(d["input_len"]),
            int(d["output_len"]),
            str(d.get("prefix_group", "")),
            int(d.get("prefix_len", 0)),
            None if d.get("arrival") is None else float(d["arrival"]),
        )
    except (KeyError, ValueError, TypeError, AssertionError) as e:
        raise ValueError(f"trace line {line_no}: {e!r}") from e


def group_sessions(requests: Iterable[TraceRequest]) -> list[list[TraceRequest]]:
    """Sessions in order of first appearance, each sorted by turn."""
    sessions: dict[str, list[TraceRequest]] = {}
    for r in requests:
        sessions.setdefault(r.session, []).append(r)
    return [sorted(s, key=lambda r: r.turn) for s in sessions.values()]


def output_share(requests: Iterable[TraceRequest]) -> float:
    """Output tokens over all (input + output) tokens: the 'input-heavy' check (agentic: under ~1%)."""
    inp = out = 0
    for r in requests:
        inp, out = inp + r.input_len, out + r.output_len
    return out / max(inp + out, 1)
