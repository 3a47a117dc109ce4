# swaserve: every target creates or updates .venv itself.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
RUN_ARGS ?=
# make test: pytest-xdist workers (0: one process), each test file on one worker (its fixtures once)
TEST_WORKERS ?= 2
# make image: docker/Dockerfile, VARIANT=cpu or cuda (torch's wheel index), tagged IMAGE:VERSION-VARIANT
IMAGE ?= swaserve
VARIANT ?= cpu
VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv run test test-slow test-all test-core bench lint clean image chart-golden

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev,deploy,gcache,ray]" "$(TORCH_SPEC)"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m swaserve.run_demo $(RUN_ARGS)

# make test: everything but the tests marked slow (under ~12 min on 2 cores); make test-slow: those
# (deployment emulations, bench harnesses, make run's demo, the rest of the format matrices);
# CI (.ci/run) runs both, make test-all runs them in one pytest session
test: $(STAMP)
	scripts/system_deps.sh
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile -m "not slow"

test-slow: $(STAMP)
	scripts/system_deps.sh
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile -m slow

test-all: $(STAMP)
	scripts/system_deps.sh
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile

# the core without child processes (no workers, routers, Redis or engine-core process): < 2 min
test-core: $(STAMP)
	$(BIN)/python -m pytest tests -m "not cluster"

bench: $(STAMP)
	$(BIN)/swaserve bench kv-capacity --json bench/results/kv_capacity.json
	$(BIN)/swaserve bench prefix-cache --json bench/results/prefix_cache.json
	$(BIN)/swaserve bench engine --json bench/results/engine.json
	$(BIN)/swaserve bench prefix-replay --json bench/results/prefix_replay.json
	$(BIN)/swaserve bench pd-transfer --json bench/results/pd_transfer.json
	$(BIN)/swaserve bench cluster-replay --json bench/results/cluster_replay.json
	$(BIN)/swaserve bench prefix-replay --workload agent --sessions 4 --calls 10 --max-output-tokens 16 \
		--json bench/results/prefix_replay_agent.json
	$(BIN)/swaserve bench routing-sim --json bench/results/routing_sim.json
	$(BIN)/swaserve bench routing-cluster --json bench/results/routing_cluster.json
	$(BIN)/swaserve bench frontend --json bench/results/frontend.json
	$(BIN)/swaserve bench guided --json bench/results/guided.json
	$(BIN)/swaserve bench gcache --json bench/results/gcache.json
	$(BIN)/swaserve bench encoder --json bench/results/encoder.json
	$(BIN)/swaserve bench ep --json bench/results/ep.json
	$(BIN)/swaserve bench kv-quant --json bench/results/kv_quant.json

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check swaserve services bench tests
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache --no-logo

image:
	docker build -f docker/Dockerfile --build-arg VARIANT=$(VARIANT) --build-arg TORCH_SPEC=$(TORCH_SPEC) \
		-t $(IMAGE):$(VERSION)-$(VARIANT) .

# after an intended chart change: rewrite deploy/helm/examples/output-*.yaml (review the diff)
chart-golden: $(STAMP)
	$(BIN)/python -m tests.helpers.chart --update

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
