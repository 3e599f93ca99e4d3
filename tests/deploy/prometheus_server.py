"""PrometheusServer: a real ``prometheus`` process (Debian's package) on a free 127.0.0.1 port, for tests.

It runs the deploy/prometheus/prometheus.yml of the stack with what a test must change: the scrape and
evaluation intervals (1 s, so a test sees rates within seconds), the targets (the test's server and this
Prometheus, both on loopback) and the rule file's path (absolute). ``stop()`` ends exactly the process it
started, by pid. A missing binary fails with an install hint instead of skipping.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from ..kvstore.redis_server import free_port
from .promql_queries import DEPLOY

STACK_TARGETS = {"flashtier": "flashtier:8000", "prometheus": "localhost:9090"}  # job -> target in the file


def rewritten_config(flashtier_target: str, prometheus_target: str) -> dict:
    """deploy/prometheus/prometheus.yml with the test's intervals, targets and rule path."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / "prometheus" / name) for name in config["rule_files"]]
    new = {"flashtier": flashtier_target, "prometheus": prometheus_target}
    for job in config["scrape_configs"]:
        targets = job["static_configs"][0]["targets"]
        assert targets == [STACK_TARGETS[job["job_name"]]], f"prometheus.yml targets changed: {targets}"
        job["static_configs"][0]["targets"] = [new[job["job_name"]]]
    return config


class PrometheusServer:
    def __init__(self, workdir: Path) -> None:
        self.binary = shutil.which("prometheus")
        if self.binary is None:
            raise RuntimeError("prometheus not found on PATH: install Debian's prometheus package (make system)")
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, flashtier_target: str, timeout_s: float = 60.0) -> PrometheusServer:
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(rewritten_config(flashtier_target, f"127.0.0.1:{self.port}")))
        self.log = open(self.workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("prometheus did not become ready")

    def query(self, expr: str) -> list[dict]:
        """The instant vector (or scalar, as one sample) of ``expr`` now; AssertionError on a query error."""
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body.get('error', body)}"
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def wait_for(self, expr: str, predicate, timeout_s: float = 60.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr}: still {result} after {timeout_s} s")
            time.sleep(0.25)

    def rules(self) -> list[dict]:
        body = httpx.get(self.url + "/api/v1/rules", timeout=30).json()
        return [rule for group in body["data"]["groups"] for rule in group["rules"]]

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.log.close()
