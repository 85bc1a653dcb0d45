"""A real multi-node Ray cluster on this machine (several raylets with fake GPU resources): the plan's
placement group is reserved by Ray, its real bundle-to-node table goes through bundle_order, and vLLM 0.32's
own helpers map bundles to ranks; the live inventory finds every node."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group  # noqa: E402

from conftest import LOOPBACK, assert_ray_stays_on_this_machine  # noqa: E402
from kimi_k3_serve.planning.inventory import declared_cluster
from kimi_k3_serve.planning.layout import EngineSettings, Layout  # noqa: E402
from kimi_k3_serve.cluster.live import live_inventory  # noqa: E402
from kimi_k3_serve.models import load_model  # noqa: E402
from kimi_k3_serve.planning.placement import PlacementError, bundle_order  # noqa: E402
from kimi_k3_serve.planning.planner import plan  # noqa: E402

H200_NODE = {"num_cpus": 1, "num_gpus": 8, "resources": {"accelerator_type:H200": 1}}


@pytest.fixture(scope="module")
def cluster():
    local = {"node_ip_address": LOOPBACK}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False, **local})
    nodes = {
        "h200-a": cluster.add_node(**H200_NODE, **local, labels={"ray.io/node-group": "h200"}),
        "h200-b": cluster.add_node(**H200_NODE, **local, labels={"ray.io/node-group": "h200"}),
        "odd-5": cluster.add_node(num_cpus=1, num_gpus=5, resources={"odd": 1}, **local),
        "odd-3": cluster.add_node(num_cpus=1, num_gpus=3, resources={"odd": 1}, **local),
    }
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        assert_ray_stays_on_this_machine()
        yield cluster, {name: node.node_id for name, node in nodes.items()}
    finally:
        ray.shutdown()
        cluster.shutdown()


def _reserve(bundles: list[dict], strategy: str):
    pg = placement_group(bundles, strategy=strategy)
    ray.get(pg.ready(), timeout=60)
    return pg


def test_plan_placement_group_and_vllm_rank_mapping(cluster):
    from vllm.v1.executor.ray_utils import build_actor_name, get_bundles_for_indices

    _, ids = cluster
    planned = plan(load_model("kimi-k3"), EngineSettings(max_model_len=32768), declared_cluster("H200", 2))
    layout, config = planned.layout, planned.placement_group_config
    assert (layout.tp, layout.pp) == (8, 2)
    bundles = [dict(bundle) for bundle in config["bundles"]]
    bundles[0]["CPU"] = 1  # Ray Serve LLM adds the replica actor's CPU to bundle 0
    pg = _reserve(bundles, config["strategy"])
    try:
        table = placement_group_table(pg)["bundles_to_node_id"]
        assert set(table.values()) == {ids["h200-a"], ids["h200-b"]}  # only these carry accelerator_type:H200
        order = bundle_order(layout, table, last_stage_node=ids["h200-b"])
        os_env = ",".join(map(str, order))  # what VLLM_RAY_BUNDLE_INDICES would hold
        assert len(os_env.split(",")) == layout.world_size
        # vLLM 0.32's own code: rank i <- i-th listed bundle, PP stage in the actor name.
        assignments = get_bundles_for_indices(pg, order, layout.world_size)
        stage_nodes: dict[int, set[str]] = {}
        for rank, (_, node_id, _) in enumerate(assignments):
            name = build_actor_name("x", rank, layout.tp, layout.pp, 1)
            stage = int(name.rsplit("_PP", 1)[1])
            assert stage == layout.stage_of_rank(rank)
            stage_nodes.setdefault(stage, set()).add(node_id)
        assert stage_nodes == {0: {ids["h200-a"]}, 1: {ids["h200-b"]}}
    finally:
        remove_placement_group(pg)


def test_pack_split_is_refused_with_the_bundles_per_node(cluster):
    _, ids = cluster
    layout = Layout(tp=4, pp=2)
    # 8 GPUs over the 5- and 3-GPU nodes: PACK has no choice but to split a TP4 group.
    pg = _reserve([{"GPU": 1, "odd": 0.001}] * 8, "PACK")
    try:
        table = placement_group_table(pg)["bundles_to_node_id"]
        assert sorted(list(table.values()).count(node) for node in set(table.values())) == [3, 5]
        with pytest.raises(PlacementError) as caught:
            bundle_order(layout, table)
        assert ": 5" in str(caught.value) and ": 3" in str(caught.value)
        # TP2 x PP4 needs 4 pairs; the 5-bundle node holds 2 and the 3-bundle node 1: refused too.
        with pytest.raises(PlacementError):
            bundle_order(Layout(tp=2, pp=4), table)
        order = bundle_order(Layout(tp=1, pp=8), table)
        assert sorted(order) == list(range(8))
    finally:
        remove_placement_group(pg)


def test_live_inventory_finds_every_node(cluster):
    _, ids = cluster
    inventory = live_inventory()
    found = {node.node_id: node for node in inventory.nodes}
    assert set(ids.values()) <= set(found) and len(found) == 5  # the head too
    assert found[ids["h200-a"]].gpu_count == 8 and found[ids["odd-3"]].gpu_count == 3
    gpu = found[ids["h200-a"]].gpus[0]
    assert gpu.total_bytes is None and gpu.name == "H200" and gpu.nvlink_domain == f"node:{ids['h200-a']}"
    assert found[ids["h200-a"]].node_type == "h200"
    heads = [node for node in inventory.nodes if node.gpu_count == 0]
    assert len(heads) == 1
    assert any("memory unknown" in note for note in inventory.notes)
