"""How the model is split over ranks: ``ParallelConfig`` (vLLM's names) and its checks against a model.

    world_size           = tensor_parallel_size * data_parallel_size
    rank                 = dp_rank * tensor_parallel_size + tp_rank    (a TP group is consecutive ranks)
    attention            heads split over the TP group (one group per DP replica; DP replicas hold other sequences)
    embedding / head     vocabulary split over the TP group
    MoE, expert_parallel routed experts split over ALL ranks (the EP group, world_size), shared expert over TP
    MoE, otherwise       every expert split over the TP group along its intermediate dim

``data_parallel_size > 1`` is attention DP + EP: it needs ``expert_parallel`` (the replicas share the
experts through the all-to-all; without it each replica would hold every expert).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashtier.engine.model.config import ModelConfig

FP8_ACT_BLOCK = 32  # wo_b's input is quantised per 32 along K: a rank's slice must start on a block


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for flag, value in (("--tensor-parallel-size", self.tensor_parallel_size),
                            ("--data-parallel-size", self.data_parallel_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} {value!r}: must be a positive integer")
        if not isinstance(self.expert_parallel, bool):
            raise ValueError(f"--enable-expert-parallel {self.expert_parallel!r}: must be true or false")
        if self.data_parallel_size > 1 and not self.expert_parallel:
            raise ValueError(f"--data-parallel-size {self.data_parallel_size} needs --enable-expert-parallel: "
                             "data parallel attention shares the experts through expert parallelism")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the routed experts are split over: every rank with ``expert_parallel``, else 1."""
        return self.world_size if self.expert_parallel else 1

    def validate_for(self, cfg: ModelConfig, *, with_dspark: bool = False) -> None:
        """Raise ValueError naming the setting when this split does not fit ``cfg``'s geometry.

        ``with_dspark``: the model also holds the DSpark stages (their MoE has its own expert count).
        """
        tp = self.tensor_parallel_size
        flag = f"--tensor-parallel-size {tp}"
        if cfg.num_attention_heads % tp:
            raise ValueError(f"{flag} does not divide the {cfg.num_attention_heads} attention heads")
        if cfg.o_groups % tp:
            raise ValueError(f"{flag} does not divide the {cfg.o_groups} output groups (o_groups): the grouped "
                             f"output projection wo_a is split on group boundaries, so at most {cfg.o_groups} ranks")
        if tp > 1 and cfg.o_lora_rank % FP8_ACT_BLOCK:
            raise ValueError(f"{flag}: o_lora_rank {cfg.o_lora_rank} is not a multiple of {FP8_ACT_BLOCK}, so "
                             "wo_b's FP8 activation blocks would straddle ranks")
        if cfg.vocab_size % tp:
            raise ValueError(f"{flag} does not divide the vocabulary of {cfg.vocab_size} tokens")
        counts = [("routed experts", cfg.n_routed_experts)]
        if with_dspark and cfg.num_nextn_predict_layers:
            counts.append(("DSpark routed experts", cfg.dspark_n_routed_experts))
        if self.expert_parallel:
            ep = self.expert_parallel_size
            for what, n in counts:
                if n % ep:
                    raise ValueError(f"--tensor-parallel-size {tp} x --data-parallel-size {self.data_parallel_size}"
                                     f" = {ep} expert-parallel ranks do not divide the {n} {what}")
        inter = cfg.moe_intermediate_size
        if inter % tp or (inter * cfg.n_shared_experts) % tp:
            raise ValueError(f"{flag} does not divide the expert intermediate size {inter} "
                             f"(moe_intermediate_size x {cfg.n_shared_experts} shared)")
