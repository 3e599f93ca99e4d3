"""EngineConfig: the one (frozen) configuration object of flashtier.engine (built by server/config/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass


RESUME_POLICIES = ("replay", "exact-or-cold")
FORWARDS = ("auto", "batched", "per-sequence")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str | None = None  # a checkpoint directory; None: the preset with seeded random weights
    preset: str = "tiny"
    weights_seed: int = 0
    dtype: str = "float32"  # float32 | bfloat16 | float64 (the exactness-test mode)
    device: str = "cpu"
    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 512  # token budget of one step (encoder chunk + replay + decode tokens)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_waiting: int = 1024  # queue bound (beyond it: QueueFullError -> HTTP 429)
    fingerprint: str | None = None  # prefix-cache namespace; default derived from the model config + formats
    resume_policy: str = "replay"  # "replay" (the model's design) | "exact-or-cold": never an approximate window
    # "batched": every op over all rows of a step (ring arena + kernels; on the CPU their plain-torch references);
    # "per-sequence": attention per sequence (the plain-torch path, the batched forward's oracle); "auto": batched
    # on every device (on the CPU a batch of 32 decodes 4x the per-sequence forward's tokens/s, docs/engine.md, and
    # the CPU tests run the GPU engine's program)
    forward: str = "auto"
    # speculative decoding with the model's DSpark drafter: at most this many drafts verified per step and
    # sequence (0 = off; at most the drafter's block size, 5); a draft is verified only while the confidence
    # head's estimate that all drafts up to it are accepted stays >= speculative_min_confidence
    speculative_tokens: int = 0
    speculative_min_confidence: float = 0.1
    # the goodput controller (spec/controller.py) picks each step's draft length in 0 .. speculative_tokens from
    # measured step times and acceptance; False verifies up to speculative_tokens drafts in every step
    speculative_adaptive: bool = True
    # replay the decoder part of plain decode steps from CUDA graphs (batched forward on CUDA only); False is
    # vLLM's --enforce-eager
    cuda_graphs: bool = True
    # decode batch sizes captured as graphs (and warmed up); () = runner/decode_graphs.CAPTURE_SIZES
    cuda_graph_sizes: tuple[int, ...] = ()
    # the engine core runs warm_up() before it reports ready: kernels compiled, graphs captured
    warmup: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(f"EngineConfig.dtype must be float32, bfloat16 or float64, got {self.dtype!r}")
        if self.resume_policy not in RESUME_POLICIES:
            raise ValueError(f"EngineConfig.resume_policy must be one of {RESUME_POLICIES}, got {self.resume_policy!r}")
        if self.forward not in FORWARDS:
            raise ValueError(f"EngineConfig.forward must be one of {FORWARDS}, got {self.forward!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("EngineConfig.max_model_len must be >= 2")
        if self.speculative_tokens < 0:
            raise ValueError(f"EngineConfig.speculative_tokens must be >= 0, got {self.speculative_tokens}")
        if not 0.0 <= self.speculative_min_confidence < 1.0:
            raise ValueError("EngineConfig.speculative_min_confidence must be in [0, 1), got "
                             f"{self.speculative_min_confidence}")

    @property
    def batched(self) -> bool:
        """Whether the engine runs the batched forward ("auto" and "batched", on every device)."""
        return self.forward != "per-sequence"
