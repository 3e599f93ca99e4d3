"""No folder of the repository answers an import meant for an installed distribution.

The repository root holds folders named like importable packages (kernels/, server/, engine/, ...), and the
benchmarks put benchmarks/ on sys.path. PyPI has a `kernels` distribution (transformers imports it), so with the
root on sys.path, `import kernels` inside transformers found our folder and failed. These tests check, for every
root folder and every benchmark module whose name an installed distribution (other than flashtier itself) also
provides, that `importlib.util.find_spec(name)` resolves outside the repository: in this pytest process, in a
subprocess started the way the tests start servers, and under the benchmark commands docs/performance.md gives
(`python3 -P benchmarks/NAME.py`, which puts benchmarks/ first on sys.path).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def candidate_names() -> list[str]:
    """Every name the repository could shadow: root folders and benchmark modules."""
    folders = [p.name for p in ROOT.iterdir() if p.is_dir() and p.name.isidentifier()]
    modules = [p.stem for p in BENCHMARKS.glob("*.py") if p.stem.isidentifier()]
    return sorted(set(folders) | set(modules))


def provided_elsewhere(names: list[str]) -> list[str]:
    """The names among ``names`` that an installed distribution other than flashtier provides."""
    provided = importlib.metadata.packages_distributions()
    return [n for n in names if any(d.lower() != "flashtier" for d in provided.get(n, ()))]


def in_repository(where: str, root: Path) -> bool:
    """Inside the repository's own files: under ``root`` but not in a hidden folder there (the .venv that
    `make` creates inside the checkout holds the installed distributions)."""
    path = Path(where).resolve()
    return path.is_relative_to(root) and not path.relative_to(root).parts[0].startswith(".")


def shadowed(names: list[str], root: Path) -> dict[str, str]:
    """name -> where it resolves, for each name whose spec lies in the repository (or cannot be found)."""
    bad = {}
    for name in names:
        spec = importlib.util.find_spec(name)
        where = [] if spec is None else [spec.origin or "", *(spec.submodule_search_locations or [])]
        if spec is None or any(w and in_repository(w, root) for w in where):
            bad[name] = "not found" if spec is None else ", ".join(where)
    return bad


# The same check, as a script for subprocesses: argv = root, a folder to put first on sys.path ("" for none),
# names; prints {name: where} for the shadowed names.
_CHILD = """
import importlib.util, json, sys
from pathlib import Path
root, first, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
if first:
    sys.path.insert(0, first)
bad = {}
for name in names:
    spec = importlib.util.find_spec(name)
    where = [] if spec is None else [spec.origin or "", *(spec.submodule_search_locations or [])]
    inside = [Path(w).resolve() for w in where if w and Path(w).resolve().is_relative_to(root)]
    if spec is None or any(not p.relative_to(root).parts[0].startswith(".") for p in inside):
        bad[name] = "not found" if spec is None else ", ".join(where)
print(json.dumps(bad))
"""


def test_kernels_is_among_the_checked_names():
    """The check has something to check: the PyPI `kernels` (via transformers) collides with kernels/."""
    assert "kernels" in provided_elsewhere(candidate_names())


def test_no_root_folder_shadows_a_distribution_under_pytest():
    names = provided_elsewhere(candidate_names())
    assert shadowed(names, ROOT) == {}
    assert all(Path(p or os.getcwd()).resolve() != ROOT for p in sys.path)
    import kernels  # the PyPI distribution, as transformers imports it

    assert not in_repository(kernels.__file__, ROOT)


def test_the_check_fails_with_the_root_on_sys_path(monkeypatch):
    """The check can fail: with the repository root first on sys.path (prepend mode, `python -m pytest`,
    pytest-xdist's workers), kernels/ answers `import kernels`."""
    monkeypatch.syspath_prepend(str(ROOT))
    for name in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    assert "kernels" in shadowed(["kernels"], ROOT)


def _child(flags: list[str], cwd: Path, first: str, names: list[str]) -> dict[str, str]:
    out = subprocess.run([sys.executable, *flags, "-c", _CHILD, str(ROOT), first, *names], cwd=cwd,
                         env=os.environ.copy(), capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_no_root_folder_shadows_a_distribution_in_subprocesses(tmp_path):
    """A subprocess inherits this process's environment (PYTHONPATH included), as the servers the tests start."""
    assert _child([], tmp_path, "", provided_elsewhere(candidate_names())) == {}


def test_no_root_folder_shadows_a_distribution_under_a_benchmark_command():
    """`python3 -P benchmarks/NAME.py` from the root: -P keeps the working directory off sys.path, and the
    benchmark puts benchmarks/ first (its sibling modules)."""
    names = provided_elsewhere(candidate_names())
    assert _child(["-P"], ROOT, str(BENCHMARKS), names) == {}
    # without -P, `python3 -c` from the root has the root first: the check sees it
    assert "kernels" in _child([], ROOT, "", names)


def test_the_api_process_and_the_engine_core_do_not_import_the_grammar_engine_at_start():
    """xgrammar imports transformers (0.8 s of CPU per process): imported where a grammar is first used, or by
    the warm-up (engine/grammar/compiler.py). A top-level ``import xgrammar`` in either process's modules fails
    this."""
    code = ("import sys, flashtier.server.app, flashtier.engine.parallel.rank_worker, flashtier.server.cli; "
            "print(sorted(m for m in ('xgrammar', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
