"""The offline engine: one scheduler (one process, or a world of ``tp_size`` processes) driven through the client
core, with a blocking and a streaming ``generate``.

Results follow SGLang: ``{"text", "output_ids", "meta_info": {"prompt_tokens", "completion_tokens",
"finish_reason", ...}}`` per request. Streaming yields the same keys with only what is new in each piece.
The scheduler runs in a child process (see ``sync_client.py`` for why), a fresh interpreter: scripts need no main
guard.
"""

from __future__ import annotations

import os
import queue
import uuid
from collections.abc import Iterator
from typing import Any

from sglang_lite.engine.sync_client import SyncClient
from sglang_lite.multimodal.attach import ImageAttacher
from sglang_lite.multimodal.inputs import ImageInputs
from sglang_lite.multimodal.media import image_data_url
from sglang_lite.protocol.loads import LOAD_SECTIONS
from sglang_lite.protocol.outputs import ReqOutput, join_outputs
from sglang_lite.protocol.requests import fork_rids, validate_request
from sglang_lite.runtime.inputs import per_prompt, prompt_token_ids
from sglang_lite.runtime.messages import CheckQuery, FlushCache, LoadsQuery
from sglang_lite.sampling.grammar import GrammarCache, grammar_key
from sglang_lite.sampling.logprobs import LogprobParams
from sglang_lite.sampling.params import SamplingParams
from sglang_lite.server_args import ServerArgs
from sglang_lite.tokenizer.hf_tokenizer import load_server_tokenizer

Prompt = str | list[str] | None
InputIds = list[int] | list[list[int]] | None
Params = dict[str, Any] | SamplingParams | list[dict[str, Any] | SamplingParams] | None
# offline callers queue as much as they like; the HTTP server bounds its queue
UNBOUNDED_QUEUE = 2**31 - 1


class Engine:
    def __init__(self, model_path: str | os.PathLike | None = None, **server_args: Any) -> None:
        if model_path is not None:
            model_path = os.fspath(model_path)  # a pathlib.Path too
        server_args.setdefault("max_queued_requests", UNBOUNDED_QUEUE)
        # the rank's INFO lines would interleave with the caller's output (upstream's Engine: errors only)
        server_args.setdefault("log_level", "error")
        self.server_args = ServerArgs(model_path=model_path, **server_args)
        if self.server_args.dp_size != 1:
            raise ValueError(
                f"dp_size: the Engine runs one scheduler, got {self.server_args.dp_size}; "
                "serve DP ranks with sglang_lite.launch_server"
            )
        if self.server_args.disaggregation_mode != "null":
            raise ValueError(
                "disaggregation_mode: PD disaggregation runs behind the HTTP server (its bootstrap "
                "server and a PD router); the Engine serves whole requests"
            )
        self.tokenizer = load_server_tokenizer(self.server_args)
        self._client: SyncClient | None = SyncClient(self.server_args)
        self.config = self._client.config
        # to refuse what cannot compile
        budget = self.server_args.grammar_compile_timeout
        self._grammars = GrammarCache(self.tokenizer, self.config.vocab_size, budget_s=budget)
        self._attacher = ImageAttacher(self.server_args)

    # ---- generation --------------------------------------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: Params = None,
        input_ids: InputIds = None,
        stream: bool = False,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
        image_data: str | list[str] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """One result dict for one prompt, a list for a list; ``stream=True`` gives ``generate_stream``.
        ``return_logprob`` and the rest: log-probabilities in ``meta_info`` (as SGLang's, for every prompt). With
        ``n`` > 1 in a prompt's sampling parameters, its ``n`` samples come in a row (a list even for one prompt).
        ``image_data``: the images of one prompt whose text (or ids) holds their placeholders, in order (data or
        http(s) URLs, or bare base64), as the server's ``/generate`` takes them (SGLang's field)."""
        logprob = _logprob(return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob)
        if stream:
            return self.generate_stream(
                prompt, sampling_params, input_ids, logprob=logprob, image_data=image_data
            )
        prompts, batched = self._prompts(prompt, input_ids)
        images = self._images(prompts, image_data)
        requests = self._validated(prompts, sampling_params, logprob, images)
        rids = [uuid.uuid4().hex for _ in requests]
        # not streamed: each request sends one output, when it finishes
        streams = [
            self._submit(rid, ids, p, logprob, stream=False, images=im)
            for rid, (ids, p), im in zip(rids, requests, images)
        ]
        samples = [fork_rids(rid, p.n) for rid, (_, p) in zip(rids, requests)]
        try:
            results = [
                _result(join_outputs(outputs))
                for s, group in zip(streams, samples)
                for outputs in _outputs(s, group)
            ]
        except BaseException:
            for rid in [r for group in samples for r in group]:
                self.abort(rid)
            raise
        return results if batched or len(results) > 1 else results[0]

    def generate_stream(
        self,
        prompt: str | None = None,
        sampling_params: dict[str, Any] | SamplingParams | None = None,
        input_ids: list[int] | None = None,
        logprob: LogprobParams | None = None,
        image_data: str | list[str] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Pieces of one request as they are produced; closing the iterator early aborts the request. Each piece's
        ``meta_info`` carries the log-probabilities of its own tokens when ``logprob`` asks for them."""
        prompts, batched = self._prompts(prompt, input_ids)
        if batched:
            raise ValueError("generate_stream takes one prompt; call it once per prompt")
        images = self._images(prompts, image_data)
        ((ids, params),) = self._validated(prompts, sampling_params, logprob, images)
        if params.n > 1:
            raise ValueError("n: generate_stream streams one sample; call generate for n > 1")
        rid = uuid.uuid4().hex
        return self._stream(rid, self._submit(rid, ids, params, logprob, images=images[0]))

    def _stream(self, rid: str, stream: queue.Queue) -> Iterator[dict[str, Any]]:
        finished = False
        try:
            while not finished:
                output = _next_output(stream)
                finished = output.finished
                yield _result(output)
        finally:
            if not finished and self._client is not None:
                self.abort(rid)

    def abort(self, rid: str) -> None:
        self._running_client().abort(rid)

    def get_loads(self, include: tuple[str, ...] = LOAD_SECTIONS) -> dict[str, Any]:
        """Live load figures of the scheduler, taken after every command sent before this call: one ``/v1/loads``
        entry (core figures flat, each section of ``include`` a nested sub-object, the others None)."""
        unknown = sorted(set(include) - set(LOAD_SECTIONS))
        if unknown:
            raise ValueError(
                f"include: unknown load section(s) {unknown}; known: {list(LOAD_SECTIONS)}"
            )
        return self._running_client().ask(LoadsQuery, tuple(include)).loads

    def flush_cache(self) -> int:
        """Drops every cached prefix no request uses; returns the KV slots freed."""
        return self._running_client().ask(FlushCache).freed_tokens

    def check_invariants(self) -> None:
        """Asserts the pools hold exactly what the requests hold (for tests and debugging)."""
        error = self._running_client().ask(CheckQuery).error
        if error is not None:
            raise AssertionError(error)

    # ---- lifetime ----------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops the scheduler process (unfinished requests fail), which frees the model and pools."""
        if self._client is None:
            return
        client, self._client = self._client, None
        client.shutdown()

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
    def _submit(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        logprob: LogprobParams | None = None,
        stream: bool = True,
        images: ImageInputs | None = None,
    ) -> queue.Queue:
        return self._running_client().submit(rid, input_ids, params, logprob, stream, images)

    def _running_client(self) -> SyncClient:
        if self._client is None:
            raise RuntimeError("the engine is shut down")
        return self._client

    def _prompts(self, prompt: Prompt, input_ids: InputIds) -> tuple[list[list[int]], bool]:
        """Token ids of each prompt, and whether the call was batched."""
        return prompt_token_ids(prompt, input_ids, self._encode, text_name="prompt")

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(
                "prompt needs a tokenizer (skip_tokenizer_init is set); pass input_ids"
            )
        if not isinstance(text, str):
            raise ValueError(
                f"prompt must be a string or a list of strings, got {type(text).__name__}"
            )
        return self.tokenizer.encode(text)

    def _images(
        self, prompts: list[list[int]], image_data: str | list[str] | None
    ) -> list[ImageInputs | None]:
        """Each prompt's images (``multimodal.attach``; the one prompt's placeholders expanded in place)."""
        if image_data is None:
            return [None] * len(prompts)
        if len(prompts) != 1:
            raise ValueError("image_data: send one prompt with its images")
        if not self.config.image_merge_size:
            raise ValueError(
                "image_data: the model takes text only (its checkpoint has no vision tower)"
            )
        entries = [image_data] if isinstance(image_data, str) else list(image_data)
        urls = [image_data_url(entry) for entry in entries]
        config = self.config
        prompts[0], images = self._attacher.attach(
            prompts[0], urls, config.image_token_id, config.image_merge_size, config.vocab_size
        )
        return [images]

    def _validated(
        self,
        prompts: list[list[int]],
        sampling_params: Params,
        logprob: LogprobParams | None = None,
        images: list[ImageInputs | None] | None = None,
    ) -> list[tuple[list[int], SamplingParams]]:
        """All requests checked before any is queued, so one bad request sends none."""
        params = [
            SamplingParams.from_dict(p)
            for p in per_prompt(sampling_params, len(prompts), "sampling_params")
        ]
        images = images or [None] * len(prompts)
        for ids, p, im in zip(prompts, params, images):
            validate_request(ids, p, self.config, self.tokenizer is not None, logprob, im)
            if grammar_key(p) is not None:
                self._grammars.compile(grammar_key(p))  # a ValueError naming the field
        return list(zip(prompts, params))


def _logprob(
    return_logprob: bool, start: int, top: int, token_ids: list[int] | None
) -> LogprobParams | None:
    if not return_logprob and (start != -1 or top or token_ids is not None):
        raise ValueError(
            "logprob_start_len, top_logprobs_num and token_ids_logprob need return_logprob=True"
        )
    return LogprobParams(True, start, top, token_ids) if return_logprob else None


def _next_output(stream: queue.Queue) -> ReqOutput:
    item = stream.get()
    if isinstance(item, BaseException):
        raise item
    return item


def _outputs(stream: queue.Queue, rids: list[str]) -> list[list[ReqOutput]]:
    """Every output of one request, up to the finished one, for each of its parallel samples ``rids``."""
    outputs: dict[str, list[ReqOutput]] = {rid: [] for rid in rids}
    unfinished = set(rids)
    while unfinished:
        output = _next_output(stream)
        outputs[output.rid].append(output)
        if output.finished:
            unfinished.discard(output.rid)
    return [outputs[rid] for rid in rids]


def _result(output: ReqOutput) -> dict[str, Any]:
    return {
        "text": output.new_text,
        "output_ids": output.new_token_ids,
        "meta_info": output.meta_info,
    }
