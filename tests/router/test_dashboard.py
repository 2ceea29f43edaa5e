"""The router's live cluster page without a browser: the key it needs, the data behind it (per DP rank, the router's
latency, balance figures equal to the balance sampler's over the same samples), and a page that needs no network.
The headless-Chromium test of the page itself is test_dashboard_browser.py."""

from __future__ import annotations

import asyncio
import base64
import re

import aiohttp
import numpy as np
import pytest

from sglang_lite.router.dashboard import page_html
from sglang_lite.router.dashboard.page import STATIC
from sglang_lite.router.dashboard.watch import _percentile
from sglang_lite.sim.balance_sampling import balance_stats as sampler_balance_stats
from tests.router.helpers import generate, get_json, run, wait_for

KEY = "dash-key"


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


async def status_of(session: aiohttp.ClientSession, url: str, headers=None) -> tuple[int, str]:
    async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return resp.status, resp.headers.get("WWW-Authenticate", "")


def test_the_page_and_its_data_need_the_key(procs):
    up = procs.upstream(dp_size=2)
    router = procs.router("--worker-urls", up.url, "--dp-aware", "--api-key", KEY)

    async def scenario():
        async with aiohttp.ClientSession() as s:
            for path in ("/dashboard", "/dashboard/data"):
                url = router.url + path
                # a browser is asked for Basic credentials: it prompts, then sends them on every request
                assert await status_of(s, url) == (401, 'Basic realm="sglang_lite router"')
                assert (await status_of(s, url, {"Authorization": "Bearer nope"}))[0] == 401
                assert (await status_of(s, url, basic("me", "nope")))[0] == 401
                assert (await status_of(s, url, {"Authorization": "Basic %%%"}))[0] == 401
                assert (await status_of(s, url, {"Authorization": f"Bearer {KEY}"}))[0] == 200
                assert (await status_of(s, url, basic("anyone", KEY)))[0] == 200
            # Basic credentials open the page only; the other routes keep Bearer
            assert await status_of(s, router.url + "/workers", basic("me", KEY)) == (401, "Bearer")

    run(scenario())


def test_the_page_is_self_contained():
    html = page_html()
    # uPlot, its stylesheet and ours are inlined: nothing to fetch, from a CDN or from the router
    assert "uPlot" in html and "/*UPLOT_JS*/" not in html and "/*DASHBOARD_JS*/" not in html
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:)""", html), "the page links a resource"
    assert not re.search(r"""@import|url\(\s*["']?https?:""", html)
    assert "MIT License" in (STATIC / "uPlot.LICENSE").read_text()


def test_percentiles_interpolate_as_numpy():
    values = sorted(np.random.default_rng(1).exponential(0.1, 37))
    for p in (50, 90, 99):
        assert _percentile(values, p) == pytest.approx(np.percentile(values, p), rel=1e-12)
    assert _percentile([0.25], 99) == 0.25


def test_dashboard_off_serves_no_page(procs):
    up = procs.upstream(dp_size=1)
    router = procs.router("--worker-urls", up.url, "--dashboard-interval-secs", "0")

    async def scenario():
        async with aiohttp.ClientSession() as s:
            assert (await status_of(s, router.url + "/dashboard"))[0] == 404
            assert (await status_of(s, router.url + "/dashboard/data"))[0] == 404

    run(scenario())


def test_data_follows_requests_per_rank_and_matches_the_balance_sampler(procs):
    """Streams held on both DP ranks of a stand-in show up per rank (the router's in-flight and the rank's
    running), TTFT and durations are counted, and the balance figures equal the sampler's over the same samples."""
    up = procs.upstream(dp_size=2, token_delay=0.02)
    router = procs.router(
        "--worker-urls",
        up.url,
        "--dp-aware",
        "--policy",
        "round_robin",
        "--dashboard-interval-secs",
        "0.2",
    )
    keys = [f"{up.url}@0", f"{up.url}@1"]

    async def rank_view(s: aiohttp.ClientSession) -> dict:
        data = await get_json(s, router.url + "/dashboard/data")
        return {r["key"]: r for server in data["servers"] for r in server["ranks"]}

    async def scenario():
        async with aiohttp.ClientSession() as s:
            streams = [
                asyncio.create_task(
                    generate(s, router.url, stream=True, max_new_tokens=150, timeout=30)
                )
                for _ in range(4)
            ]

            async def both_ranks_busy() -> bool:
                view = await rank_view(s)
                return all(
                    view.get(k, {}).get("running", 0) >= 1 and view[k]["in_flight"] >= 1
                    for k in keys
                )

            assert await wait_for(both_ranks_busy, timeout=20, interval=0.1)
            results = await asyncio.gather(*streams)
            assert all(r.ok for r in results)

            async def all_ended() -> bool:
                data = await get_json(s, router.url + "/dashboard/data")
                return data["latency"]["duration"]["count"] >= 4

            assert await wait_for(all_ended, timeout=10)
            return await get_json(s, router.url + "/dashboard/data")

    data = run(scenario())
    assert data["policies"] == {"regular": "round_robin"}
    assert data["latency"]["ttft"]["count"] >= 4  # streamed: the first event's time is known
    assert 0 < data["latency"]["ttft"]["p50"] < data["latency"]["duration"]["p50"]
    (group,) = data["groups"]
    assert group["role"] == "regular" and group["ranks"] == keys
    window = [s for s in data["samples"] if s["t"] > data["samples"][-1]["t"] - data["window_secs"]]
    series = {
        name: [[s["ranks"][k][name] for k in keys] for s in window]
        for name in ("outstanding", "running", "kv_tokens")
    }
    assert max(max(row) for row in series["running"]) >= 1, "the samples saw the requests"
    expected = sampler_balance_stats(series["outstanding"], series["running"], series["kv_tokens"])
    balance = group["balance"]
    assert balance["num_samples"] == len(window)
    for name, value in expected.row().items():
        assert balance[name] == pytest.approx(value, abs=1e-12), name
    # and the study's definitions, written out with numpy
    running = np.array(series["running"], dtype=float)
    busy = running.mean(axis=1) > 0
    cv = (running[busy].std(axis=1) / running[busy].mean(axis=1)).mean()
    assert balance["running_cv"] == pytest.approx(cv)
    assert balance["busiest_batch"] == pytest.approx(running.max(axis=1).mean())
