"""Request bodies as pydantic models: FastAPI validates them (a wrong type is a 400 naming the field) and the
OpenAPI spec at /openapi.json describes them. Unknown fields are ignored, as OpenAI clients and sglang-router
send extras (``model: null``, ``log_metrics``, ``return_hidden_states`` ...).

The sampling fields carry the static bounds of ``SamplingParams.validate`` (so /openapi.json states them); the
bounds that depend on the model (the vocabulary) and the stop strings' total length are checked there alone."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from sglang_lite.sampling.params import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_NEW_TOKENS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


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
    return_hidden_states: StrictBool = False
    # PD disaggregation (set by a PD router): the prefill server's bootstrap address and the transfer's id
    bootstrap_host: StrictStr | list[StrictStr] | None = None
    bootstrap_port: StrictInt | list[StrictInt] | None = None
    bootstrap_room: StrictInt | list[StrictInt] | None = None


class StreamOptions(_Request):
    include_usage: StrictBool = False


class _OpenAISampling(_Request):
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=0, le=MAX_NEW_TOKENS)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=-1, le=INT32_MAX, description="-1 (off) or 1 to the vocabulary size.")
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    min_tokens: StrictInt | None = Field(None, ge=0, le=MAX_NEW_TOKENS)
    n: StrictInt = Field(1, ge=1, le=1, description="Only 1 is supported.")
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    seed: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    frequency_penalty: float | None = Field(None, ge=0, le=0, allow_inf_nan=False, description="Only 0 is supported.")
    presence_penalty: float | None = Field(None, ge=0, le=0, allow_inf_nan=False, description="Only 0 is supported.")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    rid: StrictStr | None = None
    routed_dp_rank: StrictInt | None = None
    data_parallel_rank: StrictInt | None = None
    bootstrap_host: StrictStr | None = None
    bootstrap_port: StrictInt | None = None
    bootstrap_room: StrictInt | None = None

    def sampling_dict(self, default_max_tokens: int | None) -> dict[str, Any]:
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        return {
            "max_new_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "min_new_tokens": self.min_tokens, "stop": self.stop,
            "stop_token_ids": self.stop_token_ids, "seed": self.seed, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_OpenAISampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: Literal[False] = False
    logprobs: None = Field(None, description="Log probabilities are not supported.")
    suffix: None = None


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def to_template(self) -> dict[str, Any]:
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=0, le=MAX_NEW_TOKENS)
    logprobs: StrictBool = Field(False, description="Log probabilities are not supported (false only).")
    chat_template_kwargs: dict[str, Any] | None = None


class AbortRequest(_Request):
    rid: StrictStr = ""
    abort_all: StrictBool = False
