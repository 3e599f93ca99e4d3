"""Engram: hashed 2..N-gram memory added to the residual streams before layers 1 and 14 (model.md §3.7).

Hashing (depends on token ids only, so it is prefetchable and needs no KV state)::

    tok[s]   = compressed id of the token at pos - s (s = 0..N-1); the pad class when pos < s
    r        = tok[0] * M[0];  for n = 2..N: r ^= tok[n-1] * M[n-1];  hash[n][h] = r % prime[n][h]
    row      = hash[n][h] + offset[n][h]             offsets = cumulative table sizes in (n, h) order

M: ``2 * default_rng(10007 * layer).integers(0, (int64max // V) // 2, size=N) + 1`` (V = compressed
vocab). primes: for each Engram layer in order, for n = 2..N, for each head: the next unused prime
>= ``engram_vocab_size``. Gating, per stream k (fp32)::

    e = dequant(table[rows]) [T, n_hashes * head_dim];  kv = wkv(e);  key[k] = kv[k*D:(k+1)*D], value = kv[hc*D:]
    dot[k]  = sum_c h[k,c] q_w[k,c] k_w[k,c] key[k,c] * rsqrt(ms(h[k])+eps) * rsqrt(ms(key[k])+eps) / sqrt(D)
    gate[k] = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)));   h[k] += gate[k] * value
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from flashtier.engine.model.config import ModelConfig
from flashtier.engine.model.embedding import embedding
from flashtier.engine.model.fp8_linear import linear
from flashtier.engine.model.numerics import up
from flashtier.kernels.row_reduce.op import mean_square, row_sum


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    for f in range(3, math.isqrt(n) + 1, 2):
        if n % f == 0:
            return False
    return True


def engram_primes(cfg: ModelConfig) -> dict[int, list[list[int]]]:
    """layer id -> primes[n - 2][head] for every Engram layer (all distinct, ascending)."""
    out: dict[int, list[list[int]]] = {}
    cand = cfg.engram_vocab_size
    for layer in cfg.engram_layer_ids:
        per_n = []
        for _n in range(2, cfg.engram_max_ngram_size + 1):
            heads = []
            for _h in range(cfg.engram_n_heads):
                while not _is_prime(cand):
                    cand += 1
                heads.append(cand)
                cand += 1
            per_n.append(heads)
        out[layer] = per_n
    return out


def engram_multipliers(cfg: ModelConfig, layer: int) -> list[int]:
    rng = np.random.default_rng(10007 * layer)
    hi = (np.iinfo(np.int64).max // cfg.engram_compressed_vocab) // 2
    return [int(2 * v + 1) for v in rng.integers(0, hi, size=cfg.engram_max_ngram_size)]


def engram_table_rows(cfg: ModelConfig, layer: int) -> int:
    return sum(sum(heads) for heads in engram_primes(cfg)[layer])


def default_token_map(cfg: ModelConfig) -> torch.Tensor:
    """Fallback token -> compressed-class map (id mod compressed vocab) when no tokenizer is given.

    The real map normalises each token's text (server side); the engine only needs some map that is
    fixed for a checkpoint. Built on the CPU whatever the default device: under the loader's meta device a
    meta ``%`` imports torch's compiler stack (~2 s of a server start) for a buffer the loader replaces anyway.
    """
    return torch.arange(cfg.vocab_size, dtype=torch.long, device="cpu") % cfg.engram_compressed_vocab


class Engram(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        d, hd = cfg.hidden_size, cfg.engram_head_dim
        primes = engram_primes(cfg)[layer]
        flat = [p for heads in primes for p in heads]
        self.n_hashes = len(flat)
        self.embed = embedding(sum(flat), hd, dtype)
        self.wkv = nn.Linear(self.n_hashes * hd, (cfg.hc_mult + 1) * d, bias=False, dtype=dtype)
        self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, d, dtype=torch.float32))
        self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, d, dtype=torch.float32))
        # hashing constants are plain lists: they never travel with the weights (meta-device safe)
        self.primes = flat
        self.offsets = [sum(flat[:i]) for i in range(len(flat))]
        self.multipliers = engram_multipliers(cfg, layer)
        # engram_offload moves the table to host memory: then ``embed`` is None and ``host`` (HostEngramTables)
        # brings the step's rows to the device; a plain attribute, so .to() and state_dict() never see it
        self.host = None

    def _constants(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(primes, offsets) on ``dev``, made once per device: a copy from a Python list waits for the device and
        cannot be captured in a CUDA graph."""
        cached = self.__dict__.setdefault("_consts", {})
        if dev not in cached:
            cached[dev] = (torch.tensor(self.primes, dtype=torch.long, device=dev),
                           torch.tensor(self.offsets, dtype=torch.long, device=dev))
        return cached[dev]

    def rows(self, ngram_ids: torch.Tensor) -> torch.Tensor:
        """Table rows [T, n_hashes] from compressed ids ngram_ids [T, N] (column s = token at pos - s)."""
        dev = ngram_ids.device
        m = self.multipliers
        heads = self.cfg.engram_n_heads
        primes, offsets = self._constants(dev)
        r = ngram_ids[:, 0] * m[0]
        hashes = []
        for n in range(2, self.cfg.engram_max_ngram_size + 1):
            r = torch.bitwise_xor(r, ngram_ids[:, n - 1] * m[n - 1])
            p = primes[(n - 2) * heads : (n - 1) * heads]
            hashes.append(torch.remainder(r[:, None], p[None, :]))
        return torch.cat(hashes, dim=1) + offsets[None, :]

    def forward(self, h: torch.Tensor, ngram_ids: torch.Tensor) -> torch.Tensor:
        """h [T, hc, D] residual streams -> updated streams (fp32)."""
        cfg = self.cfg
        t, hc, d = h.shape
        if self.host is not None:
            e = self.host.take(self.layer, ngram_ids, self.rows)
        else:
            e = self.embed.weight[self.rows(ngram_ids)]
        e = e.reshape(t, self.n_hashes * cfg.engram_head_dim)
        kv = linear(e, self.wkv)  # act quant: official Engram.forward, self.wkv(self.embed(...)) (fp8 Linear)
        key = kv[:, : hc * d].view(t, hc, d)
        value = kv[:, hc * d :]
        h = up(h)
        eps = cfg.rms_norm_eps
        # row reductions of fixed order on CUDA (kernels/row_reduce/op.py): a token's gate does not move with its batch
        rh = torch.rsqrt(mean_square(h) + eps)
        rk = torch.rsqrt(mean_square(key) + eps)
        dot = row_sum(h * self.q_weight * self.k_weight * key) * rh * rk / math.sqrt(d)
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
        return h + gate[..., None] * value[:, None, :]


def ngram_ids(token_map: torch.Tensor, history: torch.Tensor, n: int, pad_class: int) -> torch.Tensor:
    """Compressed ids [T, n] for the last T tokens of ``history`` (all token ids so far, [P]).

    Column s holds the class of the token s positions back; positions before 0 get ``pad_class``.
    """
    comp = token_map[history]
    pad = torch.full((n - 1,), pad_class, dtype=comp.dtype, device=comp.device)
    padded = torch.cat((pad, comp))
    cols = [padded[n - 1 - s : padded.numel() - s] for s in range(n)]
    return torch.stack(cols, dim=1)
