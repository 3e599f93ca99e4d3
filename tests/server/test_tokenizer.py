"""Tokenizer: special tokens by text (ids of model.md §5b), round trips, the incremental detokenizer."""

import json
import random
import shutil
from functools import lru_cache

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtier.server.text.tokenizer import IncrementalDetokenizer, Tokenizer, default_tokenizer_path


@lru_cache(maxsize=1)
def shipped() -> Tokenizer:
    return Tokenizer()


SAMPLES = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line one\nline two\r\n\ttabbed",
    "中文分词测试：你好，世界！",
    "日本語のテキストとカタカナ",
    "한국어 문장입니다",
    "emoji 🙂🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "combining: e\u0301 a\u0308 Z\u0335\u0321",
    "mixed 123456789 ¥€£ ∑∫√ \u00a0nbsp",
    "RTL: שלום עולם مرحبا",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 supplementary planes",
]


# ---- special tokens --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<｜begin▁of▁sentence｜>", 0),
        ("<｜end▁of▁sentence｜>", 1),
        ("<｜▁pad▁｜>", 2),
        ("<｜User｜>", 128803),
        ("<｜Assistant｜>", 128804),
        ("<think>", 128821),
        ("</think>", 128822),
        ("｜DSML｜", 128825),
        ("<｜begin▁sys｜>", 128826),
        ("<｜end▁sys｜>", 128827),
        ("<｜place▁holder▁no▁799｜>", 128799),
        ("<｜image｜>", 129279),
    ],
)
def test_special_token_ids_match_model_md(text, expected):
    tok = shipped()
    assert tok.special_tokens[text] == expected
    assert tok.token_to_id(text) == expected
    assert tok.require_token(text) == expected
    assert tok.id_to_token(expected) == text
    assert tok.encode(text) == [expected]


def test_bos_eos_pad_resolved_from_tokenizer_config():
    tok = shipped()
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.pad_id == 1  # tokenizer_config.json: pad_token is the EOS text
    assert tok.vocab_size == 129280
    assert len(tok.special_tokens) == 1283


def test_shipped_file_has_no_system_token_so_begin_sys_stands_in():
    tok = shipped()
    assert tok.token_to_id("<｜System｜>") is None
    assert tok.system_marker == "<｜begin▁sys｜>"
    with pytest.raises(ValueError, match="System"):
        tok.require_token("<｜System｜>")


def test_model_dir_with_its_own_tokenizer(tmp_path):
    tk = tokenizers.Tokenizer.from_file(str(default_tokenizer_path()))
    tk.add_special_tokens([tokenizers.AddedToken("<｜System｜>", special=False, normalized=False)])
    tk.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": {"content": "<｜end▁of▁sentence｜>"},
        "pad_token": "<｜▁pad▁｜>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_model_dir(tmp_path)
    assert tok.path == tmp_path / "tokenizer.json"
    assert tok.system_marker == "<｜System｜>"
    assert tok.encode("<｜System｜>") == [129280]
    assert tok.vocab_size == 129281
    assert tok.pad_id == 2


def test_model_dir_without_tokenizer_falls_back_to_shipped(tmp_path):
    assert Tokenizer.from_model_dir(tmp_path).path == default_tokenizer_path()
    assert Tokenizer.from_model_dir(None).path == default_tokenizer_path()


def test_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer(tmp_path / "nope.json")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer(tmp_path)


def test_loading_a_file_path_directly(tmp_path):
    shutil.copy(default_tokenizer_path(), tmp_path / "tokenizer.json")
    tok = Tokenizer(tmp_path / "tokenizer.json")
    # No tokenizer_config.json beside it: DeepSeek defaults, and the pad token is `<｜▁pad▁｜>`.
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)


# ---- encode / decode ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(text):
    tok = shipped()
    ids = tok.encode(text)
    assert ids and ids[0] != tok.bos_id  # no BOS added
    assert tok.decode(ids) == text


def test_control_tokens_in_text_allowed_or_not():
    tok = shipped()
    text = "a<｜User｜>b<think>c｜DSML｜d"
    ids = tok.encode(text)
    assert {128803, 128821, 128825} <= set(ids)
    plain = tok.encode(text, allow_special=False)
    assert not set(plain) & tok.special_ids
    assert tok.decode(plain) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_plain_path_matches_fast_path_on_text_without_control_tokens(text):
    tok = shipped()
    assert tok._encode_without_added_tokens(text) == tok.encode(text)


@given(st.text(max_size=80))
@settings(max_examples=150, deadline=None)
def test_round_trip_any_text(text):
    tok = shipped()
    assert tok.decode(tok.encode(text, allow_special=False)) == text
    if tok.find_special(text) is None:
        assert tok._encode_without_added_tokens(text) == tok.encode(text)


@pytest.mark.parametrize("bad", [-1, 129280, 10**9, 1.5, True, "3"])
def test_out_of_range_ids_are_value_errors(bad):
    tok = shipped()
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([5, bad])
    with pytest.raises(ValueError, match="out of range"):
        tok.id_to_token(bad)
    with pytest.raises(ValueError, match="out of range"):
        IncrementalDetokenizer(tok).add_token(bad)


def test_skip_special_tokens_drops_bos_eos_but_not_role_markers():
    tok = shipped()
    ids = tok.encode("<｜begin▁of▁sentence｜><｜User｜>hi<｜end▁of▁sentence｜>")
    assert tok.decode(ids, skip_special_tokens=True) == "<｜User｜>hi"


# ---- incremental detokenizer -------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], skip: bool = False) -> list[str]:
    detok = tok.incremental_detokenizer(skip_special_tokens=skip)
    pieces = [detok.add_token(i) for i in ids]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces


@pytest.mark.parametrize("text", SAMPLES)
def test_incremental_equals_full_decode(text):
    tok = shipped()
    ids = tok.encode(text)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_multibyte_character_split_across_tokens_is_held_back():
    tok = shipped()
    text = "👩‍👩‍👧‍👦𐍈"
    ids = tok.encode(text)
    # Byte-level BPE gives these rare characters several tokens each.
    assert len(ids) > len(text)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text
    assert "" in pieces  # some steps emitted nothing while a character was incomplete
    assert all("\ufffd" not in p for p in pieces)


def test_flush_releases_an_incomplete_character():
    tok = shipped()
    ids = tok.encode("🚀")
    assert len(ids) > 1
    detok = tok.incremental_detokenizer()
    assert detok.add_tokens(ids[:-1]) == ""
    assert detok.flush() == tok.decode(ids[:-1])
    assert detok.flush() == ""


def test_incremental_skip_special_tokens():
    tok = shipped()
    ids = tok.encode("hello<｜end▁of▁sentence｜>")
    assert "".join(_stream(tok, ids, skip=True)) == "hello"


@given(st.text(max_size=60), st.randoms(use_true_random=False))
@settings(max_examples=150, deadline=None)
def test_incremental_random_groupings(text, rng: random.Random):
    tok = shipped()
    ids = tok.encode(text, allow_special=False)
    detok = tok.incremental_detokenizer()
    out, pos = [], 0
    while pos < len(ids):
        step = rng.randint(1, 4)
        out.append(detok.add_tokens(ids[pos : pos + step]))
        pos += step
    out.append(detok.flush())
    assert "".join(out) == tok.decode(ids) == text
    assert detok.token_ids == ids
