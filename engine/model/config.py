"""Model configuration: the V4.1-Flash text backbone's hyper-parameters and its layer roles.

One frozen dataclass, ``ModelConfig``. It is built from a preset name (``v4.1-flash``, ``flash-16e``,
``tiny``) or from an HF ``config.json`` (top level or its ``text_config``), never from module globals.
All layer numbers are 0-based (reference/model.md §0).

Layer roles (derived from ``compress_ratios`` and the source-layer lists, model.md §2.1)::

    layer  0  1 | 2  3..7 | 8  9..13 | 14 15..19 | 20  21..23 | 24  25..27 | ... | 36 37..39
    part   encoder                               | decoder
    ratio  0  0 | 2 ...                          | 1 ...
    role   swa  | full reuse | full reuse | full reuse | full reuse | reindex reuse | ...

- ``full``: owns a compressor (global KV source) and an indexer with its own K (index source).
- ``reindex``: owns an indexer query, scores only inside layer 20's candidate pool, reads the
  latest KV source's entries and index K.
- ``reuse``: reads the latest KV source's entries and reuses the latest index source's top-k.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LayerRole:
    """What one backbone layer is: encoder/decoder part, attention role and compression ratio."""

    index: int
    part: str  # "encoder" | "decoder"
    role: str  # "swa" | "full" | "reindex" | "reuse"
    ratio: int  # 0 (SWA only), 2 (encoder global), 1 (decoder global)
    kv_source: int | None  # layer whose compressor entries this layer reads (None for SWA-only)
    index_source: int | None  # layer whose top-k (or own indexer) this layer uses


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a V4.1-Flash-architecture checkpoint (names follow HF ``text_config``)."""

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    rms_norm_eps: float = 1e-20
    swiglu_limit: float = 10.0
    # rope
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_seq_len: int = 65536
    max_position_embeddings: int = 1048576
    sliding_window: int = 128
    # MoE
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    routed_scaling_factor: float = 1.5
    gate_temp: float = 1.0
    # CSA2
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000  # prime search start
    engram_pad_token_id: int = 2
    engram_compressed_vocab: int = 99092
    engram_scale_block: int = 32
    # DSpark drafter
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # tokens
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    name: str = "custom"
    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if len(self.compress_ratios) < self.num_hidden_layers:
            raise ValueError(
                f"compress_ratios has {len(self.compress_ratios)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}; give one ratio per backbone layer (plus DSpark stages)."
            )
        if self.head_dim <= self.qk_rope_head_dim or self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even and smaller than head_dim")
        if self.num_attention_heads % self.o_groups:
            raise ValueError("num_attention_heads must be divisible by o_groups")
        if self.head_dim % 32 or self.index_head_dim % 32:
            raise ValueError("head_dim and index_head_dim must be multiples of 32 (quantisation blocks)")
        if self.sliding_window < 2:
            raise ValueError("sliding_window must be at least 2")
        for lid in self.kv_source_layer_ids:
            if self.compress_ratios[lid] == 0:
                raise ValueError(f"kv source layer {lid} has compress ratio 0")

    # ---- derived geometry -------------------------------------------------------------------
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def n_encoder_layers(self) -> int:
        """Layers before the first ratio-1 layer: the CED encoder."""
        for i, r in enumerate(self.compress_ratios[: self.num_hidden_layers]):
            if r == 1:
                return i
        return self.num_hidden_layers

    @property
    def decoder_source(self) -> int:
        """The decoder's KV source layer (layer 20): its compressor projects the encoder output."""
        return self.n_encoder_layers

    @property
    def engram_n_hashes(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def layer_roles(self) -> list[LayerRole]:
        roles: list[LayerRole] = []
        kv_src: int | None = None
        idx_src: int | None = None
        n_enc = self.n_encoder_layers
        for i in range(self.num_hidden_layers):
            ratio = self.compress_ratios[i]
            part = "encoder" if i < n_enc else "decoder"
            if ratio == 0:
                roles.append(LayerRole(i, part, "swa", 0, None, None))
                continue
            if i in self.kv_source_layer_ids:
                kv_src, idx_src, role = i, i, "full"
            elif i in self.index_source_layer_ids:
                idx_src, role = i, "reindex"
            else:
                role = "reuse"
            if kv_src is None or self.compress_ratios[kv_src] != ratio:
                raise ValueError(f"layer {i} (ratio {ratio}) has no preceding kv source with the same ratio")
            roles.append(LayerRole(i, part, role, ratio, kv_src, idx_src))
        return roles

    def to_hf_dict(self) -> dict[str, Any]:
        """The config as an HF-style ``config.json`` dict (flat; readable by ``from_hf_dict``)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra",)}
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        d["architectures"] = ["DeepseekV41ForCausalLM"]
        d["model_type"] = "deepseek_v41"
        d["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [32, 32],
            "scale_fmt": "ue8m0",
            "expert_dtype": "fp4",
        }
        return d

    def replace(self, **kw: Any) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def from_hf_dict(raw: dict[str, Any], name: str = "config.json") -> ModelConfig:
    """Build a config from an HF ``config.json`` dict (its ``text_config`` when present).

    Unknown keys are ignored (kept in ``extra``); ``rope_scaling`` (YaRN) is flattened.
    Raises ValueError on inconsistent values (see ``ModelConfig.__post_init__``).
    """
    top = dict(raw)
    text = dict(top.get("text_config") or top)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    kw: dict[str, Any] = {}
    for key, value in text.items():
        if key in known and key not in ("extra", "name"):
            kw[key] = tuple(value) if isinstance(value, list) else value
    rs = text.get("rope_scaling") or {}
    if rs:
        kw["rope_factor"] = float(rs.get("factor", ModelConfig.rope_factor))
        kw["beta_fast"] = float(rs.get("beta_fast", ModelConfig.beta_fast))
        kw["beta_slow"] = float(rs.get("beta_slow", ModelConfig.beta_slow))
        kw["original_seq_len"] = int(
            rs.get("original_max_position_embeddings", ModelConfig.original_seq_len)
        )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
        if key in top and key not in kw:
            kw[key] = top[key]
    kw["name"] = str(top.get("_flashtier_preset", name))
    kw["extra"] = tuple(sorted((k, json.dumps(v)) for k, v in text.items() if k not in known))
    return ModelConfig(**kw)


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json; pass a model directory or --preset NAME")
    return from_hf_dict(json.loads(path.read_text()), name=str(model_dir))


def _v41_flash() -> ModelConfig:
    return ModelConfig(name="v4.1-flash")


def _tiny() -> ModelConfig:
    """The real 40-layer role layout at tiny width.

    Small window (16), top-k (8) and candidate pool (4 blocks of 8) so that bounded replay,
    index selection and the hierarchical pool all bite within a few hundred tokens. The
    vocabulary stays the real one so the real tokenizer works end to end.
    """
    return ModelConfig(
        name="tiny",
        hidden_size=64,
        num_attention_heads=4,
        head_dim=64,
        qk_rope_head_dim=16,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=32,
        original_seq_len=256,
        rope_factor=4.0,
        max_position_embeddings=65536,
        sliding_window=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        candidate_topk_blocks=4,
        candidate_block_size=8,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=8,
        hc_sinkhorn_iters=20,
        engram_n_heads=2,
        engram_head_dim=32,
        engram_vocab_size=1000,
        engram_compressed_vocab=99092,
        dspark_markov_rank=16,
        dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
    )


def _flash_16e() -> ModelConfig:
    """Real geometry with 16 routed experts per layer and small Engram tables (fits one H200)."""
    return ModelConfig(
        name="flash-16e",
        n_routed_experts=16,
        dspark_n_routed_experts=16,
        engram_vocab_size=100000,
    )


PRESETS = {"v4.1-flash": _v41_flash, "flash-16e": _flash_16e, "tiny": _tiny}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


def resolve(model_dir: str | Path | None, preset_name: str | None) -> ModelConfig:
    """The config for a CLI call: the model directory's config.json, else the preset."""
    if model_dir is not None:
        return load_config(model_dir)
    return preset(preset_name or "tiny")
