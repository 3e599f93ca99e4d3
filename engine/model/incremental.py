"""The incremental path: prefill (chunked) + decode over contiguous per-sequence caches.

This is the un-paged form of what the engine runs: per layer a window ring of ``window`` slots
(slot = position % window), per KV source an ``EntryStore`` of global entries, the ratio-2
partial groups, and the encoder outputs of the newest ``window`` tokens (the decoder replay input).

    prefill(tokens):  encoder over every chunk (+ S20 projection)      -> positions [len, len + L)
                      decoder bounded replay over [n - W, n) with the decoder rings reset and the
                      window truncated at n - W (or, with ``decoder_replay=False``, the decoder on
                      every chunk: the exact full pass, plan (a))
    decode(token):    one position through the encoder and the decoder
    resume_replay(R): encoder bounded replay: keep cached entries < R, re-encode from R - W

Every method mutates the ``SequenceState`` it is given and needs no lock (one owner per state).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from flashtier.engine.model.batch_forward import decode_batch, encode_batch
from flashtier.engine.model.compressor import PartialGroup
from flashtier.engine.model.layer_forward import EntryStore, LocalKeys
from flashtier.engine.model.numerics import qdq
from flashtier.engine.model.transformer import Transformer
from flashtier.kernels.quant.fp8 import fp8_qdq


@dataclass
class Ring:
    """A layer's window KV ring: slot = position % window; pos = -1 marks an empty slot."""

    kv: torch.Tensor  # [W, hd]
    pos: torch.Tensor  # [W]

    def keys(self, start: int) -> LocalKeys:
        return LocalKeys(self.kv, self.pos, start)

    def write(self, kv_raw: torch.Tensor, pos: torch.Tensor) -> None:
        """Store the newest ``window`` of raw window KV rows (FP8 quantise-dequantise on the way in)."""
        w = self.kv.shape[0]
        kv_raw, pos = kv_raw[-w:], pos[-w:]
        slots = pos % w
        self.kv[slots] = qdq(fp8_qdq, kv_raw).to(self.kv.dtype)
        self.pos[slots] = pos

    def clear(self) -> None:
        self.pos.fill_(-1)


@dataclass
class SequenceState:
    """Everything one sequence carries between steps (contiguous form)."""

    tokens: list[int] = field(default_factory=list)  # every token fed to the encoder, in order
    rings: list[Ring] = field(default_factory=list)  # per backbone layer
    stores: dict[int, EntryStore] = field(default_factory=dict)  # per KV source layer
    partial: dict[int, PartialGroup | None] = field(default_factory=dict)  # ratio-2 sources
    enc_start: int = 0  # encoder window truncation (encoder bounded replay start)
    dec_start: int = 0  # decoder window truncation (decoder bounded replay start)
    write_from: int = 0  # global entries below this position come from the cache
    tail_x: torch.Tensor | None = None  # encoder outputs of the newest W positions [<=W, hc, D]
    tail_pre: torch.Tensor | None = None
    dec_len: int = 0  # positions the decoder has processed

    @property
    def length(self) -> int:
        return len(self.tokens)

    def ring_keys(self, layer: int, start: int) -> LocalKeys:
        return self.rings[layer].keys(start)

    def ring_write(self, layer: int, kv_raw: torch.Tensor, pos: torch.Tensor) -> None:
        self.rings[layer].write(kv_raw, pos)

    def clone(self) -> "SequenceState":
        return copy.deepcopy(self)


class IncrementalModel:
    """Prefill/decode driver over ``SequenceState`` for one model (no batching)."""

    def __init__(self, model: Transformer):
        self.model = model
        self.cfg = model.cfg

    def new_state(self) -> SequenceState:
        cfg, dev, cdt = self.cfg, self.model.device, self.model.compute_dtype
        w = cfg.sliding_window
        return SequenceState(
            rings=[
                Ring(
                    torch.zeros(w, cfg.head_dim, device=dev, dtype=cdt),
                    torch.full((w,), -1, dtype=torch.long, device=dev),
                )
                for _ in range(cfg.num_hidden_layers)
            ],
            stores={
                src: EntryStore(64, cfg.head_dim, cfg.index_head_dim, dev, cdt) for src in cfg.kv_source_layer_ids
            },
            partial={src: None for src in cfg.kv_source_layer_ids if cfg.compress_ratios[src] == 2},
        )

    # ---- encoder / decoder ---------------------------------------------------------------------
    def encode(self, state: SequenceState, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run new tokens through the encoder; project their decoder entries (S20).

        Mutates the encoder rings, the stores, the partial groups, ``tokens`` and the tail.
        Returns the encoder outputs (x [L, hc, D], pre [L, hc]).
        """
        return encode_batch(self.model, [state], [tokens])[0]

    def decode_layers(self, state: SequenceState, x: torch.Tensor, pre: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Run encoder outputs at positions pos through the decoder; logits of the LAST position [V].

        Mutates the decoder rings and ``dec_len``.
        """
        logits = decode_batch(self.model, [state], [x], [pre], [pos])[0]
        state.dec_len = int(pos[-1]) + 1
        return logits

    # ---- public steps ---------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(
        self, state: SequenceState, tokens: list[int], *, chunk_size: int | None = None, decoder_replay: bool = True
    ) -> torch.Tensor:
        """Append prompt tokens; returns the logits [V] of the last one.

        With ``decoder_replay`` (CED) the decoder runs only over the last ``window`` prompt tokens
        with its rings reset and its window truncated at the replay start.
        """
        if not tokens:
            raise ValueError("prefill needs at least one token")
        chunk = chunk_size or len(tokens)
        logits = None
        for i in range(0, len(tokens), chunk):
            part = tokens[i : i + chunk]
            x, pre = self.encode(state, part)
            if not decoder_replay:
                pos = torch.arange(state.length - len(part), state.length, device=self.model.device)
                logits = self.decode_layers(state, x, pre, pos)
        if decoder_replay:
            n = state.length
            d = max(0, n - self.cfg.sliding_window, state.enc_start)
            for layer in range(self.cfg.n_encoder_layers, self.cfg.num_hidden_layers):
                state.rings[layer].clear()
            state.dec_start = d
            pos = torch.arange(d, n, device=self.model.device)
            logits = self.decode_layers(state, state.tail_x[-(n - d):], state.tail_pre[-(n - d):], pos)
        return logits

    @torch.no_grad()
    def decode(self, state: SequenceState, token: int) -> torch.Tensor:
        """Feed one sampled token through encoder and decoder; its logits [V]."""
        x, pre = self.encode(state, [token])
        return self.decode_layers(state, x, pre, torch.tensor([state.length - 1], device=self.model.device))

    def resume_replay(self, cached: SequenceState, resume_at: int) -> SequenceState:
        """A new state holding ``cached``'s global entries below ``resume_at`` and nothing local.

        The caller then prefills ``tokens[resume_at - window:]``: those first ``window`` tokens are
        the encoder bounded replay (their window KV is regenerated, their global entries are not).
        """
        cfg = self.cfg
        w = cfg.sliding_window
        if resume_at < w or resume_at > cached.length:
            raise ValueError(f"resume point {resume_at} must lie in [window={w}, cached length={cached.length}]")
        state = self.new_state()
        for src, store in cached.stores.items():
            ratio = cfg.compress_ratios[src]
            if resume_at % ratio:
                raise ValueError(f"resume point {resume_at} is not a multiple of ratio {ratio}")
            state.stores[src] = store.clone()
            state.stores[src].truncate(resume_at // ratio)
        state.tokens = list(cached.tokens[: resume_at - w])
        state.enc_start = resume_at - w
        state.write_from = resume_at
        return state


def greedy_generate(
    runner: IncrementalModel, prompt: list[int], max_tokens: int, **prefill_kw
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and their logits: prefill, then decode ``max_tokens - 1`` more."""
    state = runner.new_state()
    logits = runner.prefill(state, prompt, **prefill_kw)
    out, all_logits = [], []
    for i in range(max_tokens):
        all_logits.append(logits)
        tok = int(torch.argmax(logits))
        out.append(tok)
        if i + 1 < max_tokens:
            logits = runner.decode(state, tok)
    return out, all_logits
