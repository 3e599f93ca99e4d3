# Two set-up commands: `make serve` and `make test`. Each creates .venv when needed and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flashtier-installed
SYS_STAMP := $(VENV)/.system-packages

.PHONY: serve test test-fast venv system clean

venv: $(STAMP)
system: $(SYS_STAMP)

# redis-server and prometheus are real processes the tests start on loopback ports; promtool (Debian's
# prometheus package) checks and unit-tests deploy/prometheus.
$(SYS_STAMP):
	@if ! command -v redis-server >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1 \
			|| ! command -v promtool >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server prometheus >/dev/null; \
	fi
	@mkdir -p $(VENV) && touch $@

# torch first and pinned: on a machine without CUDA, 2.13.0 is the CPU build on disk; an open range would
# pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(PY) -m pip install -q torch==2.13.0 triton==3.8.0 numpy==2.4.6
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

# The demo server on the embedded defaults: the tiny model with seeded random weights, 127.0.0.1:8000.
# ARGS go to `flashtier serve`: make serve ARGS="--port 9000"
ARGS ?=
serve: $(STAMP)
	$(VENV)/bin/flashtier serve $(ARGS)

# The fast pass on two pytest workers (CI has 2 cores; tests/conftest.py keeps torch at one thread per process); a
# file's tests stay on one worker so module fixtures (models, servers) are built once. The slow pass (servers under
# load, SIGKILL / SIGSTOP timing) runs in one process: two of them at once on 2 cores starve each other's timing
# windows. TEST_WORKERS=0 runs the fast pass in-process too.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: $(STAMP) $(SYS_STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q --durations=15 $(XDIST) -m "not slow and not gpu"
	@# exit code 5 = no test carries the marker yet
	TRITON_INTERPRET=1 $(PY) -m pytest -q --durations=15 -m "slow and not gpu" || [ $$? -eq 5 ]

clean:
	rm -rf $(VENV) build *.egg-info
