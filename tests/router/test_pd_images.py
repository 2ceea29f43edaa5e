"""Image input through PD disaggregation: a chat request with a data-URL image, sent through our router to a prefill
server and a decode server of a tiny random Qwen3.5-MoE VL checkpoint, gives transformers' greedy text. The prefill
server runs the vision tower (its prompt, image tokens included, is prefilled there only); the decode server takes
the KV and GDN states and offsets its positions by the request's M-RoPE delta."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import requests

from tests.server.test_images import (  # noqa: F401 - vl_checkpoint is a fixture
    NEW_TOKENS,
    _data_url,
    _image,
    _transformers_greedy,
    vl_checkpoint,
)

from .conftest import free_port, wait_until_healthy
from .helpers import run, wait_for
from .pd_helpers import drained, loads, pd_router, pd_server

try:
    import mooncake.engine  # noqa: F401
except ImportError as error:  # no silent skip: the PD tests need the transfer engine installed
    raise ImportError(f"PD tests need the Mooncake transfer engine ({error})") from error
COMMON = ("--cpu-threads-per-rank", "1", "--disaggregation-transfer-timeout", "30")


@pytest.fixture(scope="module")
def pd_vl(vl_checkpoint):  # noqa: F811 - the imported fixture
    bootstrap = free_port()
    prefill = pd_server(
        vl_checkpoint, "prefill", "--disaggregation-bootstrap-port", str(bootstrap), *COMMON
    )
    decode = pd_server(vl_checkpoint, "decode", *COMMON)
    procs = [prefill, decode]
    try:
        for proc in procs:
            assert wait_until_healthy(proc.url, proc.popen, 180, interval_s=0.25), proc.log
        router = pd_router(prefill.url, bootstrap, decode.url)
        procs.append(router)
        yield router, prefill, decode
    finally:
        for proc in procs:
            proc.kill()


def _prefilled(url: str) -> list[int]:
    async def read():
        async with aiohttp.ClientSession() as s:
            return [load["disaggregation"]["num_prefill_tokens"] for load in await loads(s, url)]

    return run(read())


@pytest.mark.parametrize("sizes", [[(64, 96)], [(96, 64), (64, 64)]], ids=["one", "two"])
def test_images_through_pd_equal_transformers(pd_vl, vl_checkpoint, sizes):  # noqa: F811
    router, prefill, decode = pd_vl
    images = [_image(w, h, seed=10 + i) for i, (w, h) in enumerate(sizes)]
    question = "Describe the pictures."
    want, _ = _transformers_greedy(vl_checkpoint, question, images)
    before = _prefilled(prefill.url)
    content = [{"type": "image_url", "image_url": {"url": _data_url(im)}} for im in images]
    body = {
        "model": "any",
        "messages": [{"role": "user", "content": [*content, {"type": "text", "text": question}]}],
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    reply = requests.post(f"{router.url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == want
    prompt_tokens = reply.json()["usage"]["prompt_tokens"]
    assert sum(_prefilled(prefill.url)) - sum(before) == prompt_tokens
    assert _prefilled(decode.url) == [0]  # the decode server ran no prefill (and no vision tower)

    async def settle():
        async with aiohttp.ClientSession() as s:
            return await wait_for(lambda: drained(s, prefill.url, decode.url), timeout=20)

    assert run(settle())


def test_a_corrupt_image_through_pd_is_a_400_naming_it(pd_vl):
    router, prefill, decode = pd_vl
    corrupt = "data:image/png;base64,aGVsbG8="
    body = {
        "model": "any",
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": corrupt}}]}
        ],
        "max_tokens": 2,
    }
    reply = requests.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400 and "image 1" in reply.text
    assert asyncio.run(_healthy(router.url))


async def _healthy(url: str) -> bool:
    async with aiohttp.ClientSession() as s, s.get(url + "/health") as response:
        return response.status == 200
