"""One grammar text compiled by xgrammar, as every compile here runs it (the rank's cache, the Engine's check and the
HTTP side's checker processes): the text's cheap checks first, then xgrammar, then the check that the compiled
grammar admits some output (``grammar_checks``). Every refusal is a ValueError naming the field.

- ``json_schema``: JSON written on one line (``any_whitespace=False``, see ``grammar``); nested at most
  ``MAX_JSON_DEPTH`` deep, since xgrammar's schema conversion grows with the cube of the nesting (300 levels of
  ``items`` take 5 s, 1000 levels minutes) while no real schema nests that deep.
- ``regex``, ``ebnf``: as xgrammar reads them (EBNF: GBNF with root rule ``root``).
- ``structural_tag``: SGLang's ``response_format`` of that type, as JSON: the legacy ``structures`` and
  ``triggers`` (each structure a ``begin``, a JSON ``schema`` and an ``end``), or xgrammar's ``format``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from sglang_lite.sampling.grammar_checks import check_admits_output

MAX_JSON_DEPTH = 64
# xgrammar's C++ errors start with a time and a source location ("[12:00:00] /project/cpp/x.cc:94: "): not the
# client's business
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def compile_text(compiler: Any, kind: str, text: str) -> Any:
    """The compiled grammar of ``text`` (the sampling parameter ``kind``); ValueError naming the field."""
    if kind in ("json_schema", "structural_tag"):
        _check_json_depth(kind, text)
    try:
        compiled = _compile(compiler, kind, text)
    except RuntimeError as error:
        message = _CPP_PREFIX.sub("", str(error).strip())
        raise ValueError(f"sampling parameter {kind} does not compile: {message}") from None
    check_admits_output(compiled, kind)
    return compiled


def _compile(compiler: Any, kind: str, text: str) -> Any:
    if kind == "json_schema":
        return compiler.compile_json_schema(text, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "structural_tag":
        return _compile_structural_tag(compiler, text)
    return compiler.compile_grammar(text)


def _compile_structural_tag(compiler: Any, text: str) -> Any:
    import xgrammar

    tag = json.loads(text)  # its depth is checked: no RecursionError
    if not isinstance(tag, dict) or "structures" not in tag:
        return compiler.compile_structural_tag(text)
    try:
        items = [
            xgrammar.StructuralTagItem(
                begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
            )
            for s in tag["structures"]
        ]
        return compiler.compile_structural_tag(items, tag["triggers"])
    except (KeyError, TypeError) as error:
        raise ValueError(
            "sampling parameter structural_tag must hold structures (each with begin, schema and end) and "
            f"triggers: {type(error).__name__} {error}"
        ) from None


def _check_json_depth(kind: str, text: str) -> None:
    """A JSON text nested deeper than ``MAX_JSON_DEPTH`` (or no JSON) is refused; read without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            in_string = escaped or char != '"'
            escaped = not escaped and char == "\\"
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    if deepest > MAX_JSON_DEPTH:
        raise ValueError(
            f"sampling parameter {kind} nests {deepest} levels deep, more than {MAX_JSON_DEPTH}"
        )
    try:
        json.loads(text)
    except ValueError as error:
        raise ValueError(f"sampling parameter {kind} does not compile: not JSON: {error}") from None
