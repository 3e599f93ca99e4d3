"""``POST /admin/v1/tenants/delete`` on a real server (`flashtier serve`, the demo model in float64, an SSD
directory, a real redis-server on loopback, per-key isolation): tenant A's KV leaves the HBM prefix cache,
the SSD files, the snapshot pool and its stored responses, while tenant B keeps every hit. The admin key's
401s and 400s, and the 404 of a server without an admin key, are checked in process."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from flashtier.engine.model.loader import demo_checkpoint
from flashtier.kvstore.snapshot.key import SnapshotKey
from flashtier.kvstore.tenant import api_key_tenant, tenant_tag

from ..kvstore.redis_server import RedisServer
from .conftest import run_server
from .test_api_tiers import BS, Server, _chunk
from ..kvstore.ssd_store_support import ssd_payloads

ADMIN = "admin-secret"
KEYS = {"a": "key-a", "b": "key-b"}
MARKER = "MARKER-tenant-a-7c1e"


def files_holding(kv_dir: Path, needle: bytes) -> list[Path]:
    return [p for p in kv_dir.rglob("*") if p.is_file() and needle in p.read_bytes()]


def wait_for(what: str, check, timeout: float = 60.0):
    """Poll ``check()`` until it returns something truthy (the writer's fsync, an async snapshot put)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def cached(got: dict) -> tuple[int, int, int, int]:
    usage = got["usage"]
    t = usage["flashtier"]["cached_tokens_by_tier"]
    return usage["prompt_tokens_details"]["cached_tokens"], t["hbm"], t["ssd"], t["snapshot"]


def snapshot_namespaces(client) -> dict[str, int]:
    out: dict[str, int] = {}
    for raw in client.scan_iter(match="ft:snap:*", count=1000):
        ns = SnapshotKey.parse(raw.decode()).namespace.hex()
        out[ns] = out.get(ns, 0) + 1
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("admin-cache")
    demo_checkpoint(path / "models")
    return path


@pytest.mark.slow
def test_delete_tenant_route_clears_every_tier_for_a_and_keeps_b(cache_dir, tmp_path):
    kv = tmp_path / "kv"
    head = {t: {"authorization": f"Bearer {k}"} for t, k in KEYS.items()}
    admin = {"authorization": f"Bearer {ADMIN}"}
    tag_a, tag_b = (tenant_tag(api_key_tenant(KEYS[t])) for t in "ab")
    with RedisServer() as redis:
        srv = Server(cache_dir, "--kv-dir", str(kv), "--redis-url", redis.url, "--api-key", "key-a,key-b",
                     "--cache-isolation", "per-key", "--admin-api-key", ADMIN)
        try:
            prompt = {"a": _chunk(300, seed=41), "b": _chunk(300, seed=42)}
            full = len(prompt["a"]) // BS * BS
            for t in "ab":
                assert cached(srv.complete(prompt[t], max_tokens=2, headers=head[t]))[0] == 0
            stored = {}
            for t in "ab":
                r = httpx.post(srv.url + "/v1/responses", headers=head[t], timeout=600, json={
                    "model": "flashtier-tiny", "input": f"{MARKER}-{t}", "max_output_tokens": 2, "store": True})
                assert r.status_code == 200, r.text
                stored[t] = r.json()["id"]
            # both tenants' records are fsynced and their snapshots stored before the deletion
            on_disk = wait_for("both tenants' SSD records", lambda: (
                p if len(p.get(tag_a, ())) >= full // BS and len(p.get(tag_b, ())) >= full // BS else None)
                if (p := ssd_payloads(kv)) is not None else None)
            ns_before = wait_for("snapshots of both tenants", lambda: (
                s if len(s) >= 2 else None) if (s := snapshot_namespaces(redis.client())) is not None else None)
            hit = {t: cached(srv.complete(prompt[t], max_tokens=2, headers=head[t])) for t in "ab"}
            assert hit["a"][0] >= full and hit["b"][0] >= full  # both hit now: the checks below can fail

            started = time.monotonic()
            r = httpx.post(srv.url + "/admin/v1/tenants/delete", headers=admin, json={"api_key": KEYS["a"]},
                           timeout=120)
            took = time.monotonic() - started
            assert r.status_code == 200, r.text
            rep = r.json()
            print(f"\ndeletion: {took * 1000:.0f} ms over HTTP; report {rep}")
            assert rep["tenant_tag"] == tag_a.hex()
            assert rep["hbm"]["cached_blocks_dropped"] >= full // BS
            assert rep["ssd"]["records_deleted"] >= len(on_disk[tag_a]) and rep["ssd"]["segments_rewritten"] >= 1
            assert rep["snapshots"]["deleted"] >= 1 and rep["responses"]["deleted"] == 1

            # SSD: none of A's KV bytes in any file; B's are all still there
            after = ssd_payloads(kv)
            assert tag_a not in after
            for payload in on_disk[tag_a]:
                assert files_holding(kv, payload) == []
            assert on_disk[tag_b] <= after[tag_b]
            assert files_holding(kv, MARKER.encode()) == []
            # snapshots: A's namespaces are gone from Redis, B's are untouched
            ns_after = snapshot_namespaces(redis.client())
            gone = set(ns_before) - set(ns_after)
            assert gone and sum(ns_before[n] for n in gone) == rep["snapshots"]["deleted"]
            assert all(ns_after[n] == ns_before[n] for n in ns_after)
            # stored responses: A's is gone, B's is there
            assert httpx.get(f"{srv.url}/v1/responses/{stored['a']}", headers=head["a"]).status_code == 404
            assert httpx.get(f"{srv.url}/v1/responses/{stored['b']}", headers=head["b"]).status_code == 200
            # the next identical requests: A is cold in every tier, B hits as before
            assert cached(srv.complete(prompt["a"], max_tokens=2, headers=head["a"])) == (0, 0, 0, 0)
            assert cached(srv.complete(prompt["b"], max_tokens=2, headers=head["b"])) == hit["b"]

            # the route's errors on the same server
            url = srv.url + "/admin/v1/tenants/delete"
            r = httpx.post(url, json={"api_key": KEYS["a"]})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = httpx.post(url, json={"api_key": KEYS["a"]}, headers=head["a"])  # a tenant key is not the admin's
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        finally:
            srv.stop()


@pytest.mark.parametrize(("body", "param"), [
    ({}, None), ({"namespace": "x", "api_key": "k"}, "namespace"), ({"namespace": ""}, "namespace"),
    ({"namespace": "a\x00b"}, "namespace"), ({"api_key": 7}, "api_key"), ({"tenant": "x"}, "tenant"), ([], None),
])
def test_bad_bodies_are_400_in_the_error_shape(tokenizer, body, param):
    with run_server(tokenizer, admin_api_key=ADMIN) as srv:
        r = httpx.post(srv.url + "/admin/v1/tenants/delete", json=body,
                       headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param


def test_admin_key_checks_and_the_404_without_one(tokenizer):
    with run_server(tokenizer, admin_api_key=ADMIN, api_key=("user-key",)) as srv:
        url = srv.url + "/admin/v1/tenants/delete"
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Bearer user-key"},
                        {"x-api-key": "wrong"}):
            r = httpx.post(url, json={"namespace": "acme"}, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        # the scripted engine cannot delete: a clear 501, not a traceback (the admin key was accepted)
        r = httpx.post(url, json={"namespace": "acme"}, headers={"x-api-key": ADMIN})
        assert r.status_code == 501 and r.json()["error"]["code"] == "not_supported"
    with run_server(tokenizer) as srv:
        r = httpx.post(srv.url + "/admin/v1/tenants/delete", json={"namespace": "acme"},
                       headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 404 and "error" in r.json()


def test_admin_key_must_differ_from_the_api_keys():
    from flashtier.server.config.settings import build_settings

    with pytest.raises(ValueError, match="--admin-api-key"):
        build_settings(None, {}, api_key=("k",), admin_api_key="k", kv_persist=False)
    assert build_settings(None, {"FLASHTIER_ADMIN_API_KEY": "adm"}, kv_persist=False).admin_api_key == "adm"
