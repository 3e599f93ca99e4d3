"""Start-up checks that need the file system or the network, run by ``flashtier serve`` before the model loads.

``preflight(settings)`` raises ``SettingsError`` for a setting the server cannot run with, and returns
warnings for what it can run with, degraded::

    --device                a torch device this machine has
    MODEL_DIR / --preset    the model config resolves (config.json or a known preset)
    --tensor-parallel-size  divides the model's heads, output groups, vocabulary and experts; CUDA sees a
                            device per rank; not with --speculative (the drafter reads the whole head)
    --kv-disk-budget        a segment of the budget (ssd_segment_bytes_for) holds one block record
    --kv-dir                a directory, not a file; not on a kernel file system (/proc, /sys, devtmpfs);
                            not read-only; creatable and writable; not held by another ``serve`` (its
                            KV_DIR/SERVER.LOCK, kv_dir_lock.py: the line names its pid) nor locked by
                            another store (the same non-blocking flock SSDStore takes on KV_DIR/LOCK,
                            released at once)
    memory plan             every rank's GPU and the host hold the plan (plan_check.py: weights, KV pool, graphs,
                            activations, the Engram tables); the line names the flag to change first
    --redis-url             warning when nothing accepts a connection there (snapshots miss, serving goes on)
    --cache-isolation       warning for per-key without --api-key (every request is then one tenant)

The syntax of each value (sizes, URL schemes) is checked earlier, by the option parsers
(config/options.py). ``str(SettingsError)`` is one line: ``--flag VALUE: what is wrong; how to fix``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from flashtier.kvstore.config import KVStoreConfig, ssd_budget_bytes_for
from flashtier.kvstore.ssd.store import make_private_dir
from flashtier.server.config.kv_dir_lock import KVDirInUse, held_by
from flashtier.server.config.plan_check import check_memory_plan
from flashtier.server.config.settings import ServerSettings
from flashtier.server.config.options import format_size

if TYPE_CHECKING:
    from flashtier.engine.model.config import ModelConfig

__all__ = ["REDIS_PROBE_TIMEOUT_S", "SettingsError", "check_device", "check_kv_dir", "check_model",
           "check_parallel", "check_segment_fits", "preflight", "probe_redis"]

REDIS_PROBE_TIMEOUT_S = 0.5
LOCK_NAME = "LOCK"  # the file SSDStore flocks in its directory (kvstore/ssd/store.py)
_VIRTUAL_ROOTS = ("/proc", "/sys")
_VIRTUAL_FS = frozenset({"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs",
                         "securityfs", "pstore", "bpf", "configfs", "fusectl", "mqueue", "binfmt_misc",
                         "efivarfs", "autofs", "nsfs", "rpc_pipefs", "hugetlbfs"})
_NO_SSD = "or run without the SSD tier: --no-kv-persist"


class SettingsError(ValueError):
    """A setting the server cannot start with; ``str()`` is ``FLAG VALUE: problem; fix`` on one line."""

    def __init__(self, flag: str, value: object, problem: str, fix: str) -> None:
        self.flag = flag
        super().__init__(f"{flag} {value}: {problem}; {fix}")


def preflight(settings: ServerSettings) -> list[str]:
    """Every check above; raises ``SettingsError``, returns the warnings (one line each)."""
    kv = settings.kvstore
    check_device(settings.device)
    cfg = check_model(settings)
    check_parallel(settings, cfg)
    if kv.ssd_dir is not None:
        check_kv_dir(kv.ssd_dir)  # first: the record size needs the engine's KV accounting (seconds of imports)
        check_segment_fits(cfg, kv)
    check_memory_plan(settings)  # last: it reads the checkpoint's headers and imports the engine (seconds)
    warnings = []
    if kv.ssd_dir is not None:
        warning = disk_budget_warning(kv.ssd_dir, kv.ssd_budget_bytes)
        if warning is not None:
            warnings.append(warning)
    if kv.redis_url is not None:
        warning = probe_redis(kv.redis_url)
        if warning is not None:
            warnings.append(warning)
    if settings.cache_isolation == "per-key" and not settings.api_key:
        warnings.append("--cache-isolation per-key without --api-key: no request carries a checked key, so "
                        "all requests are one tenant (as with shared); set --api-key to isolate tenants")
    return warnings


def disk_budget_warning(kv_dir: str, budget: int) -> str | None:
    """A warning when --kv-disk-budget exceeds what the SSD tier's file system can give it: its free space plus
    what the tier's own files already hold (they count against the budget). None when it fits."""
    path = os.path.abspath(os.path.expanduser(kv_dir))
    while not os.path.exists(path):  # check_kv_dir creates it; before that, the closest existing parent
        path = os.path.dirname(path)
    free = shutil.disk_usage(path).free
    held = 0
    if os.path.isdir(kv_dir):
        for root, _, files in os.walk(kv_dir):
            held += sum(os.path.getsize(os.path.join(root, f)) for f in files
                        if os.path.isfile(os.path.join(root, f)))
    if budget <= free + held:
        return None
    gib = 1 << 30
    return (f"--kv-disk-budget {format_size(budget)} exceeds the space the SSD tier can have: {free / gib:.1f} GiB "
            f"free where {kv_dir} lives + {held / gib:.1f} GiB of its own files; writes will fail (ENOSPC) before "
            f"the budget is reached: set --kv-disk-budget below the free space")


def check_device(device: str | None) -> None:
    """--device names a torch device this machine has (a CUDA one only when CUDA sees enough devices)."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise SettingsError("--device", device, f"is not a torch device ({exc})", "use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise SettingsError("--device", device, "no CUDA device is visible here",
                                "run on --device cpu (or leave --device unset: cuda when available, else cpu)")
        if (dev.index or 0) >= count:
            raise SettingsError("--device", device, f"CUDA sees {count} device(s) here",
                                f"use cuda:0 to cuda:{count - 1}")


def check_model(settings: ServerSettings) -> ModelConfig:
    """The model's config (MODEL_DIR's config.json, else the preset), read without the weights."""
    from flashtier.engine.model.config import PRESETS, resolve

    if settings.model_dir is None and settings.effective_preset not in PRESETS:
        raise SettingsError("--preset", settings.effective_preset, "is not a known preset",
                            f"choose one of {' | '.join(sorted(PRESETS))}")
    try:
        return resolve(settings.model_dir, settings.effective_preset)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SettingsError("MODEL_DIR", settings.model_dir, f"its config cannot be read ({exc})",
                            "pass a checkpoint directory holding the model's config.json") from None


def check_parallel(settings: ServerSettings, cfg: ModelConfig) -> None:
    """--tensor-parallel-size / --expert-parallel fit the model and the machine (nothing to check at 1)."""
    tp = settings.tensor_parallel_size
    if tp == 1:
        return
    if settings.speculative:
        raise SettingsError("--speculative", settings.speculative, f"cannot run with --tensor-parallel-size {tp} "
                            "(the DSpark drafter reads the whole vocabulary head)",
                            "turn it off (--speculative off) or serve on one rank")
    try:
        settings.parallel_config().validate_for(cfg)
    except ValueError as exc:
        raise SettingsError("--tensor-parallel-size", tp, f"{cfg.name} cannot be split over {tp} ranks ({exc})",
                            "pick a size that divides it") from None
    device = settings.engine_config().device
    import torch

    if torch.device(device).type == "cuda":
        if torch.device(device).index is not None:
            raise SettingsError("--device", device, f"names one GPU, but --tensor-parallel-size {tp} runs rank r "
                                "on cuda:r", "pass --device cuda (CUDA_VISIBLE_DEVICES picks the GPUs)")
        count = torch.cuda.device_count()
        if count < tp:
            raise SettingsError("--tensor-parallel-size", tp, f"needs {tp} GPUs, CUDA sees {count} here",
                                f"use at most {count}, or --device cpu")


def check_segment_fits(cfg: ModelConfig, kv: KVStoreConfig) -> None:
    """The model's block record (header + block bytes at --block-size) must fit one SSD segment."""
    from flashtier.engine.kv.accounting import kv_accounting
    from flashtier.kvstore.ssd.record import HEADER_BYTES

    record = HEADER_BYTES + kv_accounting(cfg, kv.block_size).block_bytes
    if record > kv.ssd_segment_bytes:
        need = format_size(-(-ssd_budget_bytes_for(record) // (1 << 20)) << 20)
        raise SettingsError(
            "--kv-disk-budget", format_size(kv.ssd_budget_bytes),
            f"its SSD segments ({format_size(kv.ssd_segment_bytes)}) cannot hold one block record ({record} B "
            f"at --block-size {kv.block_size})", f"raise --kv-disk-budget to at least {need}, lower --block-size, "
            f"{_NO_SSD}")


def _unescape_mount(field: str) -> str:
    """/proc/self/mounts writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _mount_of(path: Path) -> tuple[str, str, set[str]] | None:
    """(mount point, file system type, options) of the mount holding existing `path`; None if unknown."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    target, best = str(path), None
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        point = _unescape_mount(fields[1])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):  # a later mount over the same point wins
            best = (point, fields[2], set(fields[3].split(",")))
    return best


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _os_problem(exc: OSError) -> str:
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def check_kv_dir(kv_dir: str) -> None:
    """SettingsError unless an SSDStore could open `kv_dir` now (creates the directory, as the store would)."""
    path = Path(os.path.abspath(os.path.expanduser(kv_dir)))
    fix = f"pass a writable directory on a local disk with --kv-dir, {_NO_SSD}"
    if path.exists() and not path.is_dir():
        raise SettingsError("--kv-dir", path, "is a file, not a directory", f"pass a directory (it is created "
                            f"when missing), {_NO_SSD}")
    existing = _nearest_existing(path)
    if not existing.is_dir():
        raise SettingsError("--kv-dir", path, f"cannot be created: {existing} is a file", fix)
    real = existing.resolve()
    mount = _mount_of(real)
    virtual = any(str(real) == root or str(real).startswith(root + "/") for root in _VIRTUAL_ROOTS)
    if virtual or (mount is not None and mount[1] in _VIRTUAL_FS):
        kind = f"the kernel's {mount[1]} file system" if mount is not None else "a kernel file system"
        raise SettingsError("--kv-dir", path, f"is on {kind} ({mount[0] if mount else real}), which holds no "
                            "files", fix)
    if mount is not None and "ro" in mount[2]:
        raise SettingsError("--kv-dir", path, f"is on a read-only file system (mounted at {mount[0]})", fix)
    try:
        make_private_dir(path)  # 0700, as the store creates it (a 0755 one would get the store's warning)
        holder = held_by(path)  # a running `serve` (also before its store took LOCK): name its pid
        if holder is not None:
            raise KVDirInUse(path, holder)
        fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        problem = ("is on a read-only file system" if exc.errno == errno.EROFS
                   else f"cannot be created or written ({_os_problem(exc)})")
        raise SettingsError("--kv-dir", path, problem, fix) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SettingsError("--kv-dir", path, f"is in use by another running flashtier server (it holds "
                            f"{path / LOCK_NAME})", "stop that server, or give this one its own --kv-dir") from None
    except OSError as exc:
        raise SettingsError("--kv-dir", path, f"cannot be locked ({_os_problem(exc)})", fix) from None
    finally:
        os.close(fd)  # releases the flock: the store takes it again when the engine starts
    if not os.access(path, os.W_OK | os.X_OK):
        raise SettingsError("--kv-dir", path, "is not writable by this user", fix)


def probe_redis(url: str, timeout_s: float = REDIS_PROBE_TIMEOUT_S) -> str | None:
    """A warning line when no Redis answers at `url` within `timeout_s`, else None.

    Connects (TCP or unix socket) and, except for TLS (rediss://), sends PING and expects any RESP reply
    (+PONG, or an error such as -NOAUTH: a Redis that wants a password still counts as there), so a proxy
    that accepts every connection is not mistaken for Redis. The URL must already be valid (the
    --redis-url parser checked it with ``parse_redis_url``).
    """
    from urllib.parse import urlsplit

    from flashtier.kvstore.snapshot.redis_pool import parse_redis_url

    parts = urlsplit(parse_redis_url(url).url)
    unix = parts.scheme == "unix"
    where = f"unix://{parts.path}" if unix else f"{urlsplit(url).scheme}://{parts.hostname}:{parts.port or 6379}"
    try:
        if unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            sock.connect(parts.path)
        else:
            sock = socket.create_connection((parts.hostname, parts.port or 6379), timeout=timeout_s)
        with sock:
            if parts.scheme == "rediss":
                return None  # a TLS handshake is more than a probe should do
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            reply = sock.recv(64)
    except OSError as exc:
        reason = f"no answer within {timeout_s:g} s" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
    else:
        if reply[:1] in (b"+", b"-"):
            return None
        reason = "something accepted the connection but did not answer PING like Redis"
    return (f"--redis-url {where}: no Redis there ({reason}); serving goes on, SWA snapshots miss (bounded "
            "replay) until Redis is reachable")
