"""sglang_lite: a compact serving library for the Qwen3.5 model family.

The Triton kernels live in the top-level `kernels/` folder of the repository and are installed as
`sglang_lite.kernels` (a bare top-level `kernels` package already exists on PyPI, so we never install one).
"""

from setuptools import find_packages, setup

kernel_packages = ["sglang_lite.kernels"] + [
    f"sglang_lite.kernels.{p}" for p in find_packages("kernels")
]

setup(
    name="sglang_lite",
    version="0.1.0",
    description="Compact Qwen3.5 serving: model classes, Triton kernels, engine, server and router",
    python_requires=">=3.10",
    packages=find_packages(include=["sglang_lite", "sglang_lite.*"]) + kernel_packages,
    package_dir={"sglang_lite.kernels": "kernels"},
    package_data={
        "sglang_lite": ["assets/*/*"],
        # the router's live page: its HTML, CSS, script and the vendored uPlot with its licence
        "sglang_lite.router.dashboard": ["static/*"],
        "sglang_lite.kernels.cpu": ["csrc/*.cpp", "csrc/*.h"],
    },
    install_requires=[
        "torch>=2.4",
        "triton>=3.0",
        "safetensors",
        # 5.25 requires Hugging Face's `kernels`, through which its reference gated delta rule no longer runs on
        # the CPU (tests/kernels/test_gated_delta_rule.py): the reference we compare with stays on 5.24 or older
        "transformers>=5.2,<5.25",
        "tokenizers",
        "einops",
        "numpy",
        "tqdm",
        "fastapi",
        "uvicorn",
        "httpx",
        "aiohttp",
        "pyzmq",
        "msgpack",
        "xgrammar>=0.2.9",  # structured output (json_schema, regex, ebnf): grammars and token masks
        "matplotlib",
        "uvloop; sys_platform != 'win32'",  # the router's event loop: about 20% less CPU per request
        "ninja",  # builds the fused C++ CPU kernels (kernels/cpu) on first use, with the machine's g++
    ],
    extras_require={
        # PD disaggregation's transfer engine (CPU build; it links libibverbs.so.1: Debian's libibverbs1)
        "pd": ["mooncake-transfer-engine-non-cuda"],
        "test": [
            "pytest",
            "pytest-timeout",
            "openai==3.57.0",
            "sglang-router==0.3.2",
            "schemathesis",
            "hypothesis",
            "ruff",
            "import-linter",
            "mooncake-transfer-engine-non-cuda",
            "lm-eval[api,hf]",
        ],
    },
)
