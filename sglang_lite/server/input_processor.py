"""Tokenisation and validation on the HTTP side: prompts and chat conversations to token ids, sampling parameters
from a request, and every check a request passes before it is dispatched.

Scheduler processes detokenise (their outputs carry text deltas); this side only encodes prompts. Every request
is validated here, with the ranks' own limits (``config``, set at start), before it is sent, so bad input is a 400
and never reaches a rank. Tokenising runs on worker threads so a long text never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from sglang_lite.protocol.config import SchedulerConfig
from sglang_lite.protocol.requests import validate_request
from sglang_lite.runtime.inputs import max_prompt_chars
from sglang_lite.sampling.grammar import GrammarBusy, grammar_key
from sglang_lite.sampling.grammar_process import GrammarChecker, xgrammar_tables
from sglang_lite.sampling.params import SamplingParams, is_utf8
from sglang_lite.server.chat_render import (
    RenderLanes,
    RenderTimeout,
    chat_items,
    check_chat_size,
    stop_at_deadline,
)
from sglang_lite.server.io_struct import ChatPrompt, GenerateInput, RequestError, bad_request
from sglang_lite.server_args import ServerArgs

MAX_RID_CHARS = 256
# Sampling keys other engines and sglang-router send; accepted at their neutral value, refused otherwise.
NEUTRAL_SAMPLING = {"no_stop_trim": False, "spaces_between_special_tokens": True}


class InputProcessor:
    """Encodes prompts with the server's tokenizer and checks requests against the ranks' limits."""

    _prompt_chars_limit: int | None = None  # of a text prompt; from the tokenizer, on first use

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.tokenizer: Any = None  # set at start, as are the config and the grammars
        self.config: SchedulerConfig | None = None  # every rank's, but dp_rank
        # compiles only to check grammars, in processes a compile past its budget is killed with (the tables
        # are built at the first grammar, once the config is known)
        self.grammars = GrammarChecker(
            lambda: xgrammar_tables(self.tokenizer, self.config.vocab_size),
            args.grammar_compile_timeout,
            mask_budget_s=args.grammar_mask_budget_ms / 1000,
        )
        self.renders = RenderLanes()
        self._deadline_installed = False  # in the chat template's sandbox, at the first chat

    def set_config(self, config: SchedulerConfig) -> None:
        """The ranks' limits, once they are ready (the tokenizer is loaded before they start)."""
        self.config = config

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.renders.shutdown()

    # ---- tokenising --------------------------------------------------------------------------------------------
    async def encode(
        self, text: str, name: str = "text", add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of a text prompt, tokenised on a worker thread so a long text never stalls the event loop."""
        if self.tokenizer is None:
            raise bad_request(
                "text prompts need a tokenizer (the server skipped tokenizer init); pass input_ids"
            )
        self._check_prompt_chars(len(text), name)
        options = {} if add_special_tokens else {"add_special_tokens": False}
        return await asyncio.to_thread(self._tokenize, text, name, options)

    async def encode_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None = None,
    ) -> ChatPrompt:
        """The chat template's prompt (``tools``: OpenAI tool definitions, rendered by the template)."""
        if self.tokenizer is None:
            raise bad_request("chat needs a tokenizer (the server skipped tokenizer init)")
        check_template_kwargs(template_kwargs)
        check_chat_size({"messages": messages}, self.config.max_request_tokens)
        # every text the template renders, before any is rendered or tokenised
        chars = sum(_message_chars(m) for m in messages) + len(json.dumps(tools) if tools else "")
        self._check_prompt_chars(chars, "messages")
        if not self._deadline_installed:
            stop_at_deadline(self.tokenizer)
            self._deadline_installed = True
        items = chat_items({"messages": messages})
        try:
            return await self.renders.run(
                items, self._encode_chat, messages, template_kwargs, tools
            )
        except RenderTimeout:
            seconds = self.renders.budget_s
            raise bad_request(
                f"messages: the chat template took more than {seconds:g} s to render"
            ) from None

    def _encode_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None,
    ) -> ChatPrompt:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True, **template_kwargs
            )
        except RenderTimeout:
            raise
        except Exception as error:  # a template rejecting the conversation is the request's fault
            raise bad_request(f"messages: the chat template failed: {error}") from error
        self._check_prompt_chars(len(text), "messages")  # what the template made of them
        return ChatPrompt(text, self._tokenize(text, "messages", {"add_special_tokens": False}))

    def _tokenize(self, text: str, name: str, options: dict[str, Any]) -> list[int]:
        if not is_utf8(
            text
        ):  # JSON can carry lone surrogates, which the tokenizer refuses with a TypeError
            raise bad_request(f"{name}: the text is not valid Unicode (it holds a lone surrogate)")
        return self.tokenizer.encode(text, **options)

    def _check_prompt_chars(self, chars: int, name: str) -> None:
        """The cheap check before tokenising: a text that cannot fit in the context is a 400 at once."""
        if self._prompt_chars_limit is None:
            self._prompt_chars_limit = max_prompt_chars(
                self.tokenizer, self.config.max_request_tokens
            )
        if chars > self._prompt_chars_limit:
            raise bad_request(
                f"{name}: the prompt has {chars} characters, more than the context length "
                f"({self.config.max_request_tokens} tokens) can hold"
            )

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (empty without a tokenizer), for log-probability entries."""
        if self.tokenizer is None:
            return ["" for _ in ids]
        return self.tokenizer.batch_decode([[token] for token in ids])

    # ---- checking ----------------------------------------------------------------------------------------------
    def check_prompt_count(self, count: int, name: str) -> None:
        """A batched request carries at most ``--max-queued-requests`` prompts: more could never be queued."""
        if count > self.args.max_queued_requests:
            raise bad_request(
                f"{name}: {count} prompts in one request, more than --max-queued-requests "
                f"({self.args.max_queued_requests})"
            )

    def check_sample_count(self, inputs: list[GenerateInput]) -> None:
        """Nor may its prompts' samples together (``n`` each) be more than ``--max-queued-requests``."""
        samples = sum(request.sampling_params.n for request in inputs)
        if samples > self.args.max_queued_requests:
            raise bad_request(
                f"n: {len(inputs)} prompts with their samples make {samples} requests in one, more than "
                f"--max-queued-requests ({self.args.max_queued_requests})"
            )

    def sampling_params(self, raw: dict[str, Any] | None) -> SamplingParams:
        """SGLang sampling parameters from a request, validated; None values mean the default."""
        if raw is not None and not isinstance(raw, dict):
            raise bad_request("sampling_params must be an object")
        params = {k: v for k, v in (raw or {}).items() if v is not None}
        for key in [k for k in params if k in NEUTRAL_SAMPLING]:
            if params.pop(key) != NEUTRAL_SAMPLING[key]:
                raise bad_request(
                    f"sampling parameter {key} is not supported (only {NEUTRAL_SAMPLING[key]!r})"
                )
        for key in ("stop", "stop_token_ids"):
            if not isinstance(params.get(key, []), (str, list)):
                kind = type(params[key]).__name__
                raise bad_request(
                    f"sampling parameter {key} must be a string or a list, got {kind}"
                )
        try:
            result = SamplingParams.from_dict(params)
            result.validate(self.config.vocab_size)
        except (ValueError, TypeError) as error:
            raise bad_request(str(error)) from error
        return result

    def validate(self, request: GenerateInput) -> None:
        """The request's own checks (rid, prompt, sampling and log-probability parameters): a 400 naming the field."""
        if not _valid_rid(request.rid):
            raise bad_request(f"rid must be a UTF-8 string of 1 to {MAX_RID_CHARS} characters")
        try:
            validate_request(
                request.input_ids,
                request.sampling_params,
                self.config,
                self.tokenizer is not None,
                request.logprob,
                request.images,
            )
        except (ValueError, TypeError) as error:
            raise bad_request(str(error)) from error

    async def check_grammar(self, request: GenerateInput) -> None:
        """A grammar that cannot compile is a 400 naming its field (compiled in worker processes, once per text;
        the rank compiles it again, for its own use)."""
        key = grammar_key(request.sampling_params)
        if key is None:
            return
        # past the budget a compile fails as too complex; this bounds the wait for a slot as well
        wait_s = max(GRAMMAR_WAIT_FLOOR_S, 3 * self.args.grammar_compile_timeout)
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.grammars.submit(key)), wait_s)
        except ValueError as error:
            raise bad_request(str(error)) from error
        except GrammarBusy as error:
            raise RequestError(503, str(error), {"Retry-After": "1"}) from error
        except asyncio.TimeoutError:
            message = f"the grammar compiler is busy (no slot within {wait_s:g} s); try again later"
            raise RequestError(503, message, {"Retry-After": "1"}) from None


def _valid_rid(rid: Any) -> bool:
    """The msgpack transport carries UTF-8 only, and a rid is a key, not a payload."""
    return isinstance(rid, str) and 0 < len(rid) <= MAX_RID_CHARS and is_utf8(rid)


# apply_chat_template's own parameters: a client passing them in chat_template_kwargs would replace the server's
# template (chat_template) or how it is applied; every other key is a template variable (enable_thinking, ...)
TEMPLATE_PARAMETERS = frozenset(
    {
        "chat_template",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)
GRAMMAR_WAIT_FLOOR_S = 30.0


def check_template_kwargs(template_kwargs: Any) -> None:
    if not isinstance(template_kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object of template variables")
    refused = sorted(set(template_kwargs) & TEMPLATE_PARAMETERS)
    if refused:
        raise bad_request(
            f"chat_template_kwargs.{refused[0]}: not a template variable; the chat template and how it "
            "is applied are the server's"
        )


def _message_chars(message: dict[str, Any]) -> int:
    texts = [message.get("content"), message.get("reasoning_content")]
    chars = sum(len(t) if isinstance(t, str) else len(json.dumps(t)) for t in texts if t)
    calls = message.get("tool_calls")
    return chars + (len(json.dumps(calls)) if calls else 0)
