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
import re
from dataclasses import dataclass
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
        "import flashtier.engine.sample.sampler\n",
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
        "from flashtier.kernels.quant.fp8_weight import quantize_fp8_weight\n"
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


# ----------------------------------------------------------------------------- subpackages
#
# Every folder with an __init__.py under the four source folders is a unit ("engine.kv"; a folder's own
# modules are the unit of the folder: "engine"). docs/architecture.md's table lists each unit's arrows (what
# it may import); the code and the table must agree both ways, and the graph has no cycle. An import across
# units must name a module the target lists in its __init__'s ``__all__``.

ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _units(root: Path = ROOT) -> set[str]:
    return {".".join(init.parent.relative_to(root).parts) for package in PACKAGES
            for init in (root / package).rglob("__init__.py")}


def _unit_of(dotted: str, units: set[str]) -> str | None:
    """The deepest unit a dotted name (``flashtier.engine.kv.manager.KVManager``) lies in."""
    parts = dotted.split(".")[1:] if dotted.startswith("flashtier.") else []
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in units:
            return ".".join(parts[:k])
    return None


def _annotation_only_lines(tree: ast.AST) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:`` (annotations: not arrows)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if hasattr(n, "lineno")}
    return lines


@dataclass(frozen=True)
class CrossImport:
    """One import from unit ``src`` into unit ``dst``: ``module`` is the first name below ``dst``."""

    where: str
    src: str
    dst: str
    module: str
    annotation_only: bool


def _cross_imports(root: Path = ROOT) -> list[CrossImport]:
    units = _units(root)
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            src = ".".join(path.parent.relative_to(root).parts)
            typing_only = _annotation_only_lines(ast.parse(path.read_text()))
            for line, name, _ in _resolved_imports(path, root):
                dst = _unit_of(name, units)
                if dst is None or dst == src:
                    continue
                below = name.split(".")[1:][len(dst.split(".")):]
                found.append(CrossImport(f"{path.relative_to(root)}:{line}", src, dst, below[0] if below else "",
                                         line in typing_only))
    return found


def _documented_arrows(text: str) -> dict[str, set[str]]:
    """unit -> the units it may import, from the table after the ``<!-- arrows`` marker."""
    table = text.split("<!-- arrows", 1)[1].split("\n\n", 1)[0]
    arrows = {}
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            arrows[cells[0].strip("`")] = set(re.findall(r"`([\w.]+)`", cells[2]))
    return arrows


def _cycle(arrows: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph (as a path that returns to its start), or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(unit: str) -> list[str]:
        state[unit] = 1
        stack.append(unit)
        for nxt in sorted(arrows.get(unit, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[unit] = 2
        stack.pop()
        return []

    for unit in sorted(arrows):
        if unit not in state and (found := visit(unit)):
            return found
    return []


def _public(unit: str, root: Path = ROOT) -> set[str]:
    """The names in ``unit``'s ``__all__`` (read from its __init__.py, nothing imported)."""
    tree = ast.parse(root.joinpath(*unit.split("."), "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def _arrow_problems(root: Path, documented: dict[str, set[str]]) -> list[str]:
    problems = []
    actual: dict[str, set[str]] = {}
    for imp in _cross_imports(root):
        if not imp.annotation_only:
            actual.setdefault(imp.src, set()).add(imp.dst)
            if imp.dst not in documented.get(imp.src, set()):
                problems.append(f"{imp.where}: {imp.src} -> {imp.dst} is not an arrow of the table")
    for src, dsts in documented.items():
        problems += [f"the table's arrow {src} -> {dst} is not an import" for dst in dsts - actual.get(src, set())]
    problems += [f"unit {u} has no row in the table" for u in sorted(_units(root) - set(documented))
                 if any(p.suffix == ".py" and p.name != "__init__.py" for p in root.joinpath(*u.split(".")).iterdir())]
    return problems


def test_subpackage_imports_are_the_documented_arrows():
    assert _arrow_problems(ROOT, _documented_arrows(ARCHITECTURE.read_text())) == []


def test_the_documented_arrows_have_no_cycle():
    assert _cycle(_documented_arrows(ARCHITECTURE.read_text())) == []


def test_imports_across_subpackages_name_public_modules():
    bad = [f"{imp.where}: {imp.dst}.{imp.module} is not in {imp.dst}'s __all__"
           for imp in _cross_imports() if imp.module and imp.module not in _public(imp.dst)]
    assert not bad, "\n".join(bad)


def test_every_subpackage_says_what_lives_there():
    bare = [u for u in sorted(_units()) if not ast.get_docstring(ast.parse(
        ROOT.joinpath(*u.split("."), "__init__.py").read_text()))]
    assert bare == []


def _tiny_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
        (tmp_path / package / "__init__.py").touch()
    return tmp_path


def test_checker_catches_an_undocumented_arrow_and_a_cycle(tmp_path):
    root = _tiny_tree(tmp_path, {
        "engine/a/__init__.py": '"""A."""\n__all__ = ["x"]\n', "engine/a/x.py": "from flashtier.engine.b.y import Y\n",
        "engine/b/__init__.py": '"""B."""\n__all__ = ["y"]\n', "engine/b/y.py": "from flashtier.engine.a.x import X\n",
    })
    documented = {"engine.a": {"engine.b"}, "engine.b": set()}
    assert _arrow_problems(root, documented) == ["engine/b/y.py:1: engine.b -> engine.a is not an arrow of the table"]
    assert _cycle({"engine.a": {"engine.b"}, "engine.b": {"engine.a"}}) == ["engine.a", "engine.b", "engine.a"]


def test_checker_skips_annotation_imports_and_flags_a_private_module(tmp_path):
    root = _tiny_tree(tmp_path, {
        "engine/a/__init__.py": '"""A."""\n__all__ = ["x"]\n', "engine/a/x.py": "X = 1\n",
        "engine/a/_own.py": "Z = 1\n",
        "engine/b/__init__.py": '"""B."""\n', "engine/b/y.py": (
            "from typing import TYPE_CHECKING\nfrom flashtier.engine.a._own import Z\n"
            "if TYPE_CHECKING:\n    from flashtier.engine.a.x import X\n"),
    })
    imports = _cross_imports(root)
    assert [(i.dst, i.module, i.annotation_only) for i in imports] == [("engine.a", "_own", False),
                                                                      ("engine.a", "x", True)]
    assert [i.module for i in imports if i.module not in _public(i.dst, root)] == ["_own"]
