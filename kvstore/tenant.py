"""Tenants: who owns a cached entry, so that one tenant's entries can be found and deleted in every tier.

A request's ``cache_salt`` (the engine puts it into the namespace root of every block hash, block_hash.py)
names its tenant::

    cache_salt                              tenant (``salt_tenant``)        how the server makes the salt
    None                                    None (the default tenant)       no cache_salt (shared isolation)
    "acme"                                  "acme"                          the client's cache_salt (shared)
    "<sha256 hex of the key>\\0<salt>"      "<sha256 hex of the key>"       --cache-isolation per-key

so the tenant is the salt up to its first NUL. A client's own salt is printable (a NUL in it is a 400),
so only the per-key derivation (``api_key_tenant``, the one definition server/serving/state.py's
``tenant_salt`` agrees with) produces a NUL, and every salt a key's clients send stays that key's tenant.

Entries carry the tenant as a 16-byte tag (``tenant_tag``: BLAKE2b of the name, so the SSD records and
the operator's output never hold a salt or a key in clear): SSD records (ssd/record.py), HBM blocks
(block_pool.py). The operator names a tenant by ``--namespace NAME`` (a shared-mode cache_salt, or the
hex an ``--api-key`` maps to) or ``--api-key KEY``; ``parse_tenant`` turns either into the tag.

Pure functions, no state.
"""

from __future__ import annotations

import hashlib

__all__ = ["DEFAULT_TENANT_TAG", "TAG_BYTES", "TENANT_DOMAIN", "api_key_tenant", "salt_tenant", "tenant_tag",
           "tag_of_salt"]

TAG_BYTES = 16
TENANT_DOMAIN = b"flashtier/tenant/v1\x00"  # the domain of the per-key tenant digest (server/serving/state.py)
_TAG_PERSON = b"flashtier/tenant"  # BLAKE2b personalisation (16 bytes)


def api_key_tenant(api_key: str) -> str:
    """The tenant name of an API key under ``--cache-isolation per-key``: ``sha256(TENANT_DOMAIN + key)`` hex.
    ValueError for an empty key."""
    if not isinstance(api_key, str) or not api_key:
        raise ValueError("an API key is a non-empty string")
    return hashlib.sha256(TENANT_DOMAIN + api_key.encode("utf-8")).hexdigest()


def salt_tenant(cache_salt: str | None) -> str | None:
    """The tenant of a request whose engine-side salt is ``cache_salt``: the salt up to its first NUL."""
    if cache_salt is None:
        return None
    return cache_salt.split("\x00", 1)[0]


def tenant_tag(tenant: str | None) -> bytes:
    """The 16-byte tag entries of ``tenant`` carry (None: the default tenant, distinct from every name)."""
    if tenant is not None and not isinstance(tenant, str):
        raise ValueError(f"a tenant is a string or None, got {type(tenant).__name__}")
    data = b"\x00" if tenant is None else b"\x01" + tenant.encode("utf-8")
    return hashlib.blake2b(data, digest_size=TAG_BYTES, person=_TAG_PERSON).digest()


def tag_of_salt(cache_salt: str | None) -> bytes:
    """``tenant_tag(salt_tenant(cache_salt))``: the tag of a request's entries."""
    return tenant_tag(salt_tenant(cache_salt))


DEFAULT_TENANT_TAG = tenant_tag(None)
