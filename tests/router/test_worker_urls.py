"""Worker URLs no server could answer on are refused at once, wherever a worker is added: /add_worker
answers 400 naming the URL and the rule (the router's JSON error body) and registers nothing, the
command-line flags stop the start with exit status 2. The router's start-up timeout is long in these
tests (600 s), so a URL that was waited for instead of refused would show as a timeout."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import aiohttp
import pytest

from sglang_lite.router.app import serve
from sglang_lite.router.config import RouterConfig
from sglang_lite.router.worker_urls import WorkerUrlError, check_worker_url

from .conftest import REPO
from .helpers import generate, get_json, run

LONG_STARTUP = ["--worker-startup-timeout-secs", "600"]
FAST = ["--worker-startup-check-interval", "0.1", "--health-check-interval-secs", "0.5"]
REFUSED_WITHIN_S = 2.0  # far below the 600 s a waited-for URL would take

# (URL, a piece of the rule its refusal must name)
BAD_URLS = [
    ("file:///etc/passwd", "scheme must be http or https, not 'file'"),
    ("gopher://x", "scheme must be http or https, not 'gopher'"),
    ("ftp://127.0.0.1:21", "scheme must be http or https"),
    ("http://[::1", "does not parse"),
    ("http://[::1]:8000x", "port must be a number in 1..65535"),
    ("http://[not-v6]:80", "does not parse"),
    ("http://", "has no host"),
    ("http:///generate", "has no host"),
    ("http://127.0.0.1:abc", "port must be a number in 1..65535, not 'abc'"),
    ("http://127.0.0.1:70000", "port must be a number in 1..65535, not '70000'"),
    ("http://127.0.0.1:0", "port must be a number in 1..65535, not '0'"),
    ("http://127.0.0.1:", "port must be a number in 1..65535"),
    ("http://127.0.0.1:-1", "port must be a number in 1..65535"),
    ("http://127.0.0.1:" + "9" * 5000, "port must be a number in 1..65535"),
    ("", "empty"),
    ("http://user:secret@127.0.0.1:1", "user name or password"),
    ("http://127.0.0.1:1@evil.example", "user name or password"),
    ("http://127.0.0.1 :1", "whitespace or control characters"),
    (" http://127.0.0.1:1", "whitespace or control characters"),
    ("http://127.0.0.1:1\n", "whitespace or control characters"),
    ("http://127.0.0.1:1\r\nX-Injected: 1", "whitespace or control characters"),
    ("http://127.0.0.1\x00:1", "whitespace or control characters"),
    ("http://127.0.0.1:1/?x=1", "query or fragment"),
    ("http://127.0.0.1:1#top", "query or fragment"),
    ("http://999.0.0.1:1", "not an IPv4 address"),
    ("http://a..b:1", "not a DNS name or an IP address"),
    ("http://bad%41host:1", "not a DNS name or an IP address"),
    ("mailto:someone", "port must be a number"),
]

GOOD_URLS = [
    ("http://127.0.0.1:30001", "http://127.0.0.1:30001"),
    ("127.0.0.1:30001", "http://127.0.0.1:30001"),  # no scheme: http
    ("https://worker-0.example.com/", "https://worker-0.example.com"),
    ("http://[::1]:8000", "http://[::1]:8000"),
    ("http://gpu_node_3:8000/prefix", "http://gpu_node_3:8000/prefix"),
]


@pytest.mark.parametrize("url,rule", BAD_URLS)
def test_a_bad_worker_url_is_refused_naming_it_and_the_rule(url, rule):
    with pytest.raises(WorkerUrlError) as refused:
        check_worker_url(url)
    message = str(refused.value)
    assert rule in message
    assert not url or repr(url)[:100] in message  # the URL as typed (escaped, long ones cut)


@pytest.mark.parametrize("url,used", GOOD_URLS)
def test_a_good_worker_url_is_normalised(url, used):
    assert check_worker_url(url) == used


def test_a_long_url_is_shortened_in_the_message():
    message = str(pytest.raises(WorkerUrlError, check_worker_url, "gopher://" + "x" * 10_000).value)
    assert len(message) < 400 and "scheme must be http or https" in message


@pytest.mark.parametrize(
    "flags,named",
    [
        (
            ["--worker-urls", "http://127.0.0.1:1", "gopher://x"],
            "--worker-urls: worker URL 'gopher://x'",
        ),
        (["--worker-urls", "http://[::1"], "--worker-urls: worker URL 'http://[::1' refused"),
        (
            ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "http"]
            + ["--decode", "http://127.0.0.1:2"],
            "--prefill http://127.0.0.1:1 http: bootstrap_port must be a number",
        ),
        (
            ["--pd-disaggregation", "--prefill", "file:///etc/passwd"]
            + ["--decode", "http://127.0.0.1:2"],
            "--prefill: worker URL 'file:///etc/passwd' refused",
        ),
        (
            ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1"]
            + ["--decode", "http://127.0.0.1:99999"],
            "--decode: worker URL 'http://127.0.0.1:99999' refused: the port",
        ),
    ],
)
def test_a_bad_url_on_the_command_line_stops_the_start_at_once(flags, named):
    cmd = [sys.executable, "-m", "sglang_lite.router", "--port", "0", *LONG_STARTUP, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and done.stderr.count("\n") == 1  # one line, no traceback


def test_a_bad_url_in_a_config_fails_serve_at_once():
    """A RouterConfig built in code, not from flags: serve() raises before any worker is waited for."""
    config = RouterConfig(
        port=0, worker_urls=("http://127.0.0.1:1", "gopher://x"), worker_startup_timeout_secs=600
    )
    start = time.monotonic()
    with pytest.raises(WorkerUrlError, match="'gopher://x' refused: the scheme"):
        asyncio.run(asyncio.wait_for(serve(config), 10))
    assert time.monotonic() - start < REFUSED_WITHIN_S


def test_add_worker_refuses_bad_urls_at_once_and_the_router_keeps_serving(procs):
    up = procs.upstream()
    router = procs.router("--worker-urls", up.url, "--policy", "round_robin", *LONG_STARTUP, *FAST)

    async def add(s: aiohttp.ClientSession, params: dict) -> tuple[int, dict | None, float]:
        start = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=10)  # bounds the test, not the router
        async with s.post(router.url + "/add_worker", params=params, timeout=timeout) as resp:
            body = await resp.json(content_type=None)
            return resp.status, body, time.monotonic() - start

    async def scenario():
        async with aiohttp.ClientSession() as s:
            answers = [await add(s, {"url": url}) for url, _ in BAD_URLS]
            bad_port = await add(s, {"url": "http://127.0.0.1:9", "bootstrap_port": "x"})
            again = await add(s, {"url": up.url})
            listed = await get_json(s, router.url + "/list_workers")
            workers = await get_json(s, router.url + "/workers")
            served = [await generate(s, router.url) for _ in range(3)]
        return answers, bad_port, again, listed, workers, served

    answers, bad_port, again, listed, workers, served = run(scenario())
    for (url, rule), (status, body, seconds) in zip(BAD_URLS, answers):
        assert status == 400, (url, status, body)
        error = body["error"]
        assert error["code"] == 400 and rule in error["message"], (url, error)
        assert seconds < REFUSED_WITHIN_S, (url, seconds)
    status, body, seconds = bad_port
    assert status == 400 and "bootstrap_port must be a number" in body["error"]["message"]
    status, body, seconds = again
    assert status == 400 and "already registered" in body["error"]["message"]
    assert seconds < REFUSED_WITHIN_S
    assert listed == {"urls": [up.url]}
    assert [w["base_url"] for w in workers["workers"]] == [up.url]
    assert all(r.ok for r in served)
