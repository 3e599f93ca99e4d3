"""Which snapshot namespaces belong to a tenant: what a tenant's deletion removes from the snapshot pool.

Snapshot keys carry the namespace root ``namespace_hash(fingerprint, cache_salt)`` (kvstore/snapshot/key.py),
not the tenant, and the root cannot be inverted. A tenant's namespaces are::

    shared isolation, tenant NS          the salt is NS itself                   computed: namespace_hash(fp, NS)
    per-key, no client salt              the salt is "<hex>\\0"                   computed: namespace_hash(fp, hex + NUL)
    per-key, client salt S               the salt is "<hex>\\0S" (any S)          recorded here as requests arrive
    the default tenant (no salt)         None                                    computed: namespace_hash(fp, None)

each with its ``replayed_namespace`` (where snapshots of replayed states live). Only the third kind needs
memory: one entry per distinct (key, client salt) pair the server has seen since it started. After a
restart such namespaces of an earlier run are unknown; their Redis snapshots expire after --snapshot-ttl.

Not thread-safe: the engine thread owns it (``Engine.add_request`` records, ``Engine.drop_tenant`` reads).
"""

from __future__ import annotations

from flashtier.kvstore.block_hash import BlockHash, namespace_hash, replayed_namespace
from flashtier.kvstore.tenant import salt_tenant, tenant_tag


class TenantNamespaces:
    """tenant tag -> namespace roots of salts that are more than their tenant (per-key client salts)."""

    def __init__(self) -> None:
        self._seen: dict[bytes, set[BlockHash]] = {}

    def record(self, cache_salt: str | None, namespace: BlockHash) -> None:
        """Note ``namespace`` under its tenant when it cannot be computed from the tenant alone. O(1)."""
        if cache_salt is None:
            return
        tenant = salt_tenant(cache_salt)
        if cache_salt in (tenant, tenant + "\x00"):
            return  # computable (see the module doc)
        self._seen.setdefault(tenant_tag(tenant), set()).add(namespace)

    def namespaces(self, fingerprint: str, tenant: str | None) -> frozenset[BlockHash]:
        """Every namespace root of ``tenant`` known here, with their replayed twins."""
        if tenant is None:
            roots = {namespace_hash(fingerprint, None)}
        else:
            roots = {namespace_hash(fingerprint, tenant), namespace_hash(fingerprint, tenant + "\x00")}
        roots |= self._seen.get(tenant_tag(tenant), set())
        return frozenset(roots | {replayed_namespace(ns) for ns in roots})

    def forget(self, tenant: str | None) -> None:
        """Drop what was recorded for ``tenant`` (its deletion ran)."""
        self._seen.pop(tenant_tag(tenant), None)
