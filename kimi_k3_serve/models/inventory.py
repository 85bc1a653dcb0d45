"""What a model holds, layer by layer: every tensor with its element count, stored dtype and sharding rule,
and every layer's KV-cache or recurrent-state layout.

An inventory is built once from a ``config.json`` and is independent of any parallel layout; the per-rank
byte counts for a given TP / EP size are derived from the sharding rules here (and cached per inventory,
because the planner asks the same question for thousands of layouts). Pure data: no torch, vLLM or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from kimi_k3_serve.units import cdiv, round_up

# Sharding rules (vLLM linear-layer classes in brackets).
REPLICATED = "replicated"  # ReplicatedLinear, norms, routers, disable_tp layers
TP_DIM0 = "tp_dim0"  # ColumnParallelLinear / MergedColumnParallelLinear: output rows split
TP_DIM1 = "tp_dim1"  # RowParallelLinear: input columns split
VOCAB = "vocab"  # VocabParallelEmbedding / ParallelLMHead: rows padded to 64, then split
EXPERT = "expert"  # FusedMoE weights: split by EP (whole experts) or by TP on the intermediate dim

SHARDINGS = (REPLICATED, TP_DIM0, TP_DIM1, VOCAB, EXPERT)

# Weight categories reported per rank.
CATEGORIES = (
    "embedding",
    "lm_head",
    "attention",
    "linear_attention",
    "dense_mlp",
    "shared_experts",
    "routed_experts",
    "router_and_latent",
    "norms",
    "vision",
    "draft",
    "draft_lm_head",
    "runtime_copies",
)

STACKED_PARAMS = ((".q_proj.", ".qkv_proj."), (".k_proj.", ".qkv_proj."), (".v_proj.", ".qkv_proj."),
                  (".gate_proj.", ".gate_up_proj."), (".up_proj.", ".gate_up_proj."))
"""Checkpoint modules vLLM loads into one merged parameter (its models' ``stacked_params_mapping``)."""

# vLLM's DEFAULT_VOCAB_PADDING_SIZE (model_executor/layers/vocab_parallel_embedding.py).
VOCAB_PADDING = 64

DTYPE_BITS = {
    "float32": 32,
    "bfloat16": 16,
    "float16": 16,
    "float8_e4m3": 8,
    "float8_e8m0": 8,
    "uint8": 8,
    "int8": 8,
    "int32": 32,
    "int64": 64,
    "fp4_e2m1": 4,
    "int4": 4,
}


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor (or ``count`` identical ones, e.g. the experts of a layer).

    ``shape`` is the full, unsharded shape. For a TP-sharded tensor, ``parts`` lists the pieces along the
    sharded dimension as ``(size, split_by_tp)``: a merged projection such as Kimi-K3's
    ``fused_qkv_a_g_proj`` has a replicated q/kv latent part and a TP-split gate part. ``local_align``
    rounds the local (per-rank) size of the sharded dimension up, which is how vLLM pads Kimi-K3's KDA
    ``in_proj`` to 16 rows per rank.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    sharding: str
    category: str
    count: int = 1
    parts: tuple[tuple[int, bool], ...] | None = None
    local_align: int = 1
    checkpoint_dtype: str | None = None
    """Dtype in the checkpoint when it differs from the GPU-resident dtype (vLLM upcasts some at load)."""
    in_checkpoint: bool = True
    """False for tensors vLLM creates after loading (absorbed MLA copies, fp32 decode copies)."""
    replicated_under_sp: bool = False
    """True where vLLM 0.32 replicates a TP-sharded MLP when sequence parallelism is on (KimiMLP disable_tp)."""
    expert_dim: int | None = None
    """For EXPERT tensors: which dim holds the (TP-split) intermediate size; None = not split by TP."""
    kv_heads: int = 0
    """For k/v projections: vLLM keeps ``max(1, kv_heads // tp)`` whole heads per rank (replicas when
    TP > kv_heads), so the shard never drops below one head."""
    inter_mult: int = 1
    inter_div: int = 1
    """For EXPERT tensors: that dim is ``intermediate * inter_mult / inter_div`` (merged w1/w3: 2/1;
    group scales of w2: 1/group_size)."""

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"{self.name}: unknown sharding {self.sharding!r}")
        if self.dtype not in DTYPE_BITS:
            raise ValueError(f"{self.name}: unknown dtype {self.dtype!r}")
        if self.category not in CATEGORIES:
            raise ValueError(f"{self.name}: unknown category {self.category!r}")

    @property
    def elements(self) -> int:
        n = self.count
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """GPU-resident bytes of the whole (unsharded) tensor."""
        return self.elements * DTYPE_BITS[self.dtype] // 8

    @property
    def checkpoint_bytes(self) -> int:
        if not self.in_checkpoint:
            return 0
        return self.elements * DTYPE_BITS[self.checkpoint_dtype or self.dtype] // 8

    def local_elements(self, tp: int, ep_size: int, ep: bool, sp: bool = False, expert_min_per_rank: int = 0) -> int:
        """Elements this tensor puts on one rank (the largest shard when shards differ)."""
        shape = list(self.shape)
        count = self.count
        if self.sharding == EXPERT:
            if ep:
                count = cdiv(count, ep_size)
            elif self.expert_dim is not None and max(tp, ep_size) > 1:
                # Without EP, FusedMoE TP-shards the intermediate over every TP x DP rank (vLLM 0.32
                # fused_moe/config.py flatten_tp_across_dp_and_pcp); callers pass that group as ep_size.
                moe_tp = max(tp, ep_size)
                dim = self.expert_dim
                inter = shape[dim] * self.inter_div // self.inter_mult
                if tp > 1 and inter // tp < expert_min_per_rank:
                    # Kimi-K3 KimiMoE: pad the intermediate to expert_min_per_rank * (attention) TP before
                    # FusedMoE shards it (vllm/models/kimi_k3/nvidia/model.py padded_moe_intermediate_size).
                    inter = expert_min_per_rank * tp
                local_inter = cdiv(inter, moe_tp)
                shape[dim] = cdiv(local_inter * self.inter_mult, self.inter_div)
        elif self.sharding == REPLICATED or (sp and self.replicated_under_sp):
            pass
        elif tp == 1:
            if self.local_align > 1 and self.sharding in (TP_DIM0, TP_DIM1):
                # vLLM pads the one rank's rows as well (Kimi-K3 kda.py in_proj_padding: -local_rows % 16).
                dim = 0 if self.sharding == TP_DIM0 else 1
                shape[dim] = round_up(shape[dim], self.local_align)
        elif self.kv_heads and self.sharding == TP_DIM0:
            shape[0] = max(1, self.kv_heads // tp) * (shape[0] // self.kv_heads)
        elif self.sharding in (TP_DIM0, TP_DIM1):
            dim = 0 if self.sharding == TP_DIM0 else 1
            parts = self.parts or ((shape[dim], True),)
            local = sum(cdiv(size, tp) if split else size for size, split in parts)
            shape[dim] = round_up(local, self.local_align)
        elif self.sharding == VOCAB:
            shape[0] = cdiv(round_up(shape[0], VOCAB_PADDING), tp)
        n = count
        for d in shape:
            n *= d
        return n

    def local_bytes(self, tp: int, ep_size: int, ep: bool, sp: bool = False, expert_min_per_rank: int = 0) -> int:
        return self.local_elements(tp, ep_size, ep, sp, expert_min_per_rank) * DTYPE_BITS[self.dtype] // 8


@dataclass(frozen=True)
class GqaKv:
    """Full-attention KV (MHA/GQA): ``num_kv_heads`` heads of ``head_size`` keys + ``head_size_v`` values."""

    num_kv_heads: int
    head_size: int
    head_size_v: int
    sliding_window: int | None = None


@dataclass(frozen=True)
class MlaKv:
    """MLA latent cache: one ``kv_lora_rank + qk_rope_head_dim`` vector per token, replicated on every TP rank."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def head_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MlaProjections:
    """The widths of an MLA layer's own tensors in a forward (vLLM 0.32 models/kimi_k3/nvidia/mla.py): what its
    decode path holds, beside the latent cache ``MlaKv`` describes."""

    q_lora_rank: int
    """0: no q LoRA (a full-rank ``q_proj``)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool


@dataclass(frozen=True)
class KdaState:
    """Kimi Delta Attention recurrent state (vLLM ``MambaStateShapeCalculator.kda_state_shape``)."""

    num_heads: int
    head_dim: int
    conv_kernel_size: int
    num_k_heads: int | None = None
    head_k_dim: int | None = None

    @property
    def conv_dim(self) -> int:
        nk = self.num_k_heads or self.num_heads
        dk = self.head_k_dim or self.head_dim
        return self.num_heads * self.head_dim + 2 * nk * dk


KvLayout = GqaKv | MlaKv | KdaState


@dataclass(frozen=True)
class LayerInventory:
    index: int
    attention: str
    """``gqa``, ``mla`` or ``kda``."""
    mlp: str
    """``dense`` or ``moe``."""
    tensors: tuple[TensorSpec, ...]
    kv: KvLayout


@dataclass(frozen=True)
class ActivationWidths:
    """The widths that size vLLM's profile-run activation peak (estimates use them)."""

    hidden_size: int
    intermediate_size: int
    """The widest dense MLP intermediate (dense layers and shared experts)."""
    num_attention_heads: int
    head_dim: int
    moe_intermediate_size: int = 0
    moe_hidden_size: int = 0
    num_experts: int = 0
    experts_per_token: int = 0


@dataclass(frozen=True)
class DraftInfo:
    """What a speculative draft shares with its target and how vLLM builds it."""

    method: str
    """``eagle3`` or ``dspark``."""
    shares_target_embedding: bool
    shares_target_lm_head: bool
    num_speculative_tokens_default: int | None = None
    target_layer_ids: tuple[int, ...] = ()
    num_aux_hidden_states: int = 0
    """EAGLE3: how many of the target's hidden states its ``fc`` fuses (vLLM keeps each one through the draft's step)."""
    generic_mla: GenericMlaDims | None = None
    """The draft's attention is vLLM's generic ``MLAAttention`` (``layers/attention/mla_attention.py``; the MLA
    EAGLE3's ``DeepseekV2MLAAttention``), not Kimi-K3's own MLA layer: it allocates differently in the profile run."""


@dataclass(frozen=True)
class GenericMlaDims:
    """The per-head widths of an MLA draft layer built on vLLM's generic ``MLAAttention``."""

    q_lora_rank: int
    """0 for a full-rank ``q_proj``."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, eq=False)
class ModelInventory:
    """Everything the memory model needs to know about one checkpoint. Compared by identity."""

    name: str
    architecture: str
    family: str
    dtype: str
    hidden_size: int
    vocab_size: int
    layers: tuple[LayerInventory, ...]
    embedding: tuple[TensorSpec, ...]
    """On the first PP stage (and, for EAGLE-family drafts under PP, copied to the last)."""
    head: tuple[TensorSpec, ...]
    """lm_head and final norms: on the last PP stage."""
    widths: ActivationWidths
    quantization: str
    """Human-readable quantization summary (e.g. ``compressed-tensors mxfp4 (experts only)``)."""
    max_position_embeddings: int
    num_attention_heads: int
    num_kv_heads: int
    vision: tuple[TensorSpec, ...] = ()
    """Vision tower + projector: built on PP stage 0 unless the engine is language-model-only."""
    draft_extra: tuple[TensorSpec, ...] = ()
    """Draft-only tensors outside its decoder layers (context/fc projections, heads)."""
    draft: DraftInfo | None = None
    expert_min_intermediate_per_rank: int = 0
    """Kimi-K3 pads the expert intermediate to this many rows per rank under TP without EP (0: never)."""
    tp_divisors: tuple[tuple[str, int], ...] = ()
    """Counts that TP must divide (vLLM asserts), e.g. (("num_attention_heads", 96),)."""
    attn_res_block_size: int = 0
    """Block Attention Residuals: a stage after the first receives one residual per block of this many layers
    before it (0: a plain residual)."""
    tie_word_embeddings: bool = False
    """lm_head shares the embedding: one copy when the first stage is also the last, else the last stage
    builds its own (vLLM's Llama-family PP rule)."""
    source: str = ""
    notes: tuple[str, ...] = ()
    max_model_len_limit: int = 0
    """The longest ``max_model_len`` vLLM accepts: ``max_position_embeddings`` times the RoPE factor vLLM applies to
    it (``_get_and_verify_max_len``); 0 when the config does not say."""
    mla: MlaProjections | None = None
    """A Kimi-K3 target's MLA widths, for the warmup forward's decode path (``planning/warmup.py``)."""
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    # -- whole-model totals ------------------------------------------------------------------------
    def all_tensors(self, *, include_vision: bool = True) -> Iterable[TensorSpec]:
        yield from self.embedding
        for layer in self.layers:
            yield from layer.tensors
        yield from self.head
        yield from self.draft_extra
        if include_vision:
            yield from self.vision

    @property
    def total_params(self) -> int:
        """Parameters as the checkpoint stores them (scales and post-load copies excluded)."""
        return sum(t.elements for t in self.all_tensors() if t.in_checkpoint and not t.name.endswith("_scale"))

    @property
    def checkpoint_bytes(self) -> int:
        return sum(t.checkpoint_bytes for t in self.all_tensors())

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def count_layers(self, attention: str) -> int:
        return sum(1 for layer in self.layers if layer.attention == attention)

    def _kinds(self) -> tuple[frozenset[str], frozenset[str]]:
        kinds = self._cache.get("kinds")
        if kinds is None:
            kinds = self._cache["kinds"] = (frozenset(x.attention for x in self.layers), frozenset(x.mlp for x in self.layers))
        return kinds

    @property
    def is_hybrid(self) -> bool:
        attention = self._kinds()[0]
        return "kda" in attention and len(attention) > 1

    @property
    def uses_mla(self) -> bool:
        return "mla" in self._kinds()[0]

    @property
    def is_moe(self) -> bool:
        return "moe" in self._kinds()[1]

    # -- per-rank bytes (cached per TP/EP shape) ---------------------------------------------------
    def _local_bytes(self, t: TensorSpec, tp: int, ep_size: int, ep: bool, sp: bool) -> int:
        return t.local_bytes(tp, ep_size, ep, sp, self.expert_min_intermediate_per_rank)

    def allocations(self, tensors: Iterable[TensorSpec], tp: int, ep_size: int, ep: bool, sp: bool = False) -> list[int]:
        """Bytes of each tensor vLLM allocates for ``tensors`` on one rank. FusedMoE stacks a layer's local experts
        into one tensor; any other ``count`` is that many separate parameters; q/k/v and gate/up listed apart are
        one parameter in vLLM (``stacked_params_mapping`` of the Llama / Qwen / DeepSeek ``load_weights``: qkv_proj,
        gate_up_proj)."""
        merged: dict[tuple[str, int], int] = {}
        for t in tensors:
            allocations = 1 if t.sharding == EXPERT else t.count
            name = t.name
            for part, stacked in STACKED_PARAMS:
                name = name.replace(part, stacked)
            key = (name, allocations)
            merged[key] = merged.get(key, 0) + self._local_bytes(t, tp, ep_size, ep, sp) // allocations
        return [each for (_, allocations), each in merged.items() for _ in range(allocations)]

    def layer_bytes(self, tp: int, ep_size: int, ep: bool, sp: bool = False) -> tuple[dict[str, int], ...]:
        """Per-layer, per-category bytes on one rank of a stage holding that layer."""
        key = ("layers", tp, ep_size, ep, sp)
        cached = self._cache.get(key)
        if cached is None:
            cached = tuple(self._group_bytes(layer.tensors, tp, ep_size, ep, sp) for layer in self.layers)
            self._cache[key] = cached
        return cached

    def group_bytes(self, which: str, tp: int, ep_size: int, ep: bool, sp: bool = False) -> dict[str, int]:
        """Bytes by category on one rank for ``embedding``, ``head``, ``vision`` or ``draft_extra``."""
        key = (which, tp, ep_size, ep, sp)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._group_bytes(getattr(self, which), tp, ep_size, ep, sp)
            self._cache[key] = cached
        return cached

    def _group_bytes(self, tensors: Iterable[TensorSpec], tp: int, ep_size: int, ep: bool, sp: bool) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in tensors:
            out[t.category] = out.get(t.category, 0) + self._local_bytes(t, tp, ep_size, ep, sp)
        return out

