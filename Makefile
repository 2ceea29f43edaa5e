# Two entry points, each doing all set-up on a fresh machine:
#   make run   - the main job: the HTTP server with the built-in tiny model on 127.0.0.1:30000 (no downloads)
#   make test  - the test suite
# Both create .venv on first use. torch is pinned first so pip takes the local CPU wheel rather than a CUDA build;
# on a GPU machine install your CUDA/ROCm torch into .venv before `make`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test setup system-libs

setup: system-libs $(VENV)/.installed

# The Mooncake transfer engine (PD disaggregation) links libibverbs.so.1, even over TCP: Debian's libibverbs1.
# The test of the router's live page drives Debian's chromium headless (it skips, saying so, without it).
system-libs:
	@ldconfig -p | grep -q libibverbs.so.1 || { command -v apt-get >/dev/null && \
		{ apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null; }; } || \
		echo "warning: install libibverbs1 (the Mooncake transfer engine of PD disaggregation links it)"; }
	@command -v chromium >/dev/null || { command -v apt-get >/dev/null && \
		{ apt-get install -y -q chromium >/dev/null 2>&1 || \
		  { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }; } || \
		echo "warning: install chromium (the router's live-page test drives it headless)"; }

$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $@

run: setup
	$(PY) -m sglang_lite.launch_server $(ARGS)

test: setup
	$(PY) -m pytest -q tests
