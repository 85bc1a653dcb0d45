"""vLLM 0.32's KV-cache arithmetic, re-implemented exactly over our own frozen specs.

What is mirrored (file references are to the installed vLLM 0.32 package):
- per-layer page sizes: ``FullAttentionSpec`` / ``MLAAttentionSpec`` / ``MambaSpec``
  (v1/kv_cache_interface.py), GQA with ``max(1, kv_heads // tp)`` heads per rank, MLA with one latent head
  replicated on every TP rank (models/kimi_k3/nvidia/mla.py ``get_kv_cache_spec``: ``max_tp_shards=1``),
  ``fp8_ds_mla`` at 656 B per token;
- the hybrid block size (platforms/interface.py ``_align_hybrid_block_size``): the smallest
  kernel-aligned attention block whose page holds one recurrent-state page, then the state page padded to it;
- grouping (v1/core/kv_cache_utils.py ``get_kv_cache_groups``): one group when every layer has the same
  spec; one uniform-type group when all layers are attention with one block size; otherwise
  ``unify_kv_cache_spec_page_size`` then ``_get_kv_cache_groups_uniform_page_size`` (group size = the
  smallest bucket, or the largest when it is < 1.5x the smallest; padding; ``layers[i::num_groups]``),
  always over the whole model's layers even under PP;
- per worker: ``_project_kv_cache_groups_to_worker`` and ``_get_kv_cache_bytes_per_block`` (the largest
  group's sum of local pages), ``num_blocks = available // bytes_per_block``, the null-block reserve in the
  fit check, the minimum over workers, ``get_max_concurrency_for_kv_cache_config`` and tokens.
Pure Python: no torch or vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from kimi_k3_serve.errors import UnsupportedModelError
from kimi_k3_serve.units import cdiv

MLA_HYBRID_MIN_BLOCK = 128
"""platforms/interface.py ``_align_hybrid_block_size``: hybrid MLA/Mamba blocks are a multiple of 128."""
FP8_DS_MLA_BYTES_PER_TOKEN = 656
"""mla.py ``get_kv_cache_spec``: ``state_content_bytes=656`` for ``fp8_ds_mla``."""


@dataclass(frozen=True)
class AttentionPageSpec:
    """Full attention (``mla=False``) or MLA (``mla=True``) on one rank."""

    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype_bytes: int
    mla: bool = False
    state_content_bytes: int | None = None
    page_size_padded: int | None = None
    dcp_sharded: bool = True
    draft_marker: bool = False
    """``non_causal_multi_token_decode`` (DSpark draft layers). They form their own KV-cache groups: on the H200
    runs of 2026-11-30 vLLM 0.32 made 9 groups of 1 layer for a 4-layer slice (3 KDA, 1 MLA, 5 draft) and 7 groups
    of 2 with one padding layer for an 8-layer slice (6 KDA, 2 MLA, 5 draft), which merging them into the target's
    MLA bucket cannot give. vLLM's code says why: the DSpark draft's config asks for a non-causal backend and names
    none (v1/worker/gpu/spec_decode/dspark/utils.py); FLASHMLA, the target's, does not support non-causal, so the
    draft runs on TRITON_MLA, whose kernel blocks are any multiple of 16 where FLASHMLA's are exactly 64.
    ``customize_attention_spec`` (v1/worker/utils.py) then leaves the two specs different ``block_stride_alignment``s
    and ``MLAAttentionSpec.merge`` refuses to group them (tests/test_kvcache_conformance.py runs that path).

    A causal MLA EAGLE3 draft (``Eagle3DeepseekV2ForCausalLM``) leaves it False and shares the target's MLA bucket:
    its ``MLAAttention.get_kv_cache_spec`` (layers/attention/mla_attention.py) builds the same ``MLAAttentionSpec``
    as Kimi-K3's (models/kimi_k3/nvidia/mla.py) -- block size, one head, ``max_tp_shards=1``, head size
    ``kv_lora_rank + qk_rope_head_dim``, cache dtype, no indexer, causal -- and both pick their backend through
    ``get_attn_backend`` with the same arguments (the shipped draft has Kimi-K3's 96 heads), so ``_get_kv_cache_groups_uniform_page_size``
    (v1/core/kv_cache_utils.py) files them under one ``same_type_layers`` key."""

    @property
    def unpadded_page_size_bytes(self) -> int:
        content = self.state_content_bytes if self.state_content_bytes is not None else (
            (self.head_size + self.head_size_v) * self.dtype_bytes
        )
        return self.num_kv_heads * self.block_size * content

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded if self.page_size_padded is not None else self.unpadded_page_size_bytes

    def max_memory_usage_bytes(self, max_model_len: int, dcp: int = 1) -> int:
        length = cdiv(max_model_len, dcp) if self.dcp_sharded and dcp > 1 else max_model_len
        return cdiv(length, self.block_size) * self.page_size_bytes

    def merge_key(self) -> tuple:
        """Specs that vLLM's ``merge`` accepts in one group share this key (DSpark draft layers stay apart)."""
        return ("attn", self.block_size, self.num_kv_heads, self.head_size, self.head_size_v, self.dtype_bytes, self.mla,
                self.state_content_bytes, self.page_size_padded, self.dcp_sharded, self.draft_marker)


@dataclass(frozen=True)
class StatePageSpec:
    """A recurrent-state layer (vLLM ``MambaSpec``): KDA conv + recurrent state per sequence."""

    shapes: tuple[tuple[int, ...], ...]
    dtype_bytes: tuple[int, ...]
    page_size_padded: int | None = None
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    align_mode: bool = False
    """``mamba_cache_mode == "align"`` (prefix caching on)."""

    @property
    def state_bytes(self) -> int:
        total = 0
        for shape, size in zip(self.shapes, self.dtype_bytes):
            n = size
            for d in shape:
                n *= d
            total += n
        return total

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded if self.page_size_padded is not None else self.state_bytes

    def blocks_per_request(self) -> int:
        if self.align_mode:
            return 2 + self.num_speculative_blocks + self.num_prefill_checkpoint_blocks
        return 1 + self.num_speculative_blocks

    def max_memory_usage_bytes(self, max_model_len: int, dcp: int = 1) -> int:
        return self.page_size_bytes * self.blocks_per_request()

    def merge_key(self) -> tuple:
        return ("state", self.shapes, self.dtype_bytes, self.page_size_padded, self.num_speculative_blocks,
                self.num_prefill_checkpoint_blocks, self.align_mode)


LayerSpec = AttentionPageSpec | StatePageSpec


@dataclass(frozen=True)
class KvGroup:
    """One KV-cache group: its layers (whole model) and their spec. ``uniform_type`` groups keep per-layer
    specs (different pages, one block table)."""

    layer_names: tuple[str, ...]
    spec: LayerSpec
    layer_specs: tuple[LayerSpec, ...] | None = None

    def page_of(self, index: int) -> int:
        return (self.layer_specs[index] if self.layer_specs is not None else self.spec).page_size_bytes

    def blocks_per_request(self, max_model_len: int, dcp: int = 1) -> int:
        """``cdiv(max_memory_usage_bytes, page_size_bytes)`` (UniformType: the max over its layers)."""
        specs = self.layer_specs if self.layer_specs is not None else (self.spec,)
        return max(cdiv(s.max_memory_usage_bytes(max_model_len, dcp), s.page_size_bytes) for s in specs)


@dataclass(frozen=True)
class KvGrouping:
    groups: tuple[KvGroup, ...]
    kind: str
    """``uniform_spec``, ``uniform_type`` or ``uniform_page`` (the path vLLM takes)."""
    padding_layers: int = 0
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    def blocks_per_request(self, max_model_len: int, dcp: int = 1) -> int:
        key = ("bpr", max_model_len, dcp)
        if key not in self._memo:
            self._memo[key] = sum(g.blocks_per_request(max_model_len, dcp) for g in self.groups)
        return self._memo[key]

    def bytes_per_block(self, local_layers: frozenset[str]) -> int:
        """``_get_kv_cache_bytes_per_block`` for a worker holding ``local_layers``."""
        cached = self._memo.get(local_layers)
        if cached is None:
            cached = self._memo[local_layers] = self._bytes_per_block(local_layers)
        return cached

    def _bytes_per_block(self, local_layers: frozenset[str]) -> int:
        best = 0
        for g in self.groups:
            total = 0
            for i, name in enumerate(g.layer_names):
                if name in local_layers:
                    total += g.page_of(i)
            best = max(best, total)
        return best

    @property
    def block_size(self) -> int:
        """The attention block size (tokens per block) of the first attention group."""
        for g in self.groups:
            if isinstance(g.spec, AttentionPageSpec):
                return g.spec.block_size
        return 0


def hybrid_block_size(attn_page_per_token: int, state_page: int, *, kernel_alignment: int, backend_alignment: int = 1) -> int:
    """``_align_hybrid_block_size``: the smallest ``kernel_alignment``-multiple block whose attention page
    holds one state page, rounded up to ``backend_alignment``."""
    block = kernel_alignment * cdiv(state_page, kernel_alignment * attn_page_per_token)
    return backend_alignment * cdiv(block, backend_alignment)


def unify_page_sizes(specs: Sequence[LayerSpec]) -> list[LayerSpec]:
    """``unify_kv_cache_spec_page_size``: pad state pages, scale attention block sizes, pad non-MLA pages."""
    pages = {s.page_size_bytes for s in specs}
    if len(pages) <= 1:
        return list(specs)
    top = max(pages)
    out: list[LayerSpec] = []
    for s in specs:
        if s.page_size_bytes == top:
            out.append(s)
        elif isinstance(s, StatePageSpec):
            out.append(replace(s, page_size_padded=top))
        elif top % s.page_size_bytes == 0:
            out.append(replace(s, block_size=s.block_size * (top // s.page_size_bytes)))
        elif not s.mla:
            out.append(replace(s, page_size_padded=top))
        else:
            raise UnsupportedModelError(
                "kv_cache", f"MLA page {s.page_size_bytes} B vs {top} B",
                "vLLM 0.32 cannot unify these page sizes (unify_kv_cache_spec_page_size raises)",
            )
    return out


def group_layers(layers: Sequence[tuple[str, LayerSpec]]) -> KvGrouping:
    """``get_kv_cache_groups`` over the whole model's layers (registration order)."""
    if not layers:
        return KvGrouping((), "attention_free")
    names = [n for n, _ in layers]
    specs = [s for _, s in layers]
    keys = {s.merge_key() for s in specs}
    if len(keys) == 1:
        return KvGrouping((KvGroup(tuple(names), _merged(specs)),), "uniform_spec")
    if all(isinstance(s, AttentionPageSpec) for s in specs) and len({s.block_size for s in specs}) == 1 \
            and len({s.dcp_sharded for s in specs}) == 1:
        return KvGrouping((KvGroup(tuple(names), specs[0], tuple(specs)),), "uniform_type")
    specs = unify_page_sizes(specs)
    buckets: list[list[int]] = []
    bucket_keys: list[tuple] = []
    for i, s in enumerate(specs):
        key = s.merge_key()
        for b, k in zip(buckets, bucket_keys):
            if k == key:
                b.append(i)
                break
        else:
            buckets.append([i])
            bucket_keys.append(key)
    smallest = min(len(b) for b in buckets)
    largest = max(len(b) for b in buckets)
    group_size = largest if largest < smallest * 1.5 else smallest
    groups = []
    padding = 0
    for b in buckets:
        pad = group_size - len(b) % group_size
        if pad != group_size:
            padding += pad
        num_groups = cdiv(len(b), group_size)
        for g in range(num_groups):
            idx = b[g::num_groups]
            groups.append(KvGroup(tuple(names[i] for i in idx), _merged([specs[i] for i in idx])))
    return KvGrouping(tuple(groups), "uniform_page", padding)


def _merged(specs: Sequence[LayerSpec]) -> LayerSpec:
    first = specs[0]
    if isinstance(first, AttentionPageSpec):
        return replace(first, draft_marker=any(getattr(s, "draft_marker", False) for s in specs))
    return first


@dataclass(frozen=True)
class PoolResult:
    """The KV pool of an engine: per-worker blocks and the engine-wide numbers vLLM logs."""

    bytes_per_block: tuple[int, ...]
    num_blocks_per_worker: tuple[int, ...]
    num_blocks: int
    blocks_per_request: int
    max_concurrency: float
    kv_cache_tokens: int
    needed_bytes: tuple[int, ...]
    """Per worker: bytes one max_model_len request needs (``_max_memory_usage_bytes_from_groups``)."""
    shortfall_bytes: tuple[int, ...]
    """Per worker: what ``_check_enough_kv_cache_memory`` finds missing (0 when it passes)."""


def plan_pool(grouping: KvGrouping, local_layers: Sequence[frozenset[str]], available: Sequence[int], *,
              max_model_len: int, dcp: int = 1) -> PoolResult:
    """``get_kv_cache_configs`` + ``get_max_concurrency_for_kv_cache_config`` for workers holding
    ``local_layers`` with ``available`` KV bytes each (may be negative)."""
    per_request = grouping.blocks_per_request(max_model_len, dcp)
    bpbs, blocks, needed, short = [], [], [], []
    for layers, avail in zip(local_layers, available):
        bpb = grouping.bytes_per_block(layers)
        bpbs.append(bpb)
        if bpb == 0:
            blocks.append(0)
            needed.append(0)
            short.append(0)
            continue
        n = max(avail, 0) // bpb
        blocks.append(n)
        need = bpb * per_request
        check = avail - bpb  # the null block BlockPool keeps back
        needed.append(need)
        short.append(max(0, need - check))
    present = [b for b, bpb in zip(blocks, bpbs) if bpb]
    num_blocks = min(present) if present else 0
    concurrency = num_blocks / per_request if per_request else 0.0
    return PoolResult(tuple(bpbs), tuple(blocks), num_blocks, per_request, concurrency, int(concurrency * max_model_len),
                      tuple(needed), tuple(short))
