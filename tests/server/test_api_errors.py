"""The error matrix: every rejection has the right status and OpenAI's error body, never a traceback."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .conftest import run_server

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def assert_error(r: httpx.Response, status: int, *, type: str | None = None, param: str | None = "<any>",
                 code: str | None = "<any>") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in r.text and 'File "' not in r.text
    if type is not None:
        assert err["type"] == type
    if param != "<any>":
        assert err["param"] == param, err
    if code != "<any>":
        assert err["code"] == code, err
    return err


def _chat(server, **fields) -> httpx.Response:
    with server.http() as http:
        return http.post(CHAT, json={"messages": USER, **fields})


def _raw(server, path: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    with server.http() as http:
        return http.post(path, content=content, headers=headers or {"content-type": "application/json"})


@pytest.mark.parametrize("content", [b"{bad", b"[1, 2]", b"", b"null", b'{"messages": ' + b"[" * 5000,
                                     b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
                                     b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}'])
def test_malformed_bodies_are_400(server, content):
    assert_error(_raw(server, CHAT, content), 400, type="invalid_request_error")
    assert not server.engine.calls


def test_invalid_utf8_is_400(server):
    body = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'
    err = assert_error(_raw(server, CHAT, body), 400, code="invalid_utf8")
    assert "UTF-8" in err["message"]


def test_lone_surrogate_is_400(server):
    body = b'{"messages": [{"role": "user", "content": "x\\ud800y"}]}'
    assert_error(_raw(server, CHAT, body), 400, param="messages[0].content")
    assert_error(_raw(server, "/v1/completions", b'{"prompt": "\\udfff"}'), 400)
    assert_error(_raw(server, CHAT, b'{"messages": [{"role": "user", "content": "a"}], "cache_salt": "\\ud800"}'),
                 400, param="cache_salt")
    assert_error(_raw(server, CHAT, b'{"messages": [{"role": "user", "content": "a"}], "stop": ["\\ud800"]}'),
                 400)


def test_body_without_json_content_type_is_still_json(server):
    r = _raw(server, CHAT, json.dumps({"messages": USER}).encode(),
             headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("fields,param", [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": 2**64}, "seed"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stop": ""}, None),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, None),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
    ({"min_tokens": 10, "max_tokens": 5}, None),
    ({"cache_salt": ""}, "cache_salt"),
])
def test_invalid_values_are_400(server, fields, param):
    err = assert_error(_chat(server, **fields), 400, type="invalid_request_error")
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err
    assert not server.engine.calls


def test_tool_choice_errors(server):
    err = assert_error(_chat(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
                       400, param="tool_choice")
    assert "nope" in err["message"]
    assert_error(_chat(server, tool_choice="required"), 400, param="tool_choice")
    assert_error(_chat(server, tool_choice={"type": "function", "function": {"name": "get_weather"}}), 400,
                 param="tool_choice")
    assert_error(_chat(server, tools=TOOLS + TOOLS), 400, param="tools")
    bad_name = [{"type": "function", "function": {"name": 'a"b'}}]
    assert_error(_chat(server, tools=bad_name), 400)


def test_context_length_is_400(server):
    err = assert_error(_chat(server, max_tokens=server.engine.max_model_len), 400, code="context_length_exceeded",
                       param="max_tokens")
    assert str(server.engine.max_model_len) in err["message"]
    server.engine.max_model_len = 16
    long_messages = [{"role": "user", "content": "word " * 50}]
    assert_error(_chat(server, messages=long_messages), 400, code="context_length_exceeded", param="messages")
    with server.http() as http:
        r = http.post("/v1/completions", json={"prompt": "word " * 50})
    assert_error(r, 400, code="context_length_exceeded")
    assert not server.engine.calls


def test_engine_value_error_is_400(server):
    server.engine.script = lambda prompt, params: (_ for _ in ()).throw(ValueError("the engine refuses this"))
    err = assert_error(_chat(server), 400)
    assert err["message"] == "the engine refuses this"


def test_unknown_model_and_route_are_404(server):
    err = assert_error(_chat(server, model="gpt-4"), 404, type="not_found_error", param="model",
                       code="model_not_found")
    assert "gpt-4" in err["message"]
    with server.http() as http:
        assert_error(http.get("/v1/models/gpt-4"), 404, code="model_not_found")
        assert_error(http.post("/v1/completions", json={"model": "x", "prompt": "a"}), 404)
        assert_error(http.post("/tokenize", json={"model": "x", "prompt": "a"}), 404)
        assert_error(http.get("/v1/nothing-here"), 404)
        assert_error(http.get(CHAT), 405)
    with pytest.raises(openai.NotFoundError):
        server.openai().chat.completions.create(model="gpt-4", messages=USER)


def test_completions_specific_400s(server):
    with server.http() as http:
        assert_error(http.post("/v1/completions", json={"prompt": [1, 10**7]}), 400, param="prompt")
        assert_error(http.post("/v1/completions", json={"prompt": "a", "suffix": "b"}), 400, param="suffix")
        assert_error(http.post("/v1/completions", json={"prompt": "a", "echo": True, "logprobs": 1}), 400)
        assert_error(http.post("/v1/completions", json={"prompt": "a", "best_of": 3}), 400, param="best_of")
        assert_error(http.post("/v1/completions", json={"prompt": []}), 400)
        assert_error(http.post("/v1/completions", json={"prompt": ""}), 400)
        assert_error(http.post("/detokenize", json={"tokens": [10**7]}), 400, param="tokens")
        assert_error(http.post("/detokenize", json={"tokens": [-1]}), 400)
        assert_error(http.post("/tokenize", json={}), 400)
        assert_error(http.post("/tokenize", json={"prompt": "a", "messages": USER}), 400)


def test_queue_full_is_429(server):
    server.engine.max_active = 0
    assert_error(_chat(server), 429, type="rate_limit_error", code="queue_full")
    assert_error(_chat(server, stream=True), 429, code="queue_full")
    with server.http() as http:
        r = http.post("/v1/completions", json={"prompt": "a", "stream": True})
    assert_error(r, 429)
    assert r.headers.get("retry-after") == "1"
    with pytest.raises(openai.RateLimitError):
        server.openai().chat.completions.create(model=server.settings.model_name, messages=USER)


def test_not_ready_is_503(server):
    server.engine.ready = False
    assert_error(_chat(server), 503, type="server_error", code="not_ready")
    with server.http() as http:
        assert_error(http.get("/health"), 503)
        assert_error(http.post("/v1/completions", json={"prompt": "a"}), 503)
        assert http.get("/metrics").status_code == 200
        assert http.get("/v1/models").status_code == 200
    server.engine.ready = True
    with server.http() as http:
        assert http.get("/health").json() == {"status": "ok"}


def test_engine_failure_is_a_500_without_details(server):
    def boom(prompt, params):
        raise RuntimeError("secret internal detail")

    server.engine.script = boom
    err = assert_error(_chat(server), 500, type="server_error")
    assert "secret" not in err["message"]
    err = assert_error(_chat(server, stream=True), 500)
    assert "secret" not in err["message"]


def test_engine_failure_mid_stream_is_an_error_event(server):
    # a token id outside the vocabulary, after a few good ones: the failure comes after the 200
    server.engine.script = server.encode("fine so far") + [10**7]
    with server.http() as http:
        r = http.post(CHAT, json={"messages": USER, "stream": True})
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and "Traceback" not in r.text
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-2]) == "fine so far"
    assert_error(_chat(server), 500)


def test_request_too_large_is_413(tokenizer):
    with run_server(tokenizer, max_request_bytes=4096) as small:
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 10_000}]}).encode()
        assert_error(_raw(small, CHAT, big), 413, code="request_too_large")

        def chunks():
            for _ in range(10):
                yield b" " * 1000
            yield json.dumps({"messages": USER}).encode()

        with small.http() as http:  # no content-length: the limit applies to what arrives
            r = http.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
        assert_error(r, 413)
        ok = json.dumps({"messages": USER}).encode()
        assert _raw(small, CHAT, ok).status_code == 200
        assert not [c for c in small.engine.calls if len(c.prompt_token_ids) > 100]
