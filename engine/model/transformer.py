"""The V4.1-Flash text backbone: embedding, 40 blocks, DSpark stages, final collapse, norm and head.

Module names equal the official checkpoint names (no ``model.`` prefix), so ``state_dict()`` keys are
the tensor names of the checkpoint layout (``layers.3.attn.wq_a.weight``, ``mtp.0.main_proj.weight``,
...). ``weight_formats`` says how each is stored on disk (model.md §4).
"""

from __future__ import annotations

import torch
from torch import nn

from flashtier.engine.model.block import Block
from flashtier.engine.model.config import ModelConfig
from flashtier.engine.model.dspark import DSparkStage
from flashtier.engine.model.embedding import embedding
from flashtier.engine.model.engram import default_token_map
from flashtier.engine.model.mhc import hc_pre
from flashtier.engine.model.norm import RMSNorm
from flashtier.engine.model.numerics import linear_up, up


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, with_dspark: bool = True):
        super().__init__()
        self.cfg = cfg
        self.roles = cfg.layer_roles()
        self.embed = embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(Block(cfg, role, dtype) for role in self.roles)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        n_mtp = cfg.num_nextn_predict_layers if with_dspark else 0
        self.mtp = nn.ModuleList(DSparkStage(cfg, i, n_mtp, dtype) for i in range(n_mtp))
        self.register_buffer("token_map", default_token_map(cfg), persistent=False)

    def set_token_map(self, token_map: torch.Tensor) -> None:
        """Install the Engram token -> compressed-class map (built from the tokenizer by the server)."""
        if token_map.shape != (self.cfg.vocab_size,):
            raise ValueError(f"token map must have shape ({self.cfg.vocab_size},), got {tuple(token_map.shape)}")
        if int(token_map.min()) < 0 or int(token_map.max()) >= self.cfg.engram_compressed_vocab:
            raise ValueError(f"token map classes must lie in [0, {self.cfg.engram_compressed_vocab})")
        self.token_map = token_map.to(torch.long)

    def embed_streams(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> residual streams [T, hc, D] fp32 (the embedding copied into every stream)."""
        h = up(self.embed.weight[ids])
        return h[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()

    def logits(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Collapse with the last FFN's pre, final norm, fp32 head -> [T, V]."""
        return linear_up(self.norm(hc_pre(x, pre)), self.head.weight)

    @property
    def n_encoder_layers(self) -> int:
        return self.cfg.n_encoder_layers

    @property
    def compute_dtype(self) -> torch.dtype:
        """float64 when the parameters are float64 (the exactness-test mode), else float32."""
        return up(self.embed.weight[:1]).dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device


def weight_formats(model: Transformer) -> dict[str, str]:
    """Storage format of each checkpoint tensor: fp8 | fp8_rows | mxfp4 | bf16 | fp32 (model.md §4)."""
    fp8_suffixes = (
        "attn.wq_a.weight",
        "attn.wq_b.weight",
        "attn.wkv.weight",
        "attn.wo_a.weight",
        "attn.wo_b.weight",
        "attn.indexer.wq_b.weight",
        "engram.wkv.weight",
        "main_proj.weight",
    )
    out: dict[str, str] = {}
    for name, t in model.state_dict().items():
        if ".shared_experts." in name:
            out[name] = "fp8"
        elif ".experts." in name:
            out[name] = "mxfp4"
        elif name.endswith("engram.embed.weight"):
            out[name] = "fp8_rows"
        elif name.endswith(fp8_suffixes):
            out[name] = "fp8"
        elif t.dtype == torch.float32 and t.dim() <= 2 and (
            "norm" in name or "hc_" in name or "sink" in name or "gate.bias" in name
            or "q_weight" in name or "k_weight" in name or "confidence" in name
        ):
            out[name] = "fp32"
        else:
            out[name] = "bf16"
    return out
