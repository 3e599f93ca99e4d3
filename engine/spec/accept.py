"""The acceptance rules of speculative decoding: which drafts a sequence keeps and which token follows them.

A VERIFY work of D drafts yields D + 1 target rows: row j is the target's distribution for the position of
draft j + 1 given the sequence and drafts 1..j (row D: the position after the last draft).

    greedy   row j's target token is the argmax of its processed logits, exactly what ``Sampler`` picks for a
             greedy row (same steps, same float32 copy). Drafts are accepted while they equal it; the first
             mismatch's target token is emitted instead, so the tokens equal plain decoding's.
    sampled  speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft d, drawn from q, is
             accepted with probability min(1, p(d) / q(d)); on a rejection the token is drawn from
             max(p - q, 0) renormalised and the remaining drafts are dropped; when every draft is accepted one
             more token is drawn from row D. Each emitted token then follows p exactly, whatever q is.
             Greedy drafts are q = one-hot.

``p`` is the distribution ``Sampler`` draws from: min_tokens, penalties (with the drafts before the row
counted as generated), temperature, top-k / top-p, min-p (sampler.py, steps 2-8).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashtier.engine.sample.processors import apply_min_p, apply_top_k_top_p
from flashtier.engine.sample.processors import apply_min_tokens, apply_penalties
from flashtier.engine.sample.row import SamplerRow
from flashtier.engine.sample.row import to_device


def target_rows(logits: torch.Tensor, rows: Sequence[SamplerRow],
                eos_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sampler steps 2-8 on ``logits`` [R, V] (not modified): (greedy ids [R], p [R, V] fp32 or None).

    p is only computed when a row samples; greedy rows' rows of p are meaningless."""
    x = logits.float().clone()
    apply_min_tokens(x, rows, eos_token_id)
    apply_penalties(x, rows)
    greedy_ids = x.argmax(dim=-1)
    params = [r.params for r in rows]
    sampled = [not p.is_greedy for p in params]
    if not any(sampled):
        return greedy_ids, None
    dev = x.device
    x.div_(to_device([p.temperature if s else 1.0 for p, s in zip(params, sampled)], torch.float32, dev)[:, None])
    live = [p for p, s in zip(params, sampled) if s]
    top_k = top_p = None
    if any(p.top_k_enabled for p in live):
        top_k = to_device([p.top_k if s and p.top_k_enabled else 0 for p, s in zip(params, sampled)],
                          torch.int64, dev)
    if any(p.top_p < 1.0 for p in live):
        top_p = to_device([p.top_p if s else 1.0 for p, s in zip(params, sampled)], torch.float32, dev)
    apply_top_k_top_p(x, top_k, top_p)
    if any(p.min_p > 0.0 for p in live):
        apply_min_p(x, to_device([p.min_p if s else 0.0 for p, s in zip(params, sampled)], torch.float32, dev))
    return greedy_ids, x.softmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` [V] (need not sum to 1) by the exponential race, with ``generator``'s draws."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return int((probs / noise).argmax())


def accept_greedy(target_ids: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The emitted tokens: the accepted drafts, then the target's token at the first mismatch (or after the
    last draft). ``target_ids`` [D + 1]."""
    n = 0
    while n < len(drafts) and drafts[n] == target_ids[n]:
        n += 1
    return list(drafts[:n]) + [int(target_ids[n])]


def accept_sampled(p: torch.Tensor, drafts: Sequence[int], q: torch.Tensor | None,
                   generator: torch.Generator | None) -> list[int]:
    """The emitted tokens of speculative sampling: p [D + 1, V] target rows, q [D, V] the distributions the
    drafts were drawn from (None: greedy drafts, q = one-hot). Draws from ``generator``."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        qj = q[j] if q is not None else torch.nn.functional.one_hot(torch.tensor(d, device=p.device),
                                                                    p.shape[1]).to(p.dtype)
        u = torch.rand((), generator=generator, device=p.device, dtype=torch.float64)
        if float(u) * float(qj[d]) < float(p[j, d]):  # accept with probability min(1, p(d) / q(d))
            out.append(int(d))
            continue
        residual = (p[j] - qj).clamp_min(0)
        if not bool(residual.sum() > 0):  # p <= q everywhere (rounding): p itself is then the residual
            residual = p[j]
        return out + [draw(residual, generator)]
    return out + [draw(p[len(drafts)], generator)]
