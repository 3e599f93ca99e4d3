"""Imports go one way: server -> engine -> {kvstore, kernels}; kvstore and kernels import neither."""

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


def _imports(path: Path, package: str, root: Path = ROOT) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: stays inside the package unless it climbs out
                depth = len(path.relative_to(root / package).parts) - 1
                if node.level > depth + 1:
                    found.add("<relative import leaving the package>")
                continue
            names = [node.module or ""]
        for name in names:
            parts = name.split(".")
            if parts[0] == "flashtier" and len(parts) > 1 and parts[1] in PACKAGES:
                found.add(parts[1])
            elif parts[0] in PACKAGES:
                found.add(f"<top-level {parts[0]}>")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_flow_one_way(package):
    bad = []
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no Python files"
    for path in files:
        for dep in _imports(path, package):
            if dep != package and dep not in ALLOWED[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {dep}")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_checker_catches_a_violation(tmp_path):
    """The checker itself must flag an upward import (so the test above can fail)."""
    pkg = tmp_path / "kvstore"
    pkg.mkdir()
    (pkg / "bad.py").write_text("from flashtier.engine.model import config\nimport server.app\n")
    assert _imports(pkg / "bad.py", "kvstore", root=tmp_path) == {"engine", "<top-level server>"}
