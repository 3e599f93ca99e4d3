"""RedisTarget: a parsed ``--redis-url`` (``parse_redis_url``), for RedisSnapshotPool."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

_SCHEMES = {"redis": ("redis", False), "rediss": ("rediss", False), "unix": ("unix", False),
            "redis+cluster": ("redis", True), "rediss+cluster": ("rediss", True)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed ``--redis-url``: the URL redis-py gets, and whether it names a Redis Cluster."""

    url: str  # redis://, rediss:// or unix:// (the "+cluster" suffix removed)
    cluster: bool


def parse_redis_url(url: str) -> RedisTarget:
    """``redis://``, ``rediss://``, ``unix://`` (a server) or ``redis+cluster://`` / ``rediss+cluster://``.

    ValueError, naming the problem, for another scheme, a missing host or socket path, a bad port or a
    cluster URL that selects a database other than 0 (Redis Cluster has only db 0).
    """
    if not isinstance(url, str) or not url:
        raise ValueError(f"redis_url must be a non-empty string, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"redis_url {url!r}: scheme must be one of {sorted(_SCHEMES)}")
    scheme, cluster = _SCHEMES[parts.scheme]
    if scheme == "unix":
        if not parts.path:
            raise ValueError(f"redis_url {url!r}: a unix:// URL needs a socket path")
    else:
        if not parts.hostname:
            raise ValueError(f"redis_url {url!r}: no host")
        try:
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError as exc:
            raise ValueError(f"redis_url {url!r}: {exc}") from None
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"redis_url {url!r}: the path must be a database number, got {db!r}")
        if cluster and db not in ("", "0"):
            raise ValueError(f"redis_url {url!r}: Redis Cluster has only database 0")
    return RedisTarget(scheme + ":" + url.split(":", 1)[1], cluster)  # only the scheme changes
