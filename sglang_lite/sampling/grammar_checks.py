"""Checks that a compiled grammar admits some output, made when it compiles so that sampling never meets a grammar
whose language is empty.

- No first token: ``root ::= root "a"``, the regex ``[^\\s\\S]``. xgrammar's matcher allows nothing at the start
  (not even a stop token).
- No way to finish: ``root ::= "a" root``, the regex ``a[^\\s\\S]``, a JSON schema whose required property refers to
  the schema itself. The matcher allows a start, but no finite text completes the grammar, so a request would only
  end at its length limit. xgrammar does not tell, so the grammar it compiled (its normal form, as
  ``str(grammar)`` prints it) is read here and its productive rules found: a rule is productive when one of its
  alternatives has only productive parts (text, a character class that matches something, a repetition of at
  least zero, a productive rule), and the language is empty when ``root`` is not. Anything this reading does not
  know (a construct of a newer xgrammar) leaves the grammar accepted: a wrong refusal would refuse a valid
  request, while a grammar let through still ends cleanly at its length limit.

A grammar whose ``root`` is productive may still hold a dead branch (``root ::= "a" [^\\s\\S] | "b"``); a request
that enters one fails alone with a 400 while sampling (``GrammarDeadEnd``)."""

from __future__ import annotations

import re
from typing import Any

MAX_CODEPOINT = 0x10FFFF
_RULE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*) ::= (.*)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_REPEAT = re.compile(r"\{(\d+), ?(-?\d+)\}")
_ESCAPES = {"0": 0, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11, "a": 7, "e": 27}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
# parts of a parsed rule: ("ok",) always productive, ("rule", name), ("all", parts), ("any", parts), ("never",)
_OK = ("ok",)
_NEVER = ("never",)


class _Unknown(Exception):
    """The printed grammar holds something this reading does not know: no conclusion."""


def check_admits_output(compiled: Any, kind: str) -> None:
    """Raises ValueError naming the field when no output can match the grammar."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    if not bool(bitmask.any()):
        raise ValueError(
            f"sampling parameter {kind} admits no output: no token can start it (its language is empty)"
        )
    if not can_finish(str(compiled.grammar)):
        raise ValueError(
            f"sampling parameter {kind} admits no output: no finite text matches it (every way through it "
            "recurses forever or needs a character class that matches nothing)"
        )


def can_finish(printed: str) -> bool:
    """Whether the root rule of a grammar in xgrammar's printed normal form derives some finite text (True when
    the text cannot be read)."""
    try:
        rules = _parse_rules(printed)
    except (_Unknown, IndexError, ValueError, RecursionError):
        return True
    if "root" not in rules or any(name not in rules for name in _references(rules)):
        return True
    return "root" in _productive(rules)


def _productive(rules: dict[str, tuple]) -> set[str]:
    """The least fixed point: rules shown productive by rules already shown productive."""
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, body in rules.items():
            if name not in productive and _derives(body, productive):
                productive.add(name)
                changed = True
    return productive


def _derives(part: tuple, productive: set[str]) -> bool:
    kind = part[0]
    if kind == "ok":
        return True
    if kind == "rule":
        return part[1] in productive
    if kind == "all":
        return all(_derives(p, productive) for p in part[1])
    if kind == "any":
        return any(_derives(p, productive) for p in part[1])
    return False


def _references(rules: dict[str, tuple]) -> set[str]:
    names: set[str] = set()
    stack = list(rules.values())
    while stack:
        part = stack.pop()
        if part[0] == "rule":
            names.add(part[1])
        elif part[0] in ("all", "any"):
            stack.extend(part[1])
    return names


def _parse_rules(printed: str) -> dict[str, tuple]:
    rules: dict[str, tuple] = {}
    for line in printed.splitlines():
        if not line.strip():
            continue
        match = _RULE.fullmatch(line)
        if match is None:
            raise _Unknown(line)
        reader = _Reader(match.group(2))
        rules[match.group(1)] = reader.sequence_of_choices()
        if not reader.done:
            raise _Unknown(line)
    return rules


class _Reader:
    """A recursive-descent reader of one rule's body: choices of sequences of elements."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.at = 0

    @property
    def done(self) -> bool:
        self._skip_space()
        return self.at >= len(self.text)

    def sequence_of_choices(self) -> tuple:
        choices = [self._sequence()]
        while self._peek() == "|":
            self.at += 1
            choices.append(self._sequence())
        return choices[0] if len(choices) == 1 else ("any", choices)

    def _sequence(self) -> tuple:
        parts = []
        while self._peek() not in ("", "|", ")"):
            parts.append(self._element())
        if not parts:
            raise _Unknown(self.text)
        return parts[0] if len(parts) == 1 else ("all", parts)

    def _element(self) -> tuple:
        part = self._atom()
        while True:
            repeat = _REPEAT.match(self.text, self.at)
            if repeat is not None:
                self.at = repeat.end()
                part = _OK if int(repeat.group(1)) == 0 else part
            elif self.text.startswith(("*", "?"), self.at):
                self.at += 1
                part = _OK
            elif self.text.startswith("+", self.at):
                self.at += 1
            else:
                return part

    def _atom(self) -> tuple:
        char = self._peek()
        if char == '"':
            self._string()
            return _OK
        if char == "[":
            return _OK if self._char_class_matches() else _NEVER
        if self.text.startswith("(=", self.at):  # a lookahead: it consumes nothing
            self.at += 2
            self.sequence_of_choices()
            self._expect(")")
            return _OK
        if char == "(":
            self.at += 1
            inner = self.sequence_of_choices()
            self._expect(")")
            return inner
        name = _NAME.match(self.text, self.at)
        if name is None or self.text.startswith("(", name.end()):
            raise _Unknown(self.text[self.at : self.at + 40])  # Regex(...), TagDispatch(...), ...
        self.at = name.end()
        return ("rule", name.group())

    def _string(self) -> None:
        self.at += 1
        while self.text[self.at] != '"':
            self.at += 2 if self.text[self.at] == "\\" else 1
        self.at += 1

    def _char_class_matches(self) -> bool:
        """Reads ``[...]`` or ``[^...]`` (and a following ``*``); whether it matches some character."""
        self.at += 1
        negated = self.text.startswith("^", self.at)
        self.at += negated
        ranges = []
        while self.text[self.at] != "]":
            low = self._class_char()
            high = low
            if self.text[self.at] == "-" and self.text[self.at + 1] != "]":
                self.at += 1
                high = self._class_char()
            ranges.append((low, high))
        self.at += 1
        if self.text.startswith("*", self.at):
            self.at += 1
            return True
        if negated:
            return not _covers_all(ranges)
        return any(low <= high for low, high in ranges)

    def _class_char(self) -> int:
        char = self.text[self.at]
        if char != "\\":
            self.at += 1
            return ord(char)
        code = self.text[self.at + 1]
        if code in _HEX_DIGITS:
            digits = self.text[self.at + 2 : self.at + 2 + _HEX_DIGITS[code]]
            self.at += 2 + len(digits)
            return int(digits, 16)
        self.at += 2
        return _ESCAPES.get(code, ord(code))

    def _peek(self) -> str:
        self._skip_space()
        return self.text[self.at] if self.at < len(self.text) else ""

    def _expect(self, char: str) -> None:
        if self._peek() != char:
            raise _Unknown(self.text)
        self.at += 1

    def _skip_space(self) -> None:
        while self.at < len(self.text) and self.text[self.at] == " ":
            self.at += 1


def _covers_all(ranges: list[tuple[int, int]]) -> bool:
    """Whether the ranges together hold every code point."""
    reach = -1
    for low, high in sorted(ranges):
        if low > reach + 1:
            return False
        reach = max(reach, high)
    return reach >= MAX_CODEPOINT
