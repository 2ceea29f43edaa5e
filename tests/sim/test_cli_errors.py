"""`python -m sglang_lite.sim` with a bad argument or a failing run: one line that says what is wrong, no traceback;
exit status 2 for a bad argument (argparse's), 1 for a run that fails."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_lite.sim.__main__ import main


def _fail(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    code = stop.value.code
    message = code if isinstance(code, str) else capsys.readouterr().err
    return (1 if isinstance(code, str) else code), message


@pytest.mark.parametrize(
    "argv, says",
    [
        (["compare", "--policies", "power_of_two"], "unknown policy 'power_of_two'"),
        (["compare", "--policies", "round_robin,tokns"], "unknown policy 'tokns'"),
        (["compare", "--concurrency", "16,abc"], "'abc' is not a whole number"),
        (["run", "--policy", "nope"], "unknown policy 'nope'"),
        (["run", "--prefill-policy", "nope"], "unknown policy 'nope'"),
        (["run", "--duration", "0"], "--duration: 0 must be above 0"),
        (["run", "--duration", "60", "--warmup", "90"], "--warmup 90 must be at least 0"),
        (["run", "--cluster-file", "/no/such.json"], "no such file: /no/such.json"),
        (["fit", "/no/such.csv"], "no such file: /no/such.csv"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(argv, says, capsys):
    status, message = _fail(argv, capsys)
    assert status == 2
    assert message.count("\n") == 1 and says in message and "--help" in message
    assert "Traceback" not in message


def test_the_policy_message_lists_what_to_choose(capsys):
    _, message = _fail(["compare", "--policies", "power_of_two"], capsys)
    assert "least_requests" in message and "round_robin" in message


def test_a_failing_run_is_one_line_and_exit_1(tmp_path, capsys):
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"cost": {"no_such_cost": 1.0}}))
    status, message = _fail(["run", "--cluster-file", str(cluster), "--duration", "60"], capsys)
    assert status == 1
    assert "no_such_cost" in message and "\n" not in message.strip()


def test_the_command_line_prints_no_traceback():
    """The issue's command, as a user runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "sglang_lite.sim", "compare", "--policies", "power_of_two"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "unknown policy 'power_of_two'" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
