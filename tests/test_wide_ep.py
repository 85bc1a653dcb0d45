"""DP x TP x EP: the expert split vLLM 0.32 makes, EPLB's redundant experts charged (and refused where vLLM
would refuse them), one KV pool per DP engine, the planner's DP search and its stated reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_k3_serve.planning.inventory import declared_cluster
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.layout import EngineSettings, Layout, RankDevice
from kimi_k3_serve.planning.memory import estimate_memory
from kimi_k3_serve.models import load_model
from kimi_k3_serve.planning.planner import Pins, plan
from kimi_k3_serve.planning.vllm_args import engine_kwargs
from kimi_k3_serve.units import GiB
from kimi_k3_serve.planning.wide_ep import check_eplb, eplb_costs, expert_split, total_concurrency

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
TARGET = EngineSettings(max_model_len=32768, max_num_seqs=128)  # set: an unset 1,024 exceeds a DP engine's blocks
H200 = RankDevice(total_bytes=int(143.8 * GiB), compute_capability=(9, 0), name="NVIDIA H200")


@pytest.fixture(scope="module")
def k3():
    return load_model("kimi-k3")


@pytest.fixture(scope="module")
def dsv3():
    return load_model(str(CONFIGS / "deepseek-v3.json"))


@pytest.fixture(scope="module")
def qwen_moe():
    return load_model(str(CONFIGS / "qwen3-30b-a3b.json"))


def _routed(report, rank=0) -> int:
    return report.ranks[rank].weights_by_category["routed_experts"]


def test_experts_split_over_tp_times_dp_with_ep(k3):
    """determine_expert_map: 896 experts over EP = TP x DP = 32 ranks -> 28 each; the attention is TP-sharded
    per DP rank exactly as without DP."""
    split = expert_split(k3, Layout(tp=8, dp=4, ep=True))
    assert (split.ep_size, split.max_local_experts, split.min_local_experts) == (32, 28, 28)
    wide = estimate_memory(k3, Layout(tp=8, dp=4, ep=True), TARGET, H200)
    tep8 = estimate_memory(k3, Layout(tp=8, pp=1, ep=True), TARGET, H200)
    assert _routed(tep8) == 4 * _routed(wide)  # 112 experts per rank vs 28
    cats = ("attention", "linear_attention", "embedding", "lm_head")
    for cat in cats:
        assert wide.ranks[0].weights_by_category[cat] == tep8.ranks[0].weights_by_category[cat]
    assert len(wide.ranks) == 32 and {r.dp_rank for r in wide.ranks} == {0, 1, 2, 3}


def test_uneven_expert_split_charges_the_fuller_rank(k3):
    split = expert_split(k3, Layout(tp=2, dp=3, ep=True))  # 896 = 6 x 149 + 2
    assert (split.max_local_experts, split.min_local_experts) == (150, 149)


def test_without_ep_dp_shards_the_expert_intermediate_over_tp_times_dp(qwen_moe, k3):
    """FusedMoEParallelConfig.make without EP: tp_size = TP x DP (flatten_tp_across_dp_and_pcp)."""
    dp2 = estimate_memory(qwen_moe, Layout(tp=2, dp=2), TARGET, H200)
    tp4 = estimate_memory(qwen_moe, Layout(tp=4), TARGET, H200)
    tp2 = estimate_memory(qwen_moe, Layout(tp=2), TARGET, H200)
    assert _routed(dp2) == _routed(tp4) < _routed(tp2)
    # Kimi-K3 pads with the attention TP only: TP8 x DP2 shards 3072 rows over 16 ranks (192 each, no padding),
    # where TP16 pads to 256 x 16.
    k_dp = estimate_memory(k3, Layout(tp=8, dp=2), TARGET, H200)
    k_tp16 = estimate_memory(k3, Layout(tp=16), TARGET, H200)
    assert _routed(k_dp) * 4 == _routed(k_tp16) * 3


def test_eplb_redundant_experts_are_charged(dsv3):
    """DeepSeek-V3: 256 + 16 redundant experts over EP16 -> 17 per rank instead of 16, plus EPLB's state."""
    layout = Layout(tp=8, dp=2, ep=True)
    base = estimate_memory(dsv3, layout, TARGET, H200)
    eplb = estimate_memory(dsv3, layout, EngineSettings(max_model_len=32768, num_redundant_experts=16), H200)
    assert _routed(eplb) * 16 == _routed(base) * 17
    extra_weights, state = eplb_costs(dsv3, layout, 16, 0, dsv3.num_layers)
    assert eplb.ranks[0].weights_bytes - base.ranks[0].weights_bytes == extra_weights > 0
    assert eplb.ranks[0].workspace_bytes - base.ranks[0].workspace_bytes == state
    # The logical-to-physical map alone: 58 MoE layers x 256 experts x 1024 slots x int64.
    assert state > 58 * 256 * 1024 * 8
    assert any(e.name == "workspace:eplb" for e in eplb.estimates)
    assert eplb.ranks[0].kv_cache_bytes < base.ranks[0].kv_cache_bytes
    kwargs = engine_kwargs(layout, EngineSettings(max_model_len=32768, num_redundant_experts=16))
    assert kwargs["enable_eplb"] is True and kwargs["eplb_config"]["num_redundant_experts"] == 16
    assert kwargs["data_parallel_size"] == 2 and kwargs["enable_expert_parallel"] is True


def test_eplb_refusals_name_vllms_rule(k3, dsv3):
    with pytest.raises(ConfigError, match="KimiLinearForCausalLM"):
        check_eplb(k3, Layout(tp=8, dp=4, ep=True), 32)
    with pytest.raises(ConfigError, match="enable_expert_parallel"):
        check_eplb(dsv3, Layout(tp=8, dp=2), 16)
    with pytest.raises(ConfigError, match="divisible by EP 16"):
        check_eplb(dsv3, Layout(tp=8, dp=2, ep=True), 5)
    check_eplb(dsv3, Layout(tp=8, dp=2, ep=True), 32)


def test_each_dp_engine_has_its_own_kv_pool(k3):
    """EngineCore._initialize_kv_caches sizes each DP engine from its own workers: a DP rank on GPUs with less
    free memory gets a smaller pool, and the others keep theirs."""
    layout = Layout(tp=8, dp=4, ep=True)
    busy = RankDevice(total_bytes=H200.total_bytes, free_bytes=H200.total_bytes, compute_capability=(9, 0),
                      name=H200.name)
    devices = [H200] * 24 + [busy] * 8
    even = estimate_memory(k3, layout, TARGET, H200)
    assert len(even.engine_concurrency) == 4 and len(set(even.engine_concurrency)) == 1
    low = estimate_memory(k3, layout, EngineSettings(max_model_len=32768, gpu_memory_utilization=0.92), devices)
    assert len(low.engine_concurrency) == 4
    # Same devices -> same pools; per-rank KV bytes are the rank's own budget minus its own non-KV.
    r0, r31 = low.ranks[0], low.ranks[31]
    assert r0.kv_cache_bytes == r31.kv_cache_bytes and r0.num_blocks == r31.num_blocks
    smaller = RankDevice(total_bytes=int(120 * GiB), compute_capability=(9, 0), name="NVIDIA H200")
    mixed = estimate_memory(k3, layout, TARGET, [H200] * 24 + [smaller] * 8)
    assert mixed.engine_concurrency[0] == even.engine_concurrency[0]
    assert mixed.engine_concurrency[3] < mixed.engine_concurrency[0]
    assert mixed.max_concurrency == mixed.engine_concurrency[3]
    assert total_concurrency(mixed, 10_000) == pytest.approx(sum(mixed.engine_concurrency))


def test_planner_searches_dp_and_says_why(k3):
    cluster = declared_cluster("H200", 8)
    wide = plan(k3, TARGET, cluster, objective="max-concurrency")  # 8 engines' pools beat one deeper pipeline
    assert wide.layout.dp > 1 and wide.layout.ep
    assert any(c.layout.dp == 1 for c in wide.considered)
    assert "picked over the best TP x PP layout" in wide.rationale and "more concurrency" in wide.rationale
    assert wide.to_json()["total_concurrency"] > wide.report.max_concurrency
    # The Serve replica is one DP rank: TP x PP bundles each.
    assert len(wide.placement_group_config["bundles"]) == wide.layout.tp * wide.layout.pp
    few = plan(k3, TARGET, declared_cluster("H200", 4))  # fewest-nodes: TP8 x PP2 holds more on 2 nodes than any DP layout there
    assert few.layout.dp == 1 and "picked over the best DP x EP layout" in few.rationale


def test_pinned_dp_layout_and_its_placement(k3):
    result = plan(k3, TARGET, declared_cluster("H200", 4), Pins(tp=8, pp=1, ep=True, dp=4))
    assert result.fits and result.layout == Layout(tp=8, pp=1, ep=True, dp=4)
    by_dp = {}
    for p in result.placements:
        by_dp.setdefault(p.dp_rank, set()).add(p.nvlink_domain)
    assert all(len(domains) == 1 for domains in by_dp.values())  # every DP rank's TP group in one NVLink domain
    assert len({next(iter(d)) for d in by_dp.values()}) == 4  # one node each
    assert result.engine_kwargs["data_parallel_size"] == 4
    assert "DP 4: each DP rank is its own engine core" in " ".join(result.report.notes)
