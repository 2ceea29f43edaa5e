"""Alt-stream toggles take effect per run without re-import: two server launches with different environment flags
and arguments report different plans in /get_server_info, and a bad flag value stops the start with an error
naming the variable instead of hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from unittest import mock

import httpx
import pytest

from tests.server.conftest import ServerProcess

ALT_STREAM_VARS = (
    "SGLANG_ALT_STREAM",
    "SGLANG_GDN_QKVZ_BA_ALT_STREAM",
    "SGLANG_QK_NORM_ALT_STREAM",
    "SGLANG_ALT_STREAM_EAGER",
    "SGLANG_GDN_ALT_STREAM_MAX_TOKENS",
)
BAD_START_TIMEOUT_S = 120.0
NO_OVERLAP = {
    "alt_stream": False,
    "gdn_qkvz_ba": False,
    "qk_norm": False,
    "moe_shared_routed": False,
}


def _environment(**flags: str) -> dict[str, str]:
    """This process's environment without any alt-stream variable, plus `flags`."""
    env = {k: v for k, v in os.environ.items() if k not in ALT_STREAM_VARS}
    return {**env, **flags}


def _launch(flags: list[str], log_path: str, env: dict[str, str]) -> ServerProcess:
    with mock.patch.dict(
        os.environ, env, clear=True
    ):  # the child copies the environment when it is spawned
        return ServerProcess(["--dp-size", "1", *flags], log_path)


@pytest.fixture(scope="module")
def two_launches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, dict]]:
    """Both servers start at once; each is killed (its whole process group) whatever happens."""
    folder = tmp_path_factory.mktemp("alt_stream_plan")
    toggled_env = _environment(SGLANG_GDN_QKVZ_BA_ALT_STREAM="1", SGLANG_QK_NORM_ALT_STREAM="0")
    servers = []
    try:
        servers.append(
            _launch(["--disable-shared-experts-fusion"], str(folder / "toggled.log"), toggled_env)
        )
        servers.append(_launch([], str(folder / "default.log"), _environment()))
        for server in servers:
            server.wait_ready()
        yield tuple(httpx.get(f"{s.url}/get_server_info", timeout=10).json() for s in servers)
    finally:
        for server in servers:
            server.kill()


def test_flags_and_fusion_follow_each_launch(two_launches: tuple[dict, dict]) -> None:
    toggled, default = two_launches
    assert (
        toggled["disable_shared_experts_fusion"] is True
        and default["disable_shared_experts_fusion"] is False
    )
    toggled_plan, default_plan = toggled["alt_stream_plan"], default["alt_stream_plan"]
    assert (
        toggled_plan["flags"]["gdn_qkvz_ba"] is True and toggled_plan["flags"]["qk_norm"] is False
    )
    assert (
        default_plan["flags"]["gdn_qkvz_ba"] is False and default_plan["flags"]["qk_norm"] is None
    )
    # The tiny model's shared expert has the routed experts' size, so fusion happens unless it is disabled.
    assert toggled_plan["decode_captured"]["shared_experts_fusion"] is False
    assert default_plan["decode_captured"]["shared_experts_fusion"] is True
    assert toggled_plan["prefill_eager"]["shared_experts_fusion"] is False


@pytest.mark.parametrize("which", [0, 1])
def test_the_cpu_never_overlaps(two_launches: tuple[dict, dict], which: int) -> None:
    plan = two_launches[which]["alt_stream_plan"]
    assert plan["platform"] == "cpu" and plan["auto_overlap_by_batch_size"] == {}
    for stage in ("decode_captured", "prefill_eager"):  # even with SGLANG_GDN_QKVZ_BA_ALT_STREAM=1
        assert {k: plan[stage][k] for k in NO_OVERLAP} == NO_OVERLAP, plan


def test_a_bad_flag_value_stops_the_start_naming_the_variable(tmp_path) -> None:
    command = [sys.executable, "-m", "sglang_lite.launch_server", "--port", "0", "--dp-size", "1"]
    process = subprocess.Popen(
        command,
        env=_environment(SGLANG_ALT_STREAM="maybe"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = process.communicate(timeout=BAD_START_TIMEOUT_S)  # a hang fails here
    finally:
        _kill_group(process)
    assert process.returncode != 0
    assert "SGLANG_ALT_STREAM='maybe'" in stderr and "is not a boolean" in stderr, stderr[-3000:]


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(5)
