"""Bad settings stop `flashtier serve` before the model loads: one line ``flashtier: error: --flag VALUE: what is
wrong; how to fix``, exit status 2, no traceback (real `python -m flashtier.server.cli serve` processes, with the
cache directory in tmp_path: that no demo checkpoint appears there shows the model was never loaded). The
checks themselves (config/checks.py) are also called directly, for what a process cannot show cheaply: a
read-only mount, the Redis probe against a real redis-server.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from flashtier.kvstore.config import KVStoreConfig
from flashtier.kvstore.ssd.store import SSDStore
from flashtier.server.config import checks as settings_checks
from flashtier.server.config.settings import ServerSettings, build_settings
from flashtier.server.config.checks import SettingsError, check_kv_dir, preflight, probe_redis
from ..kvstore.redis_server import RedisServer, free_port


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHTIER_")}
    env["FLASHTIER_CACHE_DIR"] = str(tmp_path / "cache")
    return subprocess.run([sys.executable, "-m", "flashtier.server.cli", "serve", "--port", "0", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def _assert_one_line(proc: subprocess.CompletedProcess, tmp_path: Path, flag: str, *needles: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and not proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith(f"flashtier: error: {flag}"), line
    for needle in needles:
        assert needle in line, line
    assert not (tmp_path / "cache" / "models").exists()  # failed before the demo checkpoint was written
    return line


@pytest.mark.parametrize(("args", "flag", "needles"), [
    (("--kv-dir", "{file}"), "--kv-dir", ("is a file, not a directory", "--no-kv-persist")),
    (("--kv-dir", "{file}/kv"), "--kv-dir", ("cannot be created", "is a file")),
    (("--kv-dir", "/proc/flashtier-kv"), "--kv-dir", ("kernel's proc file system", "local disk")),
    (("--kv-dir", "/sys/flashtier-kv"), "--kv-dir", ("kernel",)),
    (("--redis-url", "http://127.0.0.1:6379"), "--redis-url", ("scheme must be one of", "redis://", "rediss://",
                                                              "redis+cluster://")),
    (("--kv-disk-budget", "100K"), "--kv-disk-budget", ("below the smallest SSD budget, 1M", "at least 1M",
                                                        "--no-kv-persist")),
    (("--kv-disk-budget", "2M", "--block-size", "2048", "--preset", "v4.1-flash"), "--kv-disk-budget 2M",
     ("cannot hold one block record", "raise --kv-disk-budget to at least", "--block-size")),
    (("--block-size", "60"), "--block-size", ("multiple of 8",)),
    (("--preset", "nope"), "--preset nope", ("choose one of", "tiny")),
    (("--cache-isolation", "per-tenant"), "--cache-isolation", ("shared | per-key",)),
    (("--api-key", ""), "--api-key", ("one or more",)),
    (("--device", "tpu-ish"), "--device tpu-ish", ("is not a torch device", "use cpu, cuda or cuda:N")),
    (("--device", "cuda:97"), "--device cuda:97", ("--device cpu",) if not torch.cuda.is_available() else
     ("CUDA sees",)),
])
def test_bad_setting_is_one_line_and_exit_2(tmp_path, args, flag, needles):
    (tmp_path / "file").write_text("not a directory")
    args = tuple(a.format(file=tmp_path / "file") for a in args)
    _assert_one_line(_serve(tmp_path, *args), tmp_path, flag, *needles)


def test_kv_dir_locked_by_a_running_store(tmp_path):
    kv_dir = tmp_path / "kv"
    with SSDStore(KVStoreConfig(ssd_dir=str(kv_dir), ssd_budget_bytes=8 << 20, ssd_segment_bytes=1 << 20)):
        line = _assert_one_line(_serve(tmp_path, "--kv-dir", str(kv_dir)), tmp_path, "--kv-dir",
                                "in use by another running flashtier server", "its own --kv-dir")
        assert str(kv_dir / "LOCK") in line
    check_kv_dir(str(kv_dir))  # the store closed: free again


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_kv_dir_without_write_permission(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o555)
    try:
        _assert_one_line(_serve(tmp_path, "--kv-dir", str(parent / "kv")), tmp_path, "--kv-dir",
                         "cannot be created or written")
    finally:
        parent.chmod(0o755)


def test_check_kv_dir_creates_and_releases(tmp_path):
    kv_dir = tmp_path / "a" / "b"
    check_kv_dir(str(kv_dir))
    assert kv_dir.is_dir() and (kv_dir / "LOCK").is_file()
    fd = os.open(kv_dir / "LOCK", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the check let go of it
        with pytest.raises(SettingsError, match="in use by another running flashtier server"):
            check_kv_dir(str(kv_dir))
    finally:
        os.close(fd)


def test_read_only_file_system_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(settings_checks, "_mount_of", lambda path: ("/data", "ext4", {"ro", "relatime"}))
    with pytest.raises(SettingsError) as info:
        check_kv_dir(str(tmp_path / "kv"))
    assert str(info.value).startswith(f"--kv-dir {tmp_path / 'kv'}: is on a read-only file system (mounted at /data)")
    assert not (tmp_path / "kv").exists()

    def erofs(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(settings_checks, "_mount_of", lambda path: None)  # /proc/self/mounts unreadable
    monkeypatch.setattr(Path, "mkdir", erofs)
    with pytest.raises(SettingsError, match=r"--kv-dir .*: is on a read-only file system; pass a writable"):
        check_kv_dir(str(tmp_path / "kv"))


def test_preflight_passes_good_settings(tmp_path):
    s = build_settings(None, {}, kv_dir=str(tmp_path / "kv"), kv_disk_budget=1 << 20)
    assert s.kvstore.ssd_segment_bytes == 1 << 20  # a small budget gets small segments
    assert preflight(s) == []
    assert preflight(build_settings(None, {}, kv_persist=False)) == []


def test_per_key_without_api_key_warns(tmp_path):
    s = build_settings(None, {}, kv_persist=False, cache_isolation="per-key")
    (warning,) = preflight(s)
    assert warning.startswith("--cache-isolation per-key without --api-key")
    assert preflight(ServerSettings(api_key=("k",), cache_isolation="per-key",
                                    kvstore=KVStoreConfig(ssd_dir=None))) == []


def _fake_server_reply(reply: bytes | None, timeout_s: float = 0.3) -> str | None:
    """probe_redis against a loopback listener that answers `reply` to anything (None: stays silent)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        accepted: list[socket.socket] = []

        def serve() -> None:
            conn = listener.accept()[0]
            accepted.append(conn)
            if reply is not None:
                conn.recv(64)
                conn.sendall(reply)

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            return probe_redis(f"redis://127.0.0.1:{port}", timeout_s=timeout_s)
        finally:
            thread.join(5)
            for conn in accepted:
                conn.close()


def test_redis_probe():
    dead = free_port()
    warning = probe_redis(f"redis://127.0.0.1:{dead}/0")
    assert warning.startswith(f"--redis-url redis://127.0.0.1:{dead}: no Redis there (")
    assert "serving goes on" in warning and "\n" not in warning
    assert probe_redis(f"redis+cluster://127.0.0.1:{dead}").startswith("--redis-url redis+cluster://")
    assert "No such file" in probe_redis("unix:///nonexistent/redis.sock")
    with RedisServer() as redis:
        assert probe_redis(redis.url) is None
    assert _fake_server_reply(b"-NOAUTH Authentication required.\r\n") is None  # a Redis wanting a password
    assert "no answer within 0.3 s" in _fake_server_reply(None)  # a proxy that accepts everything
    assert "did not answer PING like Redis" in _fake_server_reply(b"HTTP/1.1 400 Bad Request\r\n\r\n")


def test_a_disk_budget_above_the_free_space_is_a_warning_with_both_figures(tmp_path):
    from flashtier.server.config.checks import disk_budget_warning

    free = shutil.disk_usage(tmp_path).free
    assert disk_budget_warning(str(tmp_path / "kv"), free // 2) is None
    warning = disk_budget_warning(str(tmp_path / "kv"), free * 4)
    assert warning is not None and warning.startswith("--kv-disk-budget ") and " GiB free where " in warning
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "segment-0").write_bytes(b"x" * 4096)  # the tier's own files count for it
    assert disk_budget_warning(str(tmp_path / "kv"), shutil.disk_usage(tmp_path).free + 2048) is None
