"""Tool parameters with ``$defs`` and ``$ref`` (as pydantic's ``model_json_schema`` writes them) under a forced tool
choice: each tool's schema moves into the tool-call schema's ``$defs`` with its references made to point there, so
they resolve as in ``response_format`` (two tools' ``$defs`` of one name stay apart), and the forced call's
arguments are valid against the tool's own schema, through the chat API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from sglang_lite.sampling.grammar import GrammarCache, GrammarKey
from sglang_lite.server.io_struct import RequestError
from sglang_lite.server.openai_protocol import ChatCompletionRequest
from sglang_lite.server.openai_tools import moved_schema, tool_call_schema
from sglang_lite.tokenizer import load_tokenizer
from tests.server.conftest import ServerProcess, start_server

VOCAB = 4096  # the built-in model's
USER = [{"role": "user", "content": "Send it to Paris."}]


class Closed(BaseModel):
    # closed objects: random weights would otherwise write extra properties until max_tokens
    model_config = ConfigDict(extra="forbid")


class Zone(Closed):
    code: int = Field(ge=0, le=9)


class Address(Closed):
    city: Literal["Paris", "Rome"]
    zone: Zone


class Order(Closed):
    ship_to: Address
    bill_to: Address
    express: bool


def parcel_model() -> type[BaseModel]:
    """A second tool whose ``$defs`` also hold an ``Address``, of another shape."""

    class Address(Closed):
        street: Literal["Main", "High"]

    class Parcel(Closed):
        to: Address
        weight: int = Field(ge=1, le=5)

    return Parcel


Parcel = parcel_model()
MODELS = {"place_order": Order, "send_parcel": Parcel}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": model.model_json_schema()}}
    for name, model in MODELS.items()
]


def forced_schema(tool_choice: object) -> str:
    body = ChatCompletionRequest(messages=USER, tools=TOOLS, tool_choice=tool_choice)
    return tool_call_schema(body)


@pytest.fixture(scope="module")
def cache():
    cache = GrammarCache(load_tokenizer(None), VOCAB)
    yield cache
    cache.shutdown()


def accepts(compiled, text: str) -> bool:
    import xgrammar

    return xgrammar.GrammarMatcher(compiled).accept_string(text)


def call_text(name: str, arguments: dict) -> str:
    """A forced call as the grammar writes it (one line, separators ", " and ": ")."""
    return json.dumps([{"name": name, "parameters": arguments}])


# ---- the tool-call schema ---------------------------------------------------------------------------------------
def test_the_schemas_use_refs_that_resolve_alone():
    schema = Order.model_json_schema()
    assert schema["properties"]["ship_to"] == {"$ref": "#/$defs/Address"}
    assert "Zone" in schema["$defs"] and "Address" in Parcel.model_json_schema()["$defs"]


def test_refs_of_every_tool_resolve_in_the_forced_call_schema(cache):
    compiled = cache.compile(GrammarKey("json_schema", forced_schema("required")))
    order = {
        "ship_to": {"city": "Paris", "zone": {"code": 3}},
        "bill_to": {"city": "Rome", "zone": {"code": 0}},
        "express": True,
    }
    assert accepts(compiled, call_text("place_order", order))
    assert accepts(compiled, call_text("send_parcel", {"to": {"street": "Main"}, "weight": 2}))
    # each tool's Address is its own: neither shape passes for the other
    assert not accepts(compiled, call_text("send_parcel", {"to": order["ship_to"], "weight": 2}))
    assert not accepts(compiled, call_text("place_order", {**order, "ship_to": {"street": "Main"}}))


def test_a_named_function_s_refs_resolve_and_its_place_names_its_defs(cache):
    named = {"type": "function", "function": {"name": "send_parcel"}}
    schema = json.loads(forced_schema(named))
    assert list(schema["$defs"]) == ["tool1"]
    assert schema["$defs"]["tool1"]["properties"]["to"] == {"$ref": "#/$defs/tool1/$defs/Address"}
    compiled = cache.compile(GrammarKey("json_schema", json.dumps(schema)))
    assert accepts(compiled, call_text("send_parcel", {"to": {"street": "High"}, "weight": 5}))
    assert not accepts(compiled, call_text("place_order", {}))


def test_moving_a_schema_rewrites_local_refs_only():
    schema = {
        "$ref": "#",
        "properties": {
            "enum": {"$ref": "#/$defs/A"},  # a property named like a keyword is a schema
            "fixed": {"const": {"$ref": "#/not/a/ref"}},  # data stays as it is
        },
        "anyOf": [{"$ref": "other.json#/x"}, {"$ref": "#/definitions/B"}],
    }
    assert moved_schema(schema, "/$defs/tool0") == {
        "$ref": "#/$defs/tool0",
        "properties": {
            "enum": {"$ref": "#/$defs/tool0/$defs/A"},
            "fixed": {"const": {"$ref": "#/not/a/ref"}},
        },
        "anyOf": [{"$ref": "other.json#/x"}, {"$ref": "#/$defs/tool0/definitions/B"}],
    }


def test_a_recursive_tool_schema_refers_to_its_own_root(cache):
    tree = {
        "type": "object",
        "properties": {"leaf": {"type": "boolean"}, "child": {"$ref": "#"}},
        "required": ["leaf"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "grow", "parameters": tree}}
    body = ChatCompletionRequest(messages=USER, tools=[tool], tool_choice="required")
    compiled = cache.compile(GrammarKey("json_schema", tool_call_schema(body)))
    nested = {"leaf": True, "child": {"leaf": False, "child": {"leaf": True}}}
    assert accepts(compiled, call_text("grow", nested))


def test_a_tool_schema_nested_too_deep_is_a_400_naming_it():
    deep: dict = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    tool = {"type": "function", "function": {"name": "deep", "parameters": deep}}
    body = ChatCompletionRequest(messages=USER, tools=[TOOLS[0], tool], tool_choice="required")
    with pytest.raises(
        RequestError, match="tools.1.function.parameters nests more than 64"
    ) as error:
        tool_call_schema(body)
    assert error.value.status == 400


# ---- through the chat API ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_context_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """dp 1 with room for the prompt: the chat template renders both schemas (about 900 tokens)."""
    yield from start_server(tmp_path_factory, "tool_refs", ["--context-length", "2048"])


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "place_order"}}],
    ids=["required", "named"],
)
def test_forced_calls_with_pydantic_refs_have_valid_arguments(
    long_context_server: ServerProcess, choice
) -> None:
    client = openai.OpenAI(
        base_url=f"{long_context_server.url}/v1", api_key="none", max_retries=0, timeout=120
    )
    names = {"place_order"} if isinstance(choice, dict) else set(MODELS)
    for seed in range(3):
        response = client.chat.completions.create(
            model="m",
            messages=USER,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=300,
            temperature=1.0,
            seed=seed,
            parallel_tool_calls=False,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        choice_out = response.choices[0]
        assert choice_out.finish_reason == "tool_calls", choice_out
        (call,) = choice_out.message.tool_calls
        assert call.function.name in names
        MODELS[call.function.name].model_validate_json(call.function.arguments, strict=True)
