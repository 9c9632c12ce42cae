# gpuherd: `make run` starts a whole cluster with a demo workload; `make test` runs the tests.
# Both create .venv and install what is needed on a fresh machine.

VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-stamp

.PHONY: install run local up down test test-long test-fast test-gpu chaos nemesis nemesis-tools lint bench clean

COMPOSE  := docker compose --project-directory infra -f infra/docker-compose.yml
PROFILES ?= sim,cpu

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch is pinned here (a CPU wheel is on the build machines; an open range would pull GBs of CUDA
# packages); pyproject.toml declares torch>=2.4 so a GPU machine's own torch satisfies it.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q "atheris>=2.3" || echo "atheris did not install here; tests/fuzz/test_atheris.py will skip"
	@touch $(STAMP)

install: $(STAMP)

## run: embedded NATS + scheduler + 4 sim and 2 cpu agents; real DDP training next to a 300-job Philly slice; summary,
## audit; then the cluster and its dashboard keep serving (with commands to try) until Ctrl-C
run: install
	$(VENV)/bin/gpuherd --data-dir .gpuherd/demo up --fresh --agents 4 --gpus-per-node 8 --cpu-agents 2 --cpu-gpus 4 --demo philly

## local: a cluster on this machine that stays up (Ctrl-C stops it); NATS_URL selects an existing NATS
local: install
	$(VENV)/bin/gpuherd up --agents 2 --gpus-per-node 8

## up: the compose deployment (3-node JetStream cluster, services, agents of PROFILES=sim,cpu[,gpu])
# make-secrets.sh is run every time: it keeps what exists and adds what a newer deployment needs
# (a new NATS user, the Grafana password, the dashboard's operator token).
up:
	infra/make-secrets.sh
	@command -v docker >/dev/null || { echo "make up needs Docker Engine with Compose v2.24+; make local runs it all on this machine"; exit 1; }
	COMPOSE_PROFILES=$(PROFILES) $(COMPOSE) up --detach --build --wait

## down: stop it; VOLUMES=1 also drops the log and the agents' data
down:
	COMPOSE_PROFILES=sim,cpu,gpu $(COMPOSE) down $(if $(VOLUMES),--volumes)

infra/secrets.env:
	infra/make-secrets.sh

## test: every test but the long ones (kept under 12 minutes); test-long: those (the demo, the workflow
## e2e, the short nemesis and the power cut, real elastic jobs and warm-pool grows, bit-identical elastic
## training, real jobs on CPU agents and on leased memory, the pool under host memory pressure, the dashboard's
## browser walks at desktop and phone widths, one chaos round, the atheris run, `gpuherd profile`); .ci/run
## runs both. Each prints its 15 slowest tests (the budget).
test: install lint nemesis-tools
	$(VENV)/bin/pytest -q -m "not long" --durations=15

test-long: install nemesis-tools
	$(VENV)/bin/pytest -q -m long --durations=15

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow"

## test-gpu: on a machine with a CUDA GPU, the GPU tests and the four GPU benches (bench/gpu_all.sh: a table of
## the steps last, each step's output in .gpuherd/gpu-logs). Its own venv sees the machine's torch (a CUDA build)
## instead of the CPU wheel `install` pins.
GPU_VENV ?= .venv-gpu
test-gpu:
	[ -x $(GPU_VENV)/bin/python ] || $(PYTHON) -m venv --system-site-packages $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q -e ".[test]"
	PY=$(GPU_VENV)/bin/python bench/gpu_all.sh

## chaos: the chaos suite, longer (CHAOS_ROUNDS faults of each kind; make test-long runs it with 1)
chaos: install
	CHAOS_ROUNDS=$${CHAOS_ROUNDS:-3} $(VENV)/bin/pytest -q -s tests/chaos

## nemesis-tools: what the nemesis needs from Debian (iptables, FUSE, libfaketime), installed as root when missing
nemesis-tools:
	@missing=""; command -v iptables >/dev/null || missing="$$missing iptables"; \
	command -v fusermount3 >/dev/null || missing="$$missing fuse3"; \
	[ -e /usr/lib/x86_64-linux-gnu/libfuse.so.2 ] || [ -e /usr/lib/aarch64-linux-gnu/libfuse.so.2 ] || missing="$$missing libfuse2"; \
	command -v faketime >/dev/null || missing="$$missing faketime"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  else echo "!!!!! the nemesis lacks$$missing and cannot install it (not root): those fault kinds will be SKIPPED !!!!!" >&2; fi; \
	fi

## nemesis: the long nemesis (>= 2,000 acknowledged jobs, every fault kind, the power-cut demonstration); needs root
nemesis: install nemesis-tools
	$(PY) bench/bench_nemesis.py $(NEMESIS_ARGS)

lint: install
	$(VENV)/bin/ruff check apps libs services tests bench examples
	$(VENV)/bin/ruff format --check apps libs services tests bench examples
	$(VENV)/bin/lint-imports

bench: install
	$(PY) bench/bench_log.py
	$(PY) bench/bench_agent.py
	$(PY) bench/bench_scheduler.py
	$(PY) bench/bench_sim.py --scales 1.0,0.5 --determinism
	$(PY) bench/bench_profile.py
	$(PY) bench/bench_elastic.py
	$(PY) bench/bench_memory.py
	$(PY) bench/bench_load.py
	$(PY) bench/bench_restart.py
	$(PY) bench/bench_forecast.py

clean:
	rm -rf .gpuherd .pytest_cache .ruff_cache
