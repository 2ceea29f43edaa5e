"""``--model-path org/name`` and ``load_model("org/name")``: a Hugging Face hub id is served from the hub's cache,
laid out here as huggingface_hub lays it out, offline."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from sglang_lite import assets
from sglang_lite.utils.process import wait_until_healthy
from tests.server.conftest import free_port

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "qwen-lite/tiny-moe"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HOME with the built-in model cached as ``REPO`` at ``main``, and the hub unreachable."""
    home = tmp_path / "hf"
    repo = home / "hub" / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(assets.TINY_MODEL_DIR, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def test_a_hub_id_resolves_to_its_cached_snapshot(hub_cache: Path):
    assert Path(assets.model_dir(REPO)) == hub_cache
    assert Path(assets.model_dir(REPO, revision=COMMIT)) == hub_cache
    local = hub_cache.parent.parent.parent  # a folder that exists is a folder, whatever its name
    assert assets.model_dir(str(local)) == str(local)
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache"):
        assets.model_dir("qwen-lite/not-cached")


def test_a_server_serves_a_hub_id_offline(hub_cache: Path, tmp_path: Path):
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    command = [
        *(sys.executable, "-m", "sglang_lite.launch_server", "--port", str(port)),
        *("--model-path", REPO, "--context-length", "512", "--max-total-tokens", "2048"),
        *("--cpu-threads-per-rank", "1"),
    ]
    server = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ), start_new_session=True
    )
    try:
        assert wait_until_healthy(f"http://127.0.0.1:{port}", server, 180), (
            tmp_path / "server.log"
        ).read_text()[-3000:]
        body = {"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 4}}
        answer = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [REPO]  # the id, as upstream serves it
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)
        log.close()
