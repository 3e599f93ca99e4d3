"""The admin routes: ``POST /admin/v1/tenants/delete`` deletes one tenant from the running server.

Off unless ``--admin-api-key`` is set (every /admin path answers 404 then, as an unknown path does). The
admin key is its own (it cannot be one of the ``--api-key`` keys) and is checked here, not by the API-key
middleware (which guards /v1): ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, compared in constant
time; missing or wrong is a 401 in OpenAI's error shape.

Body: exactly one of ``{"namespace": NS}`` (a shared-mode ``cache_salt``, or the tenant hex a key maps to
under per-key isolation) or ``{"api_key": KEY}`` (the key's tenant under per-key isolation, derived as
the server derives it, kvstore/tenant.py). Anything else is a 400 naming the field.

What is deleted (docs/operations.md, "Deleting a tenant"), in this order:

    HBM prefix cache   the tenant's cached blocks leave the prefix index, on the engine thread between two
                       steps (blocks running requests hold stay theirs, unhashed, free space once freed)
    SSD tier           queued writes dropped, the writer flushed, every segment holding one of its records
                       rewritten without it and fsynced (a worker thread)
    snapshot pool      every snapshot of its namespaces (embedded or Redis, on the tier I/O loop)
    response store     (``api_key`` only) the stored conversations the key owns (owner.py)

The answer counts what each tier removed. The event loop only awaits: the engine-core process (between two
steps, then a thread for the tiers) and the tier I/O loop do the work. Failures: 501 when the engine client
cannot delete while running, 503 when the engine is not running, 500 (with the tier named) when a tier failed; a retry
finishes what is left (each step is idempotent).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from flashtier.engine.client import EngineDeadError, TenantDeletionUnsupported
from flashtier.kvstore.tenant import api_key_tenant
from flashtier.server.http.errors import APIError, BadRequest, NotFound, ServiceUnavailable
from flashtier.server.response_store.owner import response_owner
from flashtier.server.serving.state import get_state

__all__ = ["ADMIN_PREFIX", "router"]

logger = logging.getLogger(__name__)

ADMIN_PREFIX = "/admin"
MAX_NAMESPACE_CHARS = 256  # as cache_salt
router = APIRouter()


def _check_admin(request: Request) -> None:
    """404 when no admin key is configured; 401 unless the request carries it."""
    expected = get_state(request).settings.admin_api_key
    if expected is None:
        raise NotFound(f"{request.url.path} does not exist (the admin routes need --admin-api-key)",
                       code="not_found")
    supplied: str | None = None
    auth = request.headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() == "bearer":
            supplied = token.strip()
    if supplied is None:
        supplied = request.headers.get("x-api-key")
    if supplied is None:
        raise APIError(401, "Missing admin key: send --admin-api-key as `Authorization: Bearer KEY`",
                       code="invalid_api_key")
    if not hmac.compare_digest(supplied.strip().encode("utf-8"), expected.encode("utf-8")):
        raise APIError(401, "Incorrect admin key provided", code="invalid_api_key")


def _tenant_of(body: Any) -> tuple[str, str | None, str]:
    """(tenant name, response owner or None, what the caller named) from the body; BadRequest otherwise."""
    if not isinstance(body, dict):
        raise BadRequest('the body must be a JSON object: {"namespace": NS} or {"api_key": KEY}')
    unknown = sorted(set(body) - {"namespace", "api_key"})
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}; send {{\"namespace\": NS}} or {{\"api_key\": KEY}}",
                         param=unknown[0])
    if ("namespace" in body) == ("api_key" in body):
        raise BadRequest('send exactly one of "namespace" and "api_key"',
                         param="namespace" if "namespace" in body else None)
    if "namespace" in body:
        ns = body["namespace"]
        if not isinstance(ns, str) or not 1 <= len(ns) <= MAX_NAMESPACE_CHARS or not ns.isprintable():
            raise BadRequest(f"namespace must be 1 to {MAX_NAMESPACE_CHARS} printable characters (a cache_salt, "
                             "or the tenant hex of an API key)", param="namespace")
        return ns, None, "namespace"
    key = body["api_key"]
    if not isinstance(key, str) or not key or key != key.strip():
        raise BadRequest("api_key must be a non-empty string without surrounding spaces", param="api_key")
    return api_key_tenant(key), response_owner(key), "api_key"


@router.post(f"{ADMIN_PREFIX}/v1/tenants/delete", include_in_schema=False)
async def delete_tenant(request: Request) -> JSONResponse:
    _check_admin(request)
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else None  # the body middleware capped its size
    except ValueError:
        raise BadRequest("the body is not valid JSON", code="invalid_json") from None
    tenant, owner, named = _tenant_of(body)
    state = get_state(request)
    engine = state.require_engine()
    started = time.monotonic()
    delete = getattr(engine, "delete_tenant", None)
    if delete is None:
        raise APIError(501, "this engine cannot delete a tenant while running", code="not_supported")
    try:
        report = await delete(tenant)
    except TenantDeletionUnsupported as exc:
        raise APIError(501, str(exc), code="not_supported") from None
    except EngineDeadError:
        raise ServiceUnavailable("the engine has stopped; the tenant was not deleted") from None
    except Exception as exc:  # noqa: BLE001 - a tier failed: say which, never a traceback
        logger.exception("deleting a tenant failed")
        raise APIError(500, f"deleting the tenant failed in the KV tiers ({type(exc).__name__}: {exc}); "
                            "what was deleted stays deleted, retry to finish", code="tenant_delete_failed") from None
    responses = None
    if owner is not None and state.response_store is not None:
        try:
            responses = await state.response_store.delete_owner(owner)
        except Exception as exc:  # noqa: BLE001
            logger.exception("deleting a tenant's stored responses failed")
            raise APIError(500, f"the KV tiers were cleared but deleting the stored responses failed "
                                f"({type(exc).__name__}: {exc}); retry", code="tenant_delete_failed") from None
    r = report
    logger.info("tenant %s… deleted (by %s): hbm %d+%d blocks, ssd %d records, %d snapshots, %s responses",
                r.tenant_tag[:12], named, r.hbm_free_blocks, r.hbm_in_use_blocks, r.ssd_records_deleted,
                r.snapshots_deleted, responses)
    return JSONResponse({
        "object": "tenant.deletion",
        "tenant_tag": r.tenant_tag,
        "hbm": {"cached_blocks_dropped": r.hbm_free_blocks, "in_use_blocks_uncached": r.hbm_in_use_blocks},
        "ssd": {"queued_blocks_discarded": r.ssd_queued_discarded, "records_deleted": r.ssd_records_deleted,
                "live_entries_deleted": r.ssd_live_deleted, "bytes_deleted": r.ssd_bytes_deleted,
                "unattributed_bytes_dropped": r.ssd_unattributed_bytes,
                "segments_rewritten": r.ssd_segments_rewritten, "other_records_copied": r.ssd_records_kept},
        "snapshots": {"namespaces": r.snapshot_namespaces, "deleted": r.snapshots_deleted},
        "responses": {"deleted": responses,
                      "note": None if owner is not None else "a namespace deletion leaves stored responses alone"},
        "seconds": round(time.monotonic() - started, 6),
    })
