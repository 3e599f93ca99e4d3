"""The Engram token map against the published CompressedTokenizer rules, on every id of the shipped tokenizer.

``published_keys`` below is a second implementation of the official rules (V4.1 ``inference/engram.py``,
``build_compressed_token_map``), written with Python's ``unicodedata`` and ``re`` instead of the
``tokenizers`` normalisers that ``server/text/engram_map.py`` runs, and reading ``tokenizer.json`` directly.
Its switches re-create the deviations of the old map (a ``\\x00raw:`` prefix on byte-token keys, ``\\s+``,
no lone-space sentinel, no fallback to the text), so the comparison is shown to catch each of them.
"""

import re
import unicodedata

import pytest
import tokenizers
import torch

from flashtier.server.text.engram_map import engram_token_map, model_token_map, normalise
from flashtier.server.text.tokenizer import Tokenizer, default_tokenizer_path

N_IDS = 129_280  # ids of the shipped tokenizer
N_CLASSES = 99_092  # the V4.1 config's engram_compressed_vocab


def published_keys(
    texts: list[str], raw: list[str], *, ws: str = r"[ \t\r\n]+", sentinel: bool = True, fallback: bool = True,
    raw_prefix: str = "",
) -> list[str]:
    """The key of every id under the published rules; the keyword arguments exist to break them."""
    ws_re = re.compile(ws)
    keys = []
    for text, token in zip(texts, raw):
        if "\ufffd" in text:  # a byte fragment: keyed by its vocabulary string
            keys.append(raw_prefix + token)
            continue
        s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
        s = "".join(c.lower() for c in s if not unicodedata.category(c).startswith("M"))  # marks: Mn, Mc, Me
        s = ws_re.sub(" ", s)
        s = " " if sentinel and s == " " else s.strip()
        keys.append(s if s or not fallback else text)
    return keys


def number_classes(keys: list[str]) -> tuple[torch.Tensor, int]:
    """Class ids in order of first appearance."""
    classes: dict[str, int] = {}
    return torch.tensor([classes.setdefault(k, len(classes)) for k in keys]), len(classes)


@pytest.fixture(scope="module")
def vocab() -> tuple[list[str], list[str]]:
    """(decoded text, vocabulary string) of every id, read from tokenizer.json itself."""
    backend = tokenizers.Tokenizer.from_file(str(default_tokenizer_path()))
    n = backend.get_vocab_size(with_added_tokens=True)
    texts = [backend.decode([i], skip_special_tokens=False) for i in range(n)]
    return texts, [backend.id_to_token(i) for i in range(n)]


@pytest.fixture(scope="module")
def shipped_map() -> tuple[torch.Tensor, int]:
    return engram_token_map(Tokenizer())


def test_every_id_equals_the_published_rules(vocab, shipped_map):
    ours, n_classes = shipped_map
    published, n_published = number_classes(published_keys(*vocab))
    assert len(vocab[0]) == ours.numel() == N_IDS
    assert n_classes == n_published == N_CLASSES
    assert int((ours == published).sum()) == N_IDS


@pytest.mark.parametrize(
    "broken",
    [{"raw_prefix": "\x00raw:"}, {"ws": r"\s+"}, {"sentinel": False}, {"fallback": False}],
    ids=["raw-prefix", "any-whitespace", "no-sentinel", "no-fallback"],
)
def test_the_comparison_catches_each_old_deviation(vocab, shipped_map, broken):
    """Each rule of the old map, put back into the second implementation, breaks the equality above."""
    ours, _ = shipped_map
    wrong, n_wrong = number_classes(published_keys(*vocab, **broken))
    assert n_wrong != N_CLASSES or int((ours != wrong).sum()) > 0


def test_spot_ids(shipped_map):
    tok = Tokenizer()
    m, _ = shipped_map

    def cls(vocab_string: str) -> int:
        return int(m[tok.require_token(vocab_string)])

    # class ids pinned from the published rules (first appearance in id order)
    assert [int(m[i]) for i in (0, 1, 71, 97, 168, 203, 223, 45948)] == [0, 1, 39, 71, 142, 176, 174, 15844]
    # whitespace: any run of [ \t\r\n] (and NFKC spaces) is the lone-space class, kept by the sentinel
    assert cls("Ġ") == cls("ĠĠ") == cls("ĊĊ") == cls("ĉ") == cls("č") == int(m[18524]) == 174  # 18524 = U+3000
    # "\x0c" and "\x0b" are not in [ \t\r\n]: Strip() empties them, so their own text is the key
    assert len({cls("Č"), cls("ċ"), cls("Ġ")}) == 3
    assert cls("ĠHello") == cls("Hello") == cls("Ġhello") == cls("hello") != cls("Ġcafe")
    # a byte fragment (U+FFFD when decoded) is keyed by its vocabulary string, never merged with text
    assert tok.decode([168]) == "\ufffd" and int(m[168]) != cls("e")


def test_normalise_rules():
    assert normalise("  Ｈéllo\t\nWORLD ") == "hello world"  # NFKC fullwidth, accents, case, whitespace
    assert normalise("Ç") == "c" and normalise("া") == ""  # Bengali vowel sign (Mc) is stripped too
    assert normalise("\n\n") == " " and normalise("\x0c") == "" and normalise("a\x0cb") == "a\x0cb"


def test_model_map_checks_the_class_count():
    from flashtier.engine.model.config import preset

    with pytest.raises(ValueError, match="n_classes: .* gives 99092 Engram classes .* 99738"):
        model_token_map(Tokenizer(), preset("tiny").replace(engram_compressed_vocab=99_738))
