"""Serving benchmark: a concurrency sweep against any OpenAI-compatible or SGLang-native endpoint.

Works against this server, a router in front of it, or another engine. Every request streams, so time to first
token (TTFT), time per output token after the first (TPOT) and inter-token latency (ITL, gaps between streamed
chunks) are measured on the client; output tokens come from the server's usage (``completion_tokens``) when it
reports them, else one per streamed chunk.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --backend openai \
        --dataset random --input-len 128 --output-len 64 --num-prompts 64 --concurrency 1,8,32 \
        --tokenizer sglang_lite/assets/tiny_qwen3_5_moe --output-file results.json

Backends: ``sglang`` (POST /generate), ``openai`` (POST /v1/completions), ``openai-chat`` (POST
/v1/chat/completions). Datasets: ``fixed`` (every prompt input-len tokens, every output output-len tokens),
``random`` (lengths uniform in [len * (1 - range_ratio), len]) and ``agentic`` (``--sessions`` multi-turn sessions
from the trace generator, ``sglang_lite.sim.traces``: a first prompt of about input-len tokens, then each turn
appends an answer and a tool result, so each prompt extends the last; the turns of a session go in order, one
session per concurrent client; token-id prompts, so sglang or openai backends). Outputs run to their length
(``ignore_eos``). Against an sglang_lite server the table also shows the prefix-cache hit rate of each level: the
prompt tokens its ranks served from the cache (``/v1/loads`` ``num_cached_prompt_tokens``) over those sent.

    python benchmarks/bench_serving.py --backend sglang --dataset agentic --sessions 16 --input-len 1000 \
        --output-len 32 --concurrency 4

``--images N`` (against a VL checkpoint) adds N random PNG images of ``--image-size`` to each request, as
``image_url`` parts (``openai-chat``) or ``image_data`` (``sglang``, the text led by Qwen3.5's placeholders).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.tools

WORDS = (
    "alpha beta gamma delta kernel token batch cache queue rank model layer tensor stream router server "
    "prompt output state block chunk decode prefill expert gate norm head value key query"
).split()
PATHS = {"sglang": "/generate", "openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass(frozen=True)
class Prompt:
    text: str
    input_len: int
    output_len: int
    ids: list[int] | None = None  # token ids instead of text (the agentic dataset)
    session: str = ""  # the agentic dataset: turns of one session go in order
    images: tuple[str, ...] = ()  # data URLs (--images)


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    input_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (
            (self.latency - self.ttft) / (self.output_tokens - 1)
            if self.output_tokens > 1
            else None
        )


# ---- datasets ---------------------------------------------------------------------------------------------------
def make_prompts(args: argparse.Namespace) -> list[Prompt]:
    if args.dataset == "agentic":
        return agentic_prompts(args)
    rng = random.Random(args.seed)
    tokenizer = _load_tokenizer(args.tokenizer)
    prompts = []
    for _ in range(args.num_prompts):
        n_in, n_out = _lengths(rng, args)
        images = tuple(_image_url(rng, args.image_size) for _ in range(args.images))
        prompts.append(Prompt(_prompt_text(rng, tokenizer, n_in), n_in, n_out, images=images))
    return prompts


def _image_url(rng: random.Random, size: str) -> str:
    """A PNG data URL of random pixels, ``size`` WIDTHxHEIGHT (each request's own image: no prefix-cache hits)."""
    import base64
    import io

    from PIL import Image

    width, height = (int(v) for v in size.lower().split("x"))
    pixels = np.random.default_rng(rng.getrandbits(32)).integers(
        0, 256, (height, width, 3), np.uint8
    )
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def agentic_prompts(args: argparse.Namespace) -> list[Prompt]:
    """Multi-turn sessions whose prompts grow turn by turn (token ids shared with the previous turn)."""
    from sglang_lite.sim.traces import AgenticTraceConfig, agentic_trace
    from tests.tools.replay import PromptTokens

    cfg = AgenticTraceConfig(
        first_input_mean=args.input_len,
        tool_output_mean=max(8, args.input_len // 8),
        output_mean=args.output_len,
        output_max=2 * args.output_len,
        min_turns=2,
        max_turns=6,
        max_context=args.max_context,
    )
    tokens = PromptTokens(args.vocab_size)
    return [
        Prompt("", r.input_len, r.output_len, tokens.ids(r), r.session)
        for r in agentic_trace(args.sessions, args.seed, cfg)
    ]


def _lengths(rng: random.Random, args: argparse.Namespace) -> tuple[int, int]:
    if args.dataset == "fixed":
        return args.input_len, args.output_len
    low = lambda n: max(1, int(n * (1 - args.range_ratio)))  # noqa: E731
    return rng.randint(low(args.input_len), args.input_len), rng.randint(
        low(args.output_len), args.output_len
    )


def _prompt_text(rng: random.Random, tokenizer: Any, n_tokens: int) -> str:
    """Random token ids decoded with the tokenizer when one is given, else ~1 token per random word."""
    if tokenizer is None:
        return " ".join(rng.choice(WORDS) for _ in range(n_tokens))
    special = set(tokenizer.all_special_ids)
    ids = [
        i
        for i in (rng.randrange(tokenizer.vocab_size) for _ in range(n_tokens * 2))
        if i not in special
    ][:n_tokens]
    return tokenizer.decode(ids)


def _load_tokenizer(path: str | None) -> Any:
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# ---- requests ---------------------------------------------------------------------------------------------------
def request_body(backend: str, model: str, prompt: Prompt) -> dict[str, Any]:
    if backend == "sglang":
        params = {"max_new_tokens": prompt.output_len, "ignore_eos": True, "temperature": 0}
        source = {"input_ids": prompt.ids} if prompt.ids is not None else {"text": prompt.text}
        if prompt.images:  # Qwen3.5's placeholders, one per image, before the text
            source = {"text": IMAGE_PLACEHOLDER * len(prompt.images) + prompt.text}
            source["image_data"] = list(prompt.images)
        return {**source, "sampling_params": params, "stream": True}
    body = {
        "model": model,
        "max_tokens": prompt.output_len,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if backend == "openai":
        if prompt.images:
            raise ValueError("images go through --backend openai-chat or sglang")
        return {**body, "prompt": prompt.ids if prompt.ids is not None else prompt.text}
    if prompt.ids is not None:
        raise ValueError("the agentic dataset sends token ids: use --backend sglang or openai")
    content: Any = prompt.text
    if prompt.images:
        content = [{"type": "image_url", "image_url": {"url": url}} for url in prompt.images]
        content.append({"type": "text", "text": prompt.text})
    return {**body, "messages": [{"role": "user", "content": content}]}


def chunk_tokens(backend: str, event: dict[str, Any]) -> tuple[bool, int | None]:
    """(whether the event carries output, completion tokens the server reported so far or None)."""
    if backend == "sglang":
        return bool(event.get("text") or event.get("output_ids")), event.get("meta_info", {}).get(
            "completion_tokens"
        )
    usage = (event.get("usage") or {}).get("completion_tokens")
    choices = event.get("choices") or []
    piece = (
        choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
        if choices
        else None
    )
    return bool(piece), usage


async def send_one(
    session: aiohttp.ClientSession, url: str, args: argparse.Namespace, prompt: Prompt
) -> RequestResult:
    result = RequestResult(input_len=prompt.input_len)
    start = last = time.perf_counter()
    chunks, reported = 0, None
    try:
        async with session.post(
            url, json=request_body(args.backend, args.model, prompt)
        ) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                has_output, usage = chunk_tokens(args.backend, json.loads(line[5:]))
                reported = usage if usage is not None else reported
                if has_output:
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks, last = chunks + 1, now
        result.latency = time.perf_counter() - start
        result.output_tokens = reported if reported is not None else chunks
        result.ok = chunks > 0
        result.error = "" if result.ok else "no output"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


async def run_level(
    args: argparse.Namespace, prompts: list[Prompt], concurrency: int
) -> dict[str, Any]:
    url = args.base_url.rstrip("/") + PATHS[args.backend]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    gate = asyncio.Semaphore(concurrency)
    progress = tqdm(
        total=len(prompts),
        desc=f"concurrency {concurrency}",
        file=sys.stderr,
        disable=args.no_progress,
    )
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=concurrency)

    async with aiohttp.ClientSession(
        headers=headers, timeout=timeout, connector=connector
    ) as session:

        async def one(prompt: Prompt) -> RequestResult:
            async with gate:
                result = await send_one(session, url, args, prompt)
            progress.update(1)
            return result

        cached_before = await cached_prompt_tokens(session, args.base_url)
        started = time.perf_counter()
        # sessions: each client runs one session's turns in order
        if any(p.session for p in prompts):
            sessions: dict[str, list[Prompt]] = {}
            for p in prompts:
                sessions.setdefault(p.session, []).append(p)
            queue = list(sessions.values())

            async def client() -> list[RequestResult]:
                out = []
                while queue:
                    for turn in queue.pop(0):
                        out.append(await one(turn))
                return out

            results = [
                r
                for rs in await asyncio.gather(*(client() for _ in range(concurrency)))
                for r in rs
            ]
        else:
            results = await asyncio.gather(*(one(p) for p in prompts))
        duration = time.perf_counter() - started
        cached_after = await cached_prompt_tokens(session, args.base_url)
    progress.close()
    summary = summarize(results, duration, concurrency)
    sent = sum(r.input_len for r in results if r.ok)
    summary["cache_hit_rate"] = (
        (cached_after - cached_before) / sent
        if None not in (cached_before, cached_after) and sent
        else None
    )
    return summary


async def cached_prompt_tokens(session: aiohttp.ClientSession, base_url: str) -> int | None:
    """Prompt tokens an sglang_lite server's ranks have served from their prefix caches; None for other servers."""
    try:
        async with session.get(base_url.rstrip("/") + "/v1/loads?include=core") as response:
            loads = (await response.json())["loads"]
        return sum(int(load["num_cached_prompt_tokens"]) for load in loads)
    except (aiohttp.ClientError, KeyError, TypeError, ValueError):
        return None


# ---- metrics ----------------------------------------------------------------------------------------------------
def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    ms = np.asarray(values) * 1000.0
    return {
        "mean": float(ms.mean()),
        **{f"p{q}": float(np.percentile(ms, q)) for q in (50, 90, 99)},
    }


def summarize(results: list[RequestResult], duration: float, concurrency: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    errors = sorted({r.error for r in results if not r.ok})[:5]
    return {
        "concurrency": concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_throughput": sum(r.input_len for r in ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_output_tokens": output_tokens,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "tpot_ms": _stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl]),
        "e2e_latency_ms": _stats_ms([r.latency for r in ok]),
    }


def _trio(stats: dict[str, float]) -> str:
    return "/".join(f"{stats[p]:.1f}" for p in ("p50", "p90", "p99"))


def format_table(levels: list[dict[str, Any]]) -> str:
    head = (
        f"{'conc':>5} {'ok':>5} {'fail':>4} {'req/s':>8} {'out tok/s':>10} | {'TTFT p50/p90/p99 ms':>22} | "
        f"{'TPOT p50/p90/p99 ms':>22} | {'ITL p50/p90/p99 ms':>22} | {'cache hit':>9}"
    )
    rows = [head, "-" * len(head)]
    for s in levels:
        hit = s.get("cache_hit_rate")
        rows.append(
            f"{s['concurrency']:>5} {s['completed']:>5} {s['failed']:>4} {s['request_throughput']:>8.2f} "
            f"{s['output_throughput']:>10.1f} | {_trio(s['ttft_ms']):>22} | {_trio(s['tpot_ms']):>22} | "
            f"{_trio(s['itl_ms']):>22} | {'n/a' if hit is None else f'{hit:.1%}':>9}"
        )
    return "\n".join(rows)


# ---- main -------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--backend", choices=sorted(PATHS), default="openai")
    parser.add_argument(
        "--model",
        default=None,
        help="Model name for the OpenAI API; default: the first of /v1/models.",
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset", choices=("random", "fixed", "agentic"), default="random")
    parser.add_argument(
        "--sessions", type=int, default=16, help="agentic: multi-turn sessions per level."
    )
    parser.add_argument(
        "--max-context", type=int, default=3000, help="agentic: longest prompt of a session."
    )
    parser.add_argument(
        "--vocab-size", type=int, default=4096, help="agentic: token ids are drawn below this."
    )
    parser.add_argument(
        "--num-prompts", type=int, default=64, help="Requests per concurrency level."
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--range-ratio", type=float, default=0.5, help="random: lengths in [len*(1-r), len]."
    )
    parser.add_argument(
        "--concurrency", default="1,8,32", help="Comma-separated levels of the sweep."
    )
    parser.add_argument(
        "--tokenizer", default=None, help="Tokenizer folder for exact prompt lengths; else words."
    )
    parser.add_argument(
        "--images",
        type=int,
        default=0,
        help="Images per request (random PNG data URLs; a VL checkpoint).",
    )
    parser.add_argument(
        "--image-size", default="256x256", help="WIDTHxHEIGHT of each --images image."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--output-file", default=None, help="Write the results as JSON here.")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


async def discover_model(args: argparse.Namespace) -> str:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        async with aiohttp.ClientSession(headers=headers) as session:
            async with session.get(args.base_url.rstrip("/") + "/v1/models") as response:
                return (await response.json())["data"][0]["id"]
    except (aiohttp.ClientError, KeyError, IndexError, ValueError):
        return "default"


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.model is None and args.backend != "sglang":
        args.model = await discover_model(args)
    prompts = make_prompts(args)
    return [await run_level(args, prompts, int(c)) for c in args.concurrency.split(",")]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    levels = asyncio.run(main_async(args))
    print(format_table(levels))
    if args.output_file:
        config = {k: v for k, v in vars(args).items() if k != "api_key"}
        with open(args.output_file, "w") as f:
            json.dump({"config": config, "levels": levels}, f, indent=2)


if __name__ == "__main__":
    main()
