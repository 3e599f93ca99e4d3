"""The lock: pyproject.toml and both lock files agree, and this environment is the lock, exactly.

`make lock` writes requirements.lock (the CPU build of torch) and requirements-cuda.lock (PyPI's CUDA build: the
Dockerfile, GPU hosts); `make serve` / `make test` install one of them with hashes and no resolution
(docs/install.md). Everything here is offline: the checks read the files and the installed metadata.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ("requirements.lock", "requirements-cuda.lock")
# Installed first by version, never emitted into a lock (Makefile, Dockerfile).
BY_VERSION = {"torch", "triton"}
# The Dockerfile's base image (ubuntu24.04) ships Python 3.12.
DOCKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}


@dataclass(frozen=True)
class Locked:
    """One entry of a lock file: ``name==version ; marker`` and its hashes."""

    name: str
    version: str
    marker: Marker | None
    hashes: int

    def applies(self, env: dict[str, str] | None = None) -> bool:
        return self.marker is None or self.marker.evaluate(env)


def parse_lock(text: str) -> list[Locked]:
    entries: list[Locked] = []
    # an entry: a line at column 0 (continued with backslashes), then indented --hash lines and comments
    for block in re.split(r"\n(?=[^\s#])", text):
        first = block.split("\n", 1)[0]
        if not first or first.startswith("#"):
            continue
        spec = first.rstrip(" \\")
        req = Requirement(spec)
        (pin,) = req.specifier
        assert pin.operator == "==", spec
        entries.append(Locked(canonicalize_name(req.name), pin.version, req.marker,
                              len(re.findall(r"--hash=sha256:[0-9a-f]{64}", block))))
    return entries


def pyproject_pins(pyproject_text: str) -> dict[str, str]:
    """name -> version for every requirement pyproject.toml declares (runtime, the test extra, the tools group)."""
    data = tomllib.loads(pyproject_text)
    reqs = [*data["project"]["dependencies"], *data["project"]["optional-dependencies"]["test"],
            *data["dependency-groups"]["tools"]]
    pins = {}
    for text in reqs:
        req = Requirement(text)
        (pin,) = req.specifier
        assert pin.operator == "==", f"pyproject.toml pins every requirement exactly: {text}"
        pins[canonicalize_name(req.name)] = pin.version
    return pins


def disagreements(pyproject_text: str, lock_text: str, env: dict[str, str] | None = None) -> list[str]:
    """What differs between pyproject.toml and one lock, for the environment ``env`` (None: this one)."""
    entries = parse_lock(lock_text)
    problems = []
    if "make lock" not in lock_text.split("\n", 3)[1]:
        problems.append("the lock was not written by `make lock`")
    for entry in entries:
        if entry.name in BY_VERSION:
            problems.append(f"{entry.name} is in the lock (it is installed first, by version)")
        if entry.hashes == 0:
            problems.append(f"{entry.name} has no hash")
    for name, version in pyproject_pins(pyproject_text).items():
        if name in BY_VERSION:
            continue
        found = [e.version for e in entries if e.name == name and e.applies(env)]
        if found != [version]:
            problems.append(f"{name}: pyproject.toml pins {version}, the lock has {found or 'nothing'}")
    return problems


def _read(name: str) -> str:
    return (ROOT / name).read_text()


@pytest.mark.parametrize("lock", LOCKS)
def test_pyproject_and_lock_agree(lock):
    assert disagreements(_read("pyproject.toml"), _read(lock)) == []


def test_cuda_lock_resolves_for_the_docker_image():
    """Linux x86_64, Python 3.12 (the Dockerfile's base image), PyPI's CUDA build of torch: every pin has its
    entry there, and the CUDA libraries that build names are locked with it."""
    assert "ubuntu24.04" in re.search(r"^FROM (\S+)", _read("Dockerfile"), re.M).group(1)
    cuda = _read("requirements-cuda.lock")
    assert disagreements(_read("pyproject.toml"), cuda, DOCKER_ENV) == []
    docker = {e.name for e in parse_lock(cuda) if e.applies(DOCKER_ENV)}
    assert {"nvidia-cudnn-cu13", "nvidia-nccl-cu13", "cuda-toolkit"} <= docker
    cpu = {e.name for e in parse_lock(_read("requirements.lock")) if e.applies(DOCKER_ENV)}
    assert cpu <= docker and not any(n.startswith(("nvidia-", "cuda-")) for n in cpu)


@pytest.mark.parametrize("edit", ["bumped", "added", "dropped hash"])
def test_a_disagreement_is_found(edit):
    """The check can fail: a pin moved in pyproject.toml, a dependency added without `make lock`, an entry
    without its hash."""
    pyproject, lock = _read("pyproject.toml"), _read("requirements.lock")
    if edit == "bumped":
        pyproject = pyproject.replace('"fastapi==0.165.0"', '"fastapi==0.166.0"')
    elif edit == "added":
        pyproject = pyproject.replace('dependencies = [\n', 'dependencies = [\n    "left-pad==1.0.0",\n', 1)
    else:
        lock = re.sub(r"(\nfastapi==\S+ \\\n)(    --hash=\S+\s*\\?\n)+", r"\1", lock)
    assert len(disagreements(pyproject, lock)) == 1


def test_this_environment_is_the_lock():
    """Every installed distribution is the lock's version, and nothing else is installed but torch, triton,
    the project and the venv's pip."""
    lock = "requirements.lock" if "+cpu" in importlib.metadata.version("torch") else "requirements-cuda.lock"
    wanted = {e.name: e.version for e in parse_lock(_read(lock)) if e.applies()}
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    extra = set(installed) - set(wanted) - BY_VERSION - {"flashtier", "pip"}
    assert extra == set()
    assert {n: v for n, v in installed.items() if n in wanted and Version(v) != Version(wanted[n])} == {}
    assert set(wanted) - set(installed) == set()


def test_torch_metadata_in_pyproject_is_the_cpu_wheel():
    """pyproject.toml's [tool.uv] dependency-metadata for torch (what requirements.lock resolves against) is the
    installed CPU wheel's own."""
    if "+cpu" not in importlib.metadata.version("torch"):
        pytest.skip("the CUDA build of torch is installed")
    (meta,) = tomllib.loads(_read("pyproject.toml"))["tool"]["uv"]["dependency-metadata"]
    assert meta["version"] == importlib.metadata.version("torch").split("+")[0]
    own = [r for r in importlib.metadata.requires("torch") if "extra ==" not in r]
    assert sorted(map(str, map(Requirement, meta["requires-dist"]))) == sorted(map(str, map(Requirement, own)))


def test_one_uv_version_everywhere():
    """uv is installed from the lock's entry (hash-checked) by the Makefile and the Dockerfile alike."""
    for name in ("Makefile", "Dockerfile"):
        assert not re.search(r"uv==\d", _read(name)), name
    pins = pyproject_pins(_read("pyproject.toml"))
    for lock in LOCKS:
        assert [e.version for e in parse_lock(_read(lock)) if e.name == "uv"] == [pins["uv"]]
