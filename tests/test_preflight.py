"""The build-time check: bin-packing the replica's placement group onto what the nodes have available (and
what the autoscaler may add), the host-memory arithmetic of a CPU engine, and the check inside
``build_app`` on a real local Ray cluster with the CPU dev config: it passes, and a variant asking for more
logical CPUs or GPUs than the cluster has is refused in seconds, leaving no placement group and no app."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest

from kimi_k3_serve.checks.preflight import CPU_PROCESS_BYTES, cpu_memory_need
from kimi_k3_serve.errors import DoesNotFitError
from kimi_k3_serve.planning.packing import GrowableType, NodeSlot, describe_bundles, pack_bundles
from kimi_k3_serve.units import GiB

REPO = Path(__file__).resolve().parents[1]
GPU_BUNDLE = {"GPU": 1.0, "accelerator_type:H200": 0.001}
H200_NODE = {"CPU": 192.0, "GPU": 8.0, "accelerator_type:H200": 1.0}


def replica(world: int) -> list[dict[str, float]]:
    bundles = [dict(GPU_BUNDLE) for _ in range(world)]
    bundles[0]["CPU"] = 1.0
    return bundles


# ---------------------------------------------------------------------------------------------------------------
# Pure: the packer
# ---------------------------------------------------------------------------------------------------------------


def test_pack_splits_sixteen_bundles_over_two_nodes():
    result = pack_bundles([(replica(16), "PACK")], [NodeSlot("a", dict(H200_NODE)), NodeSlot("b", dict(H200_NODE))])
    assert result.fits and result.added == {}
    nodes = [node for _, node in result.placements[0]]
    assert nodes.count("a") == 8 and nodes.count("b") == 8


def test_pack_counts_what_is_available_not_what_exists():
    busy = dict(H200_NODE, GPU=3.0)  # another replica holds 5 of b's GPUs
    result = pack_bundles([(replica(16), "PACK")], [NodeSlot("a", dict(H200_NODE)), NodeSlot("b", busy)])
    assert not result.fits
    assert result.short == {"GPU": (16.0, 11.0)}
    assert "bundle 11" in result.reason


def test_strict_pack_needs_one_node():
    nodes = [NodeSlot("a", dict(H200_NODE)), NodeSlot("b", dict(H200_NODE))]
    assert pack_bundles([(replica(8), "STRICT_PACK")], nodes).fits
    refused = pack_bundles([(replica(16), "STRICT_PACK")], nodes)
    assert not refused.fits and "STRICT_PACK" in refused.reason and "GPU 8 (has 8)" not in refused.reason
    assert "lacks GPU 16 (has 8)" in refused.reason


def test_strict_spread_needs_a_node_per_bundle():
    nodes = [NodeSlot(n, {"CPU": 4.0}) for n in "abc"]
    assert pack_bundles([([{"CPU": 1.0}] * 3, "STRICT_SPREAD")], nodes).fits
    refused = pack_bundles([([{"CPU": 1.0}] * 4, "STRICT_SPREAD")], nodes)
    assert not refused.fits and "on a node of its own" in refused.reason


def test_missing_accelerator_resource_is_named():
    a100 = {"CPU": 96.0, "GPU": 8.0, "accelerator_type:A100": 1.0}
    refused = pack_bundles([(replica(8), "PACK")], [NodeSlot("a", a100)])
    assert not refused.fits and "accelerator_type:H200" in refused.short


def test_autoscaler_nodes_are_counted_up_to_max():
    head = NodeSlot("head", {"CPU": 8.0})
    grow = GrowableType("gpu_8xh200", dict(H200_NODE), count=3)
    two = pack_bundles([(replica(16), "PACK")] * 1, [head], [grow])
    assert two.fits and two.added == {"gpu_8xh200": 2}
    # Two replicas need 4 nodes; the type may add only 3 more.
    refused = pack_bundles([(replica(16), "PACK")] * 2, [head], [grow])
    assert not refused.fits and refused.short["GPU"] == (32.0, 24.0)
    assert "placement group 2" in refused.reason


def test_packer_and_memory_plan_assume_the_same_cluster_on_nodes_without_a_node_group_label():
    # A live cluster whose GPU node carries no ray.io/node-group label (node_type None) but the resources of the
    # autoscaler's node type: it is one of that type's nodes, so the type may add one more, not two.
    from dataclasses import replace

    from kimi_k3_serve.planning.inventory import ClusterInventory, NodeTypeCapacity, declared_cluster
    from kimi_k3_serve.planning.packing import growable_types

    present = declared_cluster("H200", 1).nodes[0]
    unlabelled = replace(present, node_type=None, resources={**present.resources, "CPU": 192.0, "node:10.0.0.2": 1.0})
    workers = NodeTypeCapacity("gpu-workers", "H200", 8, 1, 2, resources={**present.resources, "CPU": 192.0})
    inventory = ClusterInventory(nodes=(unlabelled,), source="live:test", autoscaling=(workers,))
    packer = growable_types(inventory)
    memory_plan = inventory.at_capacity()
    assert [(g.name, g.count) for g in packer] == [("gpu-workers", 1)]
    assert len(memory_plan.gpu_nodes) == len(inventory.gpu_nodes) + 1 == 2


def test_describe_bundles_runs():
    assert describe_bundles(replica(3)) == ("1 x {CPU: 1, GPU: 1, accelerator_type:H200: 0.001} + "
                                            "2 x {GPU: 1, accelerator_type:H200: 0.001}")


def test_cpu_memory_need_arithmetic():
    need = cpu_memory_need(workers=2, kv_space_gib=1, weights_bytes=3 * GiB, draft_bytes=None, has_draft=True)
    assert need.parts == {"KV space": 2 * GiB, "processes": 4 * CPU_PROCESS_BYTES, "weights": 3 * GiB}
    assert need.total_bytes == 2 * GiB + 4 * CPU_PROCESS_BYTES + 3 * GiB
    assert need.unknown == ("draft weights (not a local folder)",)


# ---------------------------------------------------------------------------------------------------------------
# On a real local Ray cluster (conftest's ray_head: 8 logical CPUs, Serve started)
# ---------------------------------------------------------------------------------------------------------------


def dev_args() -> dict:
    from kimi_k3_serve.config.serve_config import load_serve_app

    return copy.deepcopy(load_serve_app(REPO / "deploy" / "dev.yaml").raw_args)


def nothing_left_behind(apps_before: set[str]) -> None:
    import ray
    from ray import serve
    from ray.util.placement_group import placement_group_table

    live = {pg_id: pg for pg_id, pg in placement_group_table().items() if pg.get("state") != "REMOVED"}
    assert live == {}, live
    assert set(serve.status().applications) == apps_before
    assert ray.available_resources().get("CPU", 0) > 0


def test_serve_llm_bundles_match_ray_serve_llm(ray_head):
    """The offline check's copy of Ray Serve LLM's placement group request equals Ray's own."""
    from ray.serve.llm import LLMServer

    from kimi_k3_serve import app
    from kimi_k3_serve.config.args import load_args
    from kimi_k3_serve.commands.check import serve_llm_bundles

    for raw in (dev_args(), {**dev_args(), "accelerator": {"kind": "gpu", "type": "H200"}, "speculative": None}):
        raw = {k: v for k, v in raw.items() if v is not None}
        args = load_args(raw)
        options = LLMServer.get_deployment_options(app.llm_config_of(args))
        ours, strategy = serve_llm_bundles(args)
        theirs = [{k: float(v) for k, v in b.items() if v} for b in options["placement_group_bundles"]]
        assert theirs == ours and options["placement_group_strategy"] == strategy


def test_dev_config_passes_the_build_time_check(ray_head):
    import psutil

    from kimi_k3_serve import app
    from kimi_k3_serve.config.args import load_args, with_resolved_sources
    from kimi_k3_serve.checks.preflight import cpu_need_of_args

    args = load_args(dev_args())
    resolved = with_resolved_sources(args)
    source, draft = resolved.model.source, resolved.speculative.model
    need = cpu_need_of_args(args).total_bytes
    assert need == 2 * GiB + 4 * CPU_PROCESS_BYTES + sum(
        f.stat().st_size for d in (source, draft) for f in Path(d).iterdir() if f.suffix == ".safetensors")
    started = time.perf_counter()
    available = psutil.virtual_memory().available
    if available < need * 1.2:
        # This machine is shared: when other work holds the memory, the check must say so instead of passing.
        with pytest.raises(DoesNotFitError, match="of host memory on node"):
            app.preflight(args, app.llm_config_of(args))
        pytest.skip(f"only {available / GiB:.2f} GiB of host memory available, the dev replica needs "
                    f"{need / GiB:.2f} GiB: refused as it should be")
    report = app.preflight(args, app.llm_config_of(args))
    print(f"\n[build-time check of deploy/dev.yaml, with vLLM's engine-argument check: "
          f"{time.perf_counter() - started:.2f} s]")
    from kimi_k3_serve.commands.check import serve_llm_bundles
    from kimi_k3_serve.checks.preflight import check_before_deploy

    started = time.perf_counter()
    live = check_before_deploy(args, *serve_llm_bundles(args))
    print(f"[live check alone (placement + host memory on the local Ray cluster): {time.perf_counter() - started:.3f} s]")
    assert live.lines[0].startswith("placement:")
    text = "\n".join(report.checks)
    assert "placement: 1 replica(s) x 2 bundle(s) (PACK) can be placed on 1 node(s)" in text
    assert "host memory: node" in text and "KV space 2.00 GiB" in text


@pytest.mark.parametrize("change, expected", [
    ({"parallel": {"tensor_parallel_size": 8}}, "CPU: needs 9, cluster has"),
    ({"accelerator": {"kind": "gpu", "type": "H200"}, "speculative": None}, "GPU: needs 2, cluster has 0 available"),
])
def test_asking_for_more_than_the_cluster_has_is_refused_at_build_time(ray_head, change, expected):
    from ray import serve

    from kimi_k3_serve.app import build_app

    raw = dev_args()
    raw.update(change)
    raw = {k: v for k, v in raw.items() if v is not None}
    apps_before = set(serve.status().applications)
    started = time.perf_counter()
    with pytest.raises(DoesNotFitError) as refused:
        build_app(raw)
    seconds = time.perf_counter() - started
    print(f"\n[refused at build time in {seconds:.2f} s: {str(refused.value)[:160]}...]")
    message = str(refused.value)
    assert "would wait forever for their placement group" in message and expected in message
    assert seconds < 120  # generous: vLLM's engine-argument check is part of it on 2 shared cores
    nothing_left_behind(apps_before)
