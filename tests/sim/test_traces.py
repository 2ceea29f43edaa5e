from __future__ import annotations

import pytest

from sglang_lite.sim.traces import (
    AgenticTraceConfig,
    agentic_trace,
    group_sessions,
    load_trace,
    output_share,
    save_trace,
)


def test_agentic_trace_is_seeded_and_input_heavy():
    a, b, c = agentic_trace(50, seed=3), agentic_trace(50, seed=3), agentic_trace(50, seed=4)
    assert a == b and a != c
    assert output_share(a) < 0.01


def test_sessions_grow_and_share_their_prefix():
    for session in group_sessions(agentic_trace(30, seed=1)):
        assert session[0].prefix_len == 0
        for prev, cur in zip(session, session[1:]):
            assert cur.turn == prev.turn + 1
            assert cur.prefix_len == prev.input_len + prev.output_len < cur.input_len
            assert cur.prefix_group == prev.prefix_group == cur.session
        assert all(r.input_len + r.output_len <= AgenticTraceConfig().max_context for r in session)


def test_jsonl_round_trip_with_timestamps(tmp_path):
    trace = agentic_trace(5, seed=0, session_rate=2.0)
    assert all(r.arrival is not None for r in trace)
    path = tmp_path / "t.jsonl"
    save_trace(path, trace)
    assert load_trace(path) == trace


def test_bad_line_names_its_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"session": "a", "turn": 0, "input_len": 5, "output_len": 1}\n{"session": "a"}\n'
    )
    with pytest.raises(ValueError, match="line 2"):
        load_trace(path)
