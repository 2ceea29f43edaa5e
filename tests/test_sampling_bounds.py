"""Property-based checks of ``SamplingParams.validate``, the one gate of both HTTP APIs and the scheduler: every
generated dict, with values at and beyond every bound, is either accepted (and then within the documented limits,
carried by the transport and sampled without error) or refused with a ValueError naming its field."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_lite.runtime.messages import AddRequest, decode, encode
from sglang_lite.sampling import SamplingParams, make_generator, sample
from sglang_lite.sampling.params import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_NEW_TOKENS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
)

VOCAB = 4096
EOS = [VOCAB - 1]
EDGE_INTS = [
    0,
    1,
    -1,
    -2,
    VOCAB - 1,
    VOCAB,
    VOCAB + 1,
    INT32_MAX,
    INT32_MAX + 1,
    INT64_MAX,
    INT64_MAX + 1,
    INT64_MIN,
    INT64_MIN - 1,
    2**64,
    2**64 - 1,
    -(2**64),
    10**30,
]
EDGE_FLOATS = [
    0.0,
    -0.0,
    1.0,
    1e-6,
    5e-324,
    -1e-9,
    1.0000001,
    MAX_TEMPERATURE,
    MAX_TEMPERATURE * 1.0001,
    3.5e38,
    1.7e308,
    math.inf,
    -math.inf,
    math.nan,
]
SETTINGS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

ints = st.one_of(
    st.sampled_from(EDGE_INTS), st.integers(-(2**70), 2**70), st.integers(-3, VOCAB + 3)
)
floats = st.one_of(
    st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1)
)
numbers = st.one_of(ints, floats)
junk = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.lists(st.integers(), max_size=2))
stop_strings = st.one_of(
    st.text(max_size=MAX_STOP_CHARS + 8),
    st.sampled_from(["", "\ud800", "x" * MAX_STOP_CHARS, "x" * (MAX_STOP_CHARS + 1)]),
)
stops = st.one_of(
    stop_strings,
    st.lists(stop_strings, max_size=MAX_STOP_STRINGS + 4),
    st.just(["ab"] * (MAX_STOP_STRINGS + 1)),
    st.just(["y" * (MAX_STOP_CHARS // MAX_STOP_STRINGS)] * MAX_STOP_STRINGS),
    junk,
)
stop_ids = st.one_of(
    st.lists(ints, max_size=4),
    st.lists(
        st.integers(0, VOCAB - 2),
        min_size=MAX_STOP_TOKEN_IDS - 1,
        max_size=MAX_STOP_TOKEN_IDS + 1,
        unique=True,
    ),
    junk,
)
FIELDS = {
    "max_new_tokens": st.one_of(ints, floats, junk),
    "min_new_tokens": st.one_of(ints, floats, junk),
    "temperature": st.one_of(numbers, junk),
    "top_p": st.one_of(numbers, junk),
    "top_k": st.one_of(ints, floats, junk),
    "min_p": st.one_of(numbers, junk),
    "seed": st.one_of(ints, floats, junk),
    "stop": stops,
    "stop_token_ids": stop_ids,
    "ignore_eos": st.one_of(st.booleans(), junk, ints),
    "skip_special_tokens": st.one_of(st.booleans(), junk, ints),
}
requests = st.fixed_dictionaries({}, optional=FIELDS)


@given(raw=requests)
@SETTINGS
def test_every_value_is_accepted_within_bounds_or_refused_by_name(raw: dict) -> None:
    try:
        params = SamplingParams.from_dict(raw)
        params.validate(vocab_size=VOCAB)
    except ValueError as error:
        assert any(name in str(error) for name in raw), f"{error} names none of {sorted(raw)}"
        assert len(str(error)) < 400, "an error message quotes a bounded part of the value"
        return
    _assert_within_bounds(params)
    assert decode(encode(AddRequest("r", [1, 2], params))).sampling_params == params
    _assert_samples(params)


def _assert_within_bounds(params: SamplingParams) -> None:
    assert (
        0 <= params.max_new_tokens <= MAX_NEW_TOKENS
        and 0 <= params.min_new_tokens <= MAX_NEW_TOKENS
    )
    assert math.isfinite(params.temperature) and 0 <= params.temperature <= MAX_TEMPERATURE
    assert 0 < params.top_p <= 1 and 0 <= params.min_p <= 1
    assert params.top_k == -1 or 1 <= params.top_k <= VOCAB
    assert params.seed is None or INT64_MIN <= params.seed <= INT64_MAX
    assert len(params.stop) <= MAX_STOP_STRINGS and sum(map(len, params.stop)) <= MAX_STOP_CHARS
    assert len(params.stop_token_ids) <= MAX_STOP_TOKEN_IDS and all(
        0 <= t < VOCAB for t in params.stop_token_ids
    )
    assert isinstance(params.ignore_eos, bool) and isinstance(params.skip_special_tokens, bool)


def _assert_samples(params: SamplingParams) -> None:
    """What the rank does with a request still short of min_new_tokens: its stop ids are banned."""
    logits = torch.randn(1, VOCAB, generator=make_generator(0)) * 30
    generator = make_generator(params.seed if params.seed is not None else 0)
    token = sample(
        logits, [params], [generator], banned=[sorted(set(params.stop_token_ids) | set(EOS))]
    )
    assert 0 <= int(token[0]) < VOCAB and int(token[0]) not in params.stop_token_ids


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_k", 2**63),
        ("top_k", VOCAB + 1),
        ("top_k", 0),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", -math.inf),
        ("temperature", 10**400),
        ("top_p", math.nan),
        ("min_p", math.inf),
        ("max_new_tokens", 2**64),
        ("min_new_tokens", 2**63),
        ("seed", 2**63),
        ("seed", INT64_MIN - 1),
        ("stop", ["s"] * (MAX_STOP_STRINGS + 1)),
        ("stop", ["x" * (MAX_STOP_CHARS + 1)]),
        ("stop", ["\ud800"]),
        ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
        ("stop_token_ids", [VOCAB]),
        ("ignore_eos", "yes"),
        ("max_new_tokens", True),
    ],
)
def test_each_bound_names_its_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams.from_dict({field: value}).validate(vocab_size=VOCAB)


@pytest.mark.parametrize(
    "field,value",
    [
        ("top_k", VOCAB),
        ("top_k", -1),
        ("seed", INT64_MIN),
        ("seed", INT64_MAX),
        ("max_new_tokens", MAX_NEW_TOKENS),
        ("temperature", MAX_TEMPERATURE),
        ("stop", ["s"] * MAX_STOP_STRINGS),
        ("stop", ["x" * MAX_STOP_CHARS]),
        ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS))),
    ],
)
def test_each_bound_itself_is_accepted(field: str, value: object) -> None:
    SamplingParams.from_dict({field: value}).validate(vocab_size=VOCAB)


def test_sampling_seed_is_the_seed_under_sglang_name():
    assert SamplingParams.from_dict({"sampling_seed": 7}).seed == 7
    assert SamplingParams.from_dict({"sampling_seed": 7, "seed": 7}).seed == 7
    assert SamplingParams.from_dict({"sampling_seed": None, "seed": 3}).seed == 3
    with pytest.raises(ValueError, match="seed and sampling_seed differ"):
        SamplingParams.from_dict({"sampling_seed": 7, "seed": 8})


def test_step_seeds_depend_on_seed_and_position_only():
    from sglang_lite.sampling.sampler import step_seed

    seeds = {
        step_seed(seed, position)
        for seed in (INT64_MIN, -1, 0, 1, INT64_MAX)
        for position in range(50)
    }
    assert len(seeds) == 250 and all(
        0 <= s <= INT64_MAX for s in seeds
    )  # distinct, and torch takes them
