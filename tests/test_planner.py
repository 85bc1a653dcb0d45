"""The planner on declared clusters: Kimi-K3's layouts, no-fit answers with shortfalls, NVL72 trays, the
Hopper GEMM-RS reason, a heterogeneous cluster, pins, and the search time on 1,024 nodes."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from kimi_k3_serve.cluster.files import parse_cluster_document
from kimi_k3_serve.planning.inventory import declared_cluster
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.layout import EngineSettings, Layout
from kimi_k3_serve.planning.memory import estimate_memory
from kimi_k3_serve.models import load_model
from kimi_k3_serve.planning.planner import NoLayoutFitsError, Pins, default_partition, legal_tp_sizes, plan
from kimi_k3_serve.units import GiB

TARGET = EngineSettings(max_model_len=32768)


@pytest.fixture(scope="module")
def k3():
    return load_model("kimi-k3")


def test_legal_tp_sizes_divide_96_heads(k3):
    assert legal_tp_sizes(k3) == [1, 2, 4, 8, 16, 32]  # 64 does not divide 96
    with pytest.raises(ConfigError) as caught:
        plan(k3, TARGET, declared_cluster("H200", 2), Pins(tp=64))
    assert caught.value.field == "tp"


def test_default_partition_is_vllms(k3):
    from vllm.distributed.utils import get_pp_indices  # vLLM's own split (CPU-safe import)

    for pp in (2, 3, 4, 7, 16):
        expected = [end - start for start, end in (get_pp_indices(k3.num_layers, r, pp) for r in range(pp))]
        assert list(default_partition(k3.num_layers, pp)) == expected


def test_two_h200_nodes_get_tp8_pp2(k3):
    result = plan(k3, TARGET, declared_cluster("H200", 2))
    print(f"\n2x8 H200: {result.layout.describe()}, max concurrency {result.report.max_concurrency:.2f} at 32K, "
          f"binding rank {result.report.binding_rank} short/headroom "
          f"{min(r.headroom_bytes for r in result.report.ranks) / GiB:.2f} GiB, {len(result.considered)} checked")
    assert result.fits and (result.layout.tp, result.layout.pp) == (8, 2)
    # Every TP group on one node, the two stages on different nodes.
    stage_nodes = [{p.node_id for p in result.placements if p.pp_stage == s} for s in (0, 1)]
    assert all(len(nodes) == 1 for nodes in stage_nodes) and stage_nodes[0] != stage_nodes[1]
    # The plan's report is exactly the memory model's answer for that layout on those GPUs.
    again = estimate_memory(k3, result.layout, TARGET, [
        _device(result, p) for p in result.placements], optimisations=result.optimisations)
    assert again.max_concurrency == result.report.max_concurrency and again.fits
    # No layout of the other 16-GPU shapes that fits beats it on concurrency.
    for candidate in result.considered:
        if candidate.fits:
            assert candidate.report.max_concurrency <= result.report.max_concurrency
    kwargs = result.engine_kwargs
    assert kwargs["tensor_parallel_size"] == 8 and kwargs["pipeline_parallel_size"] == 2
    assert kwargs["max_model_len"] == 32768 and kwargs["language_model_only"] is True
    assert len(result.placement_group_config["bundles"]) == 16 and result.placement_group_config["strategy"] == "PACK"


def _device(result, placement):
    from kimi_k3_serve.planning.inventory import rank_device

    node = next(n for n in declared_cluster("H200", 2).nodes if n.node_id == placement.node_id)
    return rank_device(node, node.gpus[placement.gpu_index])


def test_h200_gemm_rs_is_off_for_hopper(k3):
    result = plan(k3, TARGET, declared_cluster("H200", 2), Pins(tp=8, pp=2))
    gemm_rs = result.optimisations.get("gemm_rs")
    assert not gemm_rs.on and "Hopper" in gemm_rs.reason and "SM100" in gemm_rs.reason
    assert "VLLM_ENABLE_GEMM_RS" not in result.env_vars


def test_one_h200_node_does_not_fit(k3):
    with pytest.raises(NoLayoutFitsError) as caught:
        plan(k3, TARGET, declared_cluster("H200", 1))
    closest = caught.value.candidates[0]
    print(f"\n1x8 H200: closest {closest.layout.describe()} short {closest.shortfall_bytes / GiB:.2f} GiB")
    assert closest.layout.world_size == 8 and closest.shortfall_bytes > 50 * GiB
    assert "short" in str(caught.value)


def test_eight_rtx_3090_do_not_fit(k3):
    with pytest.raises(NoLayoutFitsError) as caught:
        plan(k3, TARGET, declared_cluster("RTX-3090", 1, gpus_per_node=8))
    sized = [c for c in caught.value.candidates if c.report is not None]
    # Even all 8 cards as one TP8 group (TP over PCIe inside the host) are far short on every GPU.
    assert sized and all(c.shortfall_bytes > 150 * GiB for c in sized)
    assert max(c.layout.tp for c in sized) == 8
    assert min(c.shortfall_bytes for c in sized) == min(c.shortfall_bytes for c in sized if c.layout.tp == 8)


def test_gb300_trays_tp_group_across_trays_in_one_clique(k3):
    cluster = declared_cluster("GB300", 4)  # 4 trays x 4 GPUs, one NVL72 domain
    result = plan(k3, TARGET, cluster, Pins(tp=8, ep=True, dp=2))
    for dp_rank in range(2):
        group = [p for p in result.placements if p.dp_rank == dp_rank]
        assert len({p.node_id for p in group}) == 2 and len({p.nvlink_domain for p in group}) == 1
    assert result.optimisations.is_on("sequence_parallel")
    assert result.optimisations.is_on("gemm_rs") and result.env_vars["VLLM_ENABLE_GEMM_RS"] == "1"
    rs = result.optimisations.get("gemm_rs")
    assert rs.workspace_bytes > 0
    # Same TP8 across trays without the shared clique: not placeable at all.
    split = parse_cluster_document({"nodes": [{"name": f"t{i}", "gpu": "B300", "gpus": 4} for i in range(4)]})
    with pytest.raises(NoLayoutFitsError) as caught:
        plan(k3, TARGET, split, Pins(tp=8))
    assert "NVLink" in str(caught.value)


def test_gb300_default_search_keeps_gemm_ar_on(k3):
    result = plan(k3, TARGET, declared_cluster("GB300", 4))
    print(f"\n4 GB300 trays: {result.layout.describe()}, max concurrency {result.report.max_concurrency:.2f}")
    assert result.fits
    if 2 <= result.layout.tp <= 16:
        assert result.optimisations.is_on("gemm_ar")  # SM103, TP group inside the rack's NVLink domain


def test_heterogeneous_cluster_last_stage_avoids_the_busy_node(k3):
    for order in (("busy", "roomy"), ("roomy", "busy")):
        groups = {"busy": {"name": "busy", "gpu": "H200", "gpus": 8, "free_bytes": 132 * GiB},
                  "roomy": {"name": "roomy", "gpu": "H200", "gpus": 8}}
        cluster = parse_cluster_document({"nodes": [groups[name] for name in order]})
        result = plan(k3, TARGET, cluster, Pins(tp=8, pp=2))
        assert result.last_stage_nodes == ["roomy-0"], order
        assert {p.node_id for p in result.placements if p.pp_stage == 0} == {"busy-0"}


def test_pins_are_honoured(k3):
    result = plan(k3, TARGET, declared_cluster("B200", 2), Pins(tp=8, pp=2, ep=True, layer_partition=(48, 45)))
    assert result.layout == Layout(tp=8, pp=2, ep=True, layer_partition=(48, 45))
    assert result.env_vars["VLLM_PP_LAYER_PARTITION"] == "48,45"
    assert result.engine_kwargs["enable_expert_parallel"] is True
    with pytest.raises(ConfigError) as caught:
        plan(k3, TARGET, declared_cluster("B200", 2), Pins(pp=2, layer_partition=(10, 10)))
    assert caught.value.field == "layer_partition"


def _vllm_split(result):
    """The candidate with vLLM's own layer split and the chosen layout's TP, PP and EP."""
    return next(c for c in result.considered if c.layout == Layout(tp=8, pp=2, ep=result.layout.ep))


def test_uneven_partition_when_it_holds_more(k3):
    # The last stage also holds lm_head: on B200 it binds, and one layer moved off it (93 layers: vLLM splits 47/46)
    # holds more requests.
    result = plan(k3, TARGET, declared_cluster("B200", 2), Pins(tp=8, pp=2))
    default = _vllm_split(result)
    assert default.fits and default.layout.stage_of_rank(default.report.binding_rank) == 1
    assert result.layout.layer_partition == (48, 45)
    assert result.report.max_concurrency > default.report.max_concurrency
    assert result.env_vars["VLLM_PP_LAYER_PARTITION"] == "48,45"


def test_uneven_partition_when_only_it_fits(k3):
    # At the longest length any TP8 x PP2 split holds, only the uneven split fits: vLLM's own split is short there.
    # The length is found by bisection (block rounding makes a length read off the concurrency land on either side),
    # and it is beyond Kimi-K3's positions (bad input to the CLI); only the memory arithmetic is under test here.
    k3 = replace(k3, max_model_len_limit=0)
    cluster = declared_cluster("H200", 2)

    def planned(length: int):
        try:
            return plan(k3, EngineSettings(max_model_len=length), cluster, Pins(tp=8, pp=2))
        except NoLayoutFitsError:
            return None

    assert planned(1_048_576).layout.layer_partition == (48, 45)
    lo, hi = 1_048_576, 4 * 1_048_576
    assert planned(hi) is None
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if planned(mid) else (lo, mid)
    result = planned(lo)
    default = _vllm_split(result)
    assert (default.fits, default.report.verdict) == (False, "no_kv_space"), lo
    assert result.report.fits and result.layout.layer_partition == (48, 45), lo


def test_fake_gpus_cannot_be_sized(k3):
    from kimi_k3_serve.planning.inventory import ClusterInventory, GpuInfo, NodeInfo

    node = NodeInfo("n", "", {"GPU": 1.0}, {}, (GpuInfo(0, "", "", None, None, None, "node:n"),))
    with pytest.raises(ConfigError) as caught:
        plan(k3, TARGET, ClusterInventory((node,), "live:test"))
    assert caught.value.field == "cluster"


def test_plan_json_shape(k3):
    data = plan(k3, TARGET, declared_cluster("H200", 2)).to_json()
    assert data["fits"] is True and set(data["layout"]) >= {"tp", "pp", "ep", "dp", "layer_partition"}
    assert all({"on", "reason"} <= set(item) for item in data["optimisations"].values())
    assert len(data["ranks"]) == 16 and all(rank["node"] for rank in data["ranks"])
    assert {"weights_bytes", "kv_cache_bytes", "headroom_bytes"} <= set(data["ranks"][0])
    assert data["placement_group_config"]["bundles"][0]["GPU"] == 1.0


def test_planner_on_1024_nodes_finds_both_objectives_layouts(k3):
    """1,024 nodes of 8 H200s: both objectives plan, and the fewest-GPUs layout is no larger. How long it takes is
    printed and benchmarked (scripts/bench_planner.py, docs/benchmarks.md "Planner speed"), not timed here: a 5 s
    bound failed in CI at 19.0 s on a busy 2-core runner (2026-12-03), where the same plan takes under 1 s."""
    cluster = declared_cluster("H200", 1024)
    started = time.perf_counter()
    result = plan(k3, TARGET, cluster)
    elapsed = time.perf_counter() - started
    started = time.perf_counter()
    smallest = plan(k3, TARGET, cluster, objective="fewest-gpus")
    elapsed_small = time.perf_counter() - started
    print(f"\n1,024 x 8 H200: max-concurrency {result.layout.describe()} ({result.layout.world_size} GPUs, "
          f"{result.report.max_concurrency:.0f} seqs) in {elapsed:.3f} s, {len(result.considered)} layouts; "
          f"fewest-gpus {smallest.layout.describe()} in {elapsed_small:.3f} s")
    assert result.fits and smallest.fits
    assert smallest.layout.world_size <= result.layout.world_size
