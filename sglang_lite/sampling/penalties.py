"""Frequency, presence and repetition penalties and logit biases (SGLang's semantics), batched over request rows.

For one request, with ``count[t]`` the times token ``t`` is in its output so far (the prompt does not count, as in
SGLang's penaltylib), its logits become, in this order (SGLang's: additive penalties, then scaling, then biases):

    logits -= frequency_penalty * count + presence_penalty * (count > 0)
    where count > 0: logits *= repetition_penalty if logits < 0, else logits /= repetition_penalty
    logits[t] += logit_bias[t]

A ``PenaltyBook`` keeps the counts of a scheduler's request rows (``req_row``): an int32 [rows, vocab] table made
the first time a request with a penalty arrives, so a server that never sees one pays nothing. Admission (again
after a retraction) recounts the output so far; each step adds the sampled tokens and applies everything with a
few tensor ops over the rows that need it. Logit biases sit in one (row, token, bias) index built at admission.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_lite.sampling.params import SamplingParams


def has_count_penalty(params: SamplingParams) -> bool:
    """Whether the request's logits depend on its output so far (beyond the min-tokens ban)."""
    return (
        params.frequency_penalty != 0
        or params.presence_penalty != 0
        or params.repetition_penalty != 1
    )


class PenaltyBook:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device | str) -> None:
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # int32 [num_rows, vocab]: output tokens so far, per row
        self.counts: torch.Tensor | None = None
        # float32 [num_rows, 3]: frequency, presence, repetition
        self._factors: torch.Tensor | None = None
        self._counted: set[int] = set()  # rows whose request has a count penalty
        self._biases: dict[int, dict[int, float]] = {}  # row -> {token: bias}
        self._bias_index = _BiasIndex.empty(self.device)

    @property
    def is_idle(self) -> bool:
        """No row asks for anything: ``apply`` returns the logits as they are."""
        return not self._counted and not self._biases

    # ---- a request's lifetime ----------------------------------------------------------------------------------
    def admit(self, row: int, params: SamplingParams, output_ids: Sequence[int] = ()) -> None:
        """``row`` now belongs to a request with ``params`` that has produced ``output_ids`` so far."""
        self.release(row)
        if has_count_penalty(params):
            self._admit_counts(row, params, output_ids)
        if params.logit_bias:
            self._biases[row] = {
                int(token): float(bias) for token, bias in params.logit_bias.items()
            }
            self._bias_index = _BiasIndex.build(self._biases, self.device)

    def _admit_counts(self, row: int, params: SamplingParams, output_ids: Sequence[int]) -> None:
        if self.counts is None:
            self.counts = torch.zeros(
                self.num_rows, self.vocab_size, dtype=torch.int32, device=self.device
            )
            self._factors = torch.zeros(self.num_rows, 3, dtype=torch.float32, device=self.device)
        factors = [params.frequency_penalty, params.presence_penalty, params.repetition_penalty]
        self._factors[row] = torch.tensor(factors, dtype=torch.float32)
        self.counts[row] = torch.bincount(
            torch.tensor(list(output_ids), dtype=torch.int64), minlength=self.vocab_size
        ).to(self.device, torch.int32)
        self._counted.add(row)

    def release(self, row: int) -> None:
        """``row`` no longer belongs to its request (finished, aborted or retracted)."""
        self._counted.discard(row)
        if self._biases.pop(row, None) is not None:
            self._bias_index = _BiasIndex.build(self._biases, self.device)

    # ---- each step ---------------------------------------------------------------------------------------------
    def record(
        self, rows: Sequence[int], tokens: Sequence[int] | torch.Tensor, count: int = 1
    ) -> None:
        """``tokens[i]`` is the newest output token of the request in ``rows[i]`` (``count`` -1 takes back what
        was recorded: speculation counts drafted tokens while it verifies them)."""
        counted = [i for i, row in enumerate(rows) if row in self._counted]
        if not counted:
            return
        book_rows = torch.tensor([rows[i] for i in counted], device=self.device)
        taken = torch.as_tensor(tokens, device=self.device)[
            torch.tensor(counted, device=self.device)
        ]
        ones = torch.full((len(counted),), count, dtype=torch.int32, device=self.device)
        self.counts.index_put_((book_rows, taken.long()), ones, accumulate=True)

    def apply(self, rows: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] of the requests in ``rows`` with their penalties and biases; float32, a new tensor when
        anything applies (the input stays as it is), else the input itself."""
        if self.is_idle:
            return logits
        assert logits.shape == (len(rows), self.vocab_size), (
            "one row of the whole vocabulary per request"
        )
        counted = [i for i, row in enumerate(rows) if row in self._counted]
        biased = any(row in self._biases for row in rows)
        if not counted and not biased:
            return logits
        out = logits.to(torch.float32, copy=True)
        if counted:
            self._apply_counts(out, counted, [rows[i] for i in counted])
        if biased:
            self._bias_index.add_to(out, rows, self.num_rows)
        return out

    def _apply_counts(self, out: torch.Tensor, batch_rows: list[int], book_rows: list[int]) -> None:
        index = torch.tensor(batch_rows, device=out.device)
        rows = torch.tensor(book_rows, device=self.device)
        counts, factors = self.counts[rows].to(out.device), self._factors[rows].to(out.device)
        frequency = factors[:, 0:1]
        presence = factors[:, 1:2]
        repetition = factors[:, 2:3]
        seen = counts > 0
        penalised = out[index] - frequency * counts - presence * seen
        scale = torch.where(seen, repetition, 1.0)
        out[index] = torch.where(penalised < 0, penalised * scale, penalised / scale)


class _BiasIndex:
    """Every admitted request's logit biases as three flat tensors: book row, token id, bias."""

    def __init__(self, rows: torch.Tensor, tokens: torch.Tensor, values: torch.Tensor) -> None:
        self.rows = rows
        self.tokens = tokens
        self.values = values

    @classmethod
    def empty(cls, device: torch.device) -> _BiasIndex:
        return cls.build({}, device)

    @classmethod
    def build(cls, biases: dict[int, dict[int, float]], device: torch.device) -> _BiasIndex:
        entries = [
            (row, token, bias) for row, pairs in biases.items() for token, bias in pairs.items()
        ]
        return cls(
            torch.tensor([row for row, _, _ in entries], dtype=torch.int64, device=device),
            torch.tensor([token for _, token, _ in entries], dtype=torch.int64, device=device),
            torch.tensor([bias for _, _, bias in entries], dtype=torch.float32, device=device),
        )

    def add_to(self, out: torch.Tensor, rows: Sequence[int], num_rows: int) -> None:
        """Adds the biases of the requests in ``rows`` (batch order) to ``out`` [B, vocab]."""
        batch = len(rows)
        position = torch.full((num_rows,), batch, dtype=torch.int64, device=self.rows.device)
        position[torch.tensor(list(rows), dtype=torch.int64, device=self.rows.device)] = (
            torch.arange(batch, device=self.rows.device)
        )
        where = position[self.rows]
        # rows outside the batch add a zero to row 0 instead of being filtered out: no device-to-host sync
        present = where < batch
        values = torch.where(present, self.values, 0.0).to(out.device)
        target = (where.clamp(max=batch - 1).to(out.device), self.tokens.to(out.device))
        out.index_put_(target, values, accumulate=True)
