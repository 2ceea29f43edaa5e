"""NEXTN: drafts from the checkpoint's multi-token-prediction head, a chain of ``steps`` tokens.

The head takes the model's final hidden state at a position and the token after it, and predicts the token after
that. After a prefill forward it runs over the new positions (writing its own KV, a draft layer of the pools) and
drafts the first token of the next step; in a decode step it continues the chain one token at a time from that
first draft, at the positions the verify forward fills next; after the verify step it runs again over the kept
positions with the model's own hidden states, which rewrites its KV there and drafts the next first token.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from sglang_lite.forward_batch import (
    ForwardBatch,
    ForwardMode,
    build_forward_batch,
    build_rows_batch,
)
from sglang_lite.mem_cache.pools import ModelPools
from sglang_lite.sampling.sampler import argmax_rows
from sglang_lite.scheduler.request import Req
from sglang_lite.scheduler.speculative.base import Drafter, Kept


@dataclass
class Drafts:
    """A request's first draft and the MTP head's hidden state that produced it (the next chain step's input)."""

    token: int
    hidden: torch.Tensor  # [hidden]


class MtpDrafter(Drafter):
    keeps_hidden = True

    def num_drafts(self, req: Req) -> int:
        return 0 if req.drafts is None else self.context.config.speculative_steps

    def propose(
        self, reqs: list[Req], counts: list[int], starts: list[int], slots: list[list[int]]
    ) -> list[list[int]]:
        """The first draft from the last step, the others from the head at positions ``start, start + 1, ..``
        (its KV in the slots the verify forward fills next)."""
        runner = self.context.runner
        chains = [[r.drafts.token] if n > 1 else [] for r, n in zip(reqs, counts)]
        hidden = {i: r.drafts.hidden for i, (r, n) in enumerate(zip(reqs, counts)) if n > 1}
        for step in range(1, max(counts) - 1):
            rows = [i for i, n in enumerate(counts) if n - 1 > step]
            batch = build_forward_batch(
                self.context.pools,
                ForwardMode.DECODE,
                [[chains[i][-1]] for i in rows],
                [starts[i] + step - 1 for i in rows],
                [reqs[i].req_row for i in rows],
                [reqs[i].state_slot for i in rows],
                self.context.config.device,
                [slots[i][step - 1] for i in rows],
            )
            with torch.inference_mode():
                out = runner.forward_mtp(batch, torch.stack([hidden[i] for i in rows]))
                drafted = argmax_rows(runner.logits(out)).tolist()
            for i, token, state in zip(rows, drafted, out):
                chains[i].append(token)
                hidden[i] = state
        return chains

    def after_prefill(self, kept: list[Kept]) -> None:
        self._extend(kept, as_rows=False)

    def after_verify(self, kept: list[Kept]) -> None:
        self._extend(kept, as_rows=True)

    def _extend(self, kept: list[Kept], as_rows: bool) -> None:
        """The head at the kept positions of each request: its KV there, and the first draft from its last
        position. ``as_rows``: one row a token, as a verify forward (a decode step's few kept tokens; a prefill's
        run as an extend)."""
        if not kept:
            return
        pools = self.context.pools
        slots = [
            s
            for k in kept
            for s in pools.req_to_token.slots(k.req.req_row, k.start, k.start + len(k.following))
        ]
        build = build_rows_batch if as_rows else _build_extend
        batch = build(
            pools,
            [k.following for k in kept],
            [k.start for k in kept],
            [k.req.req_row for k in kept],
            [k.req.state_slot for k in kept],
            self.context.config.device,
            slots,
        )
        last_rows = torch.tensor(list(accumulate(len(k.following) for k in kept))) - 1
        runner = self.context.runner
        with torch.inference_mode():
            out = runner.forward_mtp(batch, torch.cat([k.hidden for k in kept]))
            last = out[last_rows.to(out.device)]
            tokens = argmax_rows(runner.logits(last)).tolist()
        for k, token, hidden in zip(kept, tokens, last):
            k.req.drafts = Drafts(
                token, hidden.clone()
            )  # not a view keeping the whole output alive


def _build_extend(
    pools: ModelPools,
    token_ids: list[list[int]],
    prefix_lens: list[int],
    req_rows: list[int],
    state_slots: list[int],
    device: str,
    out_cache_loc: list[int],
) -> ForwardBatch:
    return build_forward_batch(
        pools,
        ForwardMode.EXTEND,
        token_ids,
        prefix_lens,
        req_rows,
        state_slots,
        device,
        out_cache_loc,
    )


DRAFTER = MtpDrafter
