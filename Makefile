# Two set-up commands: `make serve` and `make test`. Each creates .venv when needed and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flashtier-installed
SYS_STAMP := $(VENV)/.system-packages

.PHONY: serve test test-fast venv system clean lock

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

# The install is the lock, exactly (docs/install.md): torch and triton first, pinned by version and without their
# dependencies, through pip (on a machine without CUDA, 2.13.0 is the CPU build from pip's configured find-links;
# uv does not read pip's configuration). Then uv, bootstrapped by pip from the lock's own entry (hash-checked), and
# every other package from the lock with hashes and without resolution: requirements.lock for the CPU build of
# torch, requirements-cuda.lock for PyPI's CUDA build (it adds the CUDA libraries torch names). The package itself
# last, without dependencies or build isolation (setuptools comes from the lock), and `uv pip check` proves the
# result consistent. An upstream release changes nothing here; `make lock` is the only way in.
TORCH_PINS := torch==2.13.0 triton==3.8.0
UV := $(VENV)/bin/uv
LOCK_FOR_TORCH = $$($(PY) -c "import importlib.metadata as m; print('requirements.lock' if '+cpu' in m.version('torch') else 'requirements-cuda.lock')")
$(STAMP): pyproject.toml requirements.lock requirements-cuda.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-deps $(TORCH_PINS)
	@sed -n '/^uv==/,/^[^ ]/{/^uv==/p;/^ /p;}' requirements.lock > $(VENV)/uv-bootstrap.txt
	$(PY) -m pip install -q --no-deps --require-hashes -r $(VENV)/uv-bootstrap.txt
	lock=$(LOCK_FOR_TORCH) && echo "installing $$lock" && $(UV) pip install -q --python $(PY) --require-hashes --no-deps -r $$lock
	$(UV) pip install -q --python $(PY) --no-deps --no-build-isolation -e .
	$(UV) pip check -q --python $(PY)
	@touch $@

# Refresh both locks on purpose (network: PyPI). UPGRADE="--upgrade" takes the newest releases the pins allow;
# without it, versions already locked are kept where they still satisfy pyproject.toml.
UPGRADE ?=
LOCK_FLAGS = --universal --generate-hashes --extra test --group tools --no-emit-package torch --no-emit-package triton \
	--python-version 3.11 --quiet $(UPGRADE)
# uv comes from the venv; without one, the version pyproject.toml's `tools` group pins (the lock may not exist yet).
lock:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@test -x $(UV) || $(PY) -m pip install -q "$$(grep -o '"uv==[^"]*"' pyproject.toml | tr -d '"')"
	$(UV) pip compile pyproject.toml $(LOCK_FLAGS) --custom-compile-command "make lock" -o requirements.lock
	@echo "triton==3.8.0" > $(VENV)/lock-overrides.txt
	$(UV) pip compile pyproject.toml $(LOCK_FLAGS) --no-config --override $(VENV)/lock-overrides.txt \
		--custom-compile-command "make lock" -o requirements-cuda.lock

# The demo server on the embedded defaults: the tiny model with seeded random weights, 127.0.0.1:8000.
# ARGS go to `flashtier serve`: make serve ARGS="--port 9000"
ARGS ?=
serve: $(STAMP)
	$(VENV)/bin/flashtier serve $(ARGS)

# One parallel pass on three pytest workers (CI has 2 cores; tests/conftest.py keeps torch at one thread per
# process): the server and fault tests spend much of their time waiting on their processes, so two workers kept
# 1.6 of the 2 cores busy and three keep 1.85 (measured with /usr/bin/time over a clean-clone pass: 1017 s -> 867 s).
# Every file's tests stay on one worker, so module fixtures (models, servers) are built once, and the `slow` tests
# (servers under load, SIGKILL / SIGSTOP) form one group that runs one test after another on one worker while the
# others take the files (tests/conftest.py orders the groups, heaviest first). Then the `serial` tests (timing
# windows of 100-250 ms) alone in one process: the files in SERIAL_TESTS, named so that this pass does not collect
# (import) the whole suite to find them (tests/test_makefile.py keeps the list equal to the files that carry the
# marker). TEST_WORKERS=0 runs the first pass in-process too. PYTHONDONTWRITEBYTECODE is cleared: each process
# would otherwise recompile (and pytest re-rewrite) every module it imports, the workers and every server
# subprocess alike.
TEST_WORKERS ?= 3
SERIAL_TESTS := tests/server/test_api_loading_metrics.py tests/server/test_frontend_load.py
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)
TEST_ENV = PYTHONDONTWRITEBYTECODE= TRITON_INTERPRET=1
test: $(STAMP) $(SYS_STAMP)
	$(TEST_ENV) $(PY) -P -m pytest -q --durations=15 $(XDIST) -m "not serial and not gpu"
	$(TEST_ENV) $(PY) -P -m pytest -q --durations=15 -m "serial and not gpu" $(SERIAL_TESTS)

clean:
	rm -rf $(VENV) build *.egg-info
