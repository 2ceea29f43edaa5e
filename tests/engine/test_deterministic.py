"""Deterministic inference (issue 52, ``enable_deterministic_inference``): with the flag, a request's output token
ids and their logprobs are the same bits alone, batched with ten other prompts, in 64-token prefill chunks, from
the prefix cache and under speculative decoding with the MTP head, on the built-in model (float32) and on a random
bf16 MoE checkpoint with a head; a seeded sampled request draws the same tokens alone and batched. Without the
flag, speculative greedy tokens (NEXTN, NGRAM) are plain decoding's over 96 tokens."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_lite import Engine
from tests.engine.conftest import random_prompts
from tests.hf_checkpoints import add_mtp_head, make_hf_model, save_checkpoint
from tests.speculative.conftest import repeating_head

NEW_TOKENS = 28
LENGTHS = [20, 67, 150, 41, 96]  # the prompts checked: three longer than one 64-token chunk
OTHER_LENGTHS = [5, 130, 33, 77, 12, 150, 58, 24, 101, 9]  # the ten batched beside each of them
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
CACHED_SHORT_BY = 8  # the prefix-cache scenario first caches each prompt but its last 8 tokens
NEXTN = dict(speculative_algorithm="NEXTN", speculative_num_steps=3)
NGRAM = dict(speculative_algorithm="NGRAM")
DETERMINISTIC = dict(enable_deterministic_inference=True, disable_radix_cache=True)
# a small MoE model: hidden 64, linear and full attention layers alternating, vocabulary 256
CHECKPOINT_SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    layer_types=["linear_attention", "full_attention"] * 2,
)

Completion = tuple[list[int], list[float]]  # output token ids, their logprobs


@dataclass(frozen=True)
class Model:
    """A model under test: its engine arguments, the prompts checked and the ten batched beside each."""

    name: str
    args: dict[str, Any]
    prompts: list[list[int]]
    others: list[list[int]]

    def run(self, work: Callable[[Engine], Any], **settings: Any) -> Any:
        """``work(engine)`` on a fresh engine of this model with ``settings`` added, shut down after."""
        engine = Engine(**{**self.args, **settings})
        try:
            return work(engine)
        finally:
            engine.shutdown()


def bf16_moe_checkpoint(root: str) -> str:
    """A random MoE checkpoint whose MTP head drafts its input token again, saved in bf16. Its seed is one whose
    greedy tokens repeat now and then (wider random weights rarely do), so that drafts are accepted in part."""
    path = os.path.join(root, "moe-bf16")
    hf = make_hf_model(moe=True, seed=2, **CHECKPOINT_SIZES)
    save_checkpoint(hf, path)
    add_mtp_head(hf, path, seed=6)
    repeating_head(path)
    to_bfloat16(path)
    return path


def to_bfloat16(path: str) -> None:
    """Rewrites the single-file checkpoint at ``path`` with bf16 tensors, as its config then says."""
    file = os.path.join(path, "model.safetensors")
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(file).items()}
    save_file(tensors, file)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, "dtype": "bfloat16"}, f, indent=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return bf16_moe_checkpoint(str(tmp_path_factory.mktemp("deterministic")))


def make_model(name: str, checkpoint: str) -> Model:
    # one thread: on a busy two-core host, two threads' waits at each barrier made decoding 10-100x slower
    base = dict(cpu_threads_per_rank=1, max_total_tokens=4096, context_length=512)
    if name == "builtin":  # token ids below its special ones (4093..4095)
        args = dict(base)
        vocab = 4000
    else:
        # --dtype auto: the bf16 weights stay bf16, activations float32 (the CPU's kernels)
        args = dict(base, model_path=checkpoint, skip_tokenizer_init=True)
        vocab = 256
    prompts = random_prompts(LENGTHS, vocab=vocab, seed=11)
    return Model(name, args, prompts, random_prompts(OTHER_LENGTHS, vocab=vocab, seed=12))


@pytest.fixture(scope="module", params=["builtin", "moe-bf16"])
def model(request: pytest.FixtureRequest, checkpoint: str) -> Model:
    return make_model(request.param, checkpoint)


# ---- running and comparing -------------------------------------------------------------------------------------
def completion(result: dict[str, Any]) -> Completion:
    logprobs = [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]
    return result["output_ids"], logprobs


def generate(engine: Engine, prompts: list[list[int]], params: list[dict]) -> list[dict]:
    return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)


def each_alone(
    engine: Engine, prompts: list[list[int]], params: Callable[[int], dict] = lambda i: GREEDY
) -> list[dict]:
    """Each prompt in a call of its own; ``params(i)``: prompt i's sampling parameters."""
    return [generate(engine, [p], [params(i)])[0] for i, p in enumerate(prompts)]


def each_batched(
    engine: Engine, model: Model, params: Callable[[int], dict], other: Callable[[int], dict]
) -> list[dict]:
    """Each prompt in one call with the ten others, at position i of the list; ``other(j)``: the j-th other's."""
    results = []
    for i, prompt in enumerate(model.prompts):
        prompts = model.others[:i] + [prompt] + model.others[i:]
        batch = [other(j) for j in range(i)] + [params(i)] + [other(j) for j in range(i, 10)]
        results.append(generate(engine, prompts, batch)[i])
    return results


def first_difference(got: list, want: list) -> int | None:
    """The first index where the two lists differ (the shorter one's length if one is a prefix), or None."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def difference(got: Completion, want: Completion) -> str | None:
    """The first token id that differs, else the first logprob (with the largest gap), else None."""
    ids, logprobs = got
    want_ids, want_logprobs = want
    index = first_difference(ids, want_ids)
    if index is not None:
        return f"token ids differ from index {index}: {ids} vs {want_ids}"
    index = first_difference(logprobs, want_logprobs)
    if index is None:
        return None
    worst = max(abs(a - b) for a, b in zip(logprobs, want_logprobs))
    return (
        f"logprobs differ from index {index} ({logprobs[index]!r} vs {want_logprobs[index]!r}), "
        f"max |diff| {worst:.3g}"
    )


def differences(
    got: list[Completion], want: list[Completion], model: Model, scenario: str
) -> list[str]:
    """One line per prompt whose token ids or logprobs are not bitwise equal."""
    assert len(got) == len(want) == len(model.prompts)
    found = [(i, difference(g, w)) for i, (g, w) in enumerate(zip(got, want))]
    return [
        f"{model.name}, {scenario}, prompt {i} (length {len(model.prompts[i])}): {d}"
        for i, d in found
        if d is not None
    ]


def check_equal(got: list[Completion], want: list[Completion], model: Model, scenario: str) -> None:
    problems = differences(got, want, model, scenario)
    assert not problems, "\n".join(problems)


# ---- with the flag: one engine per group of settings, shut down before the next -----------------------------------
def seeded(seed_name: str, base: int) -> Callable[[int], dict]:
    return lambda i: {**SAMPLED, seed_name: base + i}


@pytest.fixture(scope="module")
def plain(model: Model) -> dict[str, list[dict]]:
    """Prefix cache off, one chunk: each prompt alone (the reference) and batched; seeded sampling likewise."""

    def work(engine: Engine) -> dict[str, list[dict]]:
        runs = {
            "alone": each_alone(engine, model.prompts),
            "batched": each_batched(engine, model, lambda i: GREEDY, lambda j: GREEDY),
        }
        for name in ("seed", "sampling_seed"):
            runs[f"{name} alone"] = each_alone(engine, model.prompts, seeded(name, 100))
            runs[f"{name} batched"] = each_batched(
                engine, model, seeded(name, 100), seeded(name, 200)
            )
        return runs

    return model.run(work, **DETERMINISTIC)


@pytest.fixture(scope="module")
def reference(plain: dict[str, list[dict]]) -> list[Completion]:
    return [completion(r) for r in plain["alone"]]


def test_batched_with_ten_others_equals_alone(model, plain, reference):
    check_equal(
        [completion(r) for r in plain["batched"]], reference, model, "batched with 10 others"
    )


def test_chunked_prefill_equals_alone(model, reference):
    results = model.run(
        lambda engine: each_alone(engine, model.prompts),
        **DETERMINISTIC,
        chunked_prefill_size=64,
    )
    check_equal([completion(r) for r in results], reference, model, "chunked_prefill_size=64")


def test_prefix_cache_hit_equals_alone(model, reference):
    """Each prompt after a request of its first tokens but 8 (a hit ending inside a page), then once more (a
    repeated call, hitting as far): both from the prefix cache, as alone without it. An identical prompt alone
    would not hit: prefilled in one chunk, it leaves no state snapshot before its last token."""

    def work(engine: Engine) -> tuple[list[dict], list[dict]]:
        each_alone(engine, [p[:-CACHED_SHORT_BY] for p in model.prompts])
        return each_alone(engine, model.prompts), each_alone(engine, model.prompts)

    after_prefix, repeated = model.run(work, **{**DETERMINISTIC, "disable_radix_cache": False})
    problems = []
    for results, scenario in ((after_prefix, "prefix-cache hit"), (repeated, "repeated call")):
        cached = [r["meta_info"]["cached_tokens"] for r in results]
        assert all(n > 0 for n in cached), (
            f"{model.name}, {scenario}: every prompt must hit: {cached}"
        )
        problems += differences([completion(r) for r in results], reference, model, scenario)
    assert not problems, "\n".join(problems)


def test_speculative_nextn_equals_alone(model, reference):
    """The MTP head drafts (the built-in model ships one; the checkpoint's repeats its input token): each prompt
    alone, then all five in one call, as plain decoding alone."""

    def work(engine: Engine) -> tuple[list[dict], list[dict]]:
        together = generate(engine, model.prompts, [GREEDY] * len(model.prompts))
        return each_alone(engine, model.prompts), together

    alone, together = model.run(work, **DETERMINISTIC, **NEXTN)
    accepted = [r["meta_info"]["spec_accept_token_num"] for r in alone + together]
    assert sum(accepted) > 0, f"{model.name}: no draft was accepted: {accepted}"
    problems = differences([completion(r) for r in alone], reference, model, "NEXTN, alone")
    together = [completion(r) for r in together]
    problems += differences(together, reference, model, "NEXTN, all prompts together")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("seed_name", ["seed", "sampling_seed"])
def test_seeded_sampling_batched_equals_alone(model, plain, seed_name):
    alone = [completion(r) for r in plain[f"{seed_name} alone"]]
    batched = [completion(r) for r in plain[f"{seed_name} batched"]]
    check_equal(batched, alone, model, f"{seed_name}, sampled, batched with 10 others")
    greedy = [r["output_ids"] for r in plain["alone"]]
    assert [ids for ids, _ in alone] != greedy, "temperature 0.8 must sample other tokens somewhere"


# ---- without the flag: speculative greedy tokens are plain decoding's --------------------------------------------
def greedy_ids_alone(model: Model, **settings: Any) -> tuple[list[list[int]], list[dict]]:
    params = {**GREEDY, "max_new_tokens": 96}

    def work(engine: Engine) -> list[dict]:
        return [engine.generate(input_ids=p, sampling_params=params) for p in model.prompts]

    results = model.run(work, disable_radix_cache=True, **settings)
    return [r["output_ids"] for r in results], [r["meta_info"] for r in results]


@pytest.mark.parametrize(
    "name,speculative", [("moe-bf16", NEXTN), ("builtin", NGRAM)], ids=["nextn", "ngram"]
)
def test_speculative_greedy_equals_plain_without_the_flag(checkpoint, name, speculative):
    model = make_model(name, checkpoint)
    plain, _ = greedy_ids_alone(model)
    spec, metas = greedy_ids_alone(model, **speculative)
    assert sum(m["spec_accept_token_num"] for m in metas) > 0, "drafts must be accepted"
    scenario = f"{speculative['speculative_algorithm']} without the flag"
    problems = [
        f"{name}, {scenario}, prompt {i} (length {len(model.prompts[i])}): token ids differ from "
        f"index {index}: {got} vs {want}"
        for i, (got, want) in enumerate(zip(spec, plain))
        if (index := first_difference(got, want)) is not None
    ]
    assert not problems, "\n".join(problems)


def test_bfloat16_dtype_runs_float32_activations_with_the_flag(checkpoint):
    """``--dtype bfloat16`` on the CPU would compute in bf16 through the PyTorch references, which are not batch
    invariant: with the flag the activations are float32 (the weights stay bf16), and batching changes nothing."""
    model = make_model("moe-bf16", checkpoint)
    model = Model(model.name, {**model.args, "dtype": "bfloat16"}, model.prompts[:2], model.others)

    def work(engine: Engine) -> tuple[list[dict], list[dict]]:
        return each_alone(engine, model.prompts), each_batched(
            engine, model, lambda i: GREEDY, lambda j: GREEDY
        )

    alone, batched = model.run(work, **DETERMINISTIC)
    check_equal(
        [completion(r) for r in batched],
        [completion(r) for r in alone],
        model,
        "--dtype bfloat16, batched with 10 others",
    )


def test_retraction_equals_alone(model, reference):
    """A pool too small for the batch: decode retracts requests, which prefill their prompt and output so far
    again and go on; each prompt's ids and logprobs as alone."""

    def together(engine: Engine) -> list[dict]:
        return generate(engine, model.prompts, [GREEDY] * len(model.prompts))

    small = {"max_total_tokens": 320, "schedule_conservativeness": 0.0, "chunked_prefill_size": 64}
    retracted = model.run(together, **DETERMINISTIC, **small)
    assert sum(r["meta_info"]["num_retractions"] for r in retracted) > 0, (
        "the pool was meant to run out"
    )
    check_equal([completion(r) for r in retracted], reference, model, "retracted")
