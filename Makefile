# stoker: `make up` sets everything up and runs the local stack; `make test` runs lint, types and every test tier.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
# torch and torchvision, installed before the project. torchvision gives transformers its torchvision image processors
# (2.5x less CPU per picture than the PIL ones, and the same pixels as vLLM's renderer). On a CPU-only host,
# TORCH_SPEC may add `--index-url https://download.pytorch.org/whl/cpu` for the smaller CPU builds.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
APT_PACKAGES ?= tesseract-ocr tesseract-ocr-eng tesseract-ocr-chi-sim espeak-ng fonts-wqy-zenhei
# The RabbitMQ the suite runs the pipeline over (tests/integration/test_rabbitmq.py; STOKER_TEST_AMQP names another).
RABBITMQ_PORT ?= 5672
RABBITMQ_WAIT_S ?= 120
PYTEST_ARGS ?=
# Two pytest-xdist workers, one per group of test files (`tests/conftest.py`): the files that run the real model
# and tesseract one after another on one, the files with stacks of their own on the simulated device (mostly
# waiting on timeouts) on the other. 0 runs every file in one process.
TEST_WORKERS ?= 2

.PHONY: help install system-deps rabbitmq model tiny-vlm up test lint typecheck unit integration e2e bench bench-quick docs clean

help:
	@echo "make up    - install everything (venv, Debian packages, model) and start the stack"
	@echo "make test  - install everything, then ruff, mypy and all tests (unit, integration, e2e)"
	@echo "make docs  - write docs/configuration.md from the settings (stoker/settings/)"
	@echo "make bench - pipeline vs synchronous baseline, results and plots in docs/bench (bench-quick: < 3 min)"

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || \
	  { echo "stoker needs Python 3.11 (found $$($(PYTHON) --version)); set PYTHON=/path/to/python3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed system-deps

# tesseract with English and Simplified Chinese (OCR), espeak-ng (test speech), a CJK font (the Chinese OCR test);
# apt-get when missing and root.
system-deps:
	@langs=$$(tesseract --list-langs 2>/dev/null); \
	if grep -qx eng <<<"$$langs" && grep -qx chi_sim <<<"$$langs" && command -v espeak-ng >/dev/null \
	  && fc-list :lang=zh | grep -q .; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(APT_PACKAGES); \
	else echo "tesseract (eng, chi_sim), espeak-ng or a CJK font is missing: sudo apt-get install $(APT_PACKAGES)"; exit 1; fi

# A RabbitMQ on 127.0.0.1:$(RABBITMQ_PORT) for the suite: nothing to do when one answers there (or STOKER_TEST_AMQP
# names one); else, as root, apt-get it when missing, start it (no systemd needed) and wait until it answers.
# Elsewhere a note: the RabbitMQ tests then skip, and fail under CI.
rabbitmq:
	@answers() { (exec 3<>/dev/tcp/127.0.0.1/$(RABBITMQ_PORT)) 2>/dev/null; }; \
	if [ -n "$${STOKER_TEST_AMQP:-}" ] || answers; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "no RabbitMQ answers on 127.0.0.1:$(RABBITMQ_PORT): sudo apt-get install rabbitmq-server (its tests skip)"; \
	  exit 0; fi; \
	if ! command -v rabbitmq-server >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends rabbitmq-server; \
	fi; \
	answers || rabbitmq-server -detached; \
	for _ in $$(seq $(RABBITMQ_WAIT_S)); do answers && exit 0; sleep 1; done; \
	echo "RabbitMQ did not answer on 127.0.0.1:$(RABBITMQ_PORT) within $(RABBITMQ_WAIT_S) s"; exit 1

model: $(VENV)/.installed
	$(BIN)/stoker model fetch

# The SmolVLM-shaped test model (SmolLM2's weights, a random vision tower), built once into the model cache.
tiny-vlm: model
	$(BIN)/stoker model make-tiny-vlm

up: install model
	$(BIN)/stoker up

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	@# deploy/k8s against the Kubernetes schemas (strict: no unknown field); KEDA's custom resources have none here.
	$(BIN)/kubernetes-validate --strict --quiet --no-warn deploy/k8s/*.yaml

typecheck: $(VENV)/.installed
	$(BIN)/mypy

test: install rabbitmq model tiny-vlm lint typecheck
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

# Pipeline vs synchronous baseline (docs/benchmarks.md). Quick: < 3 min, one load; full: a sweep with plots.
bench-quick: install model
	$(BIN)/stoker bench --quick

bench: install model
	$(BIN)/stoker bench --out docs/bench

# The pages generated from the code: docs/configuration.md from stoker/settings/ (a unit test fails while stale).
docs: $(VENV)/.installed
	$(BIN)/stoker docs config > docs/configuration.md

unit integration e2e: install rabbitmq model tiny-vlm
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder tests/$@ $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info

# A peer in the house: a pinned vLLM on the CPU in a venv of its own (never the project's, never `make test`), its
# render of the test corpus recorded into tests/fixtures/vllm_render (with the JSON Schema of its GenerateRequest),
# then stoker's render compared with it. `make test` compares against the recorded files without vLLM.
VLLM_SPEC ?= vllm==0.33.0
PEER_VENV ?= $(HOME)/.cache/stoker/vllm-venv

$(PEER_VENV)/.installed:
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install --quiet "$(VLLM_SPEC)"
	touch $@

.PHONY: peer
peer: $(PEER_VENV)/.installed tiny-vlm
	$(PEER_VENV)/bin/python tests/fixtures/vllm_render/export_schema.py
	$(PEER_VENV)/bin/python tests/fixtures/vllm_render/record.py
	$(BIN)/pytest -q -p no:randomly tests/unit/test_vllm_render.py tests/unit/test_render_conformance.py
