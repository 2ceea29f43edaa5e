"""What the PD end-to-end tests share: starting a prefill or decode server, our router in front of a pair, one leg
of a request, a server's loads, whether its PD queues drained, a client that leaves mid-stream, and the transformers
reference of a checkpoint (greedy tokens and log-probabilities)."""

from __future__ import annotations

import re
import sys

import aiohttp
import torch

from tests.hf_checkpoints import greedy_tokens

from .conftest import Proc, free_port, launch, spawn
from .helpers import get_json, get_text, parse_counter, wait_for

CORE_QUEUES = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens")
PD_QUEUES = (  # the entry's disaggregation sub-object
    "prefill_prealloc_queue_reqs",
    "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
)


def pd_server(model_path: str | None, mode: str, *flags: str) -> Proc:
    """A prefill or decode server, not waited for (start several at once, then ``wait_healthy`` each)."""
    port = free_port()
    model = ["--model-path", model_path] if model_path else []
    cmd = [
        *(sys.executable, "-m", "sglang_lite.launch_server", "--host", "127.0.0.1"),
        *("--port", str(port), "--disaggregation-mode", mode, *model, *flags),
    ]
    return spawn(cmd, port)


def pd_router(prefill_url: str, bootstrap_port: int | None, decode_url: str, *flags: str) -> Proc:
    """Our router in PD mode in front of one prefill and one decode server (no bootstrap port: the router sends
    null and the prefill server's own is used)."""
    port = [] if bootstrap_port is None else [str(bootstrap_port)]
    return launch(
        [
            *(sys.executable, "-m", "sglang_lite.router", "--port", "0", "--pd-disaggregation"),
            *("--prefill", prefill_url, *port, "--decode", decode_url),
            *("--worker-startup-check-interval", "0.1", *flags),
        ],
        re.compile(r"router listening on http://127\.0\.0\.1:(\d+)"),
    )


async def aborted_requests(s: aiohttp.ClientSession, url: str) -> float:
    metrics = await get_text(s, url + "/metrics")
    return sum(
        parse_counter(metrics, "sglang_lite_requests_finished_total", reason="abort").values()
    )


async def leave_after_first_event(
    router_url: str, prompt: list[int], max_new_tokens: int, prefill_url: str, decode_url: str
) -> tuple[bool, float]:
    """A client streams a long greedy request through the router and leaves at the first event (decoding has
    started). Whether both servers then drained within 30 s, and how many requests the decode server aborted."""
    async with aiohttp.ClientSession() as s:
        before = await aborted_requests(s, decode_url)
        body = {
            "input_ids": prompt,
            "stream": True,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        async with s.post(router_url + "/generate", json=body) as response:
            async for _ in response.content:
                break
        ok = await wait_for(lambda: drained(s, prefill_url, decode_url), timeout=30, interval=0.2)
        return ok, await aborted_requests(s, decode_url) - before


async def generate(
    s: aiohttp.ClientSession, url: str, prompt: list[int], params: dict, **extra
) -> tuple[int, dict]:
    body = {"input_ids": prompt, "sampling_params": params, **extra}
    async with s.post(
        url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=120)
    ) as response:
        return response.status, await response.json(content_type=None)


async def loads(s: aiohttp.ClientSession, url: str) -> list[dict]:
    return (await get_json(s, url + "/v1/loads?include=all"))["loads"]


async def drained(s: aiohttp.ClientSession, *urls: str) -> bool:
    """Every DP rank of every server holds nothing and waits for nothing."""
    every = [load for url in urls for load in await loads(s, url)]
    core = all(load[q] == 0 for load in every for q in CORE_QUEUES)
    return core and all(load["disaggregation"][q] == 0 for load in every for q in PD_QUEUES)


class Reference:
    """A transformers model of a checkpoint: what the servers' outputs must equal."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        return greedy_tokens(self.model, prompt, new_tokens)

    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab] log-probabilities: row i is the distribution that predicts token i + 1."""
        with torch.no_grad():
            logits = self.model(torch.tensor([tokens])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)
