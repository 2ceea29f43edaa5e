"""The offline engine: one scheduler process driven over ZMQ, with a blocking and a streaming ``generate``.

Results follow SGLang: ``{"text", "output_ids", "meta_info": {"prompt_tokens", "completion_tokens",
"finish_reason", ...}}`` per request. Streaming yields the same keys with only what is new in each piece.
The scheduler runs in a child process (see ``driver.py`` for why), a fresh interpreter: scripts need no main guard.
"""
from __future__ import annotations

import dataclasses
import queue
import uuid
from collections.abc import Iterator
from typing import Any

from sglang_lite.engine.driver import SchedulerProcess
from sglang_lite.engine.launch import load_server_tokenizer
from sglang_lite.sampling.params import SamplingParams
from sglang_lite.scheduler.config import SchedulerConfig
from sglang_lite.scheduler.loads import SECTIONS
from sglang_lite.scheduler.request import ReqOutput
from sglang_lite.scheduler.scheduler import validate_request
from sglang_lite.server_args import ServerArgs

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
Params = dict[str, Any] | SamplingParams | list[dict[str, Any] | SamplingParams] | None
UNBOUNDED_QUEUE = 2**31 - 1  # offline callers queue as much as they like; the HTTP server bounds its queue


class Engine:
    def __init__(self, model_path: str | None = None, **server_args: Any) -> None:
        server_args.setdefault("max_queued_requests", UNBOUNDED_QUEUE)
        self.server_args = ServerArgs(model_path=model_path, **server_args)
        self.tokenizer = load_server_tokenizer(self.server_args)
        self._driver: SchedulerProcess | None = SchedulerProcess(self.server_args)
        self.config = SchedulerConfig.from_dict(self._driver.info["config"])

    # ---- generation --------------------------------------------------------------------------------------------
    def generate(
        self, prompt: Prompt = None, sampling_params: Params = None, input_ids: InputIds = None, stream: bool = False
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """One result dict for one prompt, a list for a list; ``stream=True`` gives ``generate_stream``."""
        if stream:
            return self.generate_stream(prompt, sampling_params, input_ids)
        prompts, batched = self._prompts(prompt, input_ids)
        requests = self._validated(prompts, sampling_params)
        rids = [uuid.uuid4().hex for _ in requests]
        streams = [self._submit(rid, ids, p) for rid, (ids, p) in zip(rids, requests)]
        try:
            results = [_collect(s) for s in streams]
        except BaseException:
            for rid in rids:
                self.abort(rid)
            raise
        return results if batched else results[0]

    def generate_stream(
        self, prompt: str | None = None, sampling_params: dict[str, Any] | SamplingParams | None = None,
        input_ids: list[int] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Pieces of one request as they are produced; closing the iterator early aborts the request."""
        prompts, batched = self._prompts(prompt, input_ids)
        if batched:
            raise ValueError("generate_stream takes one prompt; call it once per prompt")
        ((ids, params),) = self._validated(prompts, sampling_params)
        rid = uuid.uuid4().hex
        return self._stream(rid, self._submit(rid, ids, params))

    def _stream(self, rid: str, stream: queue.Queue) -> Iterator[dict[str, Any]]:
        finished = False
        try:
            while not finished:
                output = _next_output(stream)
                finished = output.finished
                yield {"text": output.new_text, "output_ids": output.new_token_ids, "meta_info": output.meta_info}
        finally:
            if not finished and self._driver is not None:
                self.abort(rid)

    def abort(self, rid: str) -> None:
        self._running_driver().abort(rid)

    def get_loads(self, include: tuple[str, ...] = ("core", "memory", "queues")) -> dict[str, Any]:
        """Live load figures of the scheduler, taken after every command sent before this call."""
        unknown = sorted(set(include) - set(SECTIONS))
        if unknown:
            raise ValueError(f"include: unknown load section(s) {unknown}; known: {sorted(SECTIONS)}")
        return self._running_driver().ask("loads", list(include))

    def check_invariants(self) -> None:
        """Asserts the pools hold exactly what the requests hold (for tests and debugging)."""
        error = self._running_driver().ask("check")
        if error is not None:
            raise AssertionError(error)

    # ---- lifetime ----------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops the scheduler process (unfinished requests fail), which frees the model and pools."""
        if self._driver is None:
            return
        driver, self._driver = self._driver, None
        driver.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass

    # ---- helpers -----------------------------------------------------------------------------------------------
    def _submit(self, rid: str, input_ids: list[int], params: SamplingParams) -> queue.Queue:
        return self._running_driver().submit(rid, input_ids, dataclasses.asdict(params))

    def _running_driver(self) -> SchedulerProcess:
        if self._driver is None:
            raise RuntimeError("the engine is shut down")
        return self._driver

    def _prompts(self, prompt: Prompt, input_ids: InputIds) -> tuple[list[list[int]], bool]:
        """Token ids of each prompt, and whether the call was batched."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        if input_ids is not None:
            batched = bool(input_ids) and isinstance(input_ids[0], list)
            return ([list(x) for x in input_ids] if batched else [list(input_ids)]), batched
        batched = isinstance(prompt, list)
        return [self._encode(p) for p in (prompt if batched else [prompt])], batched

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt needs a tokenizer (skip_tokenizer_init is set); pass input_ids")
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string or a list of strings, got {type(text).__name__}")
        return self.tokenizer.encode(text)

    def _validated(self, prompts: list[list[int]], sampling_params: Params) -> list[tuple[list[int], SamplingParams]]:
        """All requests checked before any is queued, so one bad request sends none."""
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params) for _ in prompts]
        for ids, p in zip(prompts, params):
            validate_request(ids, p, self.config, self.tokenizer is not None)
        return list(zip(prompts, params))


def _next_output(stream: queue.Queue) -> ReqOutput:
    item = stream.get()
    if isinstance(item, BaseException):
        raise item
    return item


def _collect(stream: queue.Queue) -> dict[str, Any]:
    text, ids = [], []
    while True:
        output = _next_output(stream)
        text.append(output.new_text)
        ids.extend(output.new_token_ids)
        if output.finished:
            return {"text": "".join(text), "output_ids": ids, "meta_info": output.meta_info}
