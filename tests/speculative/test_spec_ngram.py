"""NGRAM speculative decoding (prompt lookup, ``scheduler/speculative/ngram.py``): the index's lookups, and the
drafter inside continuous batching: greedy tokens equal plain decoding's on the built-in model and on a checkpoint
without an MTP head, with chunked prefill, prefix-cache hits, grammars and the length limits; drafts are accepted."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from sglang_lite import assets
from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.scheduler.speculative import create_drafter
from sglang_lite.scheduler.speculative.base import DraftContext, Drafter
from sglang_lite.scheduler.speculative.ngram import NgramIndex
from sglang_lite.utils.speculative_flags import ALGORITHMS
from tests.engine.conftest import random_prompts
from tests.hf_checkpoints import make_hf_model, save_checkpoint
from tests.speculative.conftest import GREEDY, run_scheduler, scheduler_args

NGRAM = dict(speculative_algorithm="NGRAM", speculative_num_steps=4)

# text that asks for itself again, as code editing and summaries do
REPEATING = [
    "def area(width, height):\n    if width < 0 or height < 0:\n        raise ValueError('negative side')\n"
    "    return width * height\n\n\n# The same function, rewritten with a docstring:\ndef area(width, height):\n",
    "The cache keeps every prefix that a finished request computed, so that a later request with the same "
    "prefix skips it.\n\nSummarise the text above.\n\nThe cache keeps",
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(10):\n",
]


def index_of(tokens: list[int], low: int = 1, high: int = 4) -> NgramIndex:
    index = NgramIndex(low, high)
    index.extend(tokens[:3])
    index.extend(tokens[3:])  # extended in parts as steps append tokens
    return index


def test_lookup_continues_the_latest_occurrence_of_the_longest_suffix():
    # suffix [2, 3] occurred twice: after the latest came 9; the shorter suffix [3] alone last came before 5
    assert index_of([1, 2, 3, 7, 2, 3, 9, 3, 5, 2, 3]).lookup(2) == [9, 3]
    assert index_of([1, 2, 3, 4, 1, 2, 3]).lookup(3) == [4, 1, 2]
    assert index_of([1, 2, 3]).lookup(3) == []  # no earlier occurrence of any suffix
    assert index_of([4, 5, 6, 4], low=2).lookup(3) == []  # the one-token match is below the window


def test_lookup_copies_a_period_with_overlap():
    assert index_of([8, 1, 2, 1, 2, 1]).lookup(5) == [2, 1, 2, 1, 2]
    assert index_of([9, 7, 7, 7]).lookup(4) == [7, 7, 7, 7]


def test_each_algorithm_names_a_drafter_module():
    """Adding an algorithm is a module with ``DRAFTER`` and its name in ``ALGORITHMS``."""
    config = SchedulerConfig(
        max_total_tokens=64,
        max_running_requests=1,
        context_length=64,
        chunk_size=8,
        max_prefill_tokens=8,
        vocab_size=16,
    )
    for name in ALGORITHMS:
        drafter = create_drafter(name, DraftContext(runner=None, pools=None, config=config))
        assert isinstance(drafter, Drafter), name


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(assets.model_dir(None))


def repeating_requests(tokenizer, new_tokens: int = 48) -> list[tuple[list[int], dict]]:
    prompts = [tokenizer.encode(text) for text in REPEATING]
    return [(p, {**GREEDY, "max_new_tokens": new_tokens - 5 * i}) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_builtin_model_greedy_tokens_are_unchanged(tokenizer, page_size):
    path = str(assets.model_dir(None))
    requests = repeating_requests(tokenizer)
    plain, _, _ = run_scheduler(scheduler_args(path, page_size=page_size), requests)
    spec, metas, scheduler = run_scheduler(
        scheduler_args(path, page_size=page_size, **NGRAM), requests
    )
    assert spec == plain
    stats = scheduler.speculation.stats
    assert stats.accepted > 0 and stats.accept_length > 1.3, stats
    for i, (_, params) in enumerate(requests):
        meta = metas[i]
        assert len(spec[i]) == params["max_new_tokens"]
        assert (
            meta["completion_tokens"] == 1 + meta["spec_verify_ct"] + meta["spec_accept_token_num"]
        )


def test_a_checkpoint_without_a_head_and_prefix_cache_hits(tmp_path):
    """NGRAM needs no MTP head; the same prompts twice (the second time from the prefix cache) and a
    prompt sharing a prefix, run one after another on one scheduler as on a plain one."""
    path = str(tmp_path / "moe")
    save_checkpoint(make_hf_model(moe=True, seed=3), path)
    base = random_prompts([30], vocab=160, seed=4)[0]
    looped = base[:10] * 3  # a prompt that repeats itself
    requests = [
        (p, {**GREEDY, "max_new_tokens": 24}) for p in (base, looped, base, base[:20] + [5])
    ]
    plain, _, _ = run_scheduler(scheduler_args(path), requests)
    spec, _, scheduler = run_scheduler(scheduler_args(path, **NGRAM), requests)
    assert spec == plain
    assert scheduler.speculation.stats.drafted > 0


def test_grammars_and_stops_with_ngram(tokenizer):
    """A request with a grammar decodes plainly inside the verify steps; stop tokens, stop strings and lengths end
    the others exactly where plain decoding ends them."""
    path = str(assets.model_dir(None))
    prompt = tokenizer.encode(REPEATING[2])
    plain_run, _, _ = run_scheduler(
        scheduler_args(path), [(prompt, {**GREEDY, "max_new_tokens": 30})]
    )
    stop = plain_run[0][12]
    stop_text = tokenizer.decode(plain_run[0][8:10])
    requests = [
        (prompt, {**GREEDY, "max_new_tokens": 30}),
        (prompt, {"temperature": 0.0, "max_new_tokens": 30, "stop_token_ids": [stop]}),
        (prompt, {"temperature": 0.0, "max_new_tokens": 12, "regex": "(for|print)+"}),
        (prompt, {**GREEDY, "max_new_tokens": 2}),
        (prompt, {"temperature": 0.0, "max_new_tokens": 30, "stop": [stop_text]}),
    ]
    with_text = dict(skip_tokenizer_init=False)
    plain, _, _ = run_scheduler(scheduler_args(path, **with_text), requests)
    spec, _, scheduler = run_scheduler(scheduler_args(path, **with_text, **NGRAM), requests)
    assert spec == plain
    assert spec[1][-1] == stop and len(spec[1]) <= 13
    assert len(spec[4]) <= 10
    assert scheduler.speculation.stats.accepted > 0


def test_seeded_sampling_with_ngram_is_reproducible(tokenizer):
    path = str(assets.model_dir(None))
    prompt = tokenizer.encode(REPEATING[0])
    params = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 32, "ignore_eos": True}
    requests = [(prompt, {**params, "seed": 7})] * 2
    first, _, _ = run_scheduler(scheduler_args(path, **NGRAM), requests)
    again, _, _ = run_scheduler(scheduler_args(path, **NGRAM), requests)
    assert first == again and len(first[0]) == 32
