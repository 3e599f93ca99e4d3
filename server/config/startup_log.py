"""The start-up summary ``flashtier serve`` logs once the engine is up: what runs where, in five lines.

    demo model: ... (or: model /models/X served as [names])
    engine: device cuda:0, dtype bfloat16, HBM pool 81,920 blocks of 64 tokens (70.0 GiB)
    SSD tier: /nvme/kv (budget 2T, lifetime 72h)               (or: off, --no-kv-persist)
    snapshot pool: redis://:***@10.0.0.5:6379/0, TTL 5m         (or: embedded in-process)
    API: http://0.0.0.0:8000/v1 (API key required)

A password in the Redis URL (user info or a ``password=`` query item) is never logged.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from flashtier.server.config.settings import DEMO_PRESET, ServerSettings, demo_note
from flashtier.server.config.options import format_size

__all__ = ["log_startup", "mask_url", "startup_lines"]

logger = logging.getLogger(__name__)

_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/@?#]*)@")
_QUERY_SECRET = re.compile(r"(?i)([?&]password=)[^&#]*")


def mask_url(url: str) -> str:
    """`url` with its password replaced by ``***`` (user info and a ``password=`` query item)."""

    def userinfo(m: re.Match[str]) -> str:
        user, colon, _ = m.group(2).partition(":")
        return f"{m.group(1)}{user}:***@" if colon else f"{m.group(1)}***@"  # a lone item may be a password

    return _QUERY_SECRET.sub(r"\1***", _USERINFO.sub(userinfo, url, count=1))


def _duration(seconds: float) -> str:
    """As --kv-lifetime takes it: 72h, 5m, 90s (days only from a week up)."""
    for unit, scale in (("d", 7 * 86400), ("h", 3600), ("m", 60)):
        if seconds >= scale and seconds % scale == 0:
            return f"{int(seconds // 86400)}d" if unit == "d" else f"{int(seconds // scale)}{unit}"
    return f"{seconds:g}s"


def _engine_line(settings: ServerSettings, engine: Any) -> str:
    """Device, dtype and HBM pool of the engine (the engine-core client describes itself; another client, a
    test double, is reported by what the settings resolve to)."""
    summary = getattr(engine, "engine_summary", None)
    if callable(summary):
        return summary()
    config = settings.engine_config()
    return (f"engine: device {config.device}, dtype {config.dtype}, HBM pool not reported by "
            f"{type(engine).__name__}")


def startup_lines(settings: ServerSettings, engine: Any) -> list[str]:
    """The summary's lines (module doc); reads `engine` without changing it."""
    kv = settings.kvstore
    if settings.is_demo:
        first = demo_note(settings.effective_preset or DEMO_PRESET)
    else:
        first = f"model {settings.model_dir} served as {list(settings.model_names)}"
    ssd = (f"SSD tier: {kv.ssd_dir} (budget {format_size(kv.ssd_budget_bytes)}, lifetime "
           f"{_duration(kv.ssd_lifetime_s)})" if kv.ssd_dir else "SSD tier: off (--no-kv-persist)")
    pool = (f"snapshot pool: {mask_url(kv.redis_url)}" if kv.redis_url else
            "snapshot pool: embedded in-process (no --redis-url)")
    pool = f"{pool}, TTL {_duration(kv.snapshot_ttl_s)}"
    if settings.tensor_parallel_size > 1:
        why = f"off with --tensor-parallel-size {settings.tensor_parallel_size}"
        ssd, pool = f"SSD tier: {why}", f"snapshot pool: {why}"
    auth = "API key required" if settings.api_key else "no API key"
    url = f"http://{settings.host}:{settings.port}/v1"
    return [first, _engine_line(settings, engine), ssd, pool, f"API: {url} ({auth})"]


def log_startup(settings: ServerSettings, engine: Any) -> None:
    """Log ``startup_lines`` at INFO; a summary that cannot be built is one warning, never a failed start."""
    try:
        lines = startup_lines(settings, engine)
    except Exception as exc:  # noqa: BLE001 - a log line must not stop the server
        logger.warning("start-up summary unavailable: %s", exc)
        return
    for line in lines:
        logger.info("%s", line)
