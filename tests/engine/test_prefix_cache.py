"""The prefix cache (radix tree of KV slots with GDN state snapshots): greedy tokens equal transformers with the
cache on and off, for prompts that share prefixes in every way, under eviction pressure too; hits are reported."""

from __future__ import annotations

import pytest

from sglang_lite.runtime.factory import create_scheduler
from sglang_lite.scheduler.policy import (
    SNAPSHOT_ALIGN,
    SNAPSHOT_MIN_GAIN,
    SNAPSHOT_MIN_PREFIX,
    snapshot_aligned_chunk,
)
from sglang_lite.server_args import ServerArgs
from tests.engine.conftest import random_prompts

NEW_TOKENS = 6
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
# pages of one token, and the default: hits reach the token either way (a prefix ending inside a page keeps a
# copy of its last page with its snapshot)
PAGE_SIZES = [1, ServerArgs.page_size]


def scheduler(
    path: str, cache: bool, max_total_tokens: int = 2048, chunk: int = 16, page_size: int = 1
):
    return create_scheduler(
        ServerArgs(
            model_path=path,
            skip_tokenizer_init=True,
            disable_radix_cache=not cache,
            max_total_tokens=max_total_tokens,
            max_running_requests=4,
            chunked_prefill_size=chunk,
            max_prefill_tokens=32,
            page_size=page_size,
        )
    )


def run(
    sched, requests: list[tuple[str, list[int]]], together: bool = False
) -> dict[str, tuple[list[int], dict]]:
    """Runs requests one after another (or all at once), checking the pools' accounting after every step."""
    out: dict[str, tuple[list[int], dict]] = {}
    batches = [requests] if together else [[r] for r in requests]
    for batch in batches:
        for rid, prompt in batch:
            sched.add_request(rid, prompt, GREEDY)
        while sched.has_work:
            for o in sched.step():
                ids, _ = out.get(o.rid, ([], {}))
                out[o.rid] = (ids + o.new_token_ids, o.meta_info)
            sched.check_invariants()
    return out


def shared_prefix_requests() -> list[tuple[str, list[int]]]:
    base, other = random_prompts([40, 25], seed=7)
    return [
        ("first", base),
        ("equal", list(base)),  # the same prompt again
        ("extends", base + other[:9]),  # one extending another (a next turn)
        ("extends-more", base + other[:9] + other[9:20]),
        ("diverges", base[:22] + other[:15]),  # shares the first 22 tokens, then differs
        ("short", base[:5]),  # a prefix of a cached prompt
    ]


@pytest.mark.parametrize(
    "kind,page_size", [("moe", 1), ("moe", ServerArgs.page_size), ("dense", ServerArgs.page_size)]
)
def test_cache_on_and_off_give_transformers_tokens(checkpoints, kind, page_size):
    checkpoint = checkpoints[kind]
    requests = shared_prefix_requests()
    with_cache = run(scheduler(checkpoint.path, cache=True, page_size=page_size), requests)
    without = run(scheduler(checkpoint.path, cache=False, page_size=page_size), requests)
    for rid, prompt in requests:
        expected = checkpoint.greedy(prompt, NEW_TOKENS)
        assert with_cache[rid][0] == expected == without[rid][0], rid
    assert all(meta["cached_tokens"] == 0 for _, meta in without.values())
    # the first run of a prompt has no hit; a later prompt extending a cached one reuses all of it
    assert with_cache["first"][1]["cached_tokens"] == 0
    assert with_cache["extends"][1]["cached_tokens"] >= 40
    assert with_cache["extends-more"][1]["cached_tokens"] >= 49
    assert (
        with_cache["equal"][1]["cached_tokens"] > 0
    )  # the prefix up to a snapshot before its last token


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_concurrent_requests_on_one_prefix_and_a_tiny_pool(checkpoints, page_size):
    """Requests sharing a prefix run at once, in a pool so small that cached prefixes are evicted (and requests
    retracted) to make room; tokens stay exact and every page is accounted for after each step."""
    checkpoint = checkpoints["moe"]
    base, a, b = random_prompts([30, 12, 12], seed=3)
    warm = [("warm", base)]
    together = [("a", base + a), ("b", base + b), ("c", base + a[:4]), ("d", list(base))]
    sched = scheduler(
        checkpoint.path, cache=True, max_total_tokens=128, chunk=8, page_size=page_size
    )
    out = run(sched, warm)
    out |= run(sched, together, together=True)
    for rid, prompt in warm + together:
        assert out[rid][0] == checkpoint.greedy(prompt, NEW_TOKENS), rid
    loads = sched.get_loads()
    assert loads.num_used_tokens == 0 and loads.cached_tokens > 0 and loads.cache_hit_rate > 0
    assert sched.flush_cache() > 0 and sched.get_loads().cached_tokens == 0
    sched.check_invariants()
    assert sched.pools.kv.allocator.num_used == 0 and sched.pools.states.snapshots.num_used == 0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_a_next_turn_that_rewrites_the_prompt_end_reuses_an_aligned_snapshot(page_size):
    """A chat template renders the end of a prompt (its generation prompt) differently once the turn is history, so
    the next turn diverges a few tokens before the prompt's end. The chunk that finishes a long prompt stops at the
    last multiple of SNAPSHOT_ALIGN, whose snapshot the next turn then reuses (the built-in model: long context)."""
    prompt, turn = random_prompts([SNAPSHOT_MIN_PREFIX + 190, 30], vocab=4000, seed=11)
    requests = [("first", prompt), ("next", prompt[:-2] + turn)]

    def engine(cache: bool):
        return create_scheduler(
            ServerArgs(
                skip_tokenizer_init=True,
                disable_radix_cache=not cache,
                max_total_tokens=4096,
                max_running_requests=4,
                page_size=page_size,
            )
        )

    with_cache, without = run(engine(True), requests), run(engine(False), requests)
    assert [with_cache[rid][0] for rid, _ in requests] == [without[rid][0] for rid, _ in requests]
    assert with_cache["next"][1]["cached_tokens"] == SNAPSHOT_MIN_PREFIX


def test_sixteen_sessions_come_back_to_their_cache_with_four_requests_running():
    """Agentic traffic: 16 sessions, every first turn before any second turn, 4 requests running at once. The
    snapshot pool is sized from memory (not one slot per running request), so the second turns still find their
    first turns' aligned snapshots; tokens equal a scheduler without the cache."""
    firsts = random_prompts([1500 + 7 * i for i in range(16)], vocab=4000, seed=5)
    news = random_prompts([40] * 16, vocab=4000, seed=6)

    def engine(cache: bool):
        args = ServerArgs(
            skip_tokenizer_init=True, disable_radix_cache=not cache, max_running_requests=4
        )
        return create_scheduler(args)

    def two_turns(sched) -> dict[str, tuple[list[int], dict]]:
        out = run(sched, [(f"s{i}", p) for i, p in enumerate(firsts)], together=True)
        turns = [
            (f"s{i}.2", p[:-3] + out[f"s{i}"][0] + n) for i, (p, n) in enumerate(zip(firsts, news))
        ]
        return {**out, **run(sched, turns, together=True)}

    cached = engine(True)
    assert cached.pools.states.snapshots.size > 4 * 16  # not max_running_requests
    with_cache = two_turns(cached)
    without = two_turns(engine(False))
    assert {r: ids for r, (ids, _) in with_cache.items()} == {
        r: ids for r, (ids, _) in without.items()
    }
    hits = [with_cache[f"s{i}.2"][1]["cached_tokens"] for i in range(16)]
    assert sum(h >= 1024 for h in hits) >= 14, hits


def test_snapshot_aligned_chunk():
    align, gain, floor = SNAPSHOT_ALIGN, SNAPSHOT_MIN_GAIN, SNAPSHOT_MIN_PREFIX
    end = floor + align + 10
    assert snapshot_aligned_chunk(0, end, end) == floor + align  # finishes the prompt: cut
    assert snapshot_aligned_chunk(0, end, floor) == floor  # does not finish it: as planned
    assert (
        snapshot_aligned_chunk(0, floor + align, floor + align) == floor
    )  # the snapshot comes before the last token
    start = (
        floor + align - gain + 1
    )  # the aligned point is too close to the previous snapshot: one chunk
    assert snapshot_aligned_chunk(start, end, end - start) == end - start
    assert (
        snapshot_aligned_chunk(0, floor - 10, floor - 10) == floor - 10
    )  # a short prompt: one chunk
