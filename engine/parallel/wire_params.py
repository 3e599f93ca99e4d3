"""``SamplingParams`` on the wire to the rank processes: everything pickles except a compiled grammar.

xgrammar's ``CompiledGrammar`` does not pickle; it travels as its own JSON (``serialize_json``), and a
rank rebuilds it against the vocabulary's ``TokenizerInfo``, which travels once per vocabulary (it is
megabytes for a real tokenizer) and is kept by the receiving ``ParamsDecoder``. A server has one
vocabulary, so one ``TokenizerInfo`` is sent in its life; vocabularies are told apart by xgrammar's
metadata (vocab type and size, stop and special ids).

Encoder and decoder are stateful and must see the same sequence of params: the driver's sender thread
encodes each event once and sends the same bytes to every rank, in order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flashtier.engine.grammar.constraint import OutputConstraint
from flashtier.engine.sample.params import SamplingParams

if TYPE_CHECKING:
    import xgrammar as xgr

__all__ = ["ParamsDecoder", "ParamsEncoder", "WireConstraint", "WireParams"]


@dataclass(frozen=True)
class WireConstraint:
    grammar_json: str
    begin_after_token: int | None
    label: str
    vocab_key: str  # xgrammar's metadata of the vocabulary the grammar was compiled for
    tokenizer_json: str | None  # that vocabulary's TokenizerInfo, on the first constraint that uses it


@dataclass(frozen=True)
class WireParams:
    params: SamplingParams  # with constraint=None
    constraint: WireConstraint | None = None


class ParamsEncoder:
    """Driver side (one thread): ``SamplingParams`` -> ``WireParams``. Mutates its record of the vocabularies
    already sent."""

    def __init__(self) -> None:
        self._sent: set[str] = set()

    def encode(self, params: SamplingParams) -> WireParams:
        c = params.constraint
        if c is None:
            return WireParams(params)
        info = c.grammar.tokenizer_info
        key = info.dump_metadata()
        tokenizer_json = None if key in self._sent else info.serialize_json()
        self._sent.add(key)
        wire = WireConstraint(c.grammar.serialize_json(), c.begin_after_token, c.label, key, tokenizer_json)
        return WireParams(dataclasses.replace(params, constraint=None), wire)


class ParamsDecoder:
    """Rank side: ``WireParams`` -> ``SamplingParams``. Mutates its cache of vocabularies. ValueError when a
    grammar names a vocabulary it was never sent (the encoder and decoder saw different sequences)."""

    def __init__(self) -> None:
        self._infos: dict[str, xgr.TokenizerInfo] = {}

    def decode(self, wire: WireParams) -> SamplingParams:
        c = wire.constraint
        if c is None:
            return wire.params
        import xgrammar as xgr  # the first grammar: engine/grammar/compiler.py says why lazily

        if c.tokenizer_json is not None:
            self._infos[c.vocab_key] = xgr.TokenizerInfo.deserialize_json(c.tokenizer_json)
        info = self._infos.get(c.vocab_key)
        if info is None:
            raise ValueError(f"constraint {c.label!r}: its vocabulary was never sent to this rank")
        grammar = xgr.CompiledGrammar.deserialize_json(c.grammar_json, info)
        return dataclasses.replace(wire.params, constraint=OutputConstraint(grammar, c.begin_after_token, c.label))
