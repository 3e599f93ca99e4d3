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

# torch first and pinned, through pip: on a machine without CUDA, 2.13.0 is the CPU build on disk (pip's
# find-links); an open range would pull a multi-GB CUDA build. The rest through uv (pinned, from PyPI), which keeps
# that torch (2.13.0+cpu satisfies ==2.13.0): 22 s against pip's 203 s for the same ~85 packages (measured once,
# on a loaded 2-core machine).
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(PY) -m pip install -q torch==2.13.0 triton==3.8.0 numpy==2.4.6 uv==0.13.9
	$(VENV)/bin/uv pip install -q --python $(PY) -e '.[test]'
	@touch $@

# The demo server on the embedded defaults: the tiny model with seeded random weights, 127.0.0.1:8000.
# ARGS go to `flashtier serve`: make serve ARGS="--port 9000"
ARGS ?=
serve: $(STAMP)
	$(VENV)/bin/flashtier serve $(ARGS)

# One parallel pass on two pytest workers (CI has 2 cores; tests/conftest.py keeps torch at one thread per process):
# every file's tests stay on one worker, so module fixtures (models, servers) are built once, and the `slow` tests
# (servers under load, SIGKILL / SIGSTOP) form one group that runs one test after another on one worker while the
# other worker takes the files (tests/conftest.py orders the groups, heaviest first). Then the `serial` tests
# (timing windows of 100-250 ms) alone in one process. TEST_WORKERS=0 runs the first pass in-process too.
# PYTHONDONTWRITEBYTECODE is cleared: each process would otherwise recompile (and pytest re-rewrite) every module
# it imports, the workers and every server subprocess alike.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)
TEST_ENV = PYTHONDONTWRITEBYTECODE= TRITON_INTERPRET=1
test: $(STAMP) $(SYS_STAMP)
	$(TEST_ENV) $(PY) -m pytest -q --durations=15 $(XDIST) -m "not serial and not gpu"
	@# exit code 5 = no test carries the marker yet
	$(TEST_ENV) $(PY) -m pytest -q --durations=15 -m "serial and not gpu" || [ $$? -eq 5 ]

clean:
	rm -rf $(VENV) build *.egg-info
