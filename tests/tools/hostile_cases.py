"""The hostile battery, in a fixed order (``hostile.py`` runs it)."""

from __future__ import annotations

from tests.tools.hostile import Case
from tests.tools.hostile_grammars import grammar_cases, template_and_tool_cases
from tests.tools.hostile_requests import (
    body_cases,
    edge_cases,
    field_cases,
    sampling_cases,
    unicode_cases,
)
from tests.tools.hostile_streams import n_logprob_stream_cases, rid_cases


def hostile_cases(vocab: int = 4096) -> list[Case]:
    """Every case; ``vocab``: the served model's vocabulary size (some cases bias every token)."""
    return [
        *body_cases(),
        *edge_cases(),  # early: the slow ones wait out the server's timeouts beside the rest
        *field_cases(),
        *sampling_cases(vocab),
        *grammar_cases(),
        *template_and_tool_cases(),
        *unicode_cases(),
        *rid_cases(),
        *n_logprob_stream_cases(),
    ]
