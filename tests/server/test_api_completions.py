"""/v1/completions through the openai SDK against a live server and a scripted engine."""

from __future__ import annotations

from .conftest import DEFAULT_REPLY


def test_completion(server):
    r = server.openai().completions.create(model=server.settings.model_name, prompt="Once upon a time",
                                           max_tokens=64)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.text == DEFAULT_REPLY and choice.finish_reason == "stop" and choice.logprobs is None
    (call,) = server.engine.calls
    assert list(call.prompt_token_ids) == server.encode("Once upon a time")
    assert r.usage.prompt_tokens == len(call.prompt_token_ids)
    assert r.usage.completion_tokens == len(server.encode(DEFAULT_REPLY))
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert call.params.max_tokens == 64


def test_default_max_tokens_is_16(server):
    server.engine.script = list(range(1000, 1040))
    r = server.openai().completions.create(model=server.settings.model_name, prompt="x")
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_streaming_completion_with_usage(server):
    stream = server.openai().completions.create(model=server.settings.model_name, prompt="Hi", stream=True,
                                                max_tokens=64, stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    assert text == DEFAULT_REPLY and finish == "stop"
    assert usage.completion_tokens == len(server.encode(DEFAULT_REPLY))


def test_token_id_prompt_echo_and_batch(server):
    client = server.openai()
    ids = server.encode("Count:")
    r = client.completions.create(model=server.settings.model_name, prompt=ids, max_tokens=64, echo=True)
    assert r.choices[0].text == "Count:" + DEFAULT_REPLY
    assert list(server.engine.calls[-1].prompt_token_ids) == ids
    r = client.completions.create(model=server.settings.model_name, prompt=["first", "second"], n=2,
                                  max_tokens=64, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ["first" + DEFAULT_REPLY] * 2 + ["second" + DEFAULT_REPLY] * 2
    assert r.usage.prompt_tokens == len(server.encode("first")) + len(server.encode("second"))
    assert r.usage.completion_tokens == 4 * len(server.encode(DEFAULT_REPLY))
    stream = client.completions.create(model=server.settings.model_name, prompt=["first", "second"],
                                       max_tokens=64, stream=True)
    texts: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: DEFAULT_REPLY, 1: DEFAULT_REPLY}


def test_completion_logprobs_shape(server):
    r = server.openai().completions.create(model=server.settings.model_name, prompt="Hi", max_tokens=64,
                                           logprobs=2)
    lp = r.choices[0].logprobs
    n = len(server.encode(DEFAULT_REPLY))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == DEFAULT_REPLY
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(top) == 2 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
    assert server.engine.calls[-1].params.logprobs == 2


def test_completion_stop_string(server):
    server.engine.script = server.script("one, two, three, four")
    r = server.openai().completions.create(model=server.settings.model_name, prompt="Count", stop=", three",
                                           max_tokens=64)
    assert r.choices[0].text == "one, two" and r.choices[0].finish_reason == "stop"
    assert server.engine.wait_for(lambda e: e.aborted == [e.calls[-1].request_id])


def test_skip_special_tokens(server):
    server.engine.script = server.script("a<｜begin▁of▁sentence｜>b")
    client = server.openai()
    r = client.completions.create(model=server.settings.model_name, prompt="x", max_tokens=64)
    assert r.choices[0].text == "ab"
    r = client.completions.create(model=server.settings.model_name, prompt="x", max_tokens=64,
                                  extra_body={"skip_special_tokens": False})
    assert r.choices[0].text == "a<｜begin▁of▁sentence｜>b"
