"""The top-level ``kernels/`` folder is ``sglang_lite.kernels``; from the repository root Python also finds it as
``kernels``, the import name of Hugging Face's kernel-hub distribution. It must not stand in for that package:
transformers probes ``kernels`` by importing it, which failed where triton is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_in_repo_root(code: str, extra_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(extra_path), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )


def test_transformers_imports_from_the_repository_root_without_triton(tmp_path):
    stub = tmp_path / "triton"
    stub.mkdir()
    (stub / "__init__.py").write_text('raise ImportError("no triton in this environment")\n')
    code = (
        "from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM\n"
        "import kernels\n"
        "print('exports:', hasattr(kernels, 'fused_moe'), getattr(kernels, '__file__', None))\n"
    )
    result = run_in_repo_root(code, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # ours exports nothing under that name: ``kernels`` is absent, or the installed distribution
    found = result.stdout.split("exports: ", 1)[1].split()
    assert found[0] == "False", result.stdout
    assert found[1] == "None" or not Path(found[1]).is_relative_to(REPO / "kernels"), result.stdout


def test_an_installed_kernels_package_wins_over_the_folder(tmp_path):
    hub = tmp_path / "kernels"
    hub.mkdir()
    (hub / "__init__.py").write_text('__version__ = "0.9.0"\nFROM_THE_HUB = True\n')
    result = run_in_repo_root(
        "import kernels\nprint(kernels.FROM_THE_HUB, kernels.__version__)\n", tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "0.9.0"]
