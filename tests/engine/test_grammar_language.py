"""Grammars that admit no output are refused when they compile: no first token, or no way to finish (read from
xgrammar's normal form of the grammar); what cannot be seen there ends cleanly at run time (a grammar that goes on
forever at its length limit, a dead branch with a 400 for its request alone)."""

from __future__ import annotations

import json

import pytest
import xgrammar

from sglang_lite import Engine
from sglang_lite.sampling.grammar import GrammarCache, GrammarKey
from sglang_lite.sampling.grammar_checks import can_finish
from sglang_lite.tokenizer import load_tokenizer

VOCAB = 4096
RECURSIVE = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
CHAIN = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"next": {"$ref": "#/$defs/node"}},
            "required": ["next"],
        }
    },
    "type": "object",
    "properties": {"head": {"$ref": "#/$defs/node"}},
    "required": ["head"],
}
# schemas that can finish, some recursive, with patterns, formats and every JSON type
FINISHING_SCHEMAS = [
    {"type": "object"},
    {"type": "object", "properties": {"next": {"$ref": "#"}}},
    {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"x": {"$ref": "#"}}}]},
    {"type": "array", "items": {"$ref": "#"}},
    {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
    {"type": "string", "format": "email"},
    {"type": "string", "format": "date-time"},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 5}}},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "number", "exclusiveMinimum": 0},
    {"enum": ["a", 1, None, True, {"k": [1]}]},
    {"const": '\u00e9\u4e2d\U0001f600 \\ " ] -'},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
    {"oneOf": [{"type": "string"}, {"type": "array", "prefixItems": [{"type": "integer"}]}]},
]


@pytest.mark.parametrize(
    "ebnf,finishes",
    [
        ('root ::= "a" root', False),
        ('root ::= root "a"', False),
        ("root ::= a\na ::= b\nb ::= a", False),
        ('root ::= "a" x | "b" x\nx ::= "c" x', False),
        ('root ::= ("a" x){1,3}\nx ::= "c" x', False),
        ('root ::= "a" [^\\x00-\\U0010FFFF]', False),
        ('root ::= "\\"]" [\\]-] root', False),
        ('root ::= "a" root | "b"', True),
        ('root ::= ("a" x){0,3}\nx ::= "c" x', True),
        ('root ::= "a" [^\\x00-\\U0010FFFF]* "b"', True),
        (
            'root ::= "a"* b+ c? ("x" | "y"){2,5} [a-z]{3} [^abc]*\nb ::= "q" (=("z"))\nc ::= ""',
            True,
        ),
        ("root ::= [^\\x00-\\x40\\x42-\\U0010FFFF]", True),  # "A" alone
    ],
)
def test_rules_that_cannot_finish_are_found_in_xgrammar_s_normal_form(ebnf, finishes):
    assert can_finish(str(xgrammar.Grammar.from_ebnf(ebnf))) is finishes


@pytest.mark.parametrize(
    "regex,finishes",
    [("a[^\\s\\S]", False), ("[^\\s\\S]", False), ("(ab|c)*d{2,3}[^x]\\d+", True), (".*", True)],
)
def test_regexes_that_cannot_finish_are_found(regex, finishes):
    assert can_finish(str(xgrammar.Grammar.from_regex(regex))) is finishes


@pytest.mark.parametrize("schema", FINISHING_SCHEMAS, ids=lambda s: json.dumps(s)[:40])
def test_schemas_that_can_finish_are_never_refused(schema):
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert can_finish(str(grammar))


def test_what_the_reading_does_not_know_is_accepted():
    assert can_finish("root ::= TagDispatch(whatever)")
    assert can_finish('root ::= Regex("[^\\s\\S]", json_string=true)')
    assert can_finish("not a grammar at all")
    assert can_finish("root ::= other")  # a rule it does not define
    assert can_finish("root ::= " + "(" * 5000 + '"a"' + ")" * 5000)  # deeper than Python recurses


@pytest.fixture(scope="module")
def cache():
    cache = GrammarCache(load_tokenizer(None), VOCAB)
    yield cache
    cache.shutdown()


@pytest.mark.parametrize(
    "kind,text",
    [
        ("ebnf", 'root ::= "a" root'),
        ("ebnf", 'root ::= "{" root "}"'),
        ("regex", "a[^\\s\\S]"),
        ("regex", "(x|y)+[^\\s\\S]"),
        ("json_schema", json.dumps(RECURSIVE)),
        ("json_schema", json.dumps(CHAIN)),
        ("json_schema", json.dumps({"type": "array", "items": {"$ref": "#"}, "minItems": 1})),
    ],
)
def test_a_grammar_that_can_start_but_never_finish_is_refused_when_it_compiles(cache, kind, text):
    with pytest.raises(
        ValueError, match=rf"^sampling parameter {kind} admits no output: no finite"
    ):
        cache.compile(GrammarKey(kind, text))


# ---- at run time -------------------------------------------------------------------------------------------------
PROMPT = "def read_config(path):\n"


@pytest.fixture(scope="module")
def engine():
    with Engine(
        load_format="dummy", max_total_tokens=1024, max_running_requests=4, context_length=256
    ) as engine:
        yield engine


def test_a_branch_that_goes_on_forever_ends_at_the_length_limit(engine):
    """``root`` can finish (with "b"), so the grammar compiles; the output takes the "a" branch, which repeats
    "c" forever: the request ends cleanly at max_new_tokens with finish reason length."""
    a = engine.tokenizer.encode("a", add_special_tokens=False)[0]
    params = {
        "ebnf": 'root ::= "a" x | "b"\nx ::= "c" x',
        "logit_bias": {str(a): 100.0},
        "max_new_tokens": 24,
        "temperature": 0.0,
    }
    result = engine.generate(PROMPT, params)
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    assert result["text"].startswith("a") and set(result["text"][1:]) == {"c"}, result["text"]


def test_a_dead_branch_fails_its_request_with_a_value_error(engine):
    a = engine.tokenizer.encode("a", add_special_tokens=False)[0]
    params = {
        "ebnf": 'root ::= "a" [^\\x00-\\U0010FFFF] | "b"',
        "logit_bias": {str(a): 100.0},
        "max_new_tokens": 8,
    }
    with pytest.raises(ValueError, match="grammar allows no next token"):
        engine.generate(PROMPT, params)
    assert engine.generate(PROMPT, {"max_new_tokens": 3, "ignore_eos": True})["text"]


def test_an_unfinishable_grammar_is_refused_before_anything_runs(engine):
    with pytest.raises(ValueError, match="sampling parameter ebnf admits no output"):
        engine.generate(PROMPT, {"ebnf": 'root ::= "a" root', "max_new_tokens": 8})
