"""Settings from flags and FLASHTIER_* variables, and `flashtier serve` as a process (start-up, SIGTERM drain)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from flashtier.server.cli import build_parser
from flashtier.server.config.settings import DEMO_NOTE, OPTIONS, build_settings
from .scripted_engine import SCRIPTED_SERVE_ARGV


def _ns(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_are_the_demo():
    s = build_settings(_ns(), {"XDG_CACHE_HOME": "/xdg"})
    assert (s.host, s.port, s.api_key, s.log_level) == ("127.0.0.1", 8000, (), "info")
    assert s.is_demo and s.effective_preset == "tiny" and s.model_names == ("flashtier-tiny",)
    assert s.kvstore.block_size == 64 and s.kvstore.enable_prefix_caching
    # persistence is on by default, in the cache directory; --no-kv-persist turns the SSD tier off
    assert s.cache_dir == "/xdg/flashtier" and s.kvstore.ssd_dir == "/xdg/flashtier/kv/demo-tiny"
    assert s.kvstore.ssd_lifetime_s == 72 * 3600 and s.kvstore.snapshot_ttl_s == 300
    assert build_settings(_ns("--no-kv-persist"), {}).kvstore.ssd_dir is None
    # each demo preset its own SSD tier: a flash-16e server never reads or evicts the tiny demo's KV
    s16 = build_settings(_ns("--preset", "flash-16e"), {"XDG_CACHE_HOME": "/xdg"})
    assert s16.kvstore.ssd_dir == "/xdg/flashtier/kv/demo-flash-16e"


def test_tier_flags_parse_sizes_and_durations(tmp_path):
    s = build_settings(_ns("--kv-dir", str(tmp_path), "--kv-disk-budget", "64M", "--kv-lifetime", "2h",
                           "--snapshot-ttl", "90s", "--redis-url", "redis://127.0.0.1:1/0"), {})
    kv = s.kvstore
    assert kv.ssd_dir == str(tmp_path) and kv.ssd_budget_bytes == 64 << 20 and kv.ssd_lifetime_s == 7200
    assert kv.snapshot_ttl_s == 90 and kv.redis_url == "redis://127.0.0.1:1/0"
    assert kv.ssd_segment_bytes <= kv.ssd_budget_bytes
    s = build_settings(_ns(), {"FLASHTIER_KV_LIFETIME": "3d", "FLASHTIER_KV_DISK_BUDGET": "1GiB"})
    assert s.kvstore.ssd_lifetime_s == 3 * 86400 and s.kvstore.ssd_budget_bytes == 1 << 30
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-lifetime", "soon"])
    assert s.max_model_len is None


def test_environment_and_flag_precedence(tmp_path):
    env = {"FLASHTIER_PORT": "9001", "FLASHTIER_API_KEY": "k1, k2", "FLASHTIER_PREFIX_CACHING": "off",
           "FLASHTIER_KV_DIR": str(tmp_path), "FLASHTIER_SERVED_MODEL_NAME": "flash",
           "FLASHTIER_MAX_MODEL_LEN": "4096", "FLASHTIER_DEFAULT_THINKING": "yes", "FLASHTIER_MODEL_DIR": str(tmp_path)}
    s = build_settings(_ns(), env)
    assert s.port == 9001 and s.api_key == ("k1", "k2") and s.served_model_name == ("flash",)
    assert not s.kvstore.enable_prefix_caching and s.kvstore.ssd_dir == str(tmp_path)
    assert s.max_model_len == 4096 and s.default_thinking and s.model_dir == str(tmp_path) and not s.is_demo
    s = build_settings(_ns("--port", "9002", "--api-key", "flag", "--prefix-caching", "--served-model-name", "a",
                           "b"), env)
    assert s.port == 9002 and s.api_key == ("flag",) and s.kvstore.enable_prefix_caching
    assert s.model_names == ("a", "b")


def test_list_options_repeat_and_split_on_commas():
    s = build_settings(_ns("--api-key", "k1,k2", "--api-key", "k3", "k1", "--served-model-name", "a, b"), {})
    assert s.api_key == ("k1", "k2", "k3") and s.served_model_name == ("a", "b")
    assert build_settings(_ns(), {"FLASHTIER_API_KEY": "k1,,k2,"}).api_key == ("k1", "k2")
    with pytest.raises(SystemExit):
        _ns("--api-key", " , ")  # `--api-key "$UNSET"` must not start an open server


def test_cache_isolation_and_small_budgets():
    assert build_settings(_ns(), {}).cache_isolation == "shared"
    assert build_settings(_ns("--cache-isolation", "per-key"), {}).cache_isolation == "per-key"
    assert build_settings(_ns(), {"FLASHTIER_CACHE_ISOLATION": "PER-KEY"}).cache_isolation == "per-key"
    for budget, segment in (("1M", 1 << 20), ("3M", 1 << 20), ("64M", 8 << 20), ("1T", 256 << 20)):
        kv = build_settings(_ns("--kv-disk-budget", budget), {}).kvstore
        assert kv.ssd_segment_bytes == segment, budget
    with pytest.raises(SystemExit):
        _ns("--kv-disk-budget", "1023K")


def test_model_dir_names_the_model(tmp_path):
    model_dir = tmp_path / "DeepSeek-V4.1-Flash"
    model_dir.mkdir()
    s = build_settings(_ns(str(model_dir)), {})
    assert s.model_names == ("DeepSeek-V4.1-Flash",) and not s.is_demo and s.effective_preset is None


def test_bad_values_name_their_source(capsys):
    with pytest.raises(ValueError, match="FLASHTIER_PORT"):
        build_settings(_ns(), {"FLASHTIER_PORT": "http"})
    with pytest.raises(ValueError, match="FLASHTIER_PREFIX_CACHING"):
        build_settings(_ns(), {"FLASHTIER_PREFIX_CACHING": "maybe"})
    with pytest.raises(ValueError, match="FLASHTIER_BLOCK_SIZE.*multiple of 8"):
        build_settings(_ns(), {"FLASHTIER_BLOCK_SIZE": "60"})
    with pytest.raises(ValueError, match="FLASHTIER_REDIS_URL.*scheme must be one of"):
        build_settings(_ns(), {"FLASHTIER_REDIS_URL": "http://127.0.0.1:6379"})
    with pytest.raises(ValueError, match="FLASHTIER_CACHE_ISOLATION"):
        build_settings(_ns(), {"FLASHTIER_CACHE_ISOLATION": "tenant"})
    with pytest.raises(SystemExit):
        _ns("--block-size", "60")
    err = capsys.readouterr().err
    assert err == "flashtier: error: --block-size: must be a positive multiple of 8 (e.g. 64), got 60\n"
    with pytest.raises(ValueError, match="not a directory"):
        build_settings(_ns("/nonexistent/model"), {})
    with pytest.raises(SystemExit):
        _ns("--port", "70000")
    err = capsys.readouterr().err
    assert err == "flashtier: error: --port: a port must be in [0, 65535], got 70000\n"  # one line, no usage


def test_every_option_has_a_flag_and_a_variable():
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # noqa: SLF001
    for opt in OPTIONS:
        assert opt.env == "FLASHTIER_" + opt.flag[2:].upper().replace("-", "_")
        if not opt.hidden:
            assert opt.flag in help_text and opt.env in help_text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scripted_serve_command() -> list[str]:
    """`flashtier serve` in front of the scripted engine (tests/server/scripted_serve.py)."""
    return list(SCRIPTED_SERVE_ARGV)


def test_serve_process_drains_on_sigterm(tmp_path):
    port, dead = _free_port(), _free_port()
    env = {**os.environ, "FLASHTIER_PORT": str(port), "FLASHTIER_DRAIN_TIMEOUT": "20",
           "FLASHTIER_CACHE_DIR": str(tmp_path / "cache"),
           # a budget this machine's disk holds: the default 512G on a smaller disk is a (right) start-up warning
           "FLASHTIER_KV_DISK_BUDGET": "1G"}
    # nothing listens on the Redis port: one warning line, and the server starts anyway
    proc = subprocess.Popen([*_scripted_serve_command(), "--redis-url", f"redis://127.0.0.1:{dead}/0"], cwd=tmp_path,
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        models = httpx.get(url + "/v1/models").json()
        assert models["data"][0]["flashtier"]["demo"] is True

        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 40}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        reader.join(30)
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its graceful exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = proc.stdout.read()
    assert events[-1] == "[DONE]", events[-3:]
    finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert finishes == ["length"]  # the in-flight stream completed during the drain
    assert DEMO_NOTE in output
    warnings = [line for line in output.splitlines() if "--redis-url" in line and "WARNING" in line]
    assert len(warnings) == 1 and re.fullmatch(
        rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}} WARNING flashtier.server.config.settings: --redis-url "
        rf"redis://127.0.0.1:{dead}: no Redis there .*", warnings[0]), output
    # one format for every line, uvicorn's included; the demo note is information, not a warning
    log_lines = [line for line in output.splitlines() if line.strip()]
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ \S+: ", line) for line in log_lines), output
    assert any(" INFO uvicorn.access: " in line and '"GET /health HTTP/1.1" 200' in line for line in log_lines)
    assert [line for line in log_lines if DEMO_NOTE in line] == [
        line for line in log_lines if DEMO_NOTE in line and " INFO flashtier.server.config.startup_log: " in line]
    assert sum(DEMO_NOTE in line for line in log_lines) == 1
    assert [line for line in log_lines if " WARNING " in line] == warnings  # the demo itself warns of nothing
    assert any(f"API: http://127.0.0.1:{port}/v1 (no API key)" in line for line in log_lines)
    assert any("snapshot pool: redis://127.0.0.1:" in line for line in log_lines)
    assert "Traceback" not in output
    assert "stopping the engine" in output


def test_engine_config_is_built_here(tmp_path):
    s = build_settings(_ns("--max-num-seqs", "8", "--max-waiting-requests", "3", "--device", "cpu",
                           "--max-model-len", "2048", "--max-num-batched-tokens", "256"), {})
    cfg = s.engine_config()
    assert (cfg.model_dir, cfg.preset, cfg.device, cfg.dtype) == (None, "tiny", "cpu", "float32")
    assert (cfg.max_num_seqs, cfg.max_waiting, cfg.max_model_len, cfg.max_num_batched_tokens) == (8, 3, 2048, 256)
    cfg = build_settings(_ns("--device", "cuda:1", "--dtype", "float64"), {}).engine_config()
    assert (cfg.device, cfg.dtype) == ("cuda:1", "float64")
    assert build_settings(_ns("--device", "cuda"), {}).engine_config().dtype == "bfloat16"
