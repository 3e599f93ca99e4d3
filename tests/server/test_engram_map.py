"""The Engram token normalisation map built from the real tokenizer."""

import torch

from flashtier.server.engram_map import engram_token_map, normalise
from flashtier.server.tokenizer import Tokenizer


def test_normalise_rules():
    assert normalise("  Ｈéllo\t\nWORLD ") == "hello world"  # NFKC fullwidth, accents, case, whitespace
    assert normalise("Ç") == "c"


def test_map_over_the_real_vocabulary():
    tok = Tokenizer()
    folded, n_keys = engram_token_map(tok, 129280, 99092)
    raw, _ = engram_token_map(tok, 129280)
    # the shipped V4 tokenizer gives 99,738 keys; V4.1's config asserts 99,092 (docs/model.md)
    assert 99000 < n_keys < 100500 and int(raw.max()) == n_keys - 1
    assert int(folded.max()) < 99092 and torch.equal(folded, raw % 99092)
    hello, upper = tok.encode(" hello"), tok.encode(" Hello")
    assert len(hello) == len(upper) == 1 and raw[hello[0]] == raw[upper[0]]
    a, b = tok.encode(" cat"), tok.encode(" dog")
    assert raw[a[0]] != raw[b[0]]
