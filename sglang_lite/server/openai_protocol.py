"""Request bodies as pydantic models: FastAPI validates them (a wrong type is a 400 naming the field) and the
OpenAPI spec at /openapi.json describes them. Unknown fields are ignored, as OpenAI clients and sglang-router
send extras (``model: null``, ``log_metrics``, ``return_hidden_states`` ...).

The sampling fields carry the static bounds of ``SamplingParams.validate`` (so /openapi.json states them); the
bounds that depend on the model (the vocabulary) and the stop strings' total length are checked there alone."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from sglang_lite.sampling.logprobs import MAX_TOP_LOGPROBS
from sglang_lite.sampling.params import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_NEW_TOKENS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
)


class _Request(BaseModel):
    """Unknown fields are ignored (clients and routers send their own extras); every field of the OpenAI and SGLang
    APIs is implemented (declared) or listed in ``refused``: a 400 naming it unless it has a neutral value."""

    model_config = ConfigDict(extra="ignore")
    refused: ClassVar[
        dict[str, tuple[tuple[Any, ...], str]]
    ] = {}  # field -> (neutral values, why it is refused)

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        for name, (neutral, why) in cls.refused.items():
            if isinstance(data, dict) and name in data and data[name] not in neutral:
                raise ValueError(f"{name} is not supported: {why}")
        return data


class GenerateRequest(_Request):
    """SGLang-native ``/generate``: one prompt (text or input_ids) or a list of them."""

    text: StrictStr | list[StrictStr] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: StrictBool = False
    rid: StrictStr | list[StrictStr] | None = None
    routed_dp_rank: StrictInt | None = None
    data_parallel_rank: StrictInt | None = Field(None, description="Older name of routed_dp_rank.")
    return_logprob: StrictBool | list[StrictBool] = False
    logprob_start_len: StrictInt | list[StrictInt] = Field(
        -1, description="-1: output tokens only."
    )
    top_logprobs_num: StrictInt | list[StrictInt] = 0
    token_ids_logprob: list[StrictInt] | list[list[StrictInt]] | None = None
    return_text_in_logprobs: StrictBool = False
    require_reasoning: StrictBool | list[StrictBool] = Field(
        False,
        description="With --reasoning-parser: the output starts inside its reasoning, and a grammar "
        "constrains only what follows the reasoning's end (</think>).",
    )
    log_metrics: Any = Field(None, description="Accepted; metrics are always recorded.")
    image_data: StrictStr | list[StrictStr] | None = Field(
        None,
        description="One prompt's images (data URLs or base64), whose placeholders its text holds.",
    )
    refused: ClassVar = {
        "return_hidden_states": ((None, False), "hidden states are not returned"),
        "input_embeds": ((None,), "prompts are text or token ids"),
        "audio_data": ((None, []), "audio input is not served"),
        "video_data": ((None, []), "video input is not served yet (images are: image_data)"),
        "lora_path": ((None,), "LoRA adapters are not supported"),
        "session_params": (
            (None,),
            "sessions are not supported (the prefix cache reuses shared prefixes)",
        ),
        "custom_logit_processor": ((None,), "custom logit processors are not supported"),
    }
    # PD disaggregation (set by a PD router): the prefill server's bootstrap address and the transfer's id
    bootstrap_host: StrictStr | list[StrictStr] | None = None
    # null (or a null entry): the decode server's own --disaggregation-bootstrap-port
    bootstrap_port: StrictInt | list[StrictInt | None] | None = None
    bootstrap_room: StrictInt | list[StrictInt] | None = None


class StreamOptions(_Request):
    include_usage: StrictBool = False


class JsonSchemaFormat(_Request):
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(
        alias="schema", description="The JSON schema the output must match."
    )
    strict: StrictBool | None = None


class StructuralTagItem(_Request):
    begin: StrictStr
    schema_: dict[str, Any] = Field(alias="schema")
    end: StrictStr


class ResponseFormat(_Request):
    """OpenAI ``response_format``: ``text`` (free), ``json_object`` (any JSON object), ``json_schema``; SGLang's
    ``structural_tag``: ``structures`` and ``triggers``, or xgrammar's ``format``."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[StructuralTagItem] | None = None
    triggers: list[StrictStr] | None = None
    format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type json_schema needs json_schema: {"name": ..., "schema": {...}}')
        legacy = self.structures is not None and self.triggers is not None
        if self.type == "structural_tag" and legacy == (self.format is not None):
            raise ValueError("type structural_tag needs structures and triggers, or format")
        return self

    def grammar(self) -> dict[str, str]:
        """The SGLang sampling parameter it becomes (json_object: SGLang's schema of any object)."""
        if self.type == "json_object":
            return {"json_schema": '{"type": "object"}'}
        if self.type == "json_schema":
            return {"json_schema": json.dumps(self.json_schema.schema_)}
        if self.type == "structural_tag" and self.format is not None:
            return {"structural_tag": json.dumps({"type": "structural_tag", "format": self.format})}
        if self.type == "structural_tag":
            structures = [s.model_dump(by_alias=True) for s in self.structures]
            return {
                "structural_tag": json.dumps({"structures": structures, "triggers": self.triggers})
            }
        return {}


LogitBias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]


class _OpenAISampling(_Request):
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=0, le=MAX_NEW_TOKENS)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt | None = Field(
        None, ge=-1, le=INT32_MAX, description="-1 (off) or 1 to the vocabulary size."
    )
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    min_tokens: StrictInt | None = Field(None, ge=0, le=MAX_NEW_TOKENS)
    n: StrictInt = Field(
        1, ge=1, le=MAX_N, description="Choices per prompt: one prefill, n samples."
    )
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    seed: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    frequency_penalty: float | None = Field(
        None, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False
    )
    presence_penalty: float | None = Field(
        None, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False
    )
    repetition_penalty: float | None = Field(
        None, gt=0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False
    )
    logit_bias: dict[StrictStr, LogitBias] | None = Field(
        None,
        description="Token id (a string) -> bias added to its logit; ids in [0, vocabulary size).",
    )
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    rid: StrictStr | None = None
    routed_dp_rank: StrictInt | None = None
    data_parallel_rank: StrictInt | None = None
    bootstrap_host: StrictStr | None = None
    bootstrap_port: StrictInt | None = None
    bootstrap_room: StrictInt | None = None
    response_format: ResponseFormat | None = None
    regex: StrictStr | None = Field(
        None, description="SGLang: the output must match this regular expression."
    )
    ebnf: StrictStr | None = Field(
        None, description="SGLang: the output must match this EBNF grammar."
    )

    def sampling_dict(self, default_max_tokens: int | None) -> dict[str, Any]:
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return {
            "max_new_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "min_new_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": self.logit_bias,
            "regex": self.regex,
            "ebnf": self.ebnf,
            "n": self.n,
            **(self.response_format.grammar() if self.response_format is not None else {}),
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_OpenAISampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = Field(
        False, description="The prompt before the completion (with logprobs: its tokens')."
    )
    logprobs: StrictInt | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Log-probabilities of the chosen tokens and of this many top ones.",
    )
    refused: ClassVar = {
        "suffix": ((None, ""), "insertion (text after the completion) is not supported"),
        "best_of": ((None, 1), "best_of > 1 is not supported (n gives n samples)"),
    }


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ImageUrl(_Request):
    url: StrictStr  # a data: URL (base64 PNG, JPEG or WebP), or http(s) with --allow-remote-images
    detail: Literal["auto", "low", "high"] | None = (
        None  # accepted; the image is taken at its own size
    )


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(_Request):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = "{}"

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str | dict[str, Any]) -> str | dict[str, Any]:
        if isinstance(arguments, str) and not isinstance(_json_or_none(arguments), dict):
            raise ValueError("arguments must be a JSON object")
        return arguments

    def arguments_dict(self) -> dict[str, Any]:
        """As Qwen templates read them (``arguments|items``); SGLang turns the JSON string into an object too."""
        return self.arguments if isinstance(self.arguments, dict) else json.loads(self.arguments)


class MessageToolCall(_Request):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: StrictStr | None = None  # tool
    # assistant: its <think> text, which the template may render
    reasoning_content: StrictStr | None = None

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImagePart)]

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text parts joined; with images, the parts in order (an image as
        ``{"type": "image"}``, where a VL template puts its placeholder)."""
        content: Any = self.content
        if isinstance(content, list) and self.image_urls():
            content = [
                {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                for p in content
            ]
        elif isinstance(content, list):
            content = "".join(p.text for p in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": c.function.arguments_dict()},
                }
                for c in self.tool_calls
            ]
        return message


class FunctionDefinition(_Request):
    name: StrictStr = Field(min_length=1, max_length=256)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: StrictStr


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=0, le=MAX_NEW_TOKENS)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="Default: auto with tools, none without. required and a named function are rendered "
        "and parsed as auto (not yet constrained by a grammar).",
    )
    parallel_tool_calls: StrictBool = True
    separate_reasoning: StrictBool = Field(
        True, description="With --reasoning-parser: reasoning_content apart."
    )
    # accepted, with no effect on the output: labels for the caller's own bookkeeping and caching hints (the prefix
    # cache reuses every shared prefix by itself)
    metadata: dict[str, StrictStr] | None = None
    service_tier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: StrictStr | None = None
    refused: ClassVar = {
        "store": ((None, False), "completions are not stored"),
        "audio": ((None,), "audio output is not supported"),
        "modalities": ((None, ["text"]), "only text output"),
        "functions": ((None, []), "deprecated by OpenAI: send tools"),
        "function_call": ((None,), "deprecated by OpenAI: send tool_choice"),
        "prediction": ((None,), "predicted outputs are not supported"),
        "reasoning_effort": (
            (None,),
            'Qwen3.5 thinks or not: chat_template_kwargs {"enable_thinking": false}',
        ),
        "verbosity": ((None,), "not supported"),
        "web_search_options": ((None,), "web search is not supported"),
        "moderation": ((None,), "moderation is not supported"),
    }


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


class TokenizeRequest(_Request):
    """``/tokenize`` (SGLang's and vLLM's): a text's token ids."""

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True


class DetokenizeRequest(_Request):
    model: StrictStr | None = None
    tokens: list[StrictInt]


_Room = Annotated[int, Field(ge=0, lt=2**63, strict=True)]


class AbortRequest(_Request):
    rid: StrictStr = ""
    abort_all: StrictBool = False
    # PD, from a router whose prefill leg failed: the decode requests of these rooms fail with ``error``
    bootstrap_room: _Room | Annotated[list[_Room], Field(max_length=4096)] | None = None
    error: Annotated[str, Field(max_length=4096)] = "the prefill server failed the request"
    status_code: Literal[400, 502] = 502
    # the prefill side will write nothing more for these rooms (it refused them, or its rank died)
    settled: StrictBool = False
