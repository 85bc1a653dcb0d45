"""Our KV-cache numbers must equal vLLM 0.32's own, computed by vLLM's code on the same inputs.

For each case the KV-cache specs are produced by vLLM itself where it can run on this CPU machine:
Kimi-K3's hybrid block size and recurrent-state padding by ``Platform._align_hybrid_block_size`` (with the
real ``KimiK3ForConditionalGeneration.get_mamba_state_shape_from_config``), the MLA spec by
``MultiHeadLatentAttention.get_kv_cache_spec`` and the KDA spec by ``KimiK3DeltaAttention.get_kv_cache_spec``
(their real methods, called on minimal instances). GQA specs are vLLM ``FullAttentionSpec`` with
``max(1, kv_heads // tp)`` heads (``ModelConfig.get_num_kv_heads``). Then vLLM's ``get_kv_cache_groups``,
``get_kv_cache_configs`` (grouping, per-worker bytes per block, null block, min over workers) and
``get_max_concurrency_for_kv_cache_config`` run on them, with each stage's available KV memory taken from
our report. Every number we report must match.

These tests are the proof that the planner's numbers are vLLM's, so they never skip: without torch and vLLM 0.32
(``pip install -e '.[cpu]'`` or ``'.[gpu]'``) the module fails to import and the run fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.config.cache import CacheConfig
from vllm.v1.core import kv_cache_utils as vku
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

from kimi_k3_serve.planning.layout import EngineSettings, Layout, RankDevice, SpeculativeSettings
from kimi_k3_serve.planning.memory import estimate_memory
from kimi_k3_serve.models import load_model, read_config

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
H200 = RankDevice(150_109_880_320, (9, 0), name="H200")
B200 = RankDevice(191_514_279_936, (10, 0), name="B200")
"""Kimi-K3's plain fp8 KV cache runs on compute capability 10.x only (planning.memory._validate_kimi_kv_dtype)."""


def _vllm_config(*, tp: int, max_model_len: int, prefix_caching: bool, block_size: int, spec_method: str | None = None,
                 num_spec: int = 0, hf_config=None, model_type: str = "llama", dtype=torch.bfloat16, dcp: int = 1):
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    cache.kv_cache_layout = "LBNHC"  # resolved by the engine core in a real launch
    spec_cfg = None
    if spec_method:
        spec_cfg = SimpleNamespace(method=spec_method, num_speculative_tokens=num_spec, use_eagle=lambda: True,
                                   use_eagle_block_drop=lambda: True)
    model = SimpleNamespace(
        model_impl="auto", architecture="KimiK3ForConditionalGeneration" if model_type == "kimi_k3" else "LlamaForCausalLM",
        use_mla=True, dtype=dtype, hf_config=hf_config or SimpleNamespace(model_type=model_type),
        max_model_len=max_model_len, original_max_model_len=max_model_len, convert_type="none",
        get_num_kv_heads=lambda pc: 1, get_head_size=lambda: 576,
    )
    vc = SimpleNamespace(
        cache_config=cache, model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, decode_context_parallel_size=dcp),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False, enable_chunked_prefill=True),
        attention_config=SimpleNamespace(hisparse_config=None),
        speculative_config=spec_cfg, num_speculative_tokens=num_spec, num_prefill_lookahead_tokens=1,
        compilation_config=SimpleNamespace(static_forward_context={}),
    )

    def with_hf_config(cfg, v=vc):
        return SimpleNamespace(**{**vars(v), "model_config": SimpleNamespace(**{**vars(v.model_config), "hf_config": cfg})})

    vc.with_hf_config = with_hf_config
    return vc


def _compare(report, vc, worker_specs: list[dict], stage_of_worker: list[int]) -> dict:
    """Run vLLM's planner on per-stage workers with our per-stage KV memory and compare every number."""
    stage_ranks = {r.pp_stage: r for r in report.stage_ranks()}
    available = [stage_ranks[s].kv_cache_bytes for s in stage_of_worker]
    merged = {k: v for spec in worker_specs for k, v in spec.items()}
    groups = vku.get_kv_cache_groups(vc, dict(merged))
    configs = vku.get_kv_cache_configs(vc, worker_specs, available)
    vllm_blocks = configs[0].num_blocks
    assert all(c.num_blocks == vllm_blocks for c in configs)
    concurrency = vku.get_max_concurrency_for_kv_cache_config(vc, configs[0])
    tokens, _ = vku.get_kv_cache_capacity(vc, configs[0])
    layout = vc.cache_config.get_resolved_kv_cache_layout()
    for spec, stage in zip(worker_specs, stage_of_worker):
        projected = vku._project_kv_cache_groups_to_worker(groups, spec)
        assert vku._get_kv_cache_bytes_per_block(projected, layout) == stage_ranks[stage].bytes_per_block
        # Each worker's own pool before the engine-wide minimum.
        own = vku.get_kv_cache_config_from_groups(vc, projected, stage_ranks[stage].kv_cache_bytes).num_blocks
        assert own == stage_ranks[stage].num_blocks
    assert len(groups) == report.num_kv_groups
    assert vllm_blocks == report.num_blocks
    assert concurrency == pytest.approx(report.max_concurrency, rel=0, abs=1e-12)
    assert tokens == report.kv_cache_tokens
    per_request = sum(vku.cdiv(g.kv_cache_spec.max_memory_usage_bytes(vc), g.kv_cache_spec.page_size_bytes) for g in groups)
    assert per_request == report.blocks_per_request
    return {"blocks": vllm_blocks, "concurrency": concurrency, "tokens": tokens, "groups": len(groups)}


# -- Kimi-K3 ----------------------------------------------------------------------------------------

def _k3_hf_config():
    from vllm.transformers_utils.configs.kimi_k3 import KimiK3Config

    raw, _, _ = read_config("kimi-k3")
    return KimiK3Config(**{k: v for k, v in raw.items() if k != "architectures"}), raw


def _k3_specs(vc, stages: list[tuple[int, int]], kda_layers: set[int], num_layers: int, dspark_layers: int):
    """Per-stage {layer_name: spec}, built by vLLM's own layer methods and adjusted for each layer's backend as
    ``GPUModelRunner.get_kv_cache_spec`` does (``customize_attention_spec``)."""
    from vllm.model_executor.models.config import MambaModelConfig
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
    from vllm.v1.worker.utils import customize_attention_spec

    MambaModelConfig.verify_and_update_config(vc)  # mamba_cache_mode / mamba_block_size from prefix caching
    Platform._align_hybrid_block_size(vc, FlashMLABackend)
    kda = object.__new__(KimiK3DeltaAttention)
    torch.nn.Module.__init__(kda)
    for key, value in dict(tp_size=vc.parallel_config.tensor_parallel_size, num_heads=96, head_dim=128, conv_size=4,
                           num_spec=vc.num_speculative_tokens, model_config=vc.model_config, cache_config=vc.cache_config,
                           kda_prefill_backend="flashkda").items():
        object.__setattr__(kda, key, value)
    kda_spec = kda.get_kv_cache_spec(vc)
    mla_spec = customize_attention_spec(FlashMLABackend, MultiHeadLatentAttention.get_kv_cache_spec(
        SimpleNamespace(kv_cache_dtype=vc.cache_config.cache_dtype, head_size=576, non_causal_multi_token_decode=False), vc))
    # DSpark's draft layers get their own groups (9 for a 4-layer slice on the H200, 7 with a padding layer for 8:
    # tests/fixtures/gpu/2026-11-30-second-host). The draft's config sets attention_config.use_non_causal and no
    # backend (v1/worker/gpu/spec_decode/dspark/utils.py), FLASHMLA does not support non-causal, so the selector
    # picks TRITON_MLA (the H200 logs say so). Its kernel blocks are any multiple of 16, FLASHMLA's exactly 64: the
    # two specs' block_stride_alignment differ and MLAAttentionSpec.merge refuses to put them in one group.
    assert not FlashMLABackend.supports_non_causal() and TritonMLABackend.supports_non_causal()
    draft_spec = customize_attention_spec(TritonMLABackend, MultiHeadLatentAttention.get_kv_cache_spec(
        SimpleNamespace(kv_cache_dtype=vc.cache_config.cache_dtype, head_size=576, non_causal_multi_token_decode=True), vc))
    assert draft_spec.block_stride_alignment != mla_spec.block_stride_alignment
    out = []
    for s, (start, end) in enumerate(stages):
        spec = {f"model.layers.{i}": (kda_spec if (i + 1) in kda_layers else mla_spec) for i in range(start, end)}
        if s == len(stages) - 1:
            spec.update({f"draft.layers.{j}": draft_spec for j in range(dspark_layers)})
        out.append(spec)
    return out, kda_spec, mla_spec


@pytest.mark.parametrize("dspark,max_model_len,kv_dtype,prefix", [
    (False, 32768, "auto", True), (True, 32768, "auto", True), (False, 262144, "auto", True), (True, 262144, "auto", True),
    (True, 131072, "auto", False), (False, 65536, "fp8", True), (False, 65536, "fp8_ds_mla", True),
], ids=lambda v: str(v))
def test_kimi_k3_tp8_pp2_matches_vllm(dspark: bool, max_model_len: int, kv_dtype: str, prefix: bool) -> None:
    model = load_model("kimi-k3")
    num_spec = 7 if dspark else 0
    spec = SpeculativeSettings("dspark", 7, draft=load_model("kimi-k3-dspark")) if dspark else None
    engine = EngineSettings(max_model_len=max_model_len, speculative=spec, kv_cache_dtype=kv_dtype, enable_prefix_caching=prefix,
                            fp8_prefill_query=kv_dtype == "fp8")
    report = estimate_memory(model, Layout(tp=8, pp=2), engine, B200 if kv_dtype == "fp8" else H200)
    hf, raw = _k3_hf_config()
    vc = _vllm_config(tp=8, max_model_len=max_model_len, prefix_caching=prefix, block_size=64, hf_config=hf,
                      spec_method="dspark" if dspark else None, num_spec=num_spec, model_type="kimi_k3")
    vc.cache_config.cache_dtype = kv_dtype
    kda_layers = set(raw["text_config"]["linear_attn_config"]["kda_layers"])
    specs, kda_spec, mla_spec = _k3_specs(vc, list(report.stage_layers), kda_layers, 93, 5 if dspark else 0)
    # vLLM's alignment gives the same block size as ours; its layer methods give our page sizes.
    assert vc.cache_config.block_size == report.block_size
    assert max(kda_spec.page_size_bytes, mla_spec.page_size_bytes) == report.stage_ranks()[0].page_bytes
    assert kda_spec.num_prefill_checkpoint_blocks == 1 and kda_spec.num_speculative_blocks == num_spec
    got = _compare(report, vc, specs, [0, 1])
    print(f"\nK3 TP8xPP2 {'dspark' if dspark else 'no draft'} L={max_model_len} kv={kv_dtype} prefix={prefix}: "
          f"block {report.block_size}, page {report.stage_ranks()[0].page_bytes:,} B; vLLM {got}")


@pytest.mark.parametrize("dspark", [False, True], ids=["no-draft", "dspark"])
def test_kimi_k3_fit_boundary_is_vllms(dspark: bool) -> None:
    """The no-KV-space verdict's boundary as vLLM's own check draws it (``get_kv_cache_configs`` ->
    ``_check_enough_kv_cache_memory``, the null block held back): a 1 Mi-token request on TP8 x PP2 at 0.80, which
    the plan refuses with a shortfall per GPU. vLLM accepts each stage's pool grown by exactly that shortfall and
    refuses it one byte short."""
    model = load_model("kimi-k3")
    num_spec = 7 if dspark else 0
    spec = SpeculativeSettings("dspark", 7, draft=load_model("kimi-k3-dspark")) if dspark else None
    engine = EngineSettings(max_model_len=1_048_576, max_num_seqs=16, max_num_batched_tokens=2048,
                            gpu_memory_utilization=0.80, speculative=spec)
    report = estimate_memory(model, Layout(tp=8, pp=2), engine, H200)
    assert report.verdict == "no_kv_space"
    hf, raw = _k3_hf_config()
    vc = _vllm_config(tp=8, max_model_len=1_048_576, prefix_caching=True, block_size=64, hf_config=hf,
                      spec_method="dspark" if dspark else None, num_spec=num_spec, model_type="kimi_k3")
    kda_layers = set(raw["text_config"]["linear_attn_config"]["kda_layers"])
    specs, _, _ = _k3_specs(vc, list(report.stage_layers), kda_layers, 93, 5 if dspark else 0)
    stages = report.stage_ranks()
    assert all(r.shortfall_bytes > 0 for r in stages)
    with pytest.raises(ValueError, match="To serve at least one request"):
        vku.get_kv_cache_configs(vc, specs, [r.kv_cache_bytes for r in stages])
    enough = [r.kv_cache_bytes + r.shortfall_bytes for r in stages]
    vku.get_kv_cache_configs(vc, specs, enough)
    for s in range(len(stages)):
        with pytest.raises(ValueError, match="To serve at least one request"):
            vku.get_kv_cache_configs(vc, specs, [b - (i == s) for i, b in enumerate(enough)])


@pytest.mark.parametrize("kv_dtype,block", [("auto", 768), ("fp8", 1536)])
def test_kimi_k3_hybrid_block_size_matches_vllm(kv_dtype: str, block: int) -> None:
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend

    hf, _ = _k3_hf_config()
    vc = _vllm_config(tp=8, max_model_len=32768, prefix_caching=True, block_size=64, hf_config=hf, model_type="kimi_k3")
    vc.cache_config.cache_dtype = kv_dtype
    vc.model_config.architecture = "KimiK3ForConditionalGeneration"
    Platform._align_hybrid_block_size(vc, FlashMLABackend)
    report = estimate_memory(load_model("kimi-k3"), Layout(tp=8, pp=2), EngineSettings(
        max_model_len=32768, kv_cache_dtype=kv_dtype, fp8_prefill_query=kv_dtype == "fp8"), B200 if kv_dtype == "fp8" else H200)
    assert vc.cache_config.block_size == report.block_size == block
    assert vc.cache_config.mamba_page_size_padded == report.stage_ranks()[0].page_bytes == 884_736


@pytest.mark.parametrize("tp", [1, 2])
def test_kimi_k3_slice_with_mla_eagle3_draft_matches_vllm(tp: int) -> None:
    """The MLA EAGLE3 draft's layer spec, from vLLM's ``MLAAttention.get_kv_cache_spec`` (layers/attention/
    mla_attention.py, what ``DeepseekV2MLAAttention`` registers), is the target MLA layer's spec, so vLLM files both
    under one key; the plan's groups, blocks and concurrency are then vLLM's. (The GQA EAGLE3 draft is refused.)"""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.worker.utils import customize_attention_spec

    from kimi_k3_serve.rehearsal.slicing import slice_draft_config, slice_text_config
    from kimi_k3_serve.models import inventory_from_config

    sliced = slice_text_config(read_config("kimi-k3")[0], 8)
    model = inventory_from_config(sliced, name="kimi-k3-slice")
    draft = inventory_from_config(slice_draft_config(read_config("kimi-k3-eagle3-mla")[0], 8), name="eagle3-mla")
    engine = EngineSettings(max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=256, gpu_memory_utilization=0.92,
                            speculative=SpeculativeSettings("eagle3", 3, draft=draft))
    report = estimate_memory(model, Layout(tp=tp), engine, H200)
    hf, _ = _k3_hf_config()
    vc = _vllm_config(tp=tp, max_model_len=8192, prefix_caching=True, block_size=64, hf_config=hf,
                      spec_method="eagle3", num_spec=3, model_type="kimi_k3")
    kda_layers = set(sliced["linear_attn_config"]["kda_layers"])
    (specs,), kda_spec, mla_spec = _k3_specs(vc, [(0, 8)], kda_layers, 8, 0)
    # A causal draft keeps the target's attention backend (FLASHMLA, the deploy configs pin it).
    draft_spec = customize_attention_spec(FlashMLABackend, MLAAttention.get_kv_cache_spec(
        SimpleNamespace(kv_cache_dtype=vc.cache_config.cache_dtype, head_size=draft.layers[0].kv.head_size,
                        sliding_window=None, indexer=None, non_causal_multi_token_decode=False), vc))
    assert draft_spec == mla_spec and hash(draft_spec) == hash(mla_spec)
    specs.update({f"draft.layers.{j}": draft_spec for j in range(draft.num_layers)})
    assert vc.cache_config.block_size == report.block_size
    got = _compare(report, vc, [specs], [0])
    # 6 KDA layers and 3 MLA layers (2 target + the draft's): two KDA groups and one MLA group of three.
    groups = vku.get_kv_cache_groups(vc, dict(specs))
    assert any({"model.layers.3", "model.layers.7", "draft.layers.0"} == set(g.layer_names) for g in groups)
    print(f"\nK3 slice 8 TP{tp} + MLA EAGLE3: block {report.block_size}, vLLM {got}")


# -- MLA MoE, GQA with TP > kv heads, the tiny Llama ---------------------------------------------------

def _uniform_case(path: str, layout: Layout, engine: EngineSettings, make_spec) -> dict:
    model = load_model(FIXTURES / path)
    report = estimate_memory(model, layout, engine, H200)
    vc = _vllm_config(tp=layout.tp, max_model_len=engine.max_model_len, prefix_caching=True, block_size=report.block_size)
    specs = []
    for start, end in report.stage_layers:
        specs.append({f"model.layers.{i}": make_spec(report.block_size) for i in range(start, end)})
    return _compare(report, vc, specs, list(range(layout.pp)))


def test_deepseek_v3_mla_matches_vllm() -> None:
    def mla(block: int):
        return MLAAttentionSpec(block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.bfloat16,
                                cache_dtype_str="auto")

    got = _uniform_case("deepseek-v3.json", Layout(tp=8, pp=2), EngineSettings(max_model_len=65536), mla)
    print(f"\nDeepSeek-V3 TP8xPP2: vLLM {got}")


def test_gqa_tp_above_kv_heads_matches_vllm() -> None:
    cfg = json.loads((FIXTURES / "qwen3-30b-a3b.json").read_text())
    heads_per_rank = max(1, cfg["num_key_value_heads"] // 8)  # ModelConfig.get_num_kv_heads: 4 KV heads on TP8 -> 1

    def full(block: int):
        return FullAttentionSpec(block_size=block, num_kv_heads=heads_per_rank, head_size=cfg["head_dim"], dtype=torch.bfloat16)

    got = _uniform_case("qwen3-30b-a3b.json", Layout(tp=8), EngineSettings(max_model_len=40960), full)
    print(f"\nQwen3-30B-A3B TP8 (4 KV heads): vLLM {got}")


@pytest.mark.parametrize("layout", [Layout(tp=1), Layout(tp=2, pp=2), Layout(tp=4)], ids=lambda x: x.describe())
def test_tiny_llama_matches_vllm(layout: Layout) -> None:
    cfg = json.loads((FIXTURES / "tiny-llama.json").read_text())
    head = cfg["hidden_size"] // cfg["num_attention_heads"]

    def full(block: int):
        return FullAttentionSpec(block_size=block, num_kv_heads=max(1, cfg["num_key_value_heads"] // layout.tp),
                                 head_size=head, dtype=torch.bfloat16)

    device = RankDevice(24 * 2**30, (8, 6), name="RTX-3090")
    model = load_model(FIXTURES / "tiny-llama.json")
    engine = EngineSettings(max_model_len=2048, gpu_memory_utilization=0.5)
    report = estimate_memory(model, layout, engine, device)
    vc = _vllm_config(tp=layout.tp, max_model_len=2048, prefix_caching=True, block_size=report.block_size)
    specs = [{f"model.layers.{i}": full(report.block_size) for i in range(s, e)} for s, e in report.stage_layers]
    got = _compare(report, vc, specs, list(range(layout.pp)))
    print(f"\ntiny Llama {layout.describe()}: vLLM {got}")
