"""The memory plan of a serving configuration: bytes per GPU (per rank) and per host, before anything loads.

``build_plan(PlanInputs)`` places every tensor of an ``Inventory`` on the ranks exactly as the engine does,
then adds what the settings size. Exact rows are computed from the layouts the engine allocates; estimates
say so and give their basis::

    per rank (GPU, or a CPU process)                                     exact / estimate
      weights        each tensor's slice of this rank, in the form it is resident:           exact
                       CUDA, one rank   FP8 linears e4m3 + e8m0 (32x32 re-gridded on the slice), routed
                                        experts MXFP4, shared expert FP8, the rest in the parameter dtype
                       CUDA, TP + EP    as above (ExpertParallelMoE.convert_experts_: RankExperts + one int64
                                        id per expert), the shared slice FP8 only on whole 32-blocks
                       CUDA, TP, no EP  every expert float in the model dtype (TensorParallelMoE's slices)
                       CPU / float64    every weight float (model dtype; fp32-kept parameters fp32)
                     split (engine/parallel): wq_b / attn_sink / wo_a rows and wo_b columns by the rank's output
                     groups, embed / head rows by vocabulary, routed experts whole by --expert-parallel (else each
                     expert's width), the shared expert's width by the TP group; everything else replicated
      KV pool        num_blocks x block_bytes (kvstore/layout.py), num_blocks as KVStoreConfig.pool_blocks      exact
                     sizes it: --num-blocks, else utilisation x the memory free after the weights
      window rings   the ring arena: layers x (2 x max_num_seqs + 1) x window x (hd + hd/32) + positions     exact
      Engram copies  device buffers of the host-table gathers: layers x 2 slots x rows x (hd + hd/32)        exact
      CUDA graphs    buckets (<= MAX_GRAPHS) x their static outputs + one decode step's activations          estimate
      activations    one step of --max-num-batched-tokens tokens (formula in ``activation_bytes``)          estimate
      CUDA runtime   context, kernel modules, cuBLAS workspace (+ NCCL buffers with several ranks)          estimate
      loading        the peak while the model is built, by path (``_load_peak``): one process's demo draws
                     the whole float model, several ranks draw their shares one tensor at a time; a
                     checkpoint is read by byte range; under EP one block's experts float at a time         bound
    per host
      Engram tables  in the checkpoint's fp8 rows. A checkpoint's: mapped from the files, one copy per host
                     (shared page cache, registered in place, nothing rounded); the demo's at N ranks: one
                     shared file drawn once per host, the same; one process's demo: pinned, torch's
                     allocator rounding each block up to a power of two                                     exact
      staging        pinned Engram gather staging, the SSD restore buffers, the embedded snapshot pool       bound
      loading        a checkpoint: + one tensor in flight per rank (stored + fp32 + model dtype)            bound

Pure: reads no tensor data and allocates nothing on a device (the caller measures the cards and the host
and passes the sizes in). ``check_fit`` compares a plan with those sizes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from flashtier.engine.config import EngineConfig
from flashtier.engine.engine import DEFAULT_CPU_KV_BYTES
from flashtier.engine.kv.accounting import kv_geometry
from flashtier.engine.model.checkpoint import StorageFormat
from flashtier.engine.model.config import ModelConfig
from flashtier.engine.model.engram_host import DEFAULT_TOKENS
from flashtier.engine.parallel.parallel_attention import HeadShard
from flashtier.engine.parallel.parallel_config import ParallelConfig
from flashtier.engine.parallel.shard import even_shard
from flashtier.engine.plan.inventory import Inventory, Part, TensorSpec, stored_bytes
from flashtier.engine.runner.decode_graphs import CAPTURE_SIZES, MAX_GRAPHS, MIN_TABLE
from flashtier.engine.tiers.manager import RESTORE_MAX_BYTES
from flashtier.kvstore.config import GiB, MiB, KVStoreConfig
from flashtier.kvstore.layout import BlockLayout

__all__ = ["CUDA_RUNTIME_BYTES", "NCCL_BYTES", "MemoryPlan", "PlanInputs", "PlanMisfit", "PlanRow", "RankPlan",
           "Row", "activation_bytes", "build_plan", "check_fit", "pinned_bytes", "rank_weights"]

# Estimates (the plan marks their rows as such). The CUDA context with the kernel modules flashtier loads and the
# cuBLAS / Triton workspaces: 0.5-1 GiB per process on an H100 with CUDA 12; the upper end is taken.
CUDA_RUNTIME_BYTES = 1 * GiB
NCCL_BYTES = 1 * GiB  # NCCL's channel buffers and communicator state per rank, with several ranks
RESTORE_BUFFERS = 2  # RestoreBuffer's kept buffers (engine/tiers/restore_buffer.py, count=2)
_ATTN_SPLIT = re.compile(r"^(?:layers|mtp)\.\d+\.attn\.(wq_b\.weight|attn_sink|wo_a\.weight|wo_b\.weight)$")
_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_SHARED = re.compile(r"\.ffn\.shared_experts\.(w[123])\.weight$")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}


class Row:
    """Row labels of the plan (plain strings, printed as they are)."""

    KV_POOL = "KV pool"
    RINGS = "window rings"
    ENGRAM_DEVICE = "engram gather buffers"
    GRAPHS = "CUDA graphs"
    ACTIVATIONS = "activations"
    RUNTIME = "CUDA runtime"
    ENGRAM_HOST = "engram tables (pinned)"
    ENGRAM_STAGING = "engram staging (pinned)"
    RESTORE = "SSD restore buffers (pinned)"
    SNAPSHOTS = "snapshot pool (embedded)"
    PROCESSES = "rank processes (CPU)"


@dataclass(frozen=True, slots=True)
class PlanRow:
    """One line of the plan: what, how many bytes, and how the number was reached."""

    label: str  # a ``Part`` (weights) or a ``Row``
    nbytes: int
    basis: str  # format and split, or the formula of an estimate
    estimate: bool = False  # True: a stated estimate, not a byte count of the layout
    weights: bool = False  # one of the rank's weight rows


@dataclass(frozen=True, slots=True)
class RankPlan:
    """One rank's memory: its device (a GPU, or the CPU for a CPU run) and the rows on it."""

    rank: int
    device: str  # "cuda:0" ... or "cpu"
    rows: tuple[PlanRow, ...]
    load_peak: int  # bytes on the device at the peak of loading (weights + the load's transients)
    load_basis: str

    @property
    def total(self) -> int:
        """Resident bytes once serving (every row)."""
        return sum(r.nbytes for r in self.rows)

    @property
    def weights(self) -> int:
        return sum(r.nbytes for r in self.rows if r.weights)

    @property
    def need(self) -> int:
        """What the device must hold: the larger of serving and loading."""
        return max(self.total, self.load_peak)

    def row(self, label: str) -> PlanRow | None:
        return next((r for r in self.rows if r.label == label), None)


@dataclass(frozen=True, slots=True)
class HostPlan:
    """One host's memory outside the ranks' devices (on a CPU run: the ranks themselves too)."""

    rows: tuple[PlanRow, ...]
    load_peak: int  # bytes at the peak of loading
    load_basis: str

    @property
    def total(self) -> int:
        return sum(r.nbytes for r in self.rows)

    @property
    def need(self) -> int:
        return max(self.total, self.load_peak)


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """Everything a plan depends on: the tensors, the engine / KV / parallel settings, the memory to plan for."""

    inventory: Inventory
    engine: EngineConfig  # device ("cuda" / "cpu"), dtype, token budget, sequences, graphs, speculation
    kv: KVStoreConfig
    parallel: ParallelConfig
    gpu_memory: int | None = None  # bytes of each card (None on the CPU; on CUDA needed to size an automatic pool)
    tiers: bool = True  # serve attaches the SSD tier / snapshot pool (one rank only)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    model: str
    source: str  # where the tensor list came from (a preset or a checkpoint directory)
    device_type: str  # "cuda" | "cpu"
    dtype: str
    tensor_parallel_size: int
    expert_parallel: bool
    block_size: int
    block_bytes: int
    num_blocks: int
    pool_basis: str  # how num_blocks was reached
    max_model_len: int
    ranks: tuple[RankPlan, ...]
    host: HostPlan
    gpu_memory: int | None
    notes: tuple[str, ...]

    @property
    def kv_tokens(self) -> int:
        """Tokens of global KV the pool holds (block 0 is the reserved null block)."""
        return max(0, self.num_blocks - 1) * self.block_size

    @property
    def weights_total(self) -> int:
        """Weight bytes on the ranks' devices, summed over ranks (a replicated tensor counts once per rank)."""
        return sum(r.weights for r in self.ranks)

    def busiest(self) -> RankPlan:
        return max(self.ranks, key=lambda r: (r.need, -r.rank))


@dataclass(frozen=True, slots=True)
class PlanMisfit:
    """Why a plan does not fit: where, how much it needs and has, and the flag to change first."""

    where: str  # "cuda:3" or "host"
    need: int
    have: int
    flag: str  # e.g. "--tensor-parallel-size"
    value: object  # the flag's current value
    problem: str  # one line, without the flag
    fix: str  # one line: what to change


# ---- weights ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Residency:
    """How tensors are held on a rank's device (resolved once from the settings)."""

    device_type: str
    dtype_bytes: int  # the model's parameter dtype
    float64: bool
    formats: bool  # quantised formats kept on the device (CUDA in bf16 / fp32)
    expert_formats: bool  # routed experts in MXFP4: one rank (ExpertWeights) or expert parallelism (RankExperts)
    expert_parallel: bool  # the experts are ExpertParallelMoE blocks (world > 1 with --expert-parallel)
    host_engram: bool  # the Engram tables in host memory (CUDA)
    checkpoint: bool  # a checkpoint is loaded by byte range (MODEL_DIR); else the preset's demo weights are drawn

    @staticmethod
    def of(engine: EngineConfig, par: ParallelConfig) -> _Residency:
        cuda = engine.device.startswith("cuda")
        formats = cuda and engine.dtype != "float64"
        ep = par.world_size > 1 and par.expert_parallel
        # TensorParallelMoE has no stored form (its SlicedExperts compute on float weights); ExpertParallelMoE
        # converts its own experts (convert_experts_), on both paths: place_in_formats_ after the demo's draw,
        # load_parts_ once a checkpoint's tensors are set
        return _Residency("cuda" if cuda else "cpu", _DTYPE_BYTES[engine.dtype], engine.dtype == "float64",
                          formats, formats and (par.world_size == 1 or ep), ep, cuda, engine.model_dir is not None)

    def shared_fp8(self, width: int) -> bool:
        """The shared expert's slice of ``width`` rows is held in FP8: one rank, or expert parallelism with the
        slice on whole 32-blocks (``ExpertParallelMoE.convert_experts_``; even slices start at a multiple of
        their width); otherwise it stays a float ``SlicedExpert``."""
        return self.expert_formats and (not self.expert_parallel or width % 32 == 0)


@dataclass(frozen=True, slots=True)
class _Split:
    """How one tensor is cut over ranks (classified once per plan: the names are matched here only)."""

    kind: str  # "vocab" | "wq_b" | "attn_sink" | "wo_a" | "wo_b" | "expert" | "width" | "replicated"
    axis: int = 0  # the cut axis of a "width" slice (w2: its columns)
    expert: int = -1  # a routed expert's id
    n_experts: int = 0  # experts of its layer


def _split_of(t: TensorSpec, cfg: ModelConfig) -> _Split:
    if t.name in ("embed.weight", "head.weight"):
        return _Split("vocab")
    attn = _ATTN_SPLIT.search(t.name)
    if attn:
        return _Split(attn.group(1).removesuffix(".weight"))
    expert, shared = _EXPERT.search(t.name), _SHARED.search(t.name)
    if expert:
        n = cfg.dspark_n_routed_experts if t.name.startswith("mtp.") else cfg.n_routed_experts
        return _Split("expert", 1 if expert.group(2) == "w2" else 0, int(expert.group(1)), n)
    if shared:
        return _Split("width", 1 if shared.group(1) == "w2" else 0)
    return _Split("replicated")


def _local_shape(t: TensorSpec, split: _Split, cfg: ModelConfig, par: ParallelConfig,
                 rank: int) -> tuple[int, ...] | None:
    """``t``'s shape on ``rank`` as ``shard_model_`` leaves it (None: the rank holds none of it)."""
    tp = par.tensor_parallel_size
    if par.world_size == 1 or split.kind == "replicated":
        return t.shape
    tp_index, shape = rank % tp, list(t.shape)
    kind = split.kind
    if kind == "expert" and par.expert_parallel:  # whole experts over every rank
        owned = even_shard(split.n_experts, par.expert_parallel_size, rank)
        return t.shape if owned.start <= split.expert < owned.stop else None
    if tp == 1:
        return t.shape
    if kind == "vocab":
        shape[0] = even_shard(shape[0], tp, tp_index).size
    elif kind in ("expert", "width"):  # the intermediate dim over the TP group: w1 / w3 rows, w2 columns
        shape[split.axis] = even_shard(shape[split.axis], tp, tp_index).size
    else:
        heads = HeadShard.of_rank(cfg, tp_index, tp)
        if kind == "wq_b":
            shape[0] = heads.heads * cfg.head_dim
        elif kind == "attn_sink":
            shape[0] = heads.heads
        elif kind == "wo_a":
            shape[0] = heads.groups * cfg.o_lora_rank
        else:  # wo_b: row-parallel, the columns of the rank's groups
            shape[1] = heads.groups * cfg.o_lora_rank
    return tuple(shape)


def _expert_stored(t: TensorSpec, shape: tuple[int, ...], res: _Residency) -> bool:
    """True when the expert matrix ``t`` (slice ``shape``) is held in its stored format on the device."""
    if t.part == Part.ROUTED:
        return res.expert_formats
    return res.shared_fp8(shape[1] if t.name.endswith("w2.weight") else shape[0])  # the slice's width


def _resident_bytes(t: TensorSpec, shape: tuple[int, ...], res: _Residency) -> int:
    """Device bytes of ``t``'s slice ``shape`` as the engine holds it."""
    fmt = t.fmt
    if fmt is None:  # integer tables keep their stored dtype
        return t.nbytes * math.prod(shape) // max(1, math.prod(t.shape))
    if fmt is StorageFormat.FP32:
        return math.prod(shape) * (8 if res.float64 else 4)
    part = t.part
    stored = _expert_stored(t, shape, res) if part in (Part.ROUTED, Part.SHARED) else res.formats
    if fmt.quantized and stored:
        # an FP8 slice is re-quantised on its own 32x32 grid (Fp8Linear.from_float); an Fp8Linear also keeps its
        # GEMM's split-K counters, one int32 per 16 output rows (fp8_linear.py)
        counters = 4 * max(1, -(-shape[0] // 16)) if fmt is StorageFormat.FP8 and part not in (
            Part.ROUTED, Part.SHARED) else 0
        return stored_bytes(fmt, shape) + counters
    return math.prod(shape) * res.dtype_bytes


def rank_weights(inv: Inventory, engine: EngineConfig, par: ParallelConfig, rank: int) -> dict[str, int]:
    """Weight bytes on ``rank``'s device per ``Part`` (the Engram tables only when they stay on the device)."""
    return _rank_weights(inv, _splits(inv), _Residency.of(engine, par), par, rank).parts


def _splits(inv: Inventory) -> list[_Split]:
    return [_split_of(t, inv.config) for t in inv.tensors]


@dataclass(frozen=True, slots=True)
class _RankWeights:
    """One rank's weight bytes per ``Part``, and what its expert-parallel blocks convert while a checkpoint
    loads (load_parts_ reads a block's experts as float, and the block converts them once its last is read)."""

    parts: dict[str, int]
    largest_layer_float: int = 0  # one block's converted experts (routed + shared slice) as read: model dtype


def _rank_weights(inv: Inventory, splits: list[_Split], res: _Residency, par: ParallelConfig,
                  rank: int) -> _RankWeights:
    out = dict.fromkeys(Part.ORDER, 0)
    layers: dict[str, int] = {}
    for t, split in zip(inv.tensors, splits):
        part = t.part
        if part == Part.ENGRAM_TABLE and res.host_engram:
            continue
        shape = _local_shape(t, split, inv.config, par, rank)
        if shape is None:
            continue
        nbytes = _resident_bytes(t, shape, res)
        out[part] += nbytes
        if res.expert_parallel and part in (Part.ROUTED, Part.SHARED) and _expert_stored(t, shape, res):
            key = t.name.split(".ffn.", 1)[0]
            layers[key] = layers.get(key, 0) + math.prod(shape) * res.dtype_bytes
    if res.expert_parallel and res.expert_formats:
        # RankExperts keeps its experts' global ids: one int64 each (expert_ids)
        ids = sum(8 for t, s in zip(inv.tensors, splits) if s.kind == "expert" and t.name.endswith(".w1.weight")
                  and _local_shape(t, s, inv.config, par, rank) is not None)
        out[Part.ROUTED] += ids
        return _RankWeights(out, max(layers.values(), default=0))
    return _RankWeights(out)


def _weight_basis(part: str, res: _Residency, par: ParallelConfig, cfg: ModelConfig) -> str:
    tp, ep = par.tensor_parallel_size, par.expert_parallel
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts // tp  # the slice's rows (validate_for: divisible)
    fmt = {Part.ROUTED: "mxfp4" if res.expert_formats else "float (model dtype)",
           Part.SHARED: "fp8" if res.shared_fp8(shared) else (
               f"float (model dtype): its {shared}-row slice cuts fp8 blocks" if res.expert_formats
               else "float (model dtype)"),
           Part.ATTENTION: "fp8 linears + fp32 norms" if res.formats else "float",
           Part.VOCAB: "model dtype", Part.OTHER: "fp32 mHC/norms, fp8/bf16 projections" if res.formats else "float",
           Part.ENGRAM_TABLE: "float (model dtype), on the device"}[part]
    if par.world_size == 1:
        return fmt
    split = {Part.ROUTED: f"whole experts / {par.expert_parallel_size} ranks" if ep else f"width / {tp}",
             Part.SHARED: f"width / {tp}", Part.ATTENTION: f"heads / {tp}, rest replicated",
             Part.VOCAB: f"vocabulary / {tp}", Part.OTHER: "replicated", Part.ENGRAM_TABLE: "replicated"}[part]
    return f"{fmt}; {split}"


# ---- activations, graphs, buffers ----------------------------------------------------------------------


def activation_bytes(cfg: ModelConfig, par: ParallelConfig, tokens: int, out_rows: int, context: int,
                     block_size: int, compute_bytes: int = 4) -> tuple[int, str]:
    """Estimated peak of one step's activations on one rank: ``(bytes, basis)``.

    Basis (fp32 compute, ``compute_bytes`` 8 in float64): per token the hc residual streams (x, the mixed input and
    hc_post's output: 3 x hc x D), the attention's query and output over the rank's heads (2 x H/tp x hd), the MoE's
    routed pairs (top-k x (the gathered row D + w1 / w3 / activation over the rank's width 3 x I/tp); with expert
    parallelism the rank's share of pairs, sent and received) and the shared expert (3 x I/tp); plus the indexer's
    int32 keys over the whole visible context of every row at the ratio-1 source (T x L x 4 B, + 1/8 for the block
    keys), the largest single transient at long context; plus the logits of the output rows (fp32, with the
    sampler's two working copies).
    """
    tp = par.tensor_parallel_size
    hc, d, hd, inter = cfg.hc_mult, cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    heads = cfg.num_attention_heads // tp
    streams = 3 * hc * d
    attention = 2 * heads * hd
    if par.expert_parallel and par.world_size > 1:
        routed = cfg.num_experts_per_tok * (2 * d + 3 * inter) / tp
    else:
        routed = cfg.num_experts_per_tok * (d + 3 * (inter // tp))
    shared = 3 * (inter * cfg.n_shared_experts // tp)
    per_token = int((streams + attention + routed + shared) * compute_bytes)
    min_ratio = min(cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids)
    entries = -(-context // block_size) * block_size // min_ratio
    keys = tokens * entries * 4 + tokens * -(-entries // cfg.candidate_block_size) * 4
    logits = out_rows * cfg.vocab_size * 4 * 3
    total = tokens * per_token + keys + logits
    basis = (f"{tokens} tokens x {per_token / 1024:.0f} KiB + indexer keys {tokens} x {entries} entries x 4 B "
             f"+ logits {out_rows} rows x 3 copies")
    return total, basis


def pinned_bytes(nbytes: int) -> int:
    """What torch's pinned (caching host) allocator takes for ``nbytes``: the next power of two."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def _graph_sizes(engine: EngineConfig) -> tuple[int, ...]:
    """DecodeGraphs' batch buckets: the sizes below max_num_seqs, then max_num_seqs (decode_graphs.py)."""
    rows = engine.max_num_seqs
    return tuple(s for s in (engine.cuda_graph_sizes or CAPTURE_SIZES) if s < rows) + (rows,)


def _graphs(cfg: ModelConfig, par: ParallelConfig, engine: EngineConfig, res: _Residency, context: int,
            block_size: int) -> PlanRow | None:
    """The decode graphs' memory (None when the engine captures none: TP > 1, CPU, eager)."""
    if (par.world_size > 1 or res.device_type != "cuda" or not engine.cuda_graphs
            or not res.expert_formats or cfg.index_head_dim != 128):
        return None
    sizes = _graph_sizes(engine)
    rows = sizes[-1]
    table = max(MIN_TABLE, 1 << (-(-context // block_size) - 1).bit_length())
    n_tables = max(1, table.bit_length() - MIN_TABLE.bit_length() + 1)
    # a speculative engine keeps a second set (its verify steps' graphs return the draft inputs too)
    taps = len(cfg.dspark_target_layer_ids) if engine.speculative_tokens else 0
    buckets = min(MAX_GRAPHS, len(sizes) * n_tables) * (2 if taps else 1)  # MAX_GRAPHS per set
    per_bucket = rows * (cfg.vocab_size * 4 + 2 * cfg.hc_mult * cfg.hidden_size * 4 + table * 4
                         + taps * cfg.hidden_size * 4)
    pool, _ = activation_bytes(cfg, par, rows, rows, context, block_size)
    # the drafter's graphs (spec/draft_graphs.py), per sequence bucket: every stage's ring window per sequence, and
    # (once sampled proposals reach the bucket) the noise and q of every draft, a vocabulary each in fp32
    drafts = sum(sizes) * (cfg.num_nextn_predict_layers * cfg.sliding_window * (cfg.head_dim * 4 + 8)
                           + 2 * engine.speculative_tokens * cfg.vocab_size * 4) if taps else 0
    basis = (f"estimate: {buckets} buckets (<= {MAX_GRAPHS} per set) x {rows} rows of static logits/streams/tables"
             f"{' /draft inputs' if taps else ''} + one {rows}-row decode step's activations (shared pool)"
             f"{' + the drafter graphs ring buffers' if taps else ''}")
    return PlanRow(Row.GRAPHS, buckets * per_bucket + pool + drafts, basis, estimate=True)


def _engram_rows(cfg: ModelConfig, tokens: int) -> int:
    """Rows of each Engram staging slot after ``reserve(tokens)`` (HostEngramTables: DEFAULT_TOKENS first, then
    at least doubling)."""
    h = cfg.engram_n_hashes
    cap = DEFAULT_TOKENS * h
    if tokens * h > cap:
        cap = max(tokens * h, 2 * cap)
    return cap


def _ring_bytes(cfg: ModelConfig, engine: EngineConfig) -> int:
    """The ring arena (engine/kv/ring_arena.py): 2 x max_num_seqs slots + the pad slot, records and positions."""
    geo = kv_geometry(cfg)
    rows = (2 * engine.max_num_seqs + 1) * geo.window
    return geo.n_window_layers * rows * (geo.window_slot_bytes + 8)


def _float_model_bytes(inv: Inventory, res: _Residency) -> int:
    """The whole model as float parameters (what the demo draws on a CUDA device before converting it)."""
    return sum(math.prod(t.shape) * (4 if t.fmt is StorageFormat.FP32 else res.dtype_bytes)
               if t.fmt is not None else t.nbytes for t in inv.tensors)


# ---- the plan ---------------------------------------------------------------------------------------------


def _pool(kv: KVStoreConfig, block_bytes: int, res: _Residency, gpu_memory: int | None,
          fixed: int) -> tuple[int, str]:
    """(num_blocks, basis) as ``KVStoreConfig.pool_blocks`` gets them from the engine's measurement.

    On CUDA the engine measures the memory free once the weights and the Engram buffers are in: ``fixed`` here.
    ValueError when an automatic CUDA pool has no card size to be planned against."""
    if kv.num_blocks is not None:
        return kv.num_blocks, "--num-blocks"
    if kv.hbm_budget_bytes is not None:
        return kv.hbm_budget_bytes // block_bytes, "KV budget"
    if res.device_type == "cpu":
        return int(DEFAULT_CPU_KV_BYTES * kv.hbm_utilization) // block_bytes, (
            f"{kv.hbm_utilization:g} x the CPU's default {DEFAULT_CPU_KV_BYTES // MiB} MiB")
    if gpu_memory is None:
        raise ValueError("the KV pool follows the free GPU memory: give the card size (--gpu-memory) or --num-blocks")
    free = max(0, gpu_memory - fixed)
    return max(0, int(free * kv.hbm_utilization) // block_bytes), (
        f"{kv.hbm_utilization:g} x the {free / GiB:.1f} GiB free after weights and runtime")


def build_plan(inputs: PlanInputs) -> MemoryPlan:
    """The plan for ``inputs`` (pure; see the module docstring). ValueError when the parallel split does not fit
    the model (ParallelConfig.validate_for) or an automatic CUDA pool has no card size."""
    inv, engine, kv, par = inputs.inventory, inputs.engine, inputs.kv, inputs.parallel
    cfg = inv.config
    if par.world_size > 1:
        par.validate_for(cfg, with_dspark=inv.with_dspark)
    res = _Residency.of(engine, par)
    world, cuda = par.world_size, res.device_type == "cuda"
    context = engine.max_model_len or cfg.max_position_embeddings
    layout = BlockLayout(kv_geometry(cfg), kv.block_size)
    tokens = engine.max_num_batched_tokens
    out_rows = min(tokens, engine.max_num_seqs * (1 + engine.speculative_tokens))
    batched = engine.batched
    engram_layers = len(cfg.engram_layer_ids) if res.host_engram else 0
    staging_rows = _engram_rows(cfg, tokens)
    row_bytes = cfg.engram_head_dim + -(-cfg.engram_head_dim // 32)
    compute_bytes = 8 if res.float64 else 4
    float_model = _float_model_bytes(inv, res)
    notes = []
    ranks = []
    num_blocks = pool_basis = None
    splits = _splits(inv)
    for rank in range(world):
        held = _rank_weights(inv, splits, res, par, rank)
        weights = held.parts
        rows = [PlanRow(part, weights[part], _weight_basis(part, res, par, cfg), weights=True)
                for part in Part.ORDER if weights[part] or part != Part.ENGRAM_TABLE]
        fixed = []
        if cuda:
            runtime = CUDA_RUNTIME_BYTES + (NCCL_BYTES if world > 1 else 0)
            fixed.append(PlanRow(Row.RUNTIME, runtime, "estimate: context, kernel modules, cuBLAS/Triton workspace"
                                 + (" + NCCL buffers" if world > 1 else ""), estimate=True))
        if engram_layers:
            fixed.append(PlanRow(Row.ENGRAM_DEVICE, engram_layers * 2 * staging_rows * row_bytes,
                                 f"{engram_layers} layers x 2 slots x {staging_rows} rows x {row_bytes} B"))
        if num_blocks is None:  # every rank gets the same pool (rank_engine: the smallest free memory sizes it)
            num_blocks, pool_basis = _pool(kv, layout.block_bytes, res, inputs.gpu_memory,
                                           sum(r.nbytes for r in rows + fixed))
        rows += fixed
        rows.append(PlanRow(Row.KV_POOL, num_blocks * layout.block_bytes,
                            f"{num_blocks} blocks x {layout.block_bytes} B ({pool_basis})"))
        if batched:
            rows.append(PlanRow(Row.RINGS, _ring_bytes(cfg, engine),
                                f"{2 * engine.max_num_seqs + 1} ring slots x {cfg.num_hidden_layers} layers"))
        graphs = _graphs(cfg, par, engine, res, context, kv.block_size)
        if graphs is not None:
            rows.append(graphs)
        act, basis = activation_bytes(cfg, par, tokens, out_rows, context, kv.block_size, compute_bytes)
        rows.append(PlanRow(Row.ACTIVATIONS, act, f"estimate: {basis}", estimate=True))
        resident = sum(r.nbytes for r in rows if r.weights)
        runtime = sum(r.nbytes for r in rows if r.label in (Row.RUNTIME, Row.ENGRAM_DEVICE))
        peak, load = _load_peak(inv, res, world, held, runtime, resident, float_model)
        device = f"cuda:{rank}" if cuda else "cpu"
        ranks.append(RankPlan(rank, device, tuple(rows), peak, load))
    host_rows, host_peak, host_basis = _host(inputs, res, ranks, staging_rows)
    if cuda and world > 1 and not res.expert_formats and res.formats:
        notes.append("experts stay float (model dtype) under tensor parallelism without --expert-parallel "
                     "(TensorParallelMoE has no stored form); in MXFP4 / FP8 they would take "
                     f"{_expert_formats_share(inv, par) / GiB:.1f} GiB per rank")
    return MemoryPlan(cfg.name, inv.source, res.device_type, engine.dtype, par.tensor_parallel_size,
                      par.expert_parallel, kv.block_size, layout.block_bytes, num_blocks, pool_basis, context,
                      tuple(ranks), HostPlan(tuple(host_rows), host_peak, host_basis), inputs.gpu_memory,
                      tuple(notes))


def _load_peak(inv: Inventory, res: _Residency, world: int, held: _RankWeights, runtime: int, resident: int,
               float_model: int) -> tuple[int, str]:
    """(bytes, basis) on a rank's device at the peak of loading, by the path that builds the model:

        CUDA, demo, 1 rank      random_model_on_device draws the whole float model (the Engram tables too),
                                then place_in_formats_ (factory)
        CUDA, demo, N ranks     random_rank_model draws the rank's share one tensor at a time (rank_random):
                                the weights + one tensor in fp32 twice + one EP block's float experts
        CUDA, checkpoint, EP    load_parts_ reads a block's experts as float (model dtype) and the block
                                converts them once its last tensor is read: the weights + one block's float
        CUDA, checkpoint, else  one rank: one MoE layer's stored experts in flight (load_model_in_formats);
                                TP without EP: the float slices are what stays
        CPU                     weights as resident
    """
    if res.device_type != "cuda":
        return runtime + resident, "weights as resident"
    if not res.checkpoint and world > 1:
        one = 2 * max((math.prod(t.shape) * 4 for t in inv.tensors if t.part != Part.ENGRAM_TABLE), default=0)
        peak = runtime + resident + one + held.largest_layer_float
        return peak, (f"weights + one tensor drawn whole in fp32 and snapped ({one / GiB:.2f} GiB)"
                      + (f" + one block's experts in float ({held.largest_layer_float / GiB:.2f} GiB)"
                         if held.largest_layer_float else "")
                      + ": random_rank_model draws only the rank's share (demo weights)")
    if not res.checkpoint:
        return runtime + float_model, ("at least the whole float model, drawn on each device before it is sharded "
                                       "and converted (demo weights; a checkpoint is read by byte range)")
    if held.largest_layer_float:
        peak = runtime + resident + held.largest_layer_float
        return peak, (f"weights + one block's experts as read, float ({held.largest_layer_float / GiB:.2f} GiB; "
                      "load_parts_ converts each block once its last tensor is read; the quantiser's "
                      "temporaries of one matrix not counted)")
    if world == 1:
        return runtime + resident + _largest_moe_layer(inv), "weights + one MoE layer's stored experts in flight"
    return runtime + resident, "weights as resident (read by byte range, one tensor at a time)"


def _largest_moe_layer(inv: Inventory) -> int:
    layers: dict[str, int] = {}
    for t in inv.tensors:
        if t.part in (Part.ROUTED, Part.SHARED):
            key = t.name.split(".ffn.", 1)[0]
            layers[key] = layers.get(key, 0) + t.nbytes
    return max(layers.values(), default=0)


def _expert_formats_share(inv: Inventory, par: ParallelConfig) -> int:
    """Rank 0's expert bytes if the experts kept their stored formats (the figure the TP path could reach)."""
    total = 0
    for t, split in zip(inv.tensors, _splits(inv)):
        if t.part in (Part.ROUTED, Part.SHARED):
            shape = _local_shape(t, split, inv.config, par, 0)
            if shape is not None:
                total += stored_bytes(t.fmt, shape)
    return total


def _host(inputs: PlanInputs, res: _Residency, ranks: list[RankPlan], staging_rows: int
          ) -> tuple[list[PlanRow], int, str]:
    """The host rows, the host's loading peak and its basis."""
    inv, engine, kv, par = inputs.inventory, inputs.engine, inputs.kv, inputs.parallel
    cfg, world = inv.config, par.world_size
    rows = []
    if res.device_type == "cpu":
        total = sum(r.total for r in ranks)
        rows.append(PlanRow(Row.PROCESSES, total, f"{world} rank(s): weights, KV pool and activations in host "
                            "memory", estimate=any(r.estimate for r in ranks[0].rows)))
    if res.host_engram:
        tables = [t for t in inv.tensors if t.part == Part.ENGRAM_TABLE]
        stored = sum(t.nbytes for t in tables)
        rows.append(_engram_host_row(tables, res, world, stored))
        staging = len(tables) * 2 * (pinned_bytes(staging_rows * cfg.engram_head_dim)
                                     + pinned_bytes(staging_rows * -(-cfg.engram_head_dim // 32)))
        rows.append(PlanRow(Row.ENGRAM_STAGING, world * staging,
                            f"{world} x {len(tables)} layers x 2 slots x {staging_rows} rows"))
    if inputs.tiers and world == 1:
        if kv.ssd_enabled:
            rows.append(PlanRow(Row.RESTORE, RESTORE_BUFFERS * RESTORE_MAX_BYTES,
                                f"bound: {RESTORE_BUFFERS} kept buffers x {RESTORE_MAX_BYTES // GiB} GiB"))
        if kv.redis_url is None:
            rows.append(PlanRow(Row.SNAPSHOTS, kv.snapshot_budget_bytes, "bound: its byte budget"))
    total = sum(r.nbytes for r in rows)
    if res.device_type == "cuda" and res.checkpoint:
        # sharded_reader: each rank reads one tensor's covering range at a time, dequantises it to fp32 and
        # casts it to the model dtype on the host before the copy to its device; the whole tensor bounds a slice
        one = max((t.nbytes + math.prod(t.shape) * (4 + res.dtype_bytes) for t in inv.tensors
                   if t.part != Part.ENGRAM_TABLE), default=0)
        return rows, total + world * one, (
            f"bound: + {world} x one tensor in flight ({one / GiB:.2f} GiB: stored + fp32 + model dtype); "
            "the checkpoint is read by byte range, no whole model on the host")
    return rows, total, "as resident"


def _engram_host_row(tables: list[TensorSpec], res: _Residency, world: int, stored: int) -> PlanRow:
    """The Engram tables in host memory. A checkpoint's fp8-row tables are shared read-only mappings of the
    files (HostTable.map_stored): one copy per host in the page cache, registered in place, nothing rounded.
    So are the demo's at several ranks (drawn once per host into a shared file, rank_random.py). Any other table
    (one process's demo, moved by tables_to_host_; a checkpoint table in another format) is pinned by its
    process through torch's allocator, which rounds each block up to a power of two."""
    # a checkpoint's are its files; the demo's at N ranks are drawn once into a shared file (rank_random.py)
    shared = res.checkpoint or world > 1
    mapped = [t for t in tables if shared and t.fmt is StorageFormat.FP8_ROWS]
    pinned = [t for t in tables if t not in mapped]
    per_rank = sum(pinned_bytes(t.shape[0] * t.shape[1]) + pinned_bytes(t.shape[0] * -(-t.shape[1] // 32))
                   if t.fmt is StorageFormat.FP8_ROWS else pinned_bytes(t.nbytes) for t in pinned)
    nbytes = sum(t.nbytes for t in mapped) + world * per_rank
    if not pinned:
        source = "the checkpoint" if res.checkpoint else "a file the demo draws them into once per host (/dev/shm)"
        basis = (f"1 copy per host: {len(tables)} tables of {stored / GiB:.1f} GiB fp8 rows mapped from {source} "
                 "(shared pages, registered in place, not rounded)")
    else:
        basis = (f"{world} x {len(pinned)} tables of {stored / GiB:.1f} GiB fp8 rows, pinned per rank process, "
                 "blocks rounded to powers of two" + (f"; {len(mapped)} mapped once per host" if mapped else ""))
    return PlanRow(Row.ENGRAM_HOST, nbytes, basis)


def check_fit(plan: MemoryPlan, inputs: PlanInputs, *, gpu_memory: tuple[int, ...] = (),
              host_memory: int | None = None) -> PlanMisfit | None:
    """The first way ``plan`` does not fit, or None. ``gpu_memory``: each rank's card in bytes (empty: the GPUs are
    not checked, e.g. on the CPU); ``host_memory``: the host's available bytes (None: not checked).

    The flag named is the one that moves the largest share: the split for weights that do not fit, --num-blocks
    for an explicit pool, the utilisation (or the token budget) for an automatic pool whose remainder cannot hold
    the step's activations and graphs; on the host, the rank count (each rank pins its own Engram copy) or what
    fills a CPU run."""
    engine, kv, par = inputs.engine, inputs.kv, inputs.parallel
    tp = par.tensor_parallel_size
    for rank, have in zip(plan.ranks, gpu_memory):
        need = rank.need
        if need <= have:
            continue
        weights = rank.weights + sum(r.nbytes for r in rank.rows if r.label in (Row.RUNTIME, Row.ENGRAM_DEVICE))
        problem = (f"the memory plan needs {need / GiB:.1f} GiB per GPU but {rank.device} has {have / GiB:.1f} GiB "
                   f"(weights {rank.weights / GiB:.1f} GiB, KV pool {rank.row(Row.KV_POOL).nbytes / GiB:.1f} GiB)")
        if weights <= have < rank.load_peak and engine.model_dir is None and plan.device_type == "cuda" \
                and par.world_size == 1:
            return PlanMisfit(rank.device, need, have, "--preset", engine.preset, problem + (
                f"; loading the demo weights peaks at {rank.load_peak / GiB:.1f} GiB"),
                "serve a checkpoint (MODEL_DIR, read by byte range), or several ranks: one process draws the "
                "whole float model on its GPU, ranks draw only their shares")
        if weights > have or rank.load_peak > have:
            return PlanMisfit(rank.device, need, have, "--tensor-parallel-size", tp, problem,
                              "raise --tensor-parallel-size (with --expert-parallel), or serve on larger GPUs")
        if kv.num_blocks is not None:
            return PlanMisfit(rank.device, need, have, "--num-blocks", kv.num_blocks, problem,
                              "lower --num-blocks, or raise --tensor-parallel-size")
        return PlanMisfit(rank.device, need, have, "--gpu-memory-utilization", kv.hbm_utilization, problem,
                          "lower --gpu-memory-utilization (the step's activations and graphs need the rest), or "
                          "--max-num-batched-tokens / --max-model-len")
    if host_memory is not None and plan.host.need > host_memory:
        need = plan.host.need
        problem = (f"the memory plan needs {need / GiB:.1f} GiB of host memory but this host has "
                   f"{host_memory / GiB:.1f} GiB available")
        if plan.device_type == "cpu":
            rank = plan.ranks[0]
            kv_bytes = rank.row(Row.KV_POOL).nbytes
            if kv.num_blocks is not None and kv_bytes >= rank.weights:
                return PlanMisfit("host", need, host_memory, "--num-blocks", kv.num_blocks, problem,
                                  "lower --num-blocks")
            act = rank.row(Row.ACTIVATIONS).nbytes
            if act > rank.weights:
                return PlanMisfit("host", need, host_memory, "--max-num-batched-tokens",
                                  engine.max_num_batched_tokens, problem,
                                  "lower --max-num-batched-tokens or --max-model-len")
            return PlanMisfit("host", need, host_memory, "--device", engine.device, problem,
                              "serve on GPUs (--device cuda), or a smaller model")
        return PlanMisfit("host", need, host_memory, "--kv-persist", bool(kv.ssd_enabled), problem,
                          "use a host with more memory (the Engram tables stay in pinned host memory)")
    return None
