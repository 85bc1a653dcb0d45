"""The cluster inventory: nodes, their Ray resources and labels, and their GPUs as CUDA will see them.

One type for three sources: live (``live.py``: Ray + NVML on every node), declared (``cluster/files.py``:
Ray cluster launcher YAML, KubeRay RayCluster/RayService, the project's own short format; ``declared_cluster`` here)
and local (``nvml.py``). GPU facts of declared nodes come from the catalogue in ``hardware.py``. Pure data: no
Ray, torch, yaml or NVML import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.hardware import GpuSpec, find_gpu_by_device_name, lookup_gpu
from kimi_k3_serve.planning.layout import RankDevice


# Ray resources that are bookkeeping, not capacity a new bundle can ask for: the node's own marker and the
# per-placement-group resources Ray creates for reserved bundles (``GPU_group_<pg id>``, ``CPU_group_0_<pg id>``).
_BOOKKEEPING_PREFIXES = ("node:", "bundle_group_")
_PG_RESOURCE = re.compile(r"_group_(\d+_)?[0-9a-f]{16,}$")


def capacity_resources(resources: Mapping[str, Any]) -> dict[str, float]:
    """The Ray resources of a node that are capacity (what a bundle can ask for), bookkeeping left out."""
    return {str(k): float(v) for k, v in resources.items()
            if not str(k).startswith(_BOOKKEEPING_PREFIXES) and not _PG_RESOURCE.search(str(k))}


@dataclass(frozen=True)
class GpuInfo:
    """One GPU. ``total_bytes``/``free_bytes`` are what CUDA reports; None when unknown (a fake Ray ``GPU``)."""

    index: int
    uuid: str
    name: str
    total_bytes: int | None
    free_bytes: int | None
    compute_capability: tuple[int, int] | None
    nvlink_domain: str
    """GPUs with the same value talk over NVLink: the fabric clique on NVL72 racks, else the node (or the GPU
    itself on PCIe cards)."""
    memory_exact: bool = True
    """False when the total is an estimate (NVML v1 total, or a catalogue figure of two-decimal precision)."""

    @property
    def memory_known(self) -> bool:
        return self.total_bytes is not None

    @property
    def free(self) -> int | None:
        return self.total_bytes if self.free_bytes is None else self.free_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "total_bytes": self.total_bytes,
            "free_bytes": self.free_bytes,
            "compute_capability": list(self.compute_capability) if self.compute_capability else None,
            "nvlink_domain": self.nvlink_domain,
            "memory_exact": self.memory_exact,
        }

    def spec(self) -> GpuSpec | None:
        return find_gpu_by_device_name(self.name) if self.name else None


@dataclass(frozen=True)
class NodeInfo:
    """One Ray node (one machine, or one Kubernetes pod)."""

    node_id: str
    address: str
    resources: dict[str, float]
    labels: dict[str, str]
    gpus: tuple[GpuInfo, ...]
    node_type: str | None = None
    """The cluster file's node type / worker group this node belongs to, when known."""
    is_head: bool = False
    alive: bool = True
    available_gpus: int | None = None
    """GPUs Ray can still hand out on this node (live clusters); None means all of them."""

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def free_gpu_count(self) -> int:
        return self.gpu_count if self.available_gpus is None else min(self.available_gpus, self.gpu_count)

    @property
    def accelerator_type(self) -> str | None:
        for key in self.resources:
            if key.startswith("accelerator_type:"):
                return key.split(":", 1)[1]
        return self.labels.get("ray.io/accelerator-type")

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "address": self.address,
            "node_type": self.node_type,
            "is_head": self.is_head,
            "alive": self.alive,
            "resources": dict(self.resources),
            "labels": dict(self.labels),
            "available_gpus": self.available_gpus,
            "gpus": [gpu.to_json() for gpu in self.gpus],
        }


@dataclass(frozen=True)
class NodeTypeCapacity:
    """A node type the autoscaler may start more of (cluster launcher node type, KubeRay worker group)."""

    name: str
    gpu: str | None
    gpus_per_node: int
    min_count: int
    max_count: int
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "gpu": self.gpu,
            "gpus_per_node": self.gpus_per_node,
            "min_count": self.min_count,
            "max_count": self.max_count,
        }


@dataclass(frozen=True)
class ClusterInventory:
    nodes: tuple[NodeInfo, ...]
    source: str
    """Where this came from: ``live:<address>``, ``declared:<file>``, ``declared:<gpu>x<n>``, ``local``."""
    autoscaling: tuple[NodeTypeCapacity, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def gpu_nodes(self) -> tuple[NodeInfo, ...]:
        return tuple(node for node in self.nodes if node.gpus and node.alive)

    @property
    def total_gpus(self) -> int:
        return sum(node.gpu_count for node in self.gpu_nodes)

    def node(self, node_id: str) -> NodeInfo:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(node_id)

    def growth(self) -> tuple[tuple[NodeTypeCapacity, int, int], ...]:
        """The one rule for how many nodes the autoscaler can add: per node type, (type, nodes present, nodes it
        may still add). A node belongs to the type its node-group label names; a node without one (a live
        cluster's, when Ray sets no label) to the first type whose resources it carries. Each node counts once."""
        unclaimed = list(self.nodes)
        out = []
        for capacity in self.autoscaling:
            wanted = capacity_resources(capacity.resources).items()
            present = [node for node in unclaimed if node.node_type == capacity.name or (
                node.node_type is None and capacity_resources(node.resources).items() >= wanted)]
            unclaimed = [node for node in unclaimed if all(node is not p for p in present)]
            out.append((capacity, len(present), max(0, capacity.max_count - len(present))))
        return tuple(out)

    def at_capacity(self) -> ClusterInventory:
        """The cluster grown to every node type's ``max_count``: what the autoscaler could reach."""
        extra: list[NodeInfo] = []
        for capacity, present, missing in self.growth():
            if missing <= 0:
                continue
            extra.extend(
                _declared_nodes(
                    capacity.name,
                    capacity.gpu,
                    capacity.gpus_per_node,
                    missing,
                    first_ordinal=present,
                    resources=capacity.resources,
                    labels=capacity.labels,
                    field_name=f"autoscaling.{capacity.name}",
                )
            )
        if not extra:
            return self
        return replace(self, nodes=self.nodes + tuple(extra), notes=self.notes + ("grown to max_count",))

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "total_gpus": self.total_gpus,
            "nodes": [node.to_json() for node in self.nodes],
            "autoscaling": [capacity.to_json() for capacity in self.autoscaling],
            "notes": list(self.notes),
        }


def rank_device(node: NodeInfo, gpu: GpuInfo) -> RankDevice:
    """The memory model's view of one GPU. Unknown memory is an error: a fake GPU cannot be sized."""
    if gpu.total_bytes is None or gpu.compute_capability is None:
        raise ValueError(f"GPU {gpu.index} of node {node.node_id} has unknown memory or compute capability")
    return RankDevice(
        total_bytes=gpu.total_bytes,
        compute_capability=gpu.compute_capability,
        free_bytes=gpu.free_bytes,
        name=gpu.name,
        node_id=node.node_id,
        nvlink_domain=gpu.nvlink_domain,
        index=gpu.index,
    )


# ---------------------------------------------------------------------------------------------------------------
# Declared clusters
# ---------------------------------------------------------------------------------------------------------------


def _nvlink_domain(spec: GpuSpec, group: str, node_id: str, ordinal: int, gpus_per_node: int, gpu_index: int) -> str:
    if spec.gpus_per_nvlink_domain <= 1:
        # PCIe cards: no NVLink, but vLLM runs TP over PCIe within a host, so the node is their domain
        # (the same answer the live NVML reader gives: no fabric clique -> the node).
        return f"node:{node_id}"
    if spec.gpus_per_nvlink_domain > gpus_per_node:
        # Multi-node NVLink (NVL72): the group's nodes fill racks in order, 72 GPUs (18 four-GPU trays) a rack.
        nodes_per_domain = max(1, spec.gpus_per_nvlink_domain // gpus_per_node)
        return f"nvl{spec.gpus_per_nvlink_domain}:{group}:{ordinal // nodes_per_domain}"
    return f"node:{node_id}"


def _declared_nodes(
    group: str,
    gpu: str | None,
    gpus_per_node: int,
    count: int,
    *,
    first_ordinal: int = 0,
    resources: dict[str, float] | None = None,
    labels: dict[str, str] | None = None,
    free_bytes: int | list[int] | None = None,
    is_head: bool = False,
    field_name: str = "gpu",
) -> list[NodeInfo]:
    spec = lookup_gpu(gpu, field=field_name) if gpu else None
    nodes = []
    for ordinal in range(first_ordinal, first_ordinal + count):
        node_id = f"{group}-{ordinal}"
        gpus = []
        for index in range(gpus_per_node if spec else 0):
            free = free_bytes[index] if isinstance(free_bytes, list) else free_bytes
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=f"declared-{node_id}-{index}",
                    name=spec.name,
                    total_bytes=spec.total_bytes,
                    free_bytes=free,
                    compute_capability=spec.compute_capability,
                    nvlink_domain=_nvlink_domain(spec, group, node_id, ordinal, gpus_per_node, index),
                    memory_exact=spec.measured,
                )
            )
        node_resources = dict(resources or {})
        node_labels = dict(labels or {})
        if spec:
            node_resources.setdefault("GPU", float(gpus_per_node))
            if spec.ray_accelerator_type:
                node_resources.setdefault(f"accelerator_type:{spec.ray_accelerator_type}", 1.0)
                node_labels.setdefault("ray.io/accelerator-type", spec.ray_accelerator_type)
        nodes.append(
            NodeInfo(
                node_id=node_id,
                address="",
                resources=node_resources,
                labels=node_labels,
                gpus=tuple(gpus),
                node_type=group,
                is_head=is_head,
            )
        )
    return nodes


MAX_DECLARED_NODES = 4096
"""Nodes of one declared type, as the cluster files allow (``cluster.files.MAX_NODES_PER_TYPE``)."""
MAX_DECLARED_GPUS_PER_NODE = 72
"""An NVL72 rack seen as one node is the largest GPU count per node there is."""


def declared_cluster(
    gpu: str, nodes: int, gpus_per_node: int | None = None, *, free_bytes: int | None = None
) -> ClusterInventory:
    """``nodes`` identical empty machines of ``gpu`` (catalogue name), e.g. ``declared_cluster("H200", 2)``."""
    spec = lookup_gpu(gpu, field="gpu")
    if not isinstance(nodes, int) or isinstance(nodes, bool) or not 1 <= nodes <= MAX_DECLARED_NODES:
        raise ConfigError("nodes", nodes, f"expected an integer from 1 to {MAX_DECLARED_NODES}")
    per_node = spec.gpus_per_node if gpus_per_node is None else gpus_per_node
    if not isinstance(per_node, int) or isinstance(per_node, bool) or not 1 <= per_node <= MAX_DECLARED_GPUS_PER_NODE:
        raise ConfigError("gpus_per_node", gpus_per_node, f"expected an integer from 1 to {MAX_DECLARED_GPUS_PER_NODE}")
    group = spec.name.lower()
    built = _declared_nodes(group, spec.name, per_node, nodes, free_bytes=free_bytes)
    return ClusterInventory(nodes=tuple(built), source=f"declared:{nodes}x{per_node} {spec.name}")
