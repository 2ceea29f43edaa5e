"""Frequency, presence and repetition penalties and logit biases: the batched book against a per-request loop, the
parameters' validation and transport, and their effect on the tiny model's greedy output (scheduler, Engine, HTTP)."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import httpx
import pytest
import torch

from sglang_lite.runtime.messages import AddRequest, decode, encode
from sglang_lite.sampling import SamplingParams
from sglang_lite.sampling.penalties import PenaltyBook
from tests.server.conftest import ServerProcess, server_dp1  # noqa: F401 (the session server fixture)

VOCAB = 50
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference(logits: torch.Tensor, params: SamplingParams, output_ids: list[int]) -> torch.Tensor:
    """One request's penalised logits, token by token (SGLang's order: additive, scaling, bias)."""
    out = logits.double().clone()
    for token, count in Counter(output_ids).items():
        out[token] -= params.frequency_penalty * count + params.presence_penalty
        rep = params.repetition_penalty
        out[token] = out[token] * rep if out[token] < 0 else out[token] / rep
    for token, bias in (params.logit_bias or {}).items():
        out[int(token)] += bias
    return out.float()


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["none", "counts", "bias", "all"])
    counts = kind in ("counts", "all")
    return SamplingParams(
        frequency_penalty=rng.uniform(-2, 2) if counts else 0.0,
        presence_penalty=rng.uniform(-2, 2) if counts else 0.0,
        repetition_penalty=rng.uniform(0.1, 2) if counts else 1.0,
        logit_bias={str(rng.randrange(VOCAB)): rng.uniform(-100, 100) for _ in range(3)}
        if kind in ("bias", "all")
        else None,
    )


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_book_matches_a_per_request_loop_over_mixed_rows(seed, device):
    """Rows with and without penalties share batches; requests come and go; every step's logits match."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    book = PenaltyBook(num_rows=8, vocab_size=VOCAB, device=device)
    live: dict[int, tuple[SamplingParams, list[int]]] = {}
    for _ in range(40):
        for row in [r for r in live if rng.random() < 0.1]:  # finished
            book.release(row)
            del live[row]
        for row in [
            r for r in range(8) if r not in live and rng.random() < 0.3
        ]:  # admitted (some retracted)
            params, history = (
                random_params(rng),
                [rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 5]))],
            )
            book.admit(row, params, history)
            live[row] = (params, history)
        if not live:
            continue
        rows = rng.sample(sorted(live), len(live))  # batch order is not row order
        logits = torch.randn(len(rows), VOCAB, generator=gen) * 5
        raw = logits.clone()
        got = book.apply(rows, logits.to(device)).cpu()
        assert torch.equal(logits, raw), "the raw logits (for log-probabilities) stay as they are"
        for i, row in enumerate(rows):
            assert_close(got[i], reference(raw[i], *live[row]))
        tokens = torch.randint(0, VOCAB, (len(rows),), generator=gen)
        book.record(rows, tokens.to(device))
        for row, token in zip(rows, tokens.tolist()):
            live[row][1].append(token)


def test_readmission_counts_the_output_so_far_again():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.5)
    book = PenaltyBook(num_rows=4, vocab_size=VOCAB, device="cpu")
    book.admit(2, params)
    book.record([2], [7])
    book.record([2], torch.tensor([7]))
    book.release(
        2
    )  # retracted: the row goes to another request, which leaves tokens of its own in it
    book.admit(2, SamplingParams(presence_penalty=1.0), [1, 1, 1])
    book.release(2)
    book.admit(3, params, [7, 7])  # back, in another row, with its output so far
    logits = torch.linspace(-3, 3, VOCAB).unsqueeze(0)
    assert_close(book.apply([3], logits)[0], reference(logits[0], params, [7, 7]))
    assert book.counts[3].sum() == 2 and book.counts[3, 7] == 2


def test_a_book_without_penalties_allocates_nothing_and_returns_the_logits():
    book = PenaltyBook(num_rows=4, vocab_size=VOCAB, device="cpu")
    book.admit(0, SamplingParams(temperature=0.0))
    logits = torch.randn(1, VOCAB)
    assert book.apply([0], logits) is logits and book.counts is None
    book.admit(1, SamplingParams(logit_bias={"3": 1.0}))  # a bias alone needs no counts
    assert book.counts is None and book.apply([0], logits) is logits
    assert book.apply([1, 0], torch.zeros(2, VOCAB))[:, 3].tolist() == [1.0, 0.0]


def test_penalties_do_not_break_minus_infinity_or_low_precision_logits():
    params = SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0, logit_bias={"0": -100})
    book = PenaltyBook(num_rows=1, vocab_size=4, device="cpu")
    book.admit(0, params, [0, 1])
    logits = torch.tensor([[float("-inf"), 2.0, -2.0, 0.0]], dtype=torch.bfloat16)
    got = book.apply([0], logits)
    assert got.dtype == torch.float32 and got[0].tolist() == [float("-inf"), 0.5, -2.0, 0.0]


# ---- parameters ------------------------------------------------------------------------------------------------
BAD_PARAMS = [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"presence_penalty": -2.1}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"logit_bias": {"1000": 1.0}}, "logit_bias"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": float("inf")}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
]


@pytest.mark.parametrize("params,field", BAD_PARAMS)
def test_bad_penalty_names_its_field(params, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams.from_dict(params).validate(vocab_size=1000)


def test_penalties_survive_the_wire_and_int_keys_become_strings():
    params = SamplingParams.from_dict(
        {
            "frequency_penalty": -2,
            "presence_penalty": 2.0,
            "repetition_penalty": 0.5,
            "logit_bias": {5: -100, "999": 100.0},
        }
    )
    params.validate(vocab_size=1000)
    assert params.logit_bias == {"5": -100, "999": 100.0}
    back = decode(encode(AddRequest("r", [1, 2], params)))
    assert back.sampling_params == params
    assert SamplingParams.from_dict(dataclasses.asdict(params)) == params


# ---- the tiny model: the scheduler, the Engine and the HTTP server ----------------------------------------------
GREEDY = {
    "temperature": 0.0,
    "ignore_eos": True,
    "max_new_tokens": 40,
}  # plain greedy repeats by then
PROMPT = [11, 900, 42, 7, 7, 3000, 15]


@pytest.fixture(scope="module")
def scheduler():
    from sglang_lite.runtime.factory import create_scheduler
    from sglang_lite.server_args import ServerArgs

    return create_scheduler(
        ServerArgs(
            load_format="dummy", max_total_tokens=512, max_running_requests=4, context_length=128
        )
    )


def run_recording_logits(scheduler, params: dict) -> tuple[list[int], list[torch.Tensor]]:
    """One request alone; its output and the model's raw logits at each step."""
    logits: list[torch.Tensor] = []
    forward = scheduler.runner.forward_batch
    scheduler.runner.forward_batch = lambda *args: logits.append(forward(*args)) or logits[-1]
    try:
        scheduler.add_request("r", PROMPT, params)
        output: list[int] = []
        while scheduler.has_work:
            output += [t for out in scheduler.step() for t in out.new_token_ids]
            scheduler.check_invariants()
    finally:
        del scheduler.runner.forward_batch
    return output, [step[0].float() for step in logits]


@pytest.mark.parametrize(
    "penalties",
    [
        {"frequency_penalty": 1.5},
        {"repetition_penalty": 1.8},
        {
            "presence_penalty": 0.7,
            "frequency_penalty": -0.5,
            "repetition_penalty": 0.8,
            "logit_bias": {"17": 3.0},
        },
    ],
)
def test_greedy_output_follows_the_penalised_model_logits(scheduler, penalties):
    """Each greedy token is the argmax of the model's own logits penalised by the output before it."""
    plain, _ = run_recording_logits(scheduler, GREEDY)
    output, logits = run_recording_logits(scheduler, {**GREEDY, **penalties})
    assert output != plain, "the penalty was meant to change the greedy output"
    params = SamplingParams.from_dict(penalties)
    expected = [int(reference(step, params, output[:i]).argmax()) for i, step in enumerate(logits)]
    assert output == expected


@pytest.fixture(scope="module")
def engine():
    from sglang_lite import Engine

    with Engine(
        load_format="dummy", max_total_tokens=1024, max_running_requests=4, context_length=256
    ) as engine:
        yield engine


def test_logit_bias_forces_a_token_every_step(engine):
    result = engine.generate(
        input_ids=PROMPT, sampling_params={**GREEDY, "logit_bias": {"500": 100}}
    )
    assert result["output_ids"] == [500] * GREEDY["max_new_tokens"]
    other = engine.generate(input_ids=PROMPT, sampling_params={**GREEDY, "logit_bias": {500: -100}})
    assert 500 not in other["output_ids"]


def test_large_presence_penalty_never_repeats_a_token(engine):
    plain = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    assert len(set(plain)) < len(plain), "the plain greedy output was meant to repeat itself"
    output = engine.generate(
        input_ids=PROMPT, sampling_params={**GREEDY, "presence_penalty": 2.0, "logit_bias": None}
    )
    assert len(set(output["output_ids"])) == len(output["output_ids"]) == GREEDY["max_new_tokens"]


def test_engine_refuses_bad_penalties_naming_the_field(engine):
    with pytest.raises(ValueError, match="repetition_penalty"):
        engine.generate(input_ids=PROMPT, sampling_params={"repetition_penalty": 3.0})
    with pytest.raises(ValueError, match="logit_bias"):
        engine.generate(input_ids=PROMPT, sampling_params={"logit_bias": {"4096": 1.0}})


def completions(server: ServerProcess, **body) -> httpx.Response:
    body = {"model": "m", "prompt": "def main():", "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=60)


def test_openai_completions_take_logit_bias_and_penalties(server_dp1: ServerProcess) -> None:  # noqa: F811
    forced = completions(
        server_dp1,
        logit_bias={"500": 100},
        presence_penalty=1.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.2,
    )
    assert forced.status_code == 200, forced.text
    texts = [
        r.json()["choices"][0]["text"]
        for r in (forced, completions(server_dp1, logit_bias={"500": 100}), completions(server_dp1))
    ]
    assert texts[0] == texts[1] != texts[2], texts
    bad = completions(server_dp1, presence_penalty=3.0)
    assert bad.status_code == 400 and "presence_penalty" in bad.text
    bad = completions(server_dp1, logit_bias={"banana": 1})
    assert bad.status_code == 400 and "logit_bias" in bad.text
