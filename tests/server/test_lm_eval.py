"""lm-evaluation-harness (from PyPI) against the server, as users evaluate a served model: its
``local-completions`` backend on a tiny local task of log-likelihood and generation requests, compared per sample
with its transformers backend on the same weights (the built-in model's trained ones)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_lite.assets import TINY_MODEL_DIR
from tests.server.conftest import ServerProcess, start_server

pytest.importorskip("lm_eval")
REPO_ROOT = Path(__file__).resolve().parents[2]
LM_EVAL_TIMEOUT_S = 600
CHOICES = [
    {
        "question": "def add(a, b):\n    return",
        "choices": [" a + b", " a - b", " None"],
        "answer": 0,
    },
    {"question": "import os\nimport", "choices": [" sys", " os", " 42"], "answer": 0},
    {
        "question": "for i in range(10):\n   ",
        "choices": [" print(i)", " pass", " break"],
        "answer": 1,
    },
]
PROMPTS = [
    {"question": "class Config:\n    def __init__(self", "answer": ")"},
    {"question": "# Copyright", "answer": " 2024"},
]


@pytest.fixture(scope="module")
def trained_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The built-in model with its shipped weights (the session servers use random ones)."""
    yield from start_server(
        tmp_path_factory, "lm_eval", ["--dp-size", "1", "--load-format", "auto"]
    )


def _task_dir(root: Path) -> Path:
    """A multiple-choice (log-likelihood) task and a greedy generation task, with their data."""
    for name, rows in (("choices", CHOICES), ("prompts", PROMPTS)):
        (root / f"{name}.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    common = 'dataset_path: json\ntest_split: test\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
    (root / "choices.yaml").write_text(
        f"task: sglang_lite_choices\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'choices.jsonl'}\n"
        'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\nmetric_list:\n  - metric: acc\n'
    )
    (root / "prompts.yaml").write_text(
        f"task: sglang_lite_prompts\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'prompts.jsonl'}\n"
        'output_type: generate_until\ngeneration_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 12\n'
        "  do_sample: false\n  temperature: 0\nmetric_list:\n  - metric: exact_match\n"
    )
    return root


def _lm_eval(args: list[str], tasks: Path, output: Path) -> subprocess.Popen:
    """Starts the lm_eval command from the repository root (``_samples`` waits for it)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        *args,
        "--tasks",
        "sglang_lite_choices,sglang_lite_prompts",
        "--include_path",
        str(tasks),
        "--log_samples",
        "--output_path",
        str(output),
    ]
    # its log in a file, not a pipe: two runs at once never wait on a reader
    with open(_log(output), "w") as log:
        return subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log
        )


def _log(output: Path) -> Path:
    return output.with_name(output.name + ".log")


def _samples(run: subprocess.Popen, output: Path) -> dict[tuple[str, int], list]:
    """Each sample's responses by (task, doc id), once the run has ended well."""
    try:
        run.wait(timeout=LM_EVAL_TIMEOUT_S)
    finally:
        run.kill()
    assert run.returncode == 0, _log(output).read_text()[-4000:]
    samples = {}
    for path in glob.glob(str(output / "*" / "samples_*.jsonl")):
        task = "choices" if "sglang_lite_choices" in path else "prompts"
        for line in Path(path).read_text().splitlines():
            sample = json.loads(line)
            samples[task, sample["doc_id"]] = sample["resps"]
    return samples


def test_lm_eval_against_the_server_matches_its_transformers_backend(trained_server, tmp_path):
    tasks = _task_dir(tmp_path)
    served_args = (
        f"model=tiny_qwen3_5_moe,base_url={trained_server.url}/v1/completions,num_concurrent=2,"
        "max_retries=1"
    )
    backends = {
        "served": ["--model", "local-completions", "--model_args", served_args],
        "hf": [
            "--model",
            "hf",
            "--model_args",
            f"pretrained={TINY_MODEL_DIR},dtype=float32",
            "--device",
            "cpu",
            "--batch_size",
            "1",
        ],
    }
    # both at once (each imports lm_eval, datasets and transformers for seconds)
    runs = {name: _lm_eval(args, tasks, tmp_path / name) for name, args in backends.items()}
    try:
        samples = {name: _samples(run, tmp_path / name) for name, run in runs.items()}
    finally:  # the other run too, when one failed
        for run in runs.values():
            run.kill()
    served, reference = samples["served"], samples["hf"]
    assert sorted(served) == sorted(reference) and len(served) == len(CHOICES) + len(PROMPTS)
    for key in [k for k in served if k[0] == "choices"]:
        for ours, theirs in zip(served[key], reference[key], strict=True):
            (loglikelihood, greedy), (expected, expected_greedy) = ours[0], theirs[0]
            assert abs(float(loglikelihood) - float(expected)) < 1e-3, (key, ours, theirs)
            assert greedy == expected_greedy, key
    for key in [k for k in served if k[0] == "prompts"]:
        assert served[key] == reference[key], key
