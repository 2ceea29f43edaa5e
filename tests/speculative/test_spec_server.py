"""Speculation through the HTTP server: ``meta_info``, ``/v1/loads``' speculative section and the Prometheus
gauges; bad speculative flags are one line and exit status 2."""

from __future__ import annotations

import re
import subprocess

import httpx
import pytest

from tests.engine.conftest import random_prompts
from tests.server.conftest import free_port, start_server
from tests.server.test_startup import server_command
from tests.speculative.conftest import make_spec_checkpoint


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    path = make_spec_checkpoint(str(tmp_path_factory.mktemp("spec_server")), True, True)
    flags = [
        "--model-path",
        path,
        "--load-format",
        "auto",
        "--skip-tokenizer-init",
        "--cpu-threads-per-rank",
        "1",
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        "3",
    ]
    yield from start_server(tmp_path_factory, "spec", flags)


def test_reports_accepted_drafts_in_meta_info_loads_and_metrics(spec_server):
    prompts = random_prompts([3, 17, 40], vocab=160, seed=1)
    params = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}
    body = {"input_ids": prompts, "sampling_params": params}
    results = httpx.post(f"{spec_server.url}/generate", json=body, timeout=120).json()
    for result in results:
        meta = result["meta_info"]
        assert meta["completion_tokens"] == 20
        accepted, drafted = meta["spec_accept_token_num"], meta["spec_draft_token_num"]
        assert meta["completion_tokens"] == 1 + meta["spec_verify_ct"] + accepted
        assert meta["spec_accept_length"] == pytest.approx(20 / meta["spec_verify_ct"])
        assert meta["spec_accept_rate"] == pytest.approx(accepted / drafted)
    accepted = sum(r["meta_info"]["spec_accept_token_num"] for r in results)
    verify_steps = sum(r["meta_info"]["spec_verify_ct"] for r in results)
    assert accepted > 0
    (load,) = httpx.get(f"{spec_server.url}/v1/loads", timeout=30).json()["loads"]
    spec = load["speculative"]
    assert spec["accept_length"] == pytest.approx((verify_steps + accepted) / verify_steps)
    assert 0 < spec["accept_rate"] < 1
    text = httpx.get(f"{spec_server.url}/metrics", timeout=30).text
    gauge = re.search(r'^sglang_lite_accept_length\{dp_rank="0"\} (\S+)$', text, re.M)
    assert gauge is not None and float(gauge.group(1)) == pytest.approx(spec["accept_length"])
    assert re.search(r'^sglang_lite_accept_rate\{dp_rank="0"\} 0\.\d+', text, re.M)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--speculative-algorithm", "NEXTN", "--speculative-eagle-topk", "2"], "must be 1"),
        (
            ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3"]
            + ["--speculative-num-draft-tokens", "5"],
            "speculative_num_steps + 1",
        ),
        (["--speculative-num-steps", "2"], "need --speculative-algorithm"),
        (
            ["--speculative-algorithm", "NEXTN", "--speculative-ngram-max-match-window-size", "4"],
            "need --speculative-algorithm NGRAM",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "5"]
            + ["--speculative-ngram-max-match-window-size", "3"],
            "must not exceed",
        ),
        (["--speculative-algorithm", "MEDUSA"], "invalid choice"),
        (
            ["--speculative-algorithm", "NEXTN", "--enable-dp-attention"]
            + ["--tp-size", "2", "--dp-size", "2"],
            "enable_dp_attention",
        ),
    ],
)
def test_bad_speculative_flags_are_one_line_and_status_2(flags, message):
    done = subprocess.run(
        server_command(free_port(), *flags), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch_server: error: "), lines
    assert message in lines[0]
