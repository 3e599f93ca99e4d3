"""/v1/models, /health, /tokenize, /detokenize, /metrics, /openapi.json, and API-key auth."""

from __future__ import annotations

import httpx
import openai
import pytest

from flashtier.server.text.chat_encoding import encode_to_ids
from flashtier.server.serving.metrics import GENERATION_TOKENS, PROMPT_TOKENS, REQUEST_SUCCESS, TTFT

from .conftest import run_server


def test_models_list_says_demo(server):
    models = server.openai().models.list()
    (card,) = models.data
    assert card.id == server.settings.model_name == "flashtier-tiny"
    assert card.object == "model" and card.owned_by == "flashtier"
    extra = card.model_extra
    assert extra["max_model_len"] == server.engine.max_model_len
    assert extra["flashtier"]["demo"] is True and "not meaningful" in extra["flashtier"]["note"]
    assert server.openai().models.retrieve(card.id).id == card.id


def test_served_model_names(tokenizer):
    with run_server(tokenizer, served_model_name=("flash", "deepseek-v4.1-flash")) as srv:
        client = srv.openai()
        assert [m.id for m in client.models.list().data] == ["flash", "deepseek-v4.1-flash"]
        for name in ("flash", "deepseek-v4.1-flash"):
            assert client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}]).model == name


def test_health(server):
    with server.http() as http:
        r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_tokenize_and_detokenize(server):
    with server.http() as http:
        r = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == server.encode("Hello world") and body["count"] == len(body["tokens"])
        assert "".join(body["token_strs"]) == "Hello world"
        assert body["max_model_len"] == server.engine.max_model_len
        messages = [{"role": "user", "content": "hi"}]
        r = http.post("/tokenize", json={"messages": messages, "reasoning_effort": "max"})
        assert r.json()["tokens"] == encode_to_ids(server.tokenizer, messages, thinking=True, reasoning_effort="max")
        r = http.post("/detokenize", json={"tokens": body["tokens"]})
        assert r.status_code == 200 and r.json() == {"prompt": "Hello world"}
    # the tokenizer endpoints need no engine
    server.engine.ready = False
    with server.http() as http:
        assert http.post("/tokenize", json={"prompt": "a"}).status_code == 200


def test_tokenize_matches_the_chat_prompt(server):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with server.http() as http:
        ids = http.post("/tokenize", json={"messages": messages, "tools": tools}).json()["tokens"]
        assert http.post("/v1/chat/completions", json={"messages": messages, "tools": tools}).status_code == 200
    assert list(server.engine.calls[-1].prompt_token_ids) == ids


def test_metrics_exposition(server):
    server.openai().chat.completions.create(model=server.settings.model_name,
                                            messages=[{"role": "user", "content": "x"}])
    with server.http() as http:
        r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (TTFT + "_bucket", REQUEST_SUCCESS + "_total", PROMPT_TOKENS + "_total", GENERATION_TOKENS + "_total",
                 "flashtier_num_requests_running", "flashtier_num_requests_waiting", "flashtier_kv_cache_usage_perc",
                 "flashtier_prefix_cache_queries_total", "flashtier_prefix_cache_hits_total",
                 "flashtier_num_preemptions_total", "flashtier_inter_token_latency_seconds_bucket",
                 "flashtier_e2e_request_latency_seconds_bucket", "flashtier_request_queue_time_seconds_bucket",
                 "flashtier_prompt_tokens_cached_total", "flashtier_http_requests_total"):
        assert name in text, name
    assert 'model_name="flashtier-tiny"' in text
    assert "_created" not in text
    metrics = server.metrics()
    assert metrics[("flashtier_http_requests_total",
                    (("method", "POST"), ("route", "/v1/chat/completions"), ("status", "200")))] >= 1


def test_openapi_document(server):
    with server.http() as http:
        spec = http.get("/openapi.json").json()
    paths = spec["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize",
                 "/detokenize"):
        assert path in paths
    chat = paths["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in chat and {"200", "400", "404", "413", "429", "500", "503"} <= set(chat)
    assert "text/event-stream" in chat["200"]["content"]
    assert "ErrorResponse" in spec["components"]["schemas"]


@pytest.fixture(scope="module")
def auth_server(tokenizer):
    with run_server(tokenizer, api_key=("key-one", "key-two")) as srv:
        yield srv


def test_auth_required_on_v1(auth_server):
    url = auth_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic key-one"},
                    {"Authorization": "key-one"}):
        r = httpx.get(url + "/v1/models", headers=headers)
        assert r.status_code == 401, headers
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        r = httpx.post(url + "/v1/chat/completions", headers=headers,
                       json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401
    assert not auth_server.engine.calls
    for key in ("key-one", "key-two"):
        assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"authorization": f"bearer {key}"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        auth_server.openai(api_key="nope").models.list()
    r = auth_server.openai(api_key="key-two").chat.completions.create(
        model=auth_server.settings.model_name, messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].finish_reason == "stop"


def test_health_metrics_and_version_stay_open(auth_server):
    url = auth_server.url
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    assert httpx.get(url + "/version").status_code == 200
    assert httpx.get(url + "/openapi.json").status_code == 200


def test_tokenize_and_detokenize_need_the_key(auth_server):
    """They spend CPU on whatever text a caller sends, so a keyed server guards them like /v1/*."""
    url, good = auth_server.url, {"Authorization": "Bearer key-one"}
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(url + path, json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
        assert httpx.post(url + path, json=body, headers=good).status_code == 200
    spec = httpx.get(url + "/openapi.json").json()
    assert "401" in spec["paths"]["/tokenize"]["post"]["responses"]
    assert "401" not in spec["paths"]["/health"]["get"]["responses"]


def test_tier_statistics_are_exported(server):
    server.engine.tier_stats = {"ssd_bytes": 4096.0, "ssd_oldest_entry_age_s": 12.5, "snapshot_hits": 7.0,
                                "ssd_admission_refusals": 2.0}
    m = server.metrics()
    assert m[("flashtier_ssd_bytes", ())] == 4096
    assert m[("flashtier_ssd_oldest_entry_age_seconds", ())] == 12.5
    assert m[("flashtier_snapshot_hits_total", ())] == 7
    assert m[("flashtier_ssd_admission_refusals_total", ())] == 2
    with server.http() as http:
        text = http.get("/metrics").text
    assert "# TYPE flashtier_ssd_bytes gauge" in text and "# TYPE flashtier_snapshot_hits_total counter" in text


def test_engine_shutting_down_is_503(server):
    server.engine.ready = False  # generate() refuses while not ready, as the engine does when draining
    server.engine.script = lambda prompt, params: (_ for _ in ()).throw(RuntimeError("the engine is shutting down"))
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
