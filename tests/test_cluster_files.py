"""Declared clusters: every cluster file format becomes the same inventory, with GPU facts from the catalogue,
and every bad file is one ConfigError naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_k3_serve.cluster.files import load_cluster_file, parse_cluster_document
from kimi_k3_serve.planning.inventory import declared_cluster
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.hardware import CATALOGUE, lookup_gpu, lookup_instance

CLUSTERS = Path(__file__).parent / "fixtures" / "clusters"
H200 = lookup_gpu("H200")


def test_launcher_instance_type_names_the_gpu():
    inventory = load_cluster_file(str(CLUSTERS / "launcher-aws-p5en.yaml"))
    gpu_nodes = inventory.gpu_nodes
    assert [node.node_id for node in gpu_nodes] == ["gpu_workers-0", "gpu_workers-1"]  # min_workers
    assert all(node.gpu_count == 8 for node in gpu_nodes)
    assert {gpu.total_bytes for node in gpu_nodes for gpu in node.gpus} == {H200.total_bytes}
    assert gpu_nodes[0].resources["accelerator_type:H200"] == 1
    head = inventory.node("head-0")
    assert head.is_head and head.gpu_count == 0
    (capacity,) = inventory.autoscaling
    assert (capacity.name, capacity.gpu, capacity.min_count, capacity.max_count) == ("gpu_workers", "H200", 2, 4)
    grown = inventory.at_capacity()  # max_workers: 4 (global) caps the type's 6
    assert grown.total_gpus == 32
    assert len({node.node_id for node in grown.nodes}) == len(grown.nodes)


def test_launcher_explicit_resources_scale_from_zero():
    inventory = load_cluster_file(str(CLUSTERS / "launcher-gcp-explicit.yaml"))
    assert inventory.total_gpus == 0  # min_workers: 0
    assert inventory.at_capacity().total_gpus == 16
    assert {gpu.nvlink_domain for node in inventory.at_capacity().gpu_nodes for gpu in node.gpus} == {
        "node:h200-0",
        "node:h200-1",
    }


def test_rayservice_worker_group():
    inventory = load_cluster_file(str(CLUSTERS / "rayservice-h200.yaml"))
    assert [node.node_id for node in inventory.gpu_nodes] == ["h200-0", "h200-1"]
    assert inventory.gpu_nodes[0].gpus[0].name == "H200"
    assert inventory.gpu_nodes[0].labels["ray.io/accelerator-type"] == "H200"
    assert inventory.at_capacity().total_gpus == 32


def test_raycluster_gb300_trays_share_an_nvlink_domain_across_nodes():
    inventory = load_cluster_file(str(CLUSTERS / "raycluster-gb300.yaml"))
    trays = inventory.gpu_nodes
    assert len(trays) == 4 and all(node.gpu_count == 4 for node in trays)
    domains = {gpu.nvlink_domain for node in trays for gpu in node.gpus}
    assert len(domains) == 1, domains  # 4 trays x 4 GPUs: one NVL72 domain spanning 4 Ray nodes
    assert trays[0].gpus[0].total_bytes == lookup_gpu("GB300").total_bytes
    grown = inventory.at_capacity()
    assert grown.total_gpus == 72


def test_nvl72_rack_boundary():
    inventory = declared_cluster("GB200", nodes=20)  # 80 GPUs: 18 trays fill rack 0, 2 spill into rack 1
    domains = [node.gpus[0].nvlink_domain for node in inventory.nodes]
    assert domains[:18] == [domains[0]] * 18 and domains[18] == domains[19] != domains[0]


def test_simple_format_heterogeneous_free_memory():
    inventory = load_cluster_file(str(CLUSTERS / "hetero-h200.yaml"))
    roomy, busy = inventory.gpu_nodes
    assert roomy.gpus[0].free == H200.total_bytes
    assert busy.gpus[0].free == 141_733_920_768


def test_declared_cluster_defaults_from_catalogue():
    assert declared_cluster("H200", 2).total_gpus == 16
    assert declared_cluster("GB300", 18).total_gpus == 72
    rtx = declared_cluster("RTX-3090", 1, gpus_per_node=8)
    # PCIe cards share no NVLink, but TP over PCIe inside one host is what vLLM runs: one domain per node.
    assert len({gpu.nvlink_domain for gpu in rtx.nodes[0].gpus}) == 1


@pytest.mark.parametrize(
    "document, field",
    [
        ({"available_node_types": {"gpu_workers": {"resources": {"GPU": "eight"}}}},
         "available_node_types.gpu_workers.resources.GPU"),
        ({"available_node_types": {"gpu_workers": {"resources": {"GPU": 8}, "max_workers": 1}}},
         "available_node_types.gpu_workers.resources"),
        ({"available_node_types": {"w": {"resources": {"GPU": 8, "accelerator_type:Z9": 1}}}},
         "available_node_types.w.resources.accelerator_type"),
        ({"available_node_types": {"w": {"node_config": {"InstanceType": "p5en.48xlarge"}, "min_workers": 3,
                                         "max_workers": 1}}}, "available_node_types.w.max_workers"),
        ({"available_node_types": {"w": {}}, "head_node_type": "nope"}, "head_node_type"),
        ({"nodes": [{"count": 2, "gpu": "H900"}]}, "nodes[0].gpu"),
        ({"nodes": [{"count": -1, "gpu": "H200"}]}, "nodes[0].count"),
        ({"nodes": [{"gpu": "H200", "gpus": 8, "free_bytes": 10**15}]}, "nodes[0].free_bytes"),
        ({"nodes": [{"gpu": "H200", "colour": "red"}]}, "nodes[0].colour"),
        ({"kind": "RayCluster", "spec": {"headGroupSpec": {}, "workerGroupSpecs": [
            {"groupName": "g", "replicas": 1, "template": {"spec": {"containers": [
                {"resources": {"limits": {"nvidia.com/gpu": 8}}}]}}}]}},
         "spec.workerGroupSpecs[0].resources"),
        ({"kind": "RayCluster", "spec": {"headGroupSpec": {}, "workerGroupSpecs": [
            {"groupName": "g", "replicas": "two"}]}}, "spec.workerGroupSpecs[0].replicas"),
        ({"something": 1}, "(top level)"),
    ],
)
def test_bad_cluster_documents_name_the_field(document, field):
    with pytest.raises(ConfigError) as caught:
        parse_cluster_document(document, source="test.yaml")
    assert caught.value.field == field
    assert "test.yaml" in str(caught.value)


def test_bad_file_on_disk():
    with pytest.raises(ConfigError) as caught:
        load_cluster_file(str(CLUSTERS / "bad-launcher-gpu.yaml"))
    assert caught.value.field == "available_node_types.gpu_workers.resources.GPU"
    with pytest.raises(ConfigError) as caught:
        load_cluster_file(str(CLUSTERS / "missing.yaml"))
    assert caught.value.field == "cluster"


def test_catalogue_is_consistent():
    for spec in CATALOGUE:
        assert spec.total_bytes > 0 and spec.source
        assert lookup_gpu(spec.name) is spec
    assert lookup_gpu("GB300").gpus_per_nvlink_domain == 72 and lookup_gpu("GB300").gpus_per_node == 4
    assert lookup_instance("p5en.48xlarge").gpu == "H200"
    assert lookup_instance("a4-highgpu-8g").gpu == "B200"
    with pytest.raises(ConfigError):
        lookup_gpu("H900")
