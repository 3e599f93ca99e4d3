"""Structured output in the engine: the bitmask unpacking against a per-token reference, the sampler's
grammar step (constrained rows only see allowed tokens, other rows are bit-identical), the
``begin_after_token`` switch, and the engine on the tiny model producing grammar-conforming output
for every choice of a batched, seeded request."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from flashtier.engine.grammar.compiler import ConstraintError, GrammarCompiler
from flashtier.engine.grammar.constraint import ConstraintKind, ConstraintSpec, GrammarState, OutputConstraint
from flashtier.engine.sample.sampler import Sampler, SamplerRow
from flashtier.engine.sample.sampler import allowed_tokens, apply_token_bitmask
from flashtier.engine.sample.params import SamplingParams
from flashtier.server.grammar.service import grammar_vocab
from flashtier.server.text.tokenizer import Tokenizer

from .test_engine import make_engine, run

VOCAB_GRID = [1, 31, 32, 33, 95, 1000]  # ragged: below, at and above a 32-token word


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer()


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler(grammar_vocab(tok, tok.vocab_size, (tok.eos_id,)))


def reference_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Token by token: bit t % 32 of word t // 32."""
    out = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool)
    for b in range(bitmask.shape[0]):
        for t in range(vocab):
            out[b, t] = bool((int(bitmask[b, t // 32]) >> (t % 32)) & 1)
    return out


@pytest.mark.parametrize("vocab", VOCAB_GRID)
def test_bitmask_unpacking_equals_the_per_token_reference(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    want = reference_allowed(bitmask, vocab)
    assert torch.equal(allowed_tokens(bitmask, vocab), want)
    broken = bitmask.clone()
    broken[1, (vocab - 1) // 32] ^= 1 << ((vocab - 1) % 32)  # flip the last token's bit
    assert not torch.equal(allowed_tokens(broken, vocab), want)
    x = torch.randn(3, vocab, generator=g)
    masked = x.clone()
    apply_token_bitmask(masked, bitmask)
    assert torch.equal(masked[want], x[want]) and bool((masked[~want] == float("-inf")).all())


def test_sampler_masks_constrained_rows_only():
    g = torch.Generator().manual_seed(0)
    V = 200
    logits = torch.randn(3, V, generator=g)
    rows = [SamplerRow(SamplingParams(temperature=0)), SamplerRow(SamplingParams(temperature=0)),
            SamplerRow(SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(5))]
    free = Sampler()(logits, rows).token_ids
    bitmask = torch.full((3, (V + 31) // 32), -1, dtype=torch.int32)
    bitmask[1] = 0
    bitmask[1, 3] = 1 << 7  # only token 103
    rows[2] = SamplerRow(SamplingParams(temperature=1.0), generator=torch.Generator().manual_seed(5))
    masked = Sampler()(logits, rows, token_bitmask=bitmask).token_ids
    assert masked[1].item() == 103 and free[1].item() != 103
    assert masked[0].item() == free[0].item() and masked[2].item() == free[2].item()


def test_begin_after_token_lets_reasoning_run_free(compiler, tok):
    plain = compiler.compile(ConstraintSpec(ConstraintKind.REGEX, "ab", "t"))
    state = GrammarState(OutputConstraint(plain.grammar, begin_after_token=7, label="t"))
    assert not state.active and state.accept(123) and not state.active  # reasoning: anything goes
    assert state.accept(7) and state.active  # </think>
    a, b = tok.encode("a", allow_special=False), tok.encode("b", allow_special=False)
    assert state.accept(a[0]) and not state.accept(a[0])  # "aa" is not in the language
    assert state.accept(b[0]) and state.accept(tok.eos_id) and state.matcher.is_terminated()


def test_constraint_conflicts_with_ignore_eos_and_min_tokens(compiler):
    c = compiler.compile(ConstraintSpec(ConstraintKind.JSON_OBJECT, "", "response_format"))
    with pytest.raises(ValueError, match="ignore_eos and min_tokens"):
        SamplingParams(constraint=c, ignore_eos=True)
    with pytest.raises(ValueError, match="ignore_eos and min_tokens"):
        SamplingParams(constraint=c, min_tokens=2, max_tokens=5)


def test_uncompilable_grammars_name_their_field(compiler):
    with pytest.raises(ConstraintError, match=r"^response_format.json_schema: .*nonsense"):
        compiler.compile(ConstraintSpec(ConstraintKind.JSON_SCHEMA, '{"type": "nonsense"}', "response_format.json_schema"))
    with pytest.raises(ConstraintError, match=r"^structured_outputs.regex: "):
        compiler.compile(ConstraintSpec(ConstraintKind.REGEX, "(a", "structured_outputs.regex"))


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count", "ok", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}}}


def test_engine_output_matches_its_grammar_for_every_seeded_choice(tiny32, compiler, tok):
    """The tiny model's random weights would never write JSON; under the grammar every choice does."""
    engine = make_engine(tiny32)
    schema = compiler.compile(ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA), "response_format",
                                             any_whitespace=False))
    regex = compiler.compile(ConstraintSpec(ConstraintKind.REGEX, r"[a-c]{2,4}-\d{3}", "regex"))
    prompt = tok.encode("Answer in JSON:", allow_special=False)
    out = run(engine, [("json", prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=120, constraint=schema)),
                       ("re", prompt, SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=20, constraint=regex)),
                       ("free", prompt, SamplingParams(temperature=1.0, seed=5, max_tokens=12))])
    for i in range(4):
        text = tok.decode(out[("json", i)])
        jsonschema.validate(json.loads(text), SCHEMA)
    for i in range(2):
        assert re.fullmatch(r"[a-c]{2,4}-\d{3}", tok.decode(out[("re", i)]))
    with pytest.raises(ValueError):
        json.loads(tok.decode(out[("free", 0)]))  # the unconstrained neighbour is noise
