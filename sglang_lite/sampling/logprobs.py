"""Log-probabilities a request asks for (SGLang's ``return_logprob`` family) and their batched computation.

They come from the model's own logits: a log-softmax before temperature, penalties, biases and grammar masks
(SGLang's default), in float32. One entry is ``[logprob, token_id, None]``; the third place is the token's text,
which the front end fills in when asked (``return_text_in_logprobs``). Input entries start with
``[None, first_token, None]`` when the range starts at the first prompt token (nothing predicts it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

MAX_TOP_LOGPROBS = 100  # per position; a client wanting more wants the whole distribution
MAX_TOKEN_IDS_LOGPROB = 256
# log-probability entries one request may ask for, all its samples together: a response of 500k entries is ~15 MB
# of JSON and takes seconds to build; n=64 samples of a 1000-token prompt's top 100 would be 6.4 million
MAX_LOGPROB_ENTRIES = 500_000
OUTPUT_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
INPUT_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
Entry = list  # [logprob | None, token_id, text | None]


@dataclass
class LogprobParams:
    return_logprob: bool = False
    # -1: output tokens only; k >= 0: also every prompt token from position k
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any] | LogprobParams | None) -> LogprobParams | None:
        if values is None or isinstance(values, LogprobParams):
            return values
        return cls(**values)

    @property
    def wants_input(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    def entries(self, prompt_len: int, output_len: int) -> int:
        """At most how many entries one sample reports: one per position, plus its top and chosen ids."""
        if not self.return_logprob:
            return 0
        positions = output_len + (prompt_len - self.logprob_start_len if self.wants_input else 0)
        return positions * (1 + self.top_logprobs_num + len(self.token_ids_logprob or []))

    def validate(self, vocab_size: int, prompt_len: int) -> None:
        """Raises ValueError naming the first bad field."""
        if not isinstance(self.return_logprob, bool):
            raise ValueError(f"return_logprob must be true or false, got {self.return_logprob!r}")
        start = self.logprob_start_len
        if not _is_int(start) or not -1 <= start < prompt_len:
            raise ValueError(
                f"logprob_start_len must be -1 (output tokens only) or a prompt position in "
                f"[0, {prompt_len - 1}], got {start!r}"
            )
        top = self.top_logprobs_num
        if not _is_int(top) or not 0 <= top <= min(MAX_TOP_LOGPROBS, vocab_size):
            raise ValueError(
                f"top_logprobs_num must be an integer in [0, {min(MAX_TOP_LOGPROBS, vocab_size)}], "
                f"got {top!r}"
            )
        ids = self.token_ids_logprob
        if ids is not None and not (
            isinstance(ids, list)
            and len(ids) <= MAX_TOKEN_IDS_LOGPROB
            and all(_is_int(t) and 0 <= t < vocab_size for t in ids)
        ):
            raise ValueError(
                f"token_ids_logprob must be a list of at most {MAX_TOKEN_IDS_LOGPROB} token ids in "
                f"[0, {vocab_size})"
            )


@dataclass
class LogprobRecord:
    """What a request has computed and not yet reported, by ``meta_info`` key."""

    entries: dict[str, list] = field(default_factory=dict)
    # prompt positions below this are reported (a re-prefill after retraction skips them)
    input_upto: int = 0

    def add(self, key: str, values: list) -> None:
        self.entries.setdefault(key, []).extend(values)

    def copy_input(self) -> LogprobRecord:
        """A parallel sample's record: the prompt's entries not yet reported, which it reports too."""
        entries = {key: list(self.entries[key]) for key in INPUT_KEYS if key in self.entries}
        return LogprobRecord(entries, self.input_upto)

    def take(self, params: LogprobParams) -> dict[str, list]:
        """The unsent entries under every key the request asked for (empty lists where nothing is new)."""
        keys = list(OUTPUT_KEYS) + (list(INPUT_KEYS) if params.wants_input else [])
        taken = {key: self.entries.get(key, []) for key in keys if _asked(key, params)}
        self.entries = {}
        return taken


def _asked(key: str, params: LogprobParams) -> bool:
    if key.endswith("top_logprobs"):
        return params.top_logprobs_num > 0
    if key.endswith("token_ids_logprobs"):
        return params.token_ids_logprob is not None
    return True


def logprob_entries(
    logits: torch.Tensor, targets: torch.Tensor, params: list[LogprobParams]
) -> list[dict]:
    """For each row i: the log-probability of ``targets[i]`` under ``logits[i]``, the row's top
    ``top_logprobs_num`` and its ``token_ids_logprob``, as lists of entries, in one pass over the batch."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets.view(-1, 1)).squeeze(1).tolist()
    ids = targets.tolist()
    top_k = max(p.top_logprobs_num for p in params)
    tops = logprobs.topk(top_k, dim=-1) if top_k else None
    top_values, top_ids = (
        (tops.values.tolist(), tops.indices.tolist()) if tops is not None else (None, None)
    )
    results = []
    for i, p in enumerate(params):
        row = {"token": [chosen[i], ids[i], None]}
        if p.top_logprobs_num:
            k = p.top_logprobs_num
            row["top"] = [[v, t, None] for v, t in zip(top_values[i][:k], top_ids[i][:k])]
        if p.token_ids_logprob is not None:
            picked = logprobs[i, p.token_ids_logprob].tolist() if p.token_ids_logprob else []
            row["ids"] = [[v, t, None] for v, t in zip(picked, p.token_ids_logprob)]
        results.append(row)
    return results


def record_output(record: LogprobRecord, row: dict) -> None:
    record.add("output_token_logprobs", [row["token"]])
    if "top" in row:
        record.add("output_top_logprobs", [row["top"]])
    if "ids" in row:
        record.add("output_token_ids_logprobs", [row["ids"]])


def record_input(record: LogprobRecord, rows: list[dict], first: int | None) -> None:
    """Prompt entries of one prefill chunk; ``first``: the first prompt token, when the range starts there."""
    if first is not None:
        record.add("input_token_logprobs", [[None, first, None]])
        record.add("input_top_logprobs", [None])
        record.add("input_token_ids_logprobs", [None])
    record.add("input_token_logprobs", [row["token"] for row in rows])
    record.add("input_top_logprobs", [row.get("top") for row in rows])
    record.add("input_token_ids_logprobs", [row.get("ids") for row in rows])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
