"""The routing semantics of router.md, line by line, on the pure policy objects."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from sglang_lite.router.policies import (
    CacheAwarePolicy,
    ConsistentHashingPolicy,
    PowerOfTwoPolicy,
    RadixTree,
    RandomPolicy,
    RequestInfo,
    RoundRobinPolicy,
    WorkerState,
    create_policy,
)
from sglang_lite.router.policies.consistent_hashing import HashRing

NO_REQUEST = RequestInfo()


def w(
    name: str, in_flight: int = 0, tokens: int | None = None, healthy: bool = True
) -> WorkerState:
    return WorkerState(
        url=f"http://{name}", in_flight=in_flight, polled_tokens=tokens, healthy=healthy
    )


def picks(policy, workers, n: int, seed: int = 0, request: RequestInfo = NO_REQUEST) -> Counter:
    rng = random.Random(seed)
    return Counter(policy.select(workers, request, rng).url for _ in range(n))


# ---- round robin ----------------------------------------------------------------------------------------
def test_round_robin_cycles_over_healthy_workers_only():
    policy = RoundRobinPolicy()
    workers = [w("a"), w("b", healthy=False), w("c")]
    order = [policy.select(workers, NO_REQUEST, random.Random(0)).url for _ in range(4)]
    assert order == ["http://a", "http://c", "http://a", "http://c"]


def test_round_robin_counter_is_modulo_current_healthy_count():
    policy = RoundRobinPolicy()
    three = [w("a"), w("b"), w("c")]
    assert [policy.select(three, NO_REQUEST, None).url for _ in range(2)] == [
        "http://a",
        "http://b",
    ]
    # counter is 2 now; with only two healthy workers 2 % 2 = 0 -> a
    assert policy.select([w("a"), w("b")], NO_REQUEST, None).url == "http://a"


def test_every_policy_returns_none_without_healthy_workers():
    down = [w("a", healthy=False), w("b", healthy=False)]
    for name in ("round_robin", "random", "power_of_two", "consistent_hashing", "cache_aware"):
        assert create_policy(name).select(down, NO_REQUEST, random.Random(0)) is None, name
        assert create_policy(name).select([], NO_REQUEST, random.Random(0)) is None, name


# ---- random ---------------------------------------------------------------------------------------------
def test_random_is_uniform_over_healthy_and_seeded():
    workers = [w("a"), w("b", healthy=False), w("c"), w("d")]
    counts = picks(RandomPolicy(), workers, 3000)
    assert set(counts) == {"http://a", "http://c", "http://d"}
    assert all(900 < c < 1100 for c in counts.values()), counts
    assert picks(RandomPolicy(), workers, 50, seed=7) == picks(RandomPolicy(), workers, 50, seed=7)


# ---- power of two: metric selection ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "env,flag,expected",
    [
        (None, None, "tokens"),
        ("requests", None, "requests"),
        ("least_requests", None, "least_requests"),
        ("bogus", None, "tokens"),
        ("requests", "tokens", "tokens"),
        (None, "least_requests", "least_requests"),
        (" Requests ", None, "requests"),
    ],
)
def test_load_metric_from_env_and_flag_flag_wins(monkeypatch, env, flag, expected):
    if env is None:
        monkeypatch.delenv("SGLANG_ROUTER_P2C_LOAD_METRIC", raising=False)
    else:
        monkeypatch.setenv("SGLANG_ROUTER_P2C_LOAD_METRIC", env)
    assert PowerOfTwoPolicy(flag).load_metric == expected


def test_load_metric_is_read_when_the_policy_is_created(monkeypatch):
    monkeypatch.setenv("SGLANG_ROUTER_P2C_LOAD_METRIC", "requests")
    policy = PowerOfTwoPolicy()
    monkeypatch.setenv("SGLANG_ROUTER_P2C_LOAD_METRIC", "least_requests")
    assert policy.load_metric == "requests"


def test_power_of_two_single_healthy_worker_is_chosen():
    for metric in ("tokens", "requests", "least_requests"):
        workers = [w("a", healthy=False), w("b", in_flight=99, tokens=10**6)]
        assert (
            PowerOfTwoPolicy(metric).select(workers, NO_REQUEST, random.Random(0)).url == "http://b"
        )


# ---- power of two: tokens -------------------------------------------------------------------------------
def test_tokens_prefers_lower_polled_tokens_even_with_more_requests():
    a, b = w("a", in_flight=10, tokens=100), w("b", in_flight=0, tokens=5000)
    assert set(picks(PowerOfTwoPolicy("tokens"), [a, b], 50)) == {"http://a"}


def test_tokens_falls_back_to_in_flight_on_equal_tokens():
    a, b = w("a", in_flight=3, tokens=100), w("b", in_flight=1, tokens=100)
    assert set(picks(PowerOfTwoPolicy("tokens"), [a, b], 50)) == {"http://b"}


@pytest.mark.parametrize("ta,tb", [(None, 100), (100, None), (None, None)])
def test_tokens_falls_back_to_in_flight_when_a_token_count_is_missing(ta, tb):
    a, b = w("a", in_flight=1, tokens=ta), w("b", in_flight=4, tokens=tb)
    assert set(picks(PowerOfTwoPolicy("tokens"), [a, b], 50)) == {"http://a"}


def test_tokens_tie_on_everything_goes_to_the_first_candidate():
    # With two workers the first candidate is whichever rng.sample drew first: both must win sometimes,
    # and each winner must equal the first sampled candidate.
    a, b = w("a", 2, 100), w("b", 2, 100)
    policy, rng = PowerOfTwoPolicy("tokens"), random.Random(3)
    for _ in range(40):
        state = rng.getstate()
        first = random.Random()
        first.setstate(state)
        expected = first.sample([a, b], 2)[0]
        assert policy.select([a, b], NO_REQUEST, rng) is expected


def test_two_candidates_are_distinct_and_uniform():
    # Four equal workers: every pick must be one of them, about evenly (no candidate compared with itself).
    workers = [w(n, 1, 10) for n in "abcd"]
    counts = picks(PowerOfTwoPolicy("tokens"), workers, 4000)
    assert all(850 < c < 1150 for c in counts.values()), counts


def test_p2c_never_picks_the_worst_of_three():
    # The worst worker can only win a comparison against itself, which distinct candidates rule out.
    workers = [w("a", 0, 10), w("b", 1, 20), w("c", 5, 900)]
    for metric in ("tokens", "requests"):
        assert "http://c" not in picks(PowerOfTwoPolicy(metric), workers, 300), metric


# ---- power of two: requests -----------------------------------------------------------------------------
def test_requests_prefers_fewer_in_flight_over_lower_token_load():
    a, b = w("a", in_flight=1, tokens=50_000), w("b", in_flight=2, tokens=10)
    assert set(picks(PowerOfTwoPolicy("requests"), [a, b], 50)) == {"http://a"}


def test_requests_tie_is_broken_by_tokens_when_both_present():
    a, b = w("a", in_flight=2, tokens=900), w("b", in_flight=2, tokens=100)
    assert set(picks(PowerOfTwoPolicy("requests"), [a, b], 50)) == {"http://b"}


def test_requests_tie_with_a_missing_token_count_goes_to_the_first_candidate():
    a, b = w("a", in_flight=2, tokens=None), w("b", in_flight=2, tokens=1)
    counts = picks(PowerOfTwoPolicy("requests"), [a, b], 400)
    assert 150 < counts["http://a"] < 250, counts  # random order of the two candidates decides


# ---- power of two: least_requests -----------------------------------------------------------------------
def test_least_requests_picks_the_global_minimum():
    workers = [w(n, in_flight=5, tokens=10) for n in "abcdefg"] + [w("min", in_flight=1, tokens=10)]
    assert set(picks(PowerOfTwoPolicy("least_requests"), workers, 100)) == {"http://min"}


def test_least_requests_skips_workers_without_polled_load():
    workers = [w("idle-unpolled", in_flight=0, tokens=None), w("a", 3, 10), w("b", 2, 10)]
    assert set(picks(PowerOfTwoPolicy("least_requests"), workers, 100)) == {"http://b"}


def test_least_requests_uses_all_healthy_when_none_is_polled():
    workers = [w("a", 3), w("b", 1), w("c", 2), w("d", 0, healthy=False)]
    assert set(picks(PowerOfTwoPolicy("least_requests"), workers, 100)) == {"http://b"}


def test_least_requests_breaks_request_ties_by_tokens_then_randomly():
    by_tokens = [w("a", 1, 500), w("b", 1, 100), w("c", 2, 0)]
    assert set(picks(PowerOfTwoPolicy("least_requests"), by_tokens, 100)) == {"http://b"}
    tied = [w(n, 1, 100) for n in "abcd"]
    counts = picks(PowerOfTwoPolicy("least_requests"), tied, 2000)
    assert len(counts) == 4 and all(380 < c < 620 for c in counts.values()), counts


# ---- consistent hashing ---------------------------------------------------------------------------------
def _req(**headers: str) -> RequestInfo:
    return RequestInfo(headers={k.lower().replace("_", "-"): v for k, v in headers.items()})


def test_ring_has_150_virtual_nodes_per_worker():
    ring = HashRing(["http://a", "http://b"])
    assert len(ring._hashes) == 300 and Counter(ring._owners) == {"http://a": 150, "http://b": 150}


def test_same_key_same_worker_and_keys_spread():
    workers = [w(n) for n in "abcd"]
    policy, rng = ConsistentHashingPolicy(), random.Random(0)
    homes = {
        k: policy.select(workers, _req(x_smg_routing_key=f"user{k}"), rng).url for k in range(400)
    }
    again = {
        k: policy.select(workers, _req(x_smg_routing_key=f"user{k}"), rng).url for k in range(400)
    }
    assert homes == again
    spread = Counter(homes.values())
    assert len(spread) == 4 and min(spread.values()) > 50, spread


def test_key_header_priority_order():
    workers = [w(n) for n in "abcdefgh"]
    policy, rng = ConsistentHashingPolicy(), random.Random(0)
    # The routing key beats Authorization, which beats X-Forwarded-For, which beats Cookie.
    only = lambda **h: policy.select(workers, _req(**h), rng).url  # noqa: E731
    everything = dict(
        x_smg_routing_key="k1", authorization="Bearer t", x_forwarded_for="10.0.0.1", cookie="c=1"
    )
    assert only(**everything) == only(x_smg_routing_key="k1")
    del everything["x_smg_routing_key"]
    assert only(**everything) == only(authorization="Bearer t")
    del everything["authorization"]
    assert only(**everything) == only(x_forwarded_for="10.0.0.1")
    del everything["x_forwarded_for"]
    assert only(**everything) == only(cookie="c=1")


def test_keys_land_on_distinct_workers_for_distinct_headers():
    # Sanity for the priority test: different keys do map to different workers sometimes.
    workers = [w(n) for n in "abcdefgh"]
    policy, rng = ConsistentHashingPolicy(), random.Random(0)
    homes = {policy.select(workers, _req(authorization=f"Bearer {i}"), rng).url for i in range(40)}
    assert len(homes) > 3


def test_target_worker_header_is_a_direct_index():
    workers = [w("a"), w("b"), w("c", healthy=False)]
    policy, rng = ConsistentHashingPolicy(), random.Random(0)
    assert (
        policy.select(workers, _req(x_smg_target_worker="1", x_smg_routing_key="z"), rng).url
        == "http://b"
    )
    # An unhealthy or out-of-range target falls through to the routing key.
    keyed = policy.select(workers, _req(x_smg_routing_key="z"), rng).url
    assert (
        policy.select(workers, _req(x_smg_target_worker="2", x_smg_routing_key="z"), rng).url
        == keyed
    )
    assert (
        policy.select(workers, _req(x_smg_target_worker="9", x_smg_routing_key="z"), rng).url
        == keyed
    )


def test_no_key_is_a_random_healthy_worker():
    workers = [w("a"), w("b"), w("c", healthy=False)]
    counts = picks(ConsistentHashingPolicy(), workers, 400)
    assert set(counts) == {"http://a", "http://b"} and min(counts.values()) > 150


def test_unhealthy_home_walks_clockwise_and_comes_back():
    workers = [w(n) for n in "abcd"]
    policy, rng = ConsistentHashingPolicy(), random.Random(0)
    key = _req(x_smg_routing_key="session-42")
    home = policy.select(workers, key, rng).url
    next_on_ring = [u for u in policy._ring.walk("session-42")][1]
    down = [w(n, healthy=(f"http://{n}" != home)) for n in "abcd"]
    assert policy.select(down, key, rng).url == next_on_ring
    assert policy.select(workers, key, rng).url == home


def test_removing_a_worker_moves_only_its_keys():
    policy, rng = ConsistentHashingPolicy(), random.Random(0)
    four, three = [w(n) for n in "abcd"], [w(n) for n in "abc"]
    before = {k: policy.select(four, _req(x_smg_routing_key=str(k)), rng).url for k in range(300)}
    after = {k: policy.select(three, _req(x_smg_routing_key=str(k)), rng).url for k in range(300)}
    moved = [k for k in before if before[k] != after[k]]
    assert moved and all(before[k] == "http://d" for k in moved)


def test_bounded_load_spills_to_the_next_node():
    key = _req(x_smg_routing_key="hot")
    rng = random.Random(0)
    unbounded, bounded = ConsistentHashingPolicy(), ConsistentHashingPolicy(bounded_load=1.5)
    names = "abcd"
    home = unbounded.select([w(n) for n in names], key, rng).url
    # home holds 8 in flight, the others 0: average 2, bound 3 -> spill; without the bound it stays home.
    loaded = [w(n, in_flight=8 if f"http://{n}" == home else 0) for n in names]
    assert unbounded.select(loaded, key, rng).url == home
    spilled = bounded.select(loaded, key, rng).url
    assert spilled != home and spilled == list(bounded._ring.walk("hot"))[1]
    # Within 1.5x the average it stays: home 3, others 3, 3, 1 -> average 2.5, bound 3.75.
    others = iter([3, 3, 1])
    within = [w(n, in_flight=3 if f"http://{n}" == home else next(others)) for n in names]
    assert bounded.select(within, key, rng).url == home


# ---- cache aware ----------------------------------------------------------------------------------------
def test_radix_tree_match_insert_split_and_size():
    tree = RadixTree()
    tree.insert("hello world")
    tree.insert("hello there")
    assert tree.size == len("hello world") + len("there")
    assert tree.match("hello wonder") == len("hello wo")
    assert tree.match("help") == 3 and tree.match("xyz") == 0 and tree.match("hello there!") == 11


def test_radix_tree_evicts_least_recently_used_leaves():
    tree = RadixTree()
    tree.insert("aaaa-old")
    tree.insert("bbbb-new")
    tree.match("bbbb-new")
    tree.evict(8)
    assert tree.size <= 8 and tree.match("bbbb-new") == 8 and tree.match("aaaa-old") == 0


def test_cache_aware_routes_shared_prefixes_to_the_same_worker():
    workers = [w("a"), w("b"), w("c")]
    policy, rng = CacheAwarePolicy(cache_threshold=0.5), random.Random(0)
    first = policy.select(
        workers, RequestInfo(text="system prompt: you are helpful. question 1"), rng
    ).url
    for i in range(2, 10):
        text = f"system prompt: you are helpful. question {i}"
        assert policy.select(workers, RequestInfo(text=text), rng).url == first


def test_cache_aware_without_a_match_goes_to_the_smallest_tree():
    workers = [w("a"), w("b"), w("c")]
    policy, rng = CacheAwarePolicy(cache_threshold=0.5), random.Random(0)
    chosen = [policy.select(workers, RequestInfo(text=p * 20), rng).url for p in "xyz"]
    assert sorted(chosen) == [
        "http://a",
        "http://b",
        "http://c",
    ]  # each new prefix fills the emptiest worker


def test_cache_aware_match_must_exceed_the_threshold():
    workers = [w("a"), w("b")]
    policy, rng = CacheAwarePolicy(cache_threshold=0.5), random.Random(0)
    policy.select(
        workers, RequestInfo(text="abcdefghij" * 10), rng
    )  # to a (both empty: first smallest)
    # 40% shared prefix: below the threshold -> the smaller tree (b), not the match (a)
    assert (
        policy.select(workers, RequestInfo(text="abcdefghij" * 4 + "Z" * 60), rng).url == "http://b"
    )
    # 90% shared -> the match
    assert (
        policy.select(workers, RequestInfo(text="abcdefghij" * 9 + "Q" * 10), rng).url == "http://a"
    )


def test_cache_aware_imbalance_goes_to_the_least_loaded():
    def route(load_a: int, load_b: int) -> str:
        policy, rng = (
            CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5),
            random.Random(0),
        )
        policy.select(
            [w("a"), w("b")], RequestInfo(text="shared prefix " * 10), rng
        )  # a now holds the prefix
        text = RequestInfo(text="shared prefix " * 10 + "more")
        return policy.select([w("a", load_a), w("b", load_b)], text, rng).url

    assert (
        route(6, 1) == "http://b"
    )  # max-min 5 > 4 and 6 > 1*1.5: imbalanced -> least loaded, despite a's cache
    assert route(5, 1) == "http://a"  # max-min 4 is not > 4: balanced -> the cache match
    assert (
        route(30, 20) == "http://a"
    )  # max-min 10 > 4 but 30 is not > 20*1.5: balanced -> the cache match
    assert route(31, 20) == "http://b"  # both thresholds exceeded


def test_cache_aware_tree_is_bounded_and_follows_worker_removal():
    policy, rng = CacheAwarePolicy(max_tree_size=100), random.Random(0)
    for i in range(50):
        policy.select([w("a")], RequestInfo(text=f"{i:03d}" + "x" * 30), rng)
    assert policy.trees["http://a"].size <= 100
    policy.select([w("b")], RequestInfo(text="hi"), rng)
    assert set(policy.trees) == {"http://b"}


def test_create_policy_by_name_passes_only_accepted_options():
    policy = create_policy(
        "power_of_two", load_metric="requests", cache_threshold=0.9, bounded_load=2.0
    )
    assert isinstance(policy, PowerOfTwoPolicy) and policy.load_metric == "requests"
    assert create_policy("consistent_hashing", bounded_load=2.0).bounded_load == 2.0
    with pytest.raises(ValueError, match="unknown policy"):
        create_policy("fastest")


def test_policies_import_no_http_or_torch():
    import subprocess
    import sys

    code = (
        "import sys, sglang_lite.router.policies; "
        "bad = [m for m in ('aiohttp', 'torch', 'httpx', 'sglang_lite.router.app') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
