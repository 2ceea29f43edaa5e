"""Sampling parameters, the batched sampler and incremental detokenisation (no model needed)."""

from __future__ import annotations

import pytest
import torch

from sglang_lite.sampling import SamplingParams, make_generator, sample
from sglang_lite.sampling.sampler import CANDIDATES, argmax_rows, filtered_probs
from sglang_lite.sampling.sampler import draw as draw_index
from sglang_lite.tokenizer import IncrementalDetokenizer, StopStringMatcher, load_tokenizer

BAD_PARAMS = [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_new_tokens": -3}, "min_new_tokens"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"stop": [""]}, "stop"),
]


@pytest.mark.parametrize("params,field", BAD_PARAMS)
def test_bad_parameter_names_its_field(params, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams.from_dict(params).validate(vocab_size=1000)


def test_unknown_parameter_is_named():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_stop_accepts_a_single_string_and_good_params_validate():
    params = SamplingParams.from_dict({"stop": "\n", "top_k": 5, "top_p": 0.9, "temperature": 0.0})
    params.validate(vocab_size=10)
    assert params.stop == ["\n"] and params.is_greedy


def rows(*logits: list[float]) -> torch.Tensor:
    return torch.tensor(logits, dtype=torch.float32)


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    gen = make_generator(seed)
    return [sample(logits, [params], [gen]).item() for _ in range(n)]


def test_greedy_and_top_k_1_take_the_argmax():
    logits = rows([0.1, 2.0, 1.9, -1.0], [3.0, 0.0, 0.0, 2.9])
    greedy = SamplingParams(temperature=0.0)
    top1 = SamplingParams(temperature=5.0, top_k=1)
    gens = [make_generator(0), make_generator(1)]
    assert sample(logits, [greedy, top1], gens).tolist() == [1, 0]


@pytest.mark.parametrize(
    "kind", ["random", "ties", "nan", "all -inf", "max in the short last block"]
)
@pytest.mark.parametrize("vocab", [1024, 1000, 4097, 32000])
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_cpu_argmax_equals_torch_argmax(kind, vocab, backend, monkeypatch):
    """The CPU's argmax (the C++ kernel, or the blocked one of PyTorch ops) returns torch's index: the first
    maximum, NaN counting as the maximum."""
    monkeypatch.setenv("SGLANG_KERNEL_BACKEND", backend)
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    if kind == "ties":
        logits = torch.randint(0, 3, (5, vocab), generator=gen).float()
    elif kind == "nan":
        logits[:, torch.randint(0, vocab, (3,), generator=gen)] = float("nan")
        logits[0] = torch.randn(vocab, generator=gen)  # a row without NaN beside them
    elif kind == "all -inf":
        logits[:] = float("-inf")
    elif kind == "max in the short last block":
        logits[:, -1] = logits[:, -2] = 100.0
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert torch.equal(
        argmax_rows(logits[:, :-3]), logits[:, :-3].argmax(dim=-1)
    )  # rows that are strided


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05]]))
    assert set(draw(logits, SamplingParams(top_k=2), 300)) == {0, 1}
    assert set(draw(logits, SamplingParams(top_p=0.65), 300)) == {0, 1}  # 0.4 < 0.65 <= 0.7
    assert set(draw(logits, SamplingParams(min_p=0.6), 300)) == {0, 1}  # keeps p >= 0.24
    assert set(draw(logits, SamplingParams(), 2000)) == {0, 1, 2, 3, 4}


def test_temperature_follows_the_softened_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = torch.bincount(
        torch.tensor(draw(logits, SamplingParams(temperature=2.0), 4000)), minlength=3
    )
    expected = torch.softmax(logits[0] / 2.0, dim=-1)
    assert torch.allclose(counts / 4000, expected, atol=0.03), (counts / 4000, expected)


def test_seeded_request_draws_the_same_whatever_shares_its_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=7)
    alone = [sample(logits[:1], [params], [make_generator(7)]).item() for _ in range(1)]
    gens = [make_generator(7), make_generator(1), make_generator(2)]
    batched = sample(
        logits, [params, SamplingParams(), SamplingParams(temperature=0.0)], gens
    ).tolist()
    assert batched[0] == alone[0]
    again = [draw(logits[:1], params, 20, seed=7), draw(logits[:1], params, 20, seed=7)]
    assert again[0] == again[1] and len(set(again[0])) > 1


def test_draw_follows_the_weights_and_never_takes_a_zero():
    weights = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25, 0.0])
    gen = make_generator(3)
    counts = torch.bincount(
        torch.stack([draw_index(weights, gen) for _ in range(4000)]), minlength=6
    )
    assert counts[[0, 2, 5]].sum() == 0
    assert torch.allclose(counts / 4000, weights, atol=0.03), counts / 4000


def test_a_distribution_of_nan_is_refused_not_drawn_from():
    logits = rows([0.0, float("nan"), 1.0])
    with pytest.raises(ValueError, match="no token to sample"):
        sample(logits, [SamplingParams(temperature=1.0)], [make_generator(0)])


def test_filters_among_the_likeliest_tokens_draw_as_the_whole_sort_does():
    """Rows whose top-k, top-p or min-p end within the CANDIDATES likeliest tokens draw from those alone, the others
    from the whole vocabulary sorted; in one batch, every row follows the distribution its filters define."""
    vocab, n = 4 * CANDIDATES, 3000
    gen = torch.Generator().manual_seed(5)
    peaked = torch.randn(vocab, generator=gen)
    peaked[:6] += torch.tensor([9.0, 8.5, 8.0, 7.5, 7.0, 6.5])  # nearly all the mass in six tokens
    flat = torch.randn(vocab, generator=gen) * 0.1
    logits = torch.stack([peaked, flat, flat, peaked])
    params = [
        SamplingParams(top_p=0.9),  # decided among the candidates
        SamplingParams(top_p=0.9),  # the whole vocabulary needed
        SamplingParams(top_k=CANDIDATES + 500),  # more candidates than the default
        SamplingParams(temperature=0.5, min_p=0.2),
    ]
    gens = [make_generator(i) for i in range(4)]
    draws = torch.stack([sample(logits, params, gens) for _ in range(n)])  # [n, 4]
    for row, p in enumerate(params):
        expected = filtered_probs(logits[row : row + 1], p)[0]
        expected = expected / expected.sum()
        counts = torch.bincount(draws[:, row], minlength=vocab).float() / n
        assert (expected[draws[:, row]] > 0).all(), f"row {row} drew a filtered token"
        if row in (0, 3):  # few tokens: each one's frequency
            assert torch.allclose(counts, expected, atol=0.03), (row, counts[:8], expected[:8])
        else:  # many tokens: as many distinct ones drawn as the distribution gives, on average
            distinct = (1 - (1 - expected.double()) ** n).sum().item()
            drawn = len(set(draws[:, row].tolist()))
            assert drawn > 0.9 * distinct, (row, drawn, distinct)


def test_banned_ids_are_never_produced():
    logits = rows([5.0, 0.0, 0.0])
    assert (
        sample(logits, [SamplingParams(temperature=0.0)], [make_generator(0)], banned=[[0]]).item()
        != 0
    )


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def test_incremental_detokenizer_never_breaks_a_character(tokenizer):
    text = "def naïve(): return '日本語 ✓ 🐍' # ok\n    x = 1"
    ids = tokenizer.encode(text)
    detok, pieces = IncrementalDetokenizer(tokenizer), []
    for token in ids:
        pieces.append(detok.push([token]))
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert sum(1 for p in pieces if p) > 5  # it really streams


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_gives_the_wrappers_text_through_the_fast_decoder(
    tokenizer, skip_special_tokens
):
    ids = torch.randint(
        0, len(tokenizer), (400,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    assert detok._decoder is not tokenizer  # the built-in tokenizer takes the Rust path
    text = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_stop_string_spanning_pieces_is_found_and_not_emitted():
    matcher = StopStringMatcher(["STOP", "\n\n"])
    emitted = [matcher.feed(p) for p in ["abc S", "T", "OP and more"]]
    assert "".join(emitted) == "abc " and matcher.matched == "STOP"
    assert emitted[0] == "abc "  # " S" could begin "STOP": held back


def test_stop_matcher_releases_a_false_start():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("xST") == "x"
    assert matcher.feed("ay") == "STay"
    assert matcher.flush() == "" and matcher.matched is None


@pytest.mark.parametrize(
    "params,field", [({"stop": 5}, "stop"), ({"stop_token_ids": 7}, "stop_token_ids")]
)
def test_wrong_container_types_name_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(params)
