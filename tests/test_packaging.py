"""The wheel holds every subpackage: built from the sources as the Dockerfile installs them (not editable), then
every module imported from it.

pyproject.toml lists the packages one by one (the source folders sit at the root and are installed as
flashtier.*); a folder with an __init__.py missing from that list would install without it, and only an
installed (non-editable) image would notice.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("flashtier", "server", "engine", "kvstore", "kernels")


def expected_packages(root: Path = ROOT) -> set[str]:
    """Every folder with an __init__.py, as the dotted package the install gives it."""
    found = set()
    for folder in SOURCES:
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder).parts
            found.add(".".join(["flashtier", *(() if folder == "flashtier" else (folder,)), *rel]))
    return found


def build_wheel(src: Path, dist: Path) -> Path:
    """The wheel of the sources in ``src`` (pyproject.toml, README.md and the package folders), offline."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "--quiet", "--wheel-dir", str(dist), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("flashtier-*.whl")
    return wheel


def copy_sources(dest: Path, root: Path = ROOT) -> Path:
    """What the Dockerfile copies into the image before installing."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, dest / name)
    for folder in SOURCES:
        shutil.copytree(root / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def wheel_modules(wheel: Path) -> list[str]:
    names = [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("flashtier/") and n.endswith(".py")]
    return sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in names)


# Imports each module given on the command line from the folder given first (put first on sys.path, ahead of
# the editable install); prints {module: where it came from or the error}.
_IMPORT_ALL = """
import importlib, json, sys
site, names = sys.argv[1], sys.argv[2:]
sys.path.insert(0, site)
out = {}
for name in names:
    try:
        out[name] = importlib.import_module(name).__file__
    except Exception as e:
        out[name] = f"ERROR {type(e).__name__}: {e}"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    return build_wheel(copy_sources(tmp / "src"), tmp / "dist")


def packages_in(wheel: Path) -> set[str]:
    return {n[: -len("/__init__.py")].replace("/", ".") for n in zipfile.ZipFile(wheel).namelist()
            if n.endswith("/__init__.py")}


def test_the_wheel_holds_every_subpackage(wheel):
    assert packages_in(wheel) == expected_packages() and len(expected_packages()) > 30


def test_the_wheel_holds_the_data_files(wheel):
    """Every non-Python file under the package folders that the code reads (the MoE launch table) ships."""
    data = {p.relative_to(ROOT).as_posix() for folder in SOURCES[1:] for p in (ROOT / folder).rglob("*.json")}
    names = set(zipfile.ZipFile(wheel).namelist())
    assert data and {f"flashtier/{d}" for d in data} <= names


def test_every_module_imports_from_the_wheel(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    names = wheel_modules(wheel)
    out = subprocess.run([sys.executable, "-P", "-c", _IMPORT_ALL, str(site), *names], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, check=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    where = json.loads(out.stdout)
    assert {n: w for n, w in where.items() if not str(w).startswith(str(site))} == {}
    assert len(where) == len(names) > 250


def test_a_folder_missing_from_the_package_list_is_caught(tmp_path):
    """The check can fail: a new subpackage left out of pyproject.toml's list is not in the wheel."""
    src = copy_sources(tmp_path / "src")
    pyproject = src / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('    "flashtier.engine.tiers",\n', ""))
    assert expected_packages(src) - packages_in(build_wheel(src, tmp_path / "dist")) == {"flashtier.engine.tiers"}
