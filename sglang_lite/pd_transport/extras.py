"""The log-probabilities a PD request's prefill computed (its first output token's, and its prompt's when asked),
as bytes the prefill side writes into the decode rank's extras area beside the KV.

The size is a function of the request alone (its ``LogprobParams`` and prompt length), so the decode side reserves
exactly that much when it reserves the KV. Each reported position is one row of five fields, stored field by field:
the log-probability (NaN for the first prompt token, which nothing predicts), the token id, the top
``top_logprobs_num`` values and ids, and the ``token_ids_logprob`` values. The first row is the output token, then
the prompt positions from ``logprob_start_len``.
"""

from __future__ import annotations

import math

import torch

from sglang_lite.sampling.logprobs import LogprobParams

NAN = float("nan")


def _shape(params: LogprobParams | None, prompt_len: int) -> tuple[int, int, int]:
    """(positions, top count, token-ids count) the request reports; 0 positions when it reports none."""
    if params is None or not params.return_logprob:
        return 0, 0, 0
    inputs = prompt_len - params.logprob_start_len if params.wants_input else 0
    ids = len(params.token_ids_logprob) if params.token_ids_logprob is not None else 0
    return 1 + inputs, params.top_logprobs_num, ids


def extras_size(params: LogprobParams | None, prompt_len: int) -> int:
    """Bytes of the request's log-probabilities (0 when it asked for none)."""
    n, k, m = _shape(params, prompt_len)
    return n * (8 + 8 * k + 4 * m)


def encode(entries: dict[str, list], params: LogprobParams, prompt_len: int) -> torch.Tensor:
    """A recorded prefill's entries (``LogprobRecord.entries``: the output token's and the prompt's) as bytes."""
    n, k, m = _shape(params, prompt_len)
    rows = list(zip(*_columns(entries, "output"))) + list(zip(*_columns(entries, "input")))
    assert len(rows) == n, f"{len(rows)} log-probability positions recorded, {n} expected"
    values = torch.tensor([NAN if e[0] is None else e[0] for e, _, _ in rows], dtype=torch.float32)
    tokens = torch.tensor([e[1] for e, _, _ in rows], dtype=torch.int32)
    top = [t if t is not None else [[NAN, -1, None]] * k for _, t, _ in rows]
    top_values = torch.tensor([[v for v, _, _ in t] for t in top], dtype=torch.float32)
    top_ids = torch.tensor([[i for _, i, _ in t] for t in top], dtype=torch.int32)
    picked = [p if p is not None else [[NAN, 0, None]] * m for _, _, p in rows]
    picked_values = torch.tensor([[v for v, _, _ in p] for p in picked], dtype=torch.float32)
    fields = (values, tokens, top_values, top_ids, picked_values)
    return torch.cat([f.reshape(-1).view(torch.uint8) for f in fields])


def decode(data: torch.Tensor, params: LogprobParams, prompt_len: int) -> dict[str, list]:
    """``LogprobRecord.entries`` from ``encode``'s bytes."""
    n, k, m = _shape(params, prompt_len)
    sizes = (4 * n, 4 * n, 4 * n * k, 4 * n * k, 4 * n * m)
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    dtypes = (torch.float32, torch.int32, torch.float32, torch.int32, torch.float32)
    fields = [data[a:b].view(t).tolist() for a, b, t in zip(offsets, offsets[1:], dtypes)]
    values, tokens, top_values, top_ids, picked = fields
    rows = []
    for i in range(n):
        value = None if math.isnan(values[i]) else values[i]
        top = [[v, t, None] for v, t in zip(top_values[i * k : (i + 1) * k], top_ids[i * k :])]
        ids = params.token_ids_logprob or []
        chosen = [[v, t, None] for v, t in zip(picked[i * m : (i + 1) * m], ids)]
        first_prompt_token = value is None
        rows.append(
            (
                [value, tokens[i], None],
                None if first_prompt_token or not k else top,
                None if first_prompt_token or params.token_ids_logprob is None else chosen,
            )
        )
    return _entries(rows[:1], "output", params) | _entries(rows[1:], "input", params)


def _columns(entries: dict[str, list], kind: str) -> tuple[list, list, list]:
    """The token, top and token-ids entries of ``kind`` (output or input), None where not recorded."""
    tokens = entries.get(f"{kind}_token_logprobs", [])
    top = entries.get(f"{kind}_top_logprobs") or [None] * len(tokens)
    ids = entries.get(f"{kind}_token_ids_logprobs") or [None] * len(tokens)
    return tokens, top, ids


def _entries(rows: list, kind: str, params: LogprobParams) -> dict[str, list]:
    if not rows:
        return {}
    out = {f"{kind}_token_logprobs": [token for token, _, _ in rows]}
    # the prompt's entries carry every key (None where not asked); an output token's only the asked ones
    if kind == "input" or params.top_logprobs_num:
        out[f"{kind}_top_logprobs"] = [top for _, top, _ in rows]
    if kind == "input" or params.token_ids_logprob is not None:
        out[f"{kind}_token_ids_logprobs"] = [ids for _, _, ids in rows]
    return out


class ExtrasArea:
    """A decode rank's registered area for requests' log-probabilities: first-fit ranges of bytes, freed ranges
    merged with their neighbours."""

    def __init__(self, size: int) -> None:
        self.buffer = torch.zeros(max(size, 1), dtype=torch.uint8)
        self.size = size
        self._free: list[tuple[int, int]] = (
            [(0, size)] if size else []
        )  # (offset, bytes), by offset

    def alloc(self, n: int) -> int | None:
        """The offset of ``n`` free bytes, or None when no free range is that long (nothing is taken then)."""
        if n == 0:
            return 0
        for i, (offset, length) in enumerate(self._free):
            if length >= n:
                self._free[i] = (offset + n, length - n)
                if length == n:
                    del self._free[i]
                return offset
        return None

    def free(self, offset: int, n: int) -> None:
        if not n:
            return
        ranges = sorted([*self._free, (offset, n)])
        merged = [ranges[0]]
        for start, length in ranges[1:]:
            last_start, last_length = merged[-1]
            assert last_start + last_length <= start, "extras range freed twice"
            if last_start + last_length == start:
                merged[-1] = (last_start, last_length + length)
            else:
                merged.append((start, length))
        self._free = merged

    @property
    def num_free(self) -> int:
        return sum(length for _, length in self._free)
