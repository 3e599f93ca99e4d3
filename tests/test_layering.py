"""Import rules for the four source folders (flashtier.<folder>, see pyproject.toml's package-dir):

1. Imports go one way: server -> engine -> {kvstore, kernels}; kvstore and kernels import neither.
2. A leaf subpackage (engine/model/) does not import its parent package: the parent builds on it.
3. One import style: absolute ``flashtier.<pkg>...`` imports only, no relative ones.
4. The top folder (flashtier/: the offline ``LLM``) sits above everything: it may import any folder,
   and no folder imports it (``flashtier.__version__`` excepted).

Every import is resolved to the absolute dotted name it reaches (``from flashtier import server`` is
``flashtier.server``; ``from ..sampler import S`` in engine/model/x.py is ``flashtier.engine.sampler.S``),
so each rule sees every spelling of the same import.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "engine", "kvstore", "kernels")
# what each package may import from the others
ALLOWED = {
    "server": {"engine", "kvstore", "kernels"},
    "engine": {"kvstore", "kernels"},
    "kvstore": set(),
    "kernels": set(),
}
# folders (relative to ROOT) that may not import the package they sit in
LEAF_SUBPACKAGES = ("engine/model",)
LEAVES_PACKAGE = "<relative import leaving the package>"
TOP = "flashtier"  # the folder of the top-level modules (llm.py)
TOP_ALLOWED_BELOW = {"flashtier.__version__"}  # what the folders may import from the top


def _dotted_package(path: Path, root: Path) -> list[str]:
    """The package ``path`` sits in, as dotted parts: ``engine/model/x.py`` -> flashtier, engine, model."""
    return ["flashtier", *path.relative_to(root).parent.parts]


def _resolved_imports(path: Path, root: Path = ROOT) -> list[tuple[int, str, bool]]:
    """``(line, absolute dotted name, was relative)`` for every import in ``path``.

    ``from M import a, b`` yields ``M.a`` and ``M.b`` (a name may be a module or an attribute; the
    rules only compare prefixes). A relative import that climbs above ``flashtier.<folder>`` yields
    ``LEAVES_PACKAGE``.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, False) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _dotted_package(path, root)
                kept = len(package) - (node.level - 1)
                if kept < 2:  # above flashtier.<folder>
                    found.append((node.lineno, LEAVES_PACKAGE, True))
                    continue
                base = ".".join(package[:kept] + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{a.name}", bool(node.level)) for a in node.names]
    return found


def _imports(path: Path, package: str, root: Path = ROOT) -> set[str]:
    """The source folders (and top-level or escaping imports) that ``path`` in ``package`` reaches."""
    found = set()
    for _, name, _ in _resolved_imports(path, root):
        parts = name.split(".")
        if name == LEAVES_PACKAGE:
            found.add(name)
        elif parts[0] == "flashtier" and len(parts) > 1 and parts[1] in PACKAGES:
            found.add(parts[1])
        elif parts[0] in PACKAGES:
            found.add(f"<top-level {parts[0]}>")
    return found


def _parent_imports(path: Path, subpackage: str, root: Path = ROOT) -> list[str]:
    """Imports in ``path`` that reach ``subpackage``'s parent package outside ``subpackage`` itself."""
    own = ".".join(["flashtier", *Path(subpackage).parts])
    parent = own.rpartition(".")[0]
    bad = []
    for line, name, _ in _resolved_imports(path, root):
        inside = name == own or name.startswith(own + ".")
        if not inside and (name == parent or name.startswith(parent + ".")):
            bad.append(f"{path.relative_to(root)}:{line} imports {name}")
    return bad


def _relative_imports(path: Path, root: Path = ROOT) -> list[str]:
    return [
        f"{path.relative_to(root)}:{line} (-> {name})"
        for line, name, relative in _resolved_imports(path, root)
        if relative
    ]


def _sources(folder: str) -> list[Path]:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"{folder}/ has no Python files"
    return files


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_flow_one_way(package):
    bad = []
    for path in _sources(package):
        for dep in _imports(path, package):
            if dep != package and dep not in ALLOWED[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {dep}")
    assert not bad, "layering violations:\n" + "\n".join(bad)


@pytest.mark.parametrize("subpackage", LEAF_SUBPACKAGES)
def test_subpackage_does_not_import_its_parent(subpackage):
    bad = [line for path in _sources(subpackage) for line in _parent_imports(path, subpackage)]
    assert not bad, f"{subpackage}/ imports its parent package:\n" + "\n".join(bad)


def _top_imports(path: Path, root: Path = ROOT) -> list[str]:
    """Imports of the top-level modules (``flashtier.llm``, ``flashtier.LLM``) from below them."""
    bad = []
    for line, name, _ in _resolved_imports(path, root):
        parts = name.split(".")
        if parts[0] == TOP and len(parts) > 1 and parts[1] not in PACKAGES and name not in TOP_ALLOWED_BELOW:
            bad.append(f"{path.relative_to(root)}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("package", PACKAGES)
def test_nothing_imports_the_top_level(package):
    bad = [line for path in _sources(package) for line in _top_imports(path)]
    assert not bad, "the top-level API sits above every folder:\n" + "\n".join(bad)


def test_checker_catches_an_import_of_the_top(tmp_path):
    pkg = tmp_path / "engine"
    pkg.mkdir()
    (pkg / "bad.py").write_text("from flashtier import LLM, __version__\nimport flashtier.llm\n")
    assert _top_imports(pkg / "bad.py", root=tmp_path) == [
        "engine/bad.py:1 imports flashtier.LLM", "engine/bad.py:2 imports flashtier.llm"]


@pytest.mark.parametrize("package", (*PACKAGES, TOP))
def test_imports_are_absolute(package):
    bad = [line for path in _sources(package) for line in _relative_imports(path)]
    assert not bad, "relative imports (write `from flashtier.<pkg>... import ...`):\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- the checker itself


def test_checker_catches_a_violation(tmp_path):
    """The checker itself must flag an upward import (so the test above can fail)."""
    pkg = tmp_path / "kvstore"
    pkg.mkdir()
    (pkg / "bad.py").write_text("from flashtier.engine.model import config\nimport server.app\n")
    assert _imports(pkg / "bad.py", "kvstore", root=tmp_path) == {"engine", "<top-level server>"}


@pytest.mark.parametrize(
    "line",
    [
        "import flashtier.server\n",
        "import flashtier.server.app as app\n",
        "from flashtier import server\n",
        "from flashtier import kernels, server\n",
        "from flashtier.server.app import build_app\n",
        "def f():\n    from flashtier.server import app\n",
    ],
)
def test_checker_sees_every_spelling_of_a_package_import(tmp_path, line):
    pkg = tmp_path / "engine"
    pkg.mkdir()
    (pkg / "bad.py").write_text(line)
    assert "server" in _imports(pkg / "bad.py", "engine", root=tmp_path)


def test_checker_flags_a_relative_import_leaving_the_package(tmp_path):
    (tmp_path / "kvstore" / "sub").mkdir(parents=True)
    (tmp_path / "kvstore" / "sub" / "bad.py").write_text("from ...engine import engine\nfrom .. import config\n")
    found = _imports(tmp_path / "kvstore" / "sub" / "bad.py", "kvstore", root=tmp_path)
    assert found == {LEAVES_PACKAGE, "kvstore"}


@pytest.mark.parametrize(
    "line",
    [
        "from flashtier.engine.checkpoint import CheckpointReader\n",
        "from flashtier.engine import sampler\n",
        "from flashtier import engine\n",
        "import flashtier.engine.sampler\n",
        "from ..sampler import Sampler\n",
        "from .. import sampler\n",
    ],
)
def test_checker_catches_a_subpackage_importing_its_parent(tmp_path, line):
    model = tmp_path / "engine" / "model"
    model.mkdir(parents=True)
    (model / "bad.py").write_text(line)
    assert _parent_imports(model / "bad.py", "engine/model", root=tmp_path)


def test_checker_lets_a_subpackage_import_itself_and_other_packages(tmp_path):
    model = tmp_path / "engine" / "model"
    model.mkdir(parents=True)
    (model / "ok.py").write_text(
        "from flashtier.engine.model.config import ModelConfig\n"
        "from flashtier.engine import model\n"
        "from .config import preset\n"
        "from . import norm\n"
        "from flashtier.kernels.fp8_weight import quantize_fp8_weight\n"
        "import torch\n"
    )
    assert _parent_imports(model / "ok.py", "engine/model", root=tmp_path) == []


def test_checker_catches_a_relative_import(tmp_path):
    model = tmp_path / "engine" / "model"
    model.mkdir(parents=True)
    (model / "bad.py").write_text(
        "from flashtier.engine.model.config import ModelConfig\nfrom .norm import RMSNorm\nfrom .. import sampler\n"
    )
    assert _relative_imports(model / "bad.py", root=tmp_path) == [
        "engine/model/bad.py:2 (-> flashtier.engine.model.norm.RMSNorm)",
        "engine/model/bad.py:3 (-> flashtier.engine.sampler)",
    ]
