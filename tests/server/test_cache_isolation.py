"""--cache-isolation per-key and cache_salt validation.

The isolation tests run the real engine (tiny demo weights, fp32, its real prefix cache) behind the HTTP
server and talk to it with the openai SDK: under per-key, tenant B gets no cached tokens for tenant A's
prompt, not even when it sends A's cache_salt, while A's repeat is served from the cache. The same
sequence on a shared server shows B hitting A's cache, so the per-key assertions can fail. The salt the
engine receives is checked against a scripted engine, and cache_salt's validation against the shared
scripted server.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from flashtier.engine.config import EngineConfig
from flashtier.kvstore.config import KVStoreConfig
from flashtier.server.serving.state import tenant_salt

from .conftest import LiveServer, run_server
from .engine_core_support import tiny_engine_core

MODEL = "flashtier-tiny"
KEYS = ("key-tenant-a", "key-tenant-b")
# about 130 tokens: 8 full blocks of 16 in the chat prompt
PROMPT = [{"role": "user", "content": "Summarise the history of the river valley settlements. " * 12}]


@contextmanager
def real_server(tokenizer, **overrides) -> Iterator[LiveServer]:
    engine = tiny_engine_core(EngineConfig(max_num_batched_tokens=256), KVStoreConfig(block_size=16, num_blocks=400))
    with run_server(tokenizer, engine, api_key=KEYS, **overrides) as server:
        yield server


def _cached(server: LiveServer, key: str, salt: str | None = None, messages=PROMPT) -> int:
    client = server.openai(api_key=key)
    extra = {"cache_salt": salt} if salt is not None else None
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                           extra_body=extra)
    assert reply.usage.prompt_tokens >= 100
    return reply.usage.prompt_tokens_details.cached_tokens


def test_per_key_tenants_do_not_share_any_cache(tokenizer):
    a, b = KEYS
    with real_server(tokenizer, cache_isolation="per-key") as server:
        assert _cached(server, a) == 0
        assert _cached(server, a) > 0  # A's repeat is a hit: the cache works
        assert _cached(server, b) == 0  # B sends A's very prompt
        assert _cached(server, a, salt="team-1") == 0  # a salt is a namespace of its own within A
        assert _cached(server, a, salt="team-1") > 0
        assert _cached(server, b, salt="team-1") == 0  # A's salt does not open A's cache to B
        assert _cached(server, b) > 0  # B's own repeat hits B's own entries
        # completions take the same path
        text = "Once upon a time in the valley there lived a careful archivist. " * 10
        first = server.openai(api_key=a).completions.create(model=MODEL, prompt=text, max_tokens=1)
        again = server.openai(api_key=a).completions.create(model=MODEL, prompt=text, max_tokens=1)
        other = server.openai(api_key=b).completions.create(model=MODEL, prompt=text, max_tokens=1)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_shared_mode_shares_across_keys(tokenizer):
    """The contrast: without per-key, B is served from A's entries (and a shared salt joins them too)."""
    a, b = KEYS
    with real_server(tokenizer) as server:
        assert server.settings.cache_isolation == "shared"
        assert _cached(server, a) == 0
        assert _cached(server, b) > 0
        assert _cached(server, a, salt="team-1") == 0
        assert _cached(server, b, salt="team-1") > 0


@contextmanager
def _scripted(tokenizer, **overrides) -> Iterator[LiveServer]:
    with run_server(tokenizer, **overrides) as server:
        yield server


@pytest.mark.parametrize("salt", [None, "team-1"])
def test_per_key_salt_reaching_the_engine(tokenizer, salt):
    a, b = KEYS
    with _scripted(tokenizer, api_key=KEYS, cache_isolation="per-key") as server:
        for key in (a, b):
            for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                               ("/v1/completions", {"prompt": ["one", "two"]})):
                body = {**body, "max_tokens": 2, **({"cache_salt": salt} if salt is not None else {})}
                r = httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
        salts = [call.cache_salt for call in server.engine.calls]
    expect_a, expect_b = tenant_salt(a, salt), tenant_salt(b, salt)
    assert salts == [expect_a] * 3 + [expect_b] * 3
    assert expect_a != expect_b and a not in expect_a and expect_a.endswith("\x00" + (salt or ""))
    assert tenant_salt(a, salt) == expect_a  # stable: SSD entries stay reachable after a restart


def test_per_key_without_keys_is_one_tenant(tokenizer):
    with _scripted(tokenizer, cache_isolation="per-key") as server:
        for salt in (None, "s"):
            body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
            body |= {"cache_salt": salt} if salt else {}
            assert httpx.post(server.url + "/v1/chat/completions", json=body,
                              headers={"Authorization": "Bearer anything"}).status_code == 200
        assert [c.cache_salt for c in server.engine.calls] == [None, "s"]


@pytest.mark.parametrize("salt", ["", "a\x00b", "tab\there", "line\nbreak", "\x7f", "\u200b", "x" * 257, 5,
                                  ["a"]])
def test_bad_cache_salt_is_400(server, salt):
    with pytest.raises(openai.BadRequestError) as info:
        server.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                extra_body={"cache_salt": salt})
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == "cache_salt" and err["type"] == "invalid_request_error"
    assert "cache_salt" in err["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "cache_salt": salt})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    assert not server.engine.calls


@pytest.mark.parametrize("salt", ["x" * 256, "tenant a/β-ключ", "🙂"])
def test_good_cache_salt_is_passed_on(server, salt):
    server.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                            extra_body={"cache_salt": salt})
    assert server.engine.calls[-1].cache_salt == salt
