"""The pieces that keep large requests off the event loop, each against its one-call reference:
segmented tokenization (== one ``encode``), piecewise JSON parsing (== ``json.loads``), sliced validation
(== ``model_validate``), the sliced UTF-8 check (same error offset), and the pool itself."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest

from flashtier.server.http import json_body
from flashtier.server.text import tokenizer as tokenizer_module
from flashtier.server.app import _check_utf8
from flashtier.server.http.frontend_pool import FrontendPool
from flashtier.server.http.json_body import parse_json_body
from flashtier.server.http.pooled_route import parse_body, validate_body
from flashtier.server.protocol.request_models import ChatCompletionRequest, CompletionRequest, DetokenizeRequest

PIECES = ["abc", "XYZ", " ", "  ", "\n", "\n\n", " \n", "\t", "\r\n", "-", "_", ".", ",", "!?", "'", '"', "()", "[]",
          "{}", "<>", "/", "\\", "@#$%", "0", "12", "1234567", "é", "ü", "数据", "日本語", "ｶﾀ", "😀", "\u0301",
          "\u200b", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜", "<｜end▁of▁sentence｜>",
          "The", " the", "http://x.y/z", "don't", "A\nb", "a b"]


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def test_segmented_encode_equals_one_encode(tokenizer, monkeypatch):
    """Cutting only at `_CUT` positions never changes the ids, whatever the text and the segment size."""
    assert tokenizer._segmentable  # the shipped file is the DeepSeek pre-tokenizer
    rng = random.Random(7)
    for _ in range(1500):
        text = _random_text(rng, rng.randint(1, 120))
        want = tokenizer._tk.encode(text, add_special_tokens=False).ids
        segments = list(tokenizer_module._segments(text, size=rng.randint(1, 24)))
        assert "".join(segments) == text
        got = [i for seg in segments for i in tokenizer._tk.encode(seg, add_special_tokens=False).ids]
        assert got == want, (text, segments)
    # through Tokenizer.encode itself, with segments small enough that the text has hundreds of them
    monkeypatch.setattr(tokenizer_module, "SEGMENT_CHARS", 64)
    monkeypatch.setattr(tokenizer_module, "GIL_FREE_CHARS", 16)
    text = _random_text(rng, 6000)
    assert tokenizer.encode(text) == tokenizer._tk.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_a_cut_inside_a_piece_would_change_the_ids(tokenizer):
    """The cut rule matters: a cut inside a word, a digit run or a whitespace run changes the ids."""
    for text, at in (("hello world", 3), ("a\n\n b", 2), ("12345", 2)):
        whole = tokenizer._tk.encode(text, add_special_tokens=False).ids
        split = [i for part in (text[:at], text[at:]) for i in tokenizer._tk.encode(part, add_special_tokens=False).ids]
        assert split != whole, text
        assert tokenizer_module._CUT.search(text, at, at + 1) is None  # and `_CUT` never picks such a place


def test_other_pre_tokenizers_are_not_segmented(tokenizer, tmp_path):
    data = json.loads(tokenizer._tk.to_str())
    data["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    other = tokenizer_module.Tokenizer(tmp_path)
    assert not other._segmentable
    text = "word " * 3000
    assert other.encode(text) == other._tk.encode(text, add_special_tokens=False).ids


def _random_json(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.45:
        chars = ["a", " ", "\n", '"', "\\", "/", "é", "数", "😀", "\ud800", "\u0000", "\t", "xyz"]
        return "".join(rng.choice(chars) for _ in range(rng.randint(0, 40)))
    if r < 0.55:
        return rng.randint(-5, 10**6)
    if r < 0.6:
        return rng.choice([True, False, None, 1.5, -2e-3])
    if r < 0.8:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    return {str(rng.randint(0, 99)) + "k": _random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _loads_or_error(parse, raw: bytes):
    try:
        return parse(raw)
    except ValueError:
        return "error"


def test_piecewise_json_equals_json_loads(monkeypatch):
    """Tiny limits make nearly every literal and array "long", and cut them every few bytes: escapes,
    surrogate pairs, lone surrogates and multi-byte characters must all survive the cuts."""
    monkeypatch.setattr(json_body, "LONG_LITERAL", 6)
    monkeypatch.setattr(json_body, "PIECE", 5)
    rng = random.Random(11)
    for _ in range(3000):
        value = _random_json(rng)
        raw = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
        assert _loads_or_error(parse_json_body, raw) == _loads_or_error(json.loads, raw), raw
    for raw in (b'{"a": "abcdefgh', b'{"a": "ab\\q cdefgh"}', b'{"a": "abcdefgh\x01"}', b'["abcdefghij" "x"]',
                b'{"t": [1,2,3,4,5,6,7,8,]}', b'{"t": [1,2,3,4 5,6,7,8]}', b'{"t": [01,2,3,4,5,6,7,8]}',
                b"[1,,2,3,4,5,6]",
                b'{"a":"\\ud83d\\ude00abcdefgh"}', b'{"a":"\\ud800abcdefgh"}', b'{"t": [ 1, 2, 3, 4, 5, 6 ]}'):
        assert _loads_or_error(parse_json_body, raw) == _loads_or_error(json.loads, raw), raw


def test_pooled_parse_gives_the_model_or_what_fastapi_needs_to_report():
    text = "token ids and text " * 20000
    raw = json.dumps({"prompt": text, "max_tokens": 3, "cache_salt": "s"}).encode()
    parsed = parse_body(CompletionRequest, raw)
    assert isinstance(parsed, CompletionRequest) and parsed == CompletionRequest.model_validate_json(raw)
    bad = json.dumps({"prompt": text, "max_tokens": "3"}).encode()
    assert parse_body(CompletionRequest, bad) == json.loads(bad)  # FastAPI validates it and names the field
    assert parse_body(CompletionRequest, raw[:-1]) is None  # not JSON: FastAPI parses it and says so


def test_long_lists_are_validated_in_slices():
    ids = list(range(1, 200_001))
    model = validate_body(DetokenizeRequest, {"tokens": ids})
    assert model.tokens == ids and model == DetokenizeRequest.model_validate({"tokens": ids})
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        validate_body(DetokenizeRequest, {"tokens": [*ids, -1]})
    with pytest.raises(ValueError, match="valid integer"):
        validate_body(CompletionRequest, {"prompt": [*ids[:70_000], "x"]})
    batch = validate_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}] * 70_000})
    assert len(batch.messages) == 70_000 and batch.messages[-1].content == "x"


def test_sliced_utf8_check_reports_the_same_offset():
    for body in (b"abc", "é数😀".encode() * 7, b"ab\xffcd", "é".encode() * 10 + b"\xff", b"\xe6\x95",
                 b"x" * 7 + b"\xe6\x95 ", "数".encode() * 5 + b"\xed\xa0\x80"):
        try:
            body.decode("utf-8")
            want = None
        except UnicodeDecodeError as exc:
            want = exc.start
        try:
            _check_utf8(body, step=4)
            got = None
        except UnicodeDecodeError as exc:
            got = exc.start
        assert got == want, body


def test_pool_is_bounded_and_trims():
    pool = FrontendPool(2)
    running, peak, lock = [0], [0], threading.Lock()

    def work(x: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        threading.Event().wait(0.05)
        with lock:
            running[0] -= 1
        return x * 2

    async def main() -> list[int]:
        return await asyncio.gather(*(pool.run(work, i) for i in range(8)))

    assert asyncio.run(main()) == [i * 2 for i in range(8)]
    assert peak[0] == 2  # never more than the pool's workers at once
    pool.release_memory()
    pool.release_memory()  # one trim queued covers both
    pool.shutdown()
    pool.release_memory()  # after shutdown: nothing, no error
