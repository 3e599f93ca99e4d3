"""The pieces of one backbone layer, written from the formulas of reference/model.md §3 (float64 math).

Used by ``independent_forward.py``; shares no code with ``engine/model``. ``W`` is that module's weight
accessor: ``W[name]`` is a float64 checkpoint tensor, ``W.fp8_linear(x, name)`` a linear whose weight is FP8
in the checkpoint (its input quantised when ``ACT_QUANT`` is on), ``W.linear(x, name)`` any other linear.
Shapes: T tokens of one run, hc residual streams of width D.
"""

from __future__ import annotations

import math

import numpy as np
import torch



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps))


def rope_freqs(dim: int, base: float, yarn: tuple[int, float, float, float] | None) -> torch.Tensor:
    """Inverse frequencies of the dim/2 interleaved pairs (§3.9), evaluated in float64 and held in fp32 as
    the model's rotation tables are. ``yarn`` = (original_seq_len, factor, beta_fast, beta_slow)."""
    f = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if yarn is not None:
        orig, factor, fast, slow = yarn

        def corr(rot: float) -> float:  # pair index whose wavelength makes `rot` turns over `orig` positions
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = max(math.floor(corr(fast)), 0), min(math.ceil(corr(slow)), dim - 1)
        keep = 1 - ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        f = f / factor * (1 - keep) + f * keep
    return f.to(torch.float32)


def rope(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """Rotate the last 2 * len(freqs) channels of x [T, ..., d] as complex pairs (x[2i], x[2i+1]) by pos * f."""
    n = 2 * freqs.numel()
    ang = pos.double()[:, None] * freqs.double()[None, :]
    shape = (pos.numel(),) + (1,) * (x.dim() - 2) + (n // 2,)
    rot = torch.polar(torch.ones_like(ang), sign * ang).view(shape)
    tail = torch.view_as_complex(x[..., -n:].reshape(*x.shape[:-1], n // 2, 2).contiguous())
    return torch.cat((x[..., :-n], torch.view_as_real(tail * rot).flatten(-2)), dim=-1)


def hc_mix(W, x: torch.Tensor, p: str, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, hc], post [T, hc], comb [T, hc, hc]) of sub-layer parameters ``p`` (§3.2)."""
    t, hc, d = x.shape
    flat = x.reshape(t, hc * d)
    m = (flat @ W[p + "_fn"].T) * torch.rsqrt((flat * flat).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    s, b = W[p + "_scale"], W[p + "_base"]
    pre = torch.sigmoid(m[:, :hc] * s[0] + b[:hc]) + cfg.hc_eps
    post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * s[1] + b[hc : 2 * hc])
    c = torch.softmax((m[:, 2 * hc :] * s[2] + b[2 * hc :]).view(t, hc, hc), dim=-1) + cfg.hc_eps
    c = c / (c.sum(1, keepdim=True) + cfg.hc_eps)  # columns first, then (rows, columns) pairs
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        c = c / (c.sum(2, keepdim=True) + cfg.hc_eps)
        c = c / (c.sum(1, keepdim=True) + cfg.hc_eps)
    return pre, post, c


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return torch.einsum("tj,tjd->td", pre, x)


def expand(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y[k] = post[k] * f + sum_j C[j, k] x[j]."""
    return post[:, :, None] * f[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, x)


def attention(q, win_kv, win_mask, glob_kv, glob_mask, sink, scale) -> torch.Tensor:
    """One softmax per (token, head) over the visible window keys and selected entries plus a sink; K = V.

    q [T, H, d]; win_kv [T, d] with win_mask [T, T]; glob_kv [E, d] with glob_mask [T, E] (or None)."""
    keys = win_kv if glob_kv is None else torch.cat((win_kv, glob_kv))
    mask = win_mask if glob_kv is None else torch.cat((win_mask, glob_mask), dim=1)
    logits = (torch.einsum("thd,kd->thk", q, keys) * scale).masked_fill(~mask[:, None, :], -math.inf)
    with_sink = torch.cat((logits, sink[None, :, None].expand(q.shape[0], -1, 1)), dim=-1)
    p = torch.softmax(with_sink, dim=-1)[..., :-1]
    return torch.einsum("thk,kd->thd", p, keys)


def topk_mask(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """[T, E] mask of the min(k, #valid) best valid entries of each row; equal scores: lower entry first."""
    s = scores.masked_fill(~valid, -math.inf)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
    take = torch.arange(order.shape[1])[None, :] < valid.sum(-1, keepdim=True).clamp(max=k)
    return torch.zeros_like(valid).scatter(1, order, take)


def candidate_mask(scores, visible, block: int, n_blocks: int) -> torch.Tensor:
    """Layer 20's pool (§3.5): blocks of ``block`` entries scored by their max, the newest visible block
    pinned, the ``n_blocks`` best finite blocks kept (lower block first on ties); [T, E] visible entries."""
    t, e = scores.shape
    nb = -(-e // block)
    padded = torch.full((t, nb * block), -math.inf, dtype=scores.dtype)
    padded[:, :e] = scores.masked_fill(~visible, -math.inf)
    bs = padded.view(t, nb, block).amax(-1)
    n_vis = visible.sum(-1)
    newest = torch.nn.functional.one_hot(((n_vis - 1).clamp(min=0) // block), nb).bool() & (n_vis > 0)[:, None]
    bs = bs.masked_fill(newest, math.inf)
    kept = topk_mask(bs, bs > -math.inf, n_blocks)
    return kept.repeat_interleave(block, dim=1)[:, :e] & visible


def moe(W, x: torch.Tensor, p: str, cfg, n_experts: int, top_k: int) -> torch.Tensor:
    """§3.6: sqrt-softplus scores, the bias only selects, SwiGLU clamped at the limit, weight before w2."""
    s = torch.sqrt(torch.nn.functional.softplus(W.linear(x, p + "gate.weight") / cfg.gate_temp))
    biased = s + W[p + "gate.bias"]
    idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = torch.gather(s, 1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
    lim = cfg.swiglu_limit

    def expert(e: str, rows: torch.Tensor, rw: torch.Tensor | None) -> torch.Tensor:
        a, b = W.fp8_linear(rows, e + "w1.weight"), W.fp8_linear(rows, e + "w3.weight")
        act = torch.nn.functional.silu(a.clamp(max=lim)) * b.clamp(-lim, lim)
        return W.fp8_linear(act if rw is None else rw[:, None] * act, e + "w2.weight")

    y = expert(p + "shared_experts.", x, None)
    for e in range(n_experts):
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        if tok.numel():
            y = y.index_add(0, tok, expert(f"{p}experts.{e}.", x[tok], w[tok, slot]))
    return y


def engram_primes(cfg) -> list[list[int]]:
    """Per Engram layer, the (n - 1) * heads table sizes: successive unused primes from engram_vocab_size."""
    out, p = [], cfg.engram_vocab_size
    for _ in cfg.engram_layer_ids:
        sizes = []
        while len(sizes) < (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads:
            if p > 1 and all(p % f for f in range(2, math.isqrt(p) + 1)):
                sizes.append(p)
            p += 1
        out.append(sizes)
    return out


def engram_rows(cfg, token_map: torch.Tensor, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """§3.7 hashing: Engram layer -> table rows [T, (N - 1) * heads] of every position of ``tokens``."""
    n, heads = cfg.engram_max_ngram_size, cfg.engram_n_heads
    cls = token_map[tokens].long()
    pad = int(token_map[cfg.engram_pad_token_id])
    back = torch.stack([torch.cat((torch.full((s,), pad), cls[: cls.numel() - s])) for s in range(n)], dim=1)
    out = {}
    for layer, sizes in zip(cfg.engram_layer_ids, engram_primes(cfg)):
        bound = (np.iinfo(np.int64).max // cfg.engram_compressed_vocab) // 2
        mult = 2 * np.random.default_rng(10007 * layer).integers(0, bound, size=n, dtype=np.int64) + 1
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        h, cols = back[:, 0] * int(mult[0]), []
        for g in range(1, n):
            h = torch.bitwise_xor(h, back[:, g] * int(mult[g]))
            for j in range(heads):
                i = (g - 1) * heads + j
                cols.append(h % sizes[i] + int(offsets[i]))
        out[layer] = torch.stack(cols, dim=1)
    return out


def engram(W, x: torch.Tensor, rows: torch.Tensor, p: str, eps: float) -> torch.Tensor:
    """Gated add of the hashed memory to every stream (§3.7)."""
    t, hc, d = x.shape
    kv = W.fp8_linear(W[p + "embed.weight"][rows].reshape(t, -1), p + "wkv.weight")
    key, value = kv[:, : hc * d].view(t, hc, d), kv[:, hc * d :]
    ms = lambda v: (v * v).mean(-1)  # noqa: E731
    dot = (x * W[p + "q_weight"] * W[p + "k_weight"] * key).sum(-1)
    dot = dot * torch.rsqrt(ms(x) + eps) * torch.rsqrt(ms(key) + eps) / math.sqrt(d)
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
    return x + gate[..., None] * value[:, None, :]

