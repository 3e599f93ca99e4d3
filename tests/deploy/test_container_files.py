"""Dockerfile and docker-compose.yml, read by real parsers and checked against the CLI (no Docker engine runs).

The Dockerfile goes through BuildKit's own parser (the ``dockerfile`` package), the compose file through a
compose-spec parser (``compose-spec``: unknown keys, bad ports or mounts and undefined volumes or networks
are errors) after the ``${VAR:-default}`` interpolation compose does. Then:

- every file the stack mounts exists, every COPY source exists and is not excluded by .dockerignore;
- every FLASHTIER_* name (Dockerfile, compose, deploy/flashtier.env.example) is a ``flashtier serve``
  variable, every serve variable is offered, and each service's settings build (``build_settings``);
- the published and exposed port is the server's FLASHTIER_PORT, and Prometheus scrapes that port on a name
  both server services answer to; the drain timeout is shorter than the stop grace period;
- the HEALTHCHECK command, run here against a live server, passes on /health (200) and fails when the
  engine is not ready (503) or nothing listens.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys

import dockerfile
import pytest
import yaml
from compose_spec import PyOptions

from flashtier.server.config.settings import build_settings
from flashtier.server.config.options import OPTIONS

from ..kvstore.redis_server import free_port
from ..server.conftest import run_server
from .promql_queries import DEPLOY, ROOT

SERVE_ENVS = {opt.env for opt in OPTIONS} | {"FLASHTIER_MODEL_DIR"}
SERVERS = ("flashtier", "flashtier-cpu")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def interpolate(text: str, environ: dict[str, str]) -> str:
    """compose's ``${VAR}`` / ``${VAR:-default}`` (a variable without a default must be set)."""
    def sub(m: re.Match) -> str:
        if environ.get(m.group(1)):
            return environ[m.group(1)]
        if m.group(2) is None:
            raise KeyError(f"${{{m.group(1)}}} has no default")
        return m.group(2)

    return _VAR.sub(sub, text)


@pytest.fixture(scope="module")
def image() -> dict[str, list]:
    """Dockerfile instruction (lower case) -> the instructions, in order."""
    out: dict[str, list] = {}
    for cmd in dockerfile.parse_file(str(ROOT / "Dockerfile")):
        out.setdefault(cmd.cmd.lower(), []).append(cmd)
    return out


@pytest.fixture(scope="module")
def image_env(image) -> dict[str, str]:
    env: dict[str, str] = {}
    for cmd in image["env"]:
        env.update(zip(cmd.value[::2], cmd.value[1::2]))
    return env


@pytest.fixture(scope="module")
def compose() -> dict:
    text = interpolate((ROOT / "docker-compose.yml").read_text(), {})
    parsed = PyOptions(apply_merge=True).from_yaml(text)
    parsed.validate()
    return parsed.to_dict()


@pytest.mark.parametrize("old, new", [("stop_grace_period", "stop_grace_perod"), ("45s", "45 sec"),
                                      ("127.0.0.1:8000:8000", "127.0.0.1:8000:80x0"),
                                      ("condition: service_healthy", "condition: healthy"),
                                      ("networks:\n  default: {}", "")])
def test_the_compose_parser_rejects_what_compose_rejects(old, new):
    good = (ROOT / "docker-compose.yml").read_text()
    assert old in good
    with pytest.raises(ValueError):
        PyOptions(apply_merge=True).from_yaml(interpolate(good.replace(old, new), {})).validate()


def test_image_is_pinned_non_root_and_serves(image, image_env):
    base = image["from"][0].value[0]
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-[a-z]+-ubuntu\d+\.\d+", base), base
    runs = " ".join(c.value[0] for c in image["run"])
    pins = dict(re.findall(r'"(torch|triton)==([\d.]+)"', (ROOT / "pyproject.toml").read_text()))
    # torch and triton by pyproject's pins, the rest from the CUDA lock with hashes, the package without resolution
    assert f"torch=={pins['torch']} triton=={pins['triton']}" in runs
    assert "--require-hashes --no-deps -r requirements-cuda.lock" in runs and "--no-deps --no-build-isolation /src" in runs
    assert "-e " not in runs and "--editable" not in runs
    users = [c.value[0] for c in image["user"]]
    assert users and users[-1] not in ("root", "0")
    assert list(image["entrypoint"][-1].value) == ["flashtier", "serve"] and image["entrypoint"][-1].json
    assert image["stopsignal"][-1].value == ("SIGTERM",)
    assert image_env["FLASHTIER_HOST"] == "0.0.0.0"
    assert image["expose"][-1].value == (image_env["FLASHTIER_PORT"],)
    assert image_env["FLASHTIER_KV_DIR"] in [v for c in image["volume"] for v in c.value]
    assert set(k for k in image_env if k.startswith("FLASHTIER_")) <= SERVE_ENVS
    env = {k: v for k, v in image_env.items() if k.startswith("FLASHTIER_") and k != "FLASHTIER_MODEL_DIR"}
    settings = build_settings(None, env)
    assert settings.kvstore.ssd_dir == image_env["FLASHTIER_KV_DIR"] and settings.port == 8000


def test_copied_sources_exist_and_are_not_docker_ignored(image):
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for cmd in image["copy"]:
        for src in cmd.value[:-1]:
            assert (ROOT / src).exists(), src
            assert not any(fnmatch.fnmatch(src, pattern) for pattern in ignored), f"{src} is in .dockerignore"


def test_every_mounted_file_exists_and_the_model_is_the_operators(compose):
    for name, service in compose["services"].items():
        for mount in service.get("volumes", []):
            source = mount["source"] if isinstance(mount, dict) else mount.split(":")[0]
            if source.startswith("."):
                if source == "./models":  # FLASHTIER_MODEL_PATH: the operator's checkpoint directory
                    assert name == "flashtier" and "${FLASHTIER_MODEL_PATH:-./models}" in (
                        ROOT / "docker-compose.yml").read_text()
                    continue
                assert (ROOT / source).exists(), f"{name}: {source}"
            else:
                assert source in compose["volumes"], f"{name}: volume {source}"
    for name in SERVERS:
        for env_file in compose["services"][name]["env_file"]:
            assert env_file["required"] is False and (ROOT / (env_file["path"] + ".example")).is_file()
    redis = compose["services"]["redis"]
    assert redis["command"][1] in [m.split(":")[1] for m in redis["volumes"]]


def service_env(compose: dict, image_env: dict[str, str], name: str) -> dict[str, str]:
    return {**image_env, **{k: str(v) for k, v in compose["services"][name]["environment"].items()}}


def test_settings_env_names_and_values_match_the_cli(compose, image_env):
    example = (DEPLOY / "flashtier.env.example").read_text()
    offered = set(re.findall(r"^#? ?(FLASHTIER_[A-Z_]+)=", example, re.M))
    assert offered <= SERVE_ENVS
    stack = set(compose["services"]["flashtier"]["environment"])
    assert {opt.env for opt in OPTIONS if not opt.hidden} <= offered | stack
    for name in SERVERS:
        env = service_env(compose, image_env, name)
        assert {k for k in env if k.startswith("FLASHTIER_")} <= SERVE_ENVS, name
        model_dir = env.pop("FLASHTIER_MODEL_DIR")
        settings = build_settings(None, env)  # every value parses with serve's own parsers
        assert settings.host == "0.0.0.0" and settings.kvstore.redis_url == "redis://redis:6379/0"
        assert settings.kvstore.redis_url.split("//")[1].split(":")[0] in compose["services"]
        mounts = [m["target"] if isinstance(m, dict) else m.split(":")[1] for m in compose["services"][name]["volumes"]]
        assert settings.kvstore.ssd_dir in mounts and settings.cache_dir in mounts
        assert model_dir == ("/models" if name == "flashtier" else "") and (not model_dir or model_dir in mounts)
        grace = compose["services"][name]["stop_grace_period"]
        assert float(grace.removesuffix("s")) > settings.drain_timeout_s + 5, name


def test_operations_doc_lists_every_setting():
    doc = (ROOT / "docs" / "operations.md").read_text()
    missing = sorted(env for env in SERVE_ENVS if f"`{env}`" not in doc and not env.endswith("WEIGHTS_SEED"))
    assert not missing


def test_ports_match_the_server_and_prometheus(compose, image_env):
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in scrape["scrape_configs"] if j["job_name"] == "flashtier")
    host, port = job["static_configs"][0]["targets"][0].split(":")
    for name in SERVERS:
        service = compose["services"][name]
        assert service_env(compose, image_env, name)["FLASHTIER_PORT"] == port
        assert [p.rsplit(":", 1)[1] for p in service["ports"]] == [port]
        assert host == name or host in service.get("networks", {}).get("default", {}).get("aliases", []), name
    gpu, cpu = compose["services"]["flashtier"], compose["services"]["flashtier-cpu"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert "deploy" not in cpu and cpu["environment"]["FLASHTIER_DEVICE"] == "cpu"
    prometheus = compose["services"]["prometheus"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def run_healthcheck(image, port: int) -> int:
    argv = list(image["healthcheck"][-1].value)
    assert argv[0] == "CMD" and argv[1] == "python" and "/health" in argv[-1]
    env = dict(os.environ, FLASHTIER_PORT=str(port))
    return subprocess.run([sys.executable, *argv[2:]], env=env, capture_output=True, timeout=30).returncode


def test_the_healthcheck_passes_on_a_ready_server_only(image, tokenizer):
    with run_server(tokenizer) as server:
        port = int(server.url.rsplit(":", 1)[1])
        assert run_healthcheck(image, port) == 0
        server.engine.ready = False  # loading: /health is 503
        assert run_healthcheck(image, port) != 0
    assert run_healthcheck(image, free_port()) != 0


@pytest.fixture(scope="module")
def tokenizer():
    from flashtier.server.text.tokenizer import Tokenizer

    return Tokenizer()
