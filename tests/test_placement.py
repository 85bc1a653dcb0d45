"""Placement: the Ray Serve LLM placement group request, VLLM_RAY_BUNDLE_INDICES for reserved bundles, and the
planner's intended GPU for every rank."""

from __future__ import annotations

import pytest
from ray.llm._internal.common.placement import PlacementGroupConfig

from kimi_k3_serve.cluster.files import parse_cluster_document
from kimi_k3_serve.planning.inventory import declared_cluster
from kimi_k3_serve.planning.hardware import lookup_gpu
from kimi_k3_serve.planning.layout import Layout
from kimi_k3_serve.planning.placement import (
    PlacementError,
    assign_ranks,
    bundle_order,
    placement_group_config,
    ranks_on_nodes,
    roomiest_node,
)


def _stage_nodes(layout: Layout, nodes: list[str]) -> list[set[str]]:
    """Nodes of each (dp, stage) TP group, with vLLM's rank arithmetic."""
    groups: dict[tuple[int, int], set[str]] = {}
    for rank, node in enumerate(nodes):
        groups.setdefault((layout.dp_rank_of(rank), layout.stage_of_rank(rank)), set()).add(node)
    return [groups[key] for key in sorted(groups)]


def test_placement_group_config_passes_ray_serve_llm_validation():
    config = placement_group_config(Layout(tp=8, pp=2), lookup_gpu("H200"))
    assert config["strategy"] == "PACK" and len(config["bundles"]) == 16
    assert config["bundles"][0] == {"GPU": 1.0, "accelerator_type:H200": 0.001}
    validated = PlacementGroupConfig(**config)  # Ray Serve LLM 2.60's own schema
    assert validated.strategy == "PACK" and validated.bundles[3].GPU == 1.0
    single = placement_group_config(Layout(tp=8), lookup_gpu("B300"))
    assert single["strategy"] == "STRICT_PACK"  # one node holds all: nothing left to chance
    rtx = placement_group_config(Layout(tp=1, pp=4), lookup_gpu("RTX-3090"))
    assert rtx["bundles"][0] == {"GPU": 1.0}  # Ray has no accelerator_type for GeForce cards
    PlacementGroupConfig(**rtx)


def test_bundle_order_keeps_interleaved_bundles_in_tp_groups():
    layout = Layout(tp=4, pp=2)
    table = ["A", "B"] * 4  # Ray alternated nodes
    order = bundle_order(layout, table)
    assert sorted(order) == list(range(8))
    assert _stage_nodes(layout, ranks_on_nodes(layout, order, table)) == [{"A"}, {"B"}]


def test_bundle_order_puts_the_last_stage_on_the_chosen_node():
    layout = Layout(tp=8, pp=2)
    table = ["A"] * 8 + ["B"] * 8
    order = bundle_order(layout, table, last_stage_node="A")
    assert _stage_nodes(layout, ranks_on_nodes(layout, order, table)) == [{"B"}, {"A"}]
    order = bundle_order(layout, table)  # no preference: stage 0 on bundle 0's node (the engine core's)
    assert _stage_nodes(layout, ranks_on_nodes(layout, order, table)) == [{"A"}, {"B"}]


def test_bundle_order_refuses_a_tp_group_split_by_pack():
    table = ["A"] * 5 + ["B"] * 3 + ["C"] * 8
    with pytest.raises(PlacementError) as caught:
        bundle_order(Layout(tp=8, pp=2), table)
    message = str(caught.value)
    assert "A: 5" in message and "B: 3" in message and "C: 8" in message
    with pytest.raises(PlacementError):
        bundle_order(Layout(tp=8, pp=2), ["A"] * 8 + ["B"] * 8, last_stage_node="Z")


def test_bundle_order_within_an_nvl72_domain_spans_trays():
    layout = Layout(tp=8, pp=2)
    table = ["t0"] * 4 + ["t1"] * 4 + ["t2"] * 4 + ["t3"] * 4
    domains = {node: "fabric:rack0" for node in ("t0", "t1", "t2", "t3")}
    order = bundle_order(layout, table, domains, last_stage_node="t2")
    stages = _stage_nodes(layout, ranks_on_nodes(layout, order, table))
    assert "t2" in stages[1] and len(stages[1]) == 2 and stages[0].isdisjoint(stages[1])
    with pytest.raises(PlacementError):  # without the shared domain, 4-GPU trays cannot hold TP8
        bundle_order(layout, table)


def test_bundle_order_skips_bundles_without_gpus_and_checks_size():
    table = {0: "A", 1: "A", 2: "A", 3: "B", 4: "B"}
    assert bundle_order(Layout(tp=2, pp=2), table, gpu_bundles=[1, 2, 3, 4]) == [1, 2, 3, 4]
    with pytest.raises(PlacementError):
        bundle_order(Layout(tp=4, pp=2), table)


def test_assign_ranks_two_h200_nodes():
    layout = Layout(tp=8, pp=2)
    placements, reason = assign_ranks(layout, declared_cluster("H200", 2))
    assert reason is None and [p.rank for p in placements] == list(range(16))
    assert {p.node_id for p in placements if p.pp_stage == 0} == {"h200-0"}
    assert {p.node_id for p in placements if p.pp_stage == 1} == {"h200-1"}
    assert len({(p.node_id, p.gpu_index) for p in placements}) == 16


def test_assign_ranks_last_stage_avoids_the_busy_node():
    cluster = parse_cluster_document({"nodes": [
        {"name": "busy", "gpu": "H200", "gpus": 8, "free_bytes": 100 * 2**30},
        {"name": "roomy", "gpu": "H200", "gpus": 8},
    ]})
    placements, _ = assign_ranks(Layout(tp=8, pp=2), cluster)
    assert {p.node_id for p in placements if p.pp_stage == 1} == {"roomy-0"}


def test_assign_ranks_never_exceeds_free_gpus_and_explains():
    placements, reason = assign_ranks(Layout(tp=16), declared_cluster("H200", 4))
    assert placements is None and "16" in reason and "NVLink" in reason
    placements, reason = assign_ranks(Layout(tp=8, pp=3), declared_cluster("H200", 2))
    assert placements is None
    placements, reason = assign_ranks(Layout(tp=8, pp=2), declared_cluster("GB300", 4))
    assert reason is None
    assert all(len({p.node_id for p in placements if p.pp_stage == s}) == 2 for s in (0, 1))


def test_roomiest_node_chooses_where_the_last_stage_goes():
    layout = Layout(tp=8, pp=2)
    table = ["A"] * 8 + ["B"] * 8
    assert roomiest_node(layout, table, {"A": 140 * 2**30, "B": 120 * 2**30}) == "A"
    assert roomiest_node(layout, table, {"A": 130 * 2**30, "B": 130 * 2**30}) == "B"  # tie: keep A for stage 0
    node = roomiest_node(layout, table, {"A": 140 * 2**30, "B": 120 * 2**30})
    order = bundle_order(layout, table, last_stage_node=node)
    assert _stage_nodes(layout, ranks_on_nodes(layout, order, table)) == [{"B"}, {"A"}]
    assert roomiest_node(layout, ["A"] * 4 + ["B"] * 4, {"A": 1, "B": 2}) is None
