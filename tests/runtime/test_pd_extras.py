"""The log-probabilities a PD prefill sends with the KV: recorded entries survive the bytes exactly, in the size
both sides compute from the request alone, and the decode side's area hands out and takes back ranges."""

from __future__ import annotations

import pytest
import torch

from sglang_lite.pd_transport.extras import ExtrasArea, decode, encode, extras_size
from sglang_lite.sampling.logprobs import (
    LogprobParams,
    LogprobRecord,
    logprob_entries,
    record_input,
    record_output,
)

VOCAB = 50


def _recorded(params: LogprobParams, prompt: list[int], token: int) -> dict[str, list]:
    """What a prefill records, the way the sampler records it: the prompt's entries, then the first token's."""
    torch.manual_seed(len(prompt))
    record = LogprobRecord()
    if params.wants_input:
        start = params.logprob_start_len
        targets = list(range(max(start, 1), len(prompt)))
        logits = torch.randn(len(targets), VOCAB)
        rows = logprob_entries(
            logits, torch.tensor([prompt[t] for t in targets]), [params] * len(targets)
        )
        record_input(record, rows, prompt[0] if start == 0 else None)
    rows = logprob_entries(torch.randn(1, VOCAB), torch.tensor([token]), [params])
    record_output(record, rows[0])
    return record.entries


@pytest.mark.parametrize(
    "params",
    [
        LogprobParams(return_logprob=True),
        LogprobParams(return_logprob=True, top_logprobs_num=3),
        LogprobParams(return_logprob=True, token_ids_logprob=[1, 7, 49]),
        LogprobParams(return_logprob=True, token_ids_logprob=[]),
        LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=2),
        LogprobParams(
            return_logprob=True, logprob_start_len=4, top_logprobs_num=1, token_ids_logprob=[3]
        ),
    ],
)
def test_entries_round_trip_in_the_size_both_sides_compute(params: LogprobParams) -> None:
    prompt = [5, 9, 2, 44, 13, 8, 30, 1]
    entries = _recorded(params, prompt, token=17)
    data = encode(entries, params, len(prompt))
    assert data.dtype == torch.uint8 and data.numel() == extras_size(params, len(prompt))
    assert decode(data, params, len(prompt)) == entries


def test_requests_without_log_probabilities_send_nothing() -> None:
    assert extras_size(None, 100) == 0
    assert extras_size(LogprobParams(return_logprob=False, top_logprobs_num=5), 100) == 0


def test_area_first_fit_and_merging() -> None:
    area = ExtrasArea(100)
    a, b, c = area.alloc(30), area.alloc(30), area.alloc(30)
    assert (a, b, c) == (0, 30, 60) and area.alloc(20) is None  # 10 bytes left
    assert area.alloc(0) == 0  # a request without log-probabilities takes nothing
    area.free(b, 30)
    assert area.alloc(40) is None  # 30 + 10 free, not adjacent
    area.free(a, 30)
    assert area.alloc(60) == 0  # 0-60 merged
    area.free(0, 60)
    area.free(c, 30)
    assert area.num_free == 100 and area.alloc(100) == 0
