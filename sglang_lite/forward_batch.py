"""The batch one cached forward runs on: packed tokens of several requests plus where their state lives.

EXTEND runs new tokens of each request (a whole prompt, or a chunk continuing from what is cached: the prefix);
DECODE runs exactly one new token per request. Tokens are packed request after request ([T] rows, no padding).
Layers read positions and boundaries from here and their KV / linear-attention state from ``pools``.
"""

from __future__ import annotations

import array
import enum
from dataclasses import dataclass

import torch

from sglang_lite.distributed import DPTokens
from sglang_lite.mem_cache.pools import ModelPools, token_positions
from sglang_lite.streams.runtime import PLAIN, OverlapContext


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64: position of each new token in its request
    req_pool_indices: (
        torch.Tensor
    )  # [B] int64: row of each request in req_to_token (its page table)
    prefix_lens: list[int]  # tokens of each request already cached before this forward
    extend_lens: list[int]  # new tokens of each request in this forward (1 in DECODE)
    out_cache_loc: torch.Tensor  # [T] int64: KV slot receiving each new token
    state_slots: torch.Tensor  # [B] int64: linear-attention state slot of each request
    pools: ModelPools
    capturing: bool = False  # set while a CUDA graph records this batch
    overlap: OverlapContext = PLAIN  # set by the model for each forward from its stream plan
    # set by the model under DP attention: every DP rank's token counts
    dp_tokens: DPTokens | None = None
    # Device copies of the lengths. Derived from the lists unless given: a CUDA-graph runner passes its own static
    # buffers, which it refills before each replay (the lists are then only placeholders of the right length).
    seq_lens_t: torch.Tensor | None = None  # [B] int32: prefix + extend
    prefix_lens_t: torch.Tensor | None = None
    extend_lens_t: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None  # [B+1] int32
    # Longest prefix + extend, known on the host when the lists are real (None from a CUDA-graph runner, whose lists
    # are placeholders): spares the CPU attention path a read-back of seq_lens_t.
    max_seq_len: int | None = None
    # a speculative verify forward (rows of ``build_rows_batch``): the GDN layers step each request's tokens in
    # order and keep the states after each
    verify: VerifyStates | None = None
    # images (``scheduler/images.py``): a prefill's M-RoPE positions [3, T] (the rotary takes them instead of
    # ``positions``), and the rows of its image tokens with the vision tower's embeddings for them
    mrope_positions: torch.Tensor | None = None
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert len(self.prefix_lens) == len(self.extend_lens) == self.batch_size, (
            "per-request lengths disagree"
        )
        assert (
            sum(self.extend_lens)
            == self.num_tokens
            == self.positions.numel()
            == self.out_cache_loc.numel()
        )
        assert self.mode is ForwardMode.EXTEND or all(n == 1 for n in self.extend_lens), (
            "decode takes 1 token each"
        )
        if None in (self.prefix_lens_t, self.extend_lens_t, self.seq_lens_t, self.cu_seqlens):
            self._derive_lengths()

    def _derive_lengths(self) -> None:
        """The device copies of the lengths, as views of one tensor (one copy to the device, not four: at batch 1
        on the CPU each tensor made from a list costs a few microseconds of a ~1 ms step)."""
        b = self.batch_size
        seq = [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]
        cu = [0, *_cumsum(self.extend_lens)]
        lengths = host_ints(
            [*self.prefix_lens, *self.extend_lens, *seq, *cu], torch.int32, self.input_ids.device
        )
        own = (self.prefix_lens_t, self.extend_lens_t, self.seq_lens_t, self.cu_seqlens)
        derived = lengths.split([b, b, b, b + 1])
        self.prefix_lens_t, self.extend_lens_t, self.seq_lens_t, self.cu_seqlens = (
            given if given is not None else view for given, view in zip(own, derived)
        )

    def next_decode_step(self, input_ids: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
        """This decode batch one step on, as ``build_forward_batch`` would make it: each request's next token
        ``input_ids`` [B] at the position after its last, its KV going to ``out_cache_loc`` [B]."""
        assert self.is_decode and self.verify is None and self.dp_tokens is None, (
            "a plain decode batch on one rank"
        )
        assert input_ids.numel() == out_cache_loc.numel() == self.batch_size, "one token a request"
        self.input_ids = input_ids
        self.out_cache_loc = out_cache_loc
        self.positions = self.positions + 1
        self.prefix_lens = [p + 1 for p in self.prefix_lens]
        self.prefix_lens_t = self.prefix_lens_t + 1
        self.seq_lens_t = self.seq_lens_t + 1
        if self.max_seq_len is not None:
            self.max_seq_len += 1

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.numel()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    @property
    def last_token_indices(self) -> torch.Tensor:
        """Row of each request's last new token, for sampling."""
        return self.cu_seqlens[1:].long() - 1


class VerifyStates:
    """The Gated DeltaNet states a verify forward passes through: after token j of request i, every GDN layer's
    conv state ``conv[i, j]`` [layers, conv_dim, K-1] and recurrent state ``ssm[i, j]`` [layers, HV, dk, dv], so
    that the states after the last accepted token can replace those after the last verified one
    (``ModelPools.states`` rows hold all layers of a slot). ``steps[j]``: the token rows and the request indices
    that have a token j; the rows are ``build_rows_batch``'s, request after request.

    ``buffers``: (conv, ssm) of at least as many requests and tokens to keep the states in (a CUDA-graph runner
    shares its largest size's between its sizes), else new ones."""

    def __init__(
        self,
        pools: ModelPools,
        counts: list[int],
        device: torch.device,
        buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        longest = max(counts)
        if buffers is None:
            buffers = verify_buffers(pools, len(counts), longest)
        self.conv = buffers[0][: len(counts), :longest]
        self.ssm = buffers[1][: len(counts), :longest]
        starts = [0, *_cumsum(counts)]
        self.steps = []
        for j in range(longest):
            reqs = [i for i, n in enumerate(counts) if n > j]
            tokens = [starts[i] + j for i in reqs]
            self.steps.append(
                (
                    torch.tensor(tokens, dtype=torch.int64, device=device),
                    torch.tensor(reqs, dtype=torch.int64, device=device),
                )
            )

    def record(
        self,
        step: int,
        layer: int,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Layer ``layer``'s states of ``slots`` (the requests of ``step``) after that step's tokens."""
        reqs = self.steps[step][1]
        self.conv[reqs, step, layer] = conv_states[slots]
        self.ssm[reqs, step, layer] = ssm_states[slots]

    def restore(self, pools: ModelPools, request: int, step: int, slot: int) -> None:
        """Request ``request``'s states after its token ``step`` back into its state slot."""
        pools.states.conv_buffer[slot].copy_(self.conv[request, step])
        pools.states.ssm_buffer[slot].copy_(self.ssm[request, step])


def verify_buffers(
    pools: ModelPools, requests: int, tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (conv, ssm) buffers for ``VerifyStates`` of up to ``requests`` requests of ``tokens`` tokens."""
    conv, ssm = pools.states.conv_buffer, pools.states.ssm_buffer
    return (
        conv.new_empty((requests, tokens, *conv.shape[1:])),
        ssm.new_empty((requests, tokens, *ssm.shape[1:])),
    )


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}


def host_ints(values: list[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``; on the CPU through a buffer, about a third of the
    time (``torch.tensor`` inspects each list element)."""
    if torch.device(device).type != "cpu" or not values:
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype)


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def build_rows_batch(
    pools: ModelPools,
    token_ids: list[list[int]],
    prefix_lens: list[int],
    req_rows: list[int],
    state_slots: list[int],
    device: torch.device | str,
    out_cache_loc: list[int],
) -> ForwardBatch:
    """A decode-shaped batch over ``token_ids[i]``, several new tokens of request i: each token is a row of its
    own (request after request), with its request's page table row and state slot, attending to the cache up to
    itself (its request's earlier tokens of this forward are stored first). A speculative verify forward over a
    request's last token and its drafts, or the MTP head over kept tokens: a decode step's work per token (paged
    decode attention, the MoE by rows), with one shape for each number of rows, which a CUDA graph can capture.

    Through the main model it needs ``verify`` set (``VerifyStates`` of the requests' token counts), which makes
    the Gated DeltaNet layers step each request's tokens in order and keep the states after each."""
    counts = [len(t) for t in token_ids]
    rows = [(i, j) for i, n in enumerate(counts) for j in range(n)]
    return build_forward_batch(
        pools,
        ForwardMode.DECODE,
        [[token_ids[i][j]] for i, j in rows],
        [prefix_lens[i] + j for i, j in rows],
        [req_rows[i] for i, _ in rows],
        [state_slots[i] for i, _ in rows],
        device,
        out_cache_loc,
    )


def build_forward_batch(
    pools: ModelPools,
    mode: ForwardMode,
    token_ids: list[list[int]],
    prefix_lens: list[int],
    req_rows: list[int],
    state_slots: list[int],
    device: torch.device | str,
    out_cache_loc: list[int],
    position_offsets: list[int] | None = None,
) -> ForwardBatch:
    """The batch of ``token_ids[i]``, the new tokens of request i, which already holds ``prefix_lens[i]``
    computed tokens in request row ``req_rows[i]`` and linear-attention state slot ``state_slots[i]``.

    ``out_cache_loc``: the KV slots of the new tokens, in order, allocated (new pages recorded in the rows' page
    tables) before the batch is built, by ``RequestMemory.alloc_kv`` or ``ModelPools.alloc_kv``.
    ``position_offsets[i]``: added to request i's positions (a request with images: its M-RoPE delta).
    """
    extend_lens = [len(t) for t in token_ids]
    assert len(out_cache_loc) == sum(extend_lens), "one KV slot per new token"
    flat = [t for ids in token_ids for t in ids]
    one_each = all(n == 1 for n in extend_lens)
    starts = prefix_lens
    if position_offsets is not None:
        starts = [p + o for p, o in zip(prefix_lens, position_offsets)]
    # the index tensors as views of one (a decode step's positions are its prefix lengths): one copy, not five
    parts = [flat, req_rows, out_cache_loc, state_slots] + ([starts] if one_each else [])
    indices = host_ints([i for part in parts for i in part], torch.int64, device)
    input_ids, rows, slots, states, *positions = indices.split([len(part) for part in parts])
    return ForwardBatch(
        mode=mode,
        input_ids=input_ids,
        positions=positions[0] if one_each else token_positions(starts, extend_lens, device),
        req_pool_indices=rows,
        prefix_lens=list(prefix_lens),
        extend_lens=extend_lens,
        max_seq_len=max(p + e for p, e in zip(prefix_lens, extend_lens)) if extend_lens else 0,
        out_cache_loc=slots,
        state_slots=states,
        pools=pools,
    )
