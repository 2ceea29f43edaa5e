"""Log-probabilities (SGLang's ``return_logprob`` family) against transformers' log-softmax, in float32: prompt and
output tokens, top-k and chosen ids, under chunked prefill, the prefix cache, sampling and streaming."""

from __future__ import annotations

import pytest
import torch

from sglang_lite import Engine
from sglang_lite.runtime.factory import create_scheduler
from sglang_lite.sampling.logprobs import LogprobParams
from sglang_lite.server_args import ServerArgs
from tests.engine.conftest import random_prompts
from tests.engine.test_engine_parity import small_chunks

TOL = 1e-4


def reference_logprobs(checkpoint, tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of ``tokens`` [T, vocab] (position p predicts token p + 1)."""
    with torch.no_grad():
        logits = checkpoint.model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def run(
    scheduler, requests: dict[str, tuple[list[int], dict, LogprobParams | None]]
) -> dict[str, dict]:
    """Runs requests to the end in one scheduler; each rid's tokens and its meta_info lists joined."""
    for rid, (prompt, params, logprob) in requests.items():
        scheduler.add_request(rid, prompt, params, logprob=logprob)
    results: dict[str, dict] = {rid: {"ids": [], "meta": {}} for rid in requests}
    while scheduler.has_work:
        for out in scheduler.step():
            result = results[out.rid]
            result["ids"] += out.new_token_ids
            for key, value in out.meta_info.items():
                if key.endswith("logprobs"):
                    result["meta"].setdefault(key, []).extend(value)
        scheduler.check_invariants()
    return results


def check_entries(
    entries: list, reference: torch.Tensor, targets: list[int], positions: list[int]
) -> None:
    assert [e[1] for e in entries] == targets
    expected = reference[positions, targets]
    assert torch.allclose(torch.tensor([e[0] for e in entries]), expected, atol=TOL), (
        entries,
        expected,
    )


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_and_output_logprobs_match_transformers(checkpoints, chunked):
    checkpoint = checkpoints["moe"]
    args = (
        small_chunks(checkpoint.path)
        if chunked
        else dict(model_path=checkpoint.path, skip_tokenizer_init=True)
    )
    scheduler = create_scheduler(ServerArgs(**args))
    prompts = random_prompts([21, 5, 33], seed=7)
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    asks = {
        "0": LogprobParams(True, 0, 3, [1, 2, 3]),
        "1": LogprobParams(True, 2),
        "2": LogprobParams(True, -1, 2),
    }
    results = run(scheduler, {rid: (prompts[int(rid)], greedy, asks[rid]) for rid in asks})
    for rid, ask in asks.items():
        prompt, result = prompts[int(rid)], results[rid]
        out, meta = result["ids"], result["meta"]
        reference = reference_logprobs(checkpoint, prompt + out)
        n = len(prompt)
        check_entries(
            meta["output_token_logprobs"], reference, out, list(range(n - 1, n - 1 + len(out)))
        )
        if ask.top_logprobs_num:
            for position, top in zip(range(n - 1, n + len(out)), meta["output_top_logprobs"]):
                values, ids = reference[position].topk(ask.top_logprobs_num)
                assert [t[1] for t in top] == ids.tolist()
                assert torch.allclose(torch.tensor([t[0] for t in top]), values, atol=TOL)
        if ask.logprob_start_len < 0:
            assert "input_token_logprobs" not in meta
            continue
        start = ask.logprob_start_len
        entries = meta["input_token_logprobs"]
        assert len(entries) == n - start
        if start == 0:
            assert entries[0] == [None, prompt[0], None]
            entries = entries[1:]
        first = max(start, 1)
        check_entries(entries, reference, prompt[first:], list(range(first - 1, n - 1)))
        if ask.token_ids_logprob:
            picked = meta["input_token_ids_logprobs"][1:]
            for position, row in zip(range(first - 1, n - 1), picked):
                assert [t[1] for t in row] == ask.token_ids_logprob
                assert torch.allclose(
                    torch.tensor([t[0] for t in row]), reference[position, [1, 2, 3]], atol=TOL
                )


def test_max_new_tokens_zero_scores_the_prompt_and_the_cache_does_not_hide_it(checkpoints):
    """lm-eval's log-likelihood requests: prompt log-probabilities only. The second, identical request finds the
    first one's prefix cached, but positions whose log-probabilities are asked for are computed again."""
    checkpoint = checkpoints["dense"]
    scheduler = create_scheduler(ServerArgs(model_path=checkpoint.path, skip_tokenizer_init=True))
    (prompt,) = random_prompts([30], seed=3)
    reference = reference_logprobs(checkpoint, prompt)
    score = {"max_new_tokens": 0}
    for attempt in range(2):
        results = run(scheduler, {f"r{attempt}": (prompt, score, LogprobParams(True, 10, 1))})
        result = results[f"r{attempt}"]
        assert result["ids"] == []
        check_entries(
            result["meta"]["input_token_logprobs"], reference, prompt[10:], list(range(9, 29))
        )


def test_sampled_tokens_report_the_models_logprobs_not_the_tempered_ones(checkpoints):
    checkpoint = checkpoints["moe"]
    scheduler = create_scheduler(ServerArgs(model_path=checkpoint.path, skip_tokenizer_init=True))
    (prompt,) = random_prompts([12], seed=5)
    params = {"max_new_tokens": 8, "temperature": 2.5, "top_k": 20, "seed": 11, "ignore_eos": True}
    result = run(scheduler, {"s": (prompt, params, LogprobParams(True))})["s"]
    reference = reference_logprobs(checkpoint, prompt + result["ids"])
    positions = list(range(len(prompt) - 1, len(prompt) - 1 + 8))
    check_entries(result["meta"]["output_token_logprobs"], reference, result["ids"], positions)


def test_engine_streams_logprobs_per_piece(checkpoints):
    checkpoint = checkpoints["moe"]
    (prompt,) = random_prompts([9], seed=9)
    params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    with Engine(checkpoint.path, skip_tokenizer_init=True, stream_interval=1) as engine:
        whole = engine.generate(
            input_ids=prompt,
            sampling_params=params,
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
        )
        pieces = list(
            engine.generate_stream(
                input_ids=prompt, sampling_params=params, logprob=LogprobParams(True, 0, 2)
            )
        )
        with pytest.raises(ValueError, match="top_logprobs_num"):
            engine.generate(input_ids=prompt, return_logprob=True, top_logprobs_num=-1)
        with pytest.raises(ValueError, match="logprob_start_len"):
            engine.generate(input_ids=prompt, return_logprob=True, logprob_start_len=len(prompt))
    meta = whole["meta_info"]
    assert len(meta["output_token_logprobs"]) == 5 and len(meta["input_token_logprobs"]) == len(
        prompt
    )
    streamed = [e for piece in pieces for e in piece["meta_info"]["output_token_logprobs"]]
    assert streamed == meta["output_token_logprobs"]
    assert all(
        len(piece["meta_info"]["output_token_logprobs"]) == len(piece["output_ids"])
        for piece in pieces
    )
