"""Every `--flag` that README.md and docs/*.md give to one of this project's commands is one that command accepts.

The commands checked: `python -m sglang_lite.launch_server`, `python -m sglang_lite.router`,
`python -m sglang_lite.sim [run|compare|fit]` and `python benchmarks/<name>.py`, in fenced code blocks (a line
continued with a backslash is one command), indented code blocks and inline code spans (which may wrap). A
command's flags are what its `--help` prints; all the help texts come from one child interpreter, so torch is
imported once. Flags of other tools (curl, pip, lm_eval, make, ...) are not checked.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MODULES = ("sglang_lite.launch_server", "sglang_lite.router", "sglang_lite.sim")
SIM_COMMANDS = ("run", "compare", "fit")
COMMAND = re.compile(
    r"(?:^|(?<=[\s(`]))(?:\S*/)?python3?\s+"
    r"(?:-m\s+(?P<module>" + "|".join(re.escape(m) for m in MODULES) + r")(?![\w.])"
    r"|(?P<script>benchmarks/\w+\.py))"
)
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
# a comment or the next shell command ends a command
SHELL_END = re.compile(r"\s(?:#|&&|\|\||\||;|&)(?:\s|$)|\s&$")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
# an inline span may wrap onto the next line, not past a blank one
INLINE = re.compile(r"`((?:[^`\n]|\n(?!\s*\n))+)`")
# an indented code block's command line
INDENTED = re.compile(r"^ {4,}((?:\S*/)?python3?\s.*)$", re.M)

# Runs each command's --help in this one interpreter: `python -m M` as runpy runs M, `python S` as runpy runs S
# (with S's folder first on sys.path, as python puts it); prints {command: help text or the error}.
HELP_DRIVER = r"""
import contextlib, io, json, os, runpy, sys
out = {}
for key in json.loads(sys.argv[1]):
    target, *sub = key.split(" ")
    buffer = io.StringIO()
    saved = (list(sys.argv), list(sys.path))
    try:
        with contextlib.redirect_stdout(buffer):
            if target.endswith(".py"):
                sys.argv = [target, *sub, "--help"]
                sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
                runpy.run_path(target, run_name="__main__")
            else:
                sys.argv = [target, *sub, "--help"]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
        out[key] = "ERROR: --help returned without exiting"
    except SystemExit as stop:
        out[key] = buffer.getvalue() if stop.code in (0, None) else f"ERROR: --help exited {stop.code}"
    except BaseException as exc:
        out[key] = f"ERROR: {type(exc).__name__}: {exc}"
    finally:
        sys.argv, sys.path = saved
sys.stdout.write("\n@@HELP@@" + json.dumps(out))
"""


def commands_in(text: str) -> list[tuple[str, str]]:
    """(command key, the command's text) for every checked command in a markdown text. The key is the module or
    script, with the simulator's subcommand when one follows."""
    found = []
    for chunk in _code_chunks(text):
        for match in COMMAND.finditer(chunk):
            rest = SHELL_END.split(chunk[match.end() :], maxsplit=1)[0]
            key = match["module"] or match["script"]
            words = rest.split()
            if key == "sglang_lite.sim" and words and words[0] in SIM_COMMANDS:
                key += " " + words[0]
            found.append((key, match[0] + rest))
    return found


def _code_chunks(text: str) -> list[str]:
    blocks = [m[1].replace("\\\n", " ") for m in FENCE.finditer(text)]
    lines = [line for block in blocks for line in block.splitlines()]
    prose = FENCE.sub("", text)
    spans = [m[1].replace("\n", " ") for m in INLINE.finditer(prose)]
    return lines + [m[1] for m in INDENTED.finditer(prose)] + spans


def flags_in(help_text: str) -> set[str]:
    return set(FLAG.findall(help_text))


def unknown_flags(text: str, helps: dict[str, str]) -> list[str]:
    """'command: --flag' for every flag a command of ``text`` is given that its --help does not list."""
    wrong = []
    for key, command in commands_in(text):
        given = FLAG.findall(command)
        known = flags_in(helps[key]) | {"--help"} if given else set()
        wrong += [f"{command.strip()}: {flag}" for flag in given if flag not in known]
    return wrong


def ask_help(keys: set[str]) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", HELP_DRIVER, json.dumps(sorted(keys))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "@@HELP@@" in done.stdout, f"the --help driver failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.rsplit("@@HELP@@", 1)[1])


SELF_TEST_DOC = """
```bash
python -m sglang_lite.router --worker-urls http://127.0.0.1:30001 \\
    --policy round_robin --no-such-router-flag 3 &   # a comment: --not-a-flag
```
and inline `.venv/bin/python benchmarks/bench_router.py --made-up-flag`, `python -m sglang_lite.sim run --policy x`.
"""


def _documented() -> dict[Path, list[tuple[str, str]]]:
    return {path: commands_in(path.read_text()) for path in DOCS}


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """The --help of every command the docs give flags to, and of those the self-test uses."""
    keys = {
        key for commands in _documented().values() for key, text in commands if FLAG.search(text)
    }
    keys |= {key for key, _ in commands_in(SELF_TEST_DOC)}
    return ask_help(keys)


def test_the_commands_answer_help(helps):
    failed = {
        key: text for key, text in helps.items() if text.startswith("ERROR") or "--" not in text
    }
    assert not failed, f"--help failed: {failed}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_flags_exist(path, helps):
    wrong = unknown_flags(path.read_text(), helps)
    assert not wrong, (
        f"{path.relative_to(ROOT)} names flags its commands do not take:\n" + "\n".join(wrong)
    )


def test_a_made_up_flag_is_caught(helps):
    wrong = unknown_flags(SELF_TEST_DOC, helps)
    assert len(wrong) == 2, wrong  # the comment's flag and the known ones are not reported
    assert wrong[0].endswith(": --no-such-router-flag") and wrong[1].endswith(": --made-up-flag")


def test_the_parser_finds_commands_in_blocks_and_spans():
    keys = [key for key, _ in commands_in(SELF_TEST_DOC)]
    assert keys == ["sglang_lite.router", "benchmarks/bench_router.py", "sglang_lite.sim run"]
    assert any(key == "sglang_lite.launch_server" for key, _ in _documented()[ROOT / "README.md"])
