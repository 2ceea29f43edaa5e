"""The router's live page in headless Chromium (Debian's `chromium`, which `make system-libs` installs) against a
real router with an API key and a real `--dp-size 2` server under a short load: the browser asks for the key once,
both DP ranks' rows appear with numbers that change while the requests run, the charts draw, the balance figures
shown equal the balance sampler's over the page's own samples, every request stays on the router, and a
screenshot is saved under results/ (not committed)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from sglang_lite.sim.balance_sampling import balance_stats as sampler_balance_stats
from tests.router.browser import Browser, chromium_path
from tests.router.conftest import REPO
from tests.router.helpers import generate

pytestmark = pytest.mark.skipif(
    chromium_path() is None,
    reason="no chromium on PATH: Debian's chromium package is needed (make system-libs installs it)",
)
KEY = "page-key"
SCREENSHOT = REPO / "results" / "test_artifacts" / "dashboard.png"
LOAD_STREAMS = 6

# the rank rows as the page shows them
ROWS_JS = """[...document.querySelectorAll('tr.rank-row')].map(row => {
  const out = {key: row.dataset.key};
  for (const td of row.querySelectorAll('td[data-field]')) out[td.dataset.field] = td.textContent;
  return out;
})"""
# per chart, how many of its samples it holds and how many pixels carry one of its series' colours
CHARTS_JS = """Object.entries(window.dashboard.charts).map(([name, u]) => {
  const {width, height} = u.ctx.canvas;
  const px = u.ctx.getImageData(0, 0, width, height).data;
  const colours = u.series.slice(1).map((s, i) => {
    const c = typeof s.stroke === 'function' ? s.stroke(u, i + 1) : s.stroke;
    return [1, 3, 5].map(j => parseInt(c.slice(j, j + 2), 16));
  });
  let drawn = 0;
  for (let p = 0; p < px.length; p += 4) {
    if (px[p + 3] > 200 && colours.some(c => Math.abs(c[0] - px[p]) + Math.abs(c[1] - px[p + 1])
        + Math.abs(c[2] - px[p + 2]) < 60)) drawn++;
  }
  return {name, samples: u.data[0].length, drawn};
})"""
# what the page last received and the samples it holds, read at one instant
STATE_JS = """({samples: window.dashboard.samples, groups: window.dashboard.last.groups,
  window_secs: window.dashboard.last.window_secs,
  shown: [...document.querySelectorAll('tr.balance-row td[data-field]')].map(
    td => [td.parentElement.dataset.role, td.dataset.field, td.textContent])})"""


async def keep_busy(url: str, stop: asyncio.Event) -> int:
    """LOAD_STREAMS clients streaming one request after another through the router until `stop`."""
    done = 0
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as s:

        async def client() -> None:
            nonlocal done
            while not stop.is_set():
                result = await generate(
                    s, url, stream=True, max_new_tokens=64, timeout=60, headers=headers
                )
                assert result.ok, result
                done += 1

        await asyncio.gather(*(client() for _ in range(LOAD_STREAMS)))
    return done


async def watch_numbers_change(page: Browser, timeout: float) -> list[list[dict]]:
    """The rank rows, read until both ranks have shown work and the numbers took three different values."""
    seen: list[list[dict]] = []
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        rows = await page.evaluate(ROWS_JS)
        if not seen or rows != seen[-1]:
            seen.append(rows)
        busy = {row["key"] for rows in seen for row in rows if int(row["running"]) > 0}
        if len(busy) == 2 and len(seen) >= 3:
            return seen
        await asyncio.sleep(0.3)
    raise AssertionError(f"the rank rows did not show live numbers on both ranks: {seen[-3:]}")


def check_balance_equals_the_samplers(state: dict) -> None:
    (group,) = state["groups"]
    keys = group["ranks"]
    samples = state["samples"]
    window = [s for s in samples if s["t"] > samples[-1]["t"] - state["window_secs"]]
    window = [s for s in window if all(k in s["ranks"] for k in keys)]
    series = [
        [[s["ranks"][k][n] for k in keys] for s in window] for n in ("outstanding", "running")
    ]
    kv = [[s["ranks"][k]["kv_tokens"] for k in keys] for s in window]
    expected = sampler_balance_stats(series[0], series[1], kv).row()
    shown = {field: text for role, field, text in state["shown"] if role == group["role"]}
    for name, value in expected.items():
        assert group["balance"][name] == pytest.approx(value, abs=1e-12), name
        assert float(shown[name]) == pytest.approx(value, abs=5e-4 + 1e-9), (
            name
        )  # shown to 3 places
    assert int(shown["num_samples"]) == len(window)


def test_the_live_page_in_headless_chromium(procs):
    (server,) = procs.servers(["dash"], dp_size=2)
    router = procs.router(
        "--worker-urls",
        server.url,
        "--dp-aware",
        "--policy",
        "power_of_two",
        "--p2c-load-metric",
        "least_requests",
        "--api-key",
        KEY,
    )
    keys = [f"{server.url}@0", f"{server.url}@1"]

    async def scenario() -> None:
        stop = asyncio.Event()
        load = asyncio.create_task(keep_busy(router.url, stop))
        try:
            async with Browser(auth=("dashboard", KEY)) as page:
                await page.navigate(router.url + "/dashboard")
                await page.wait_for(f"{ROWS_JS}.length === 2", timeout=30)
                rows = await watch_numbers_change(page, timeout=90)
                assert [row["key"] for row in rows[-1]] == keys
                assert all(row["health"] == "up" for row in rows[-1])
                charts = await page.wait_for(
                    f"(() => {{ const c = {CHARTS_JS}; "
                    "return c.length === 3 && c.every(x => x.samples >= 5 && x.drawn > 50) && c; })()",
                    timeout=30,
                )
                assert [c["name"] for c in charts] == ["outstanding", "running", "busiest"]
                check_balance_equals_the_samplers(await page.evaluate(STATE_JS))
                await page.screenshot(SCREENSHOT)
                assert page.auth_prompts >= 1, "the page never asked for the key"
                assert await page.evaluate("window.dashboard.errors") == 0
                assert not [m for m in page.console if m.startswith("exception")], page.console
                # it loads with no network access: nothing but the router was asked for anything
                assert page.requests and all(
                    u.startswith(router.url + "/dashboard") or u.startswith("data:")
                    for u in page.requests
                ), page.requests
        finally:
            stop.set()
            finished = await asyncio.wait_for(load, 120)
        assert finished >= LOAD_STREAMS

    asyncio.run(asyncio.wait_for(scenario(), 300))
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
