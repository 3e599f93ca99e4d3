"""Shared test set-up: Triton kernels run interpreted on the CPU, and torch stays deterministic.

Scheduling under ``make test`` (``-n 3 --dist loadgroup --no-loadscope-reorder``; the Makefile says why three):
every test gets an xdist group, so that a file's tests stay on one worker (module fixtures, servers, are built
once) and the ``slow`` tests form ONE group, run one after another on one worker (two fault suites at once starve
each other's timing windows) while the other workers take the files. The groups are queued heaviest first, so no
long file starts last and leaves a worker alone at the end. ``serial`` tests are not run there: they need an
otherwise idle machine and get a pass of their own.
"""

import logging
import os
import sys
from pathlib import Path

# Must be set before any Triton kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

# No root folder may answer an import meant for an installed distribution (the PyPI `kernels` that transformers
# imports, say): the product is imported as `flashtier.*` through its install, the tests as the `tests` package
# by pytest's importlib mode (pyproject.toml), never through the repository root on sys.path. Something still
# puts it there before this file runs: `python -m pytest` (the working directory) and pytest-xdist's workers,
# which insert their working directory into sys.path and PYTHONPATH (inherited by every server subprocess).
# tests/test_import_paths.py checks the outcome.
REPO_ROOT = Path(__file__).resolve().parents[1]


def _is_repo_root(entry: str) -> bool:
    return Path(entry or os.getcwd()).resolve() == REPO_ROOT


sys.path[:] = [p for p in sys.path if not _is_repo_root(p)]
if os.environ.get("PYTHONPATH"):
    _kept = [p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p and not _is_repo_root(p)]
    if _kept:
        os.environ["PYTHONPATH"] = os.pathsep.join(_kept)
    else:
        del os.environ["PYTHONPATH"]

import pytest  # noqa: E402
import torch  # noqa: E402

# One thread: the tests' tensors are small, and with 2 cores shared by server subprocesses a second
# intra-op thread spins instead of working (measured 5-10x slower float64 tests under load).
torch.set_num_threads(1)

SLOW_GROUP = "slow"

# The files that keep a worker busy longest: seconds of their tests (slow ones excluded) in the parallel pass of
# `make test` (3 workers on 2 cores, pytest --junitxml), re-measured after the CPU engine's reference cuts. A file not
# listed is queued after these in collection order. Only the order of the queue depends on these numbers, never a
# result: xdist's default queues the files with the most tests first, which puts these (few tests, long ones) last,
# where one of them keeps a worker busy while the other idles.
HEAVY_FILES = {
    "tests/engine/test_speculative.py": 163,
    "tests/engine/test_engine.py": 143,
    "tests/server/test_api_tiers.py": 119,
    "tests/kernels/test_indexer_topk.py": 107,
    "tests/engine/test_tiers.py": 104,
    "tests/engine/test_exact_retry.py": 102,
    "tests/engine/test_oracle.py": 88,
    "tests/kernels/test_sparse_mqa.py": 83,
    "tests/engine/test_parallel_forward.py": 78,
    "tests/engine/test_memory_plan.py": 57,
    "tests/server/test_parallel_serve.py": 56,
    "tests/engine/test_parallel_executor.py": 37,
    "tests/engine/test_warmup.py": 36,
    "tests/kernels/test_moe_split_k.py": 35,
    "tests/engine/test_engine_core.py": 35,
    "tests/benchmarks/test_serve_load.py": 34,
    "tests/kernels/test_moe_grouped_gemm.py": 33,
    "tests/engine/test_decode_graphs.py": 32,
    "tests/kernels/test_fp8_gemm_fused.py": 28,
    "tests/engine/test_tenant_delete_engine.py": 27,
    "tests/engine/test_structured_output.py": 24,
    "tests/engine/test_batched_forward.py": 23,
    "tests/server/test_admin_tenant_delete.py": 3,  # its server test is `slow` (the slow group)
}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _root_logger_restored():
    """An in-process ``main(["serve", ...])`` installs a stderr handler (pytest's capture, closed after the test) and
    an INFO level on the root logger; undone here so a later test on the same worker sees neither."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)


def _group(item: pytest.Item) -> str:
    return SLOW_GROUP if item.get_closest_marker("slow") else item.nodeid.split("::", 1)[0]


def _join_group(item: pytest.Item, group: str) -> None:
    """Rename the test ``<nodeid>@<group>``: the name xdist's loadgroup scheduler reads the group from. xdist
    3.8's own renaming (for ``xdist_group`` markers) writes ``Item._nodeid``, which pytest 9 no longer reads
    (the id lives in ``Item._id``), so its groups silently fall apart into single tests; this one takes."""
    name = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):
        item._id = type(item._id).parse(name)
    else:
        item._nodeid = name


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--dist loadgroup``: group every test, the slow ones together, the others by file, and order the
    groups heaviest first (see the module doc). Mutates ``items`` (their order and node ids, which end in
    ``@<group>`` as xdist's own groups do); without loadgroup it leaves them alone."""
    if not config.getoption("loadgroup", False):  # what xdist sets in a worker for --dist loadgroup
        return
    groups = {id(item): _group(item) for item in items}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(groups[id(item)], i)

    def weight(item: pytest.Item) -> tuple[int, float, int]:
        group = groups[id(item)]
        return (0 if group == SLOW_GROUP else 1, -HEAVY_FILES.get(group, 0), first_seen[group])

    items.sort(key=weight)  # stable: a group's tests keep their order
    for item in items:
        _join_group(item, groups[id(item)])
