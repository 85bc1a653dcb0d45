"""The live cluster inventory: every alive Ray node, with its GPUs read by NVML on that node.

One small task per node that advertises GPUs, pinned there (``NodeAffinitySchedulingStrategy(soft=False)``)
and asking for no CPU and no GPU, so it runs even when every GPU is taken by a serving replica. NVML ignores
``CUDA_VISIBLE_DEVICES``, so the task sees all of the machine's GPUs. Its readings are merged with
``ray.nodes()`` (resources, labels, address). A node whose ``GPU`` resource has no NVML behind it (a CPU test
cluster with fake GPUs) is reported with GPUs of unknown memory: placement can be checked there, memory not.
Node types and their max counts come from the autoscaler's cluster config when the cluster has one.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kimi_k3_serve.planning.inventory import ClusterInventory, GpuInfo, NodeInfo, NodeTypeCapacity
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.hardware import find_gpu_by_device_name

NODE_GROUP_LABELS = ("ray.io/node-group", "ray.io/node_group", "ray.io/node-type")
RECORDED_READINGS_ENV = "KIMI_K3_SERVE_NVML_READINGS"
"""Path of a JSON file ``{"<Ray node id>": <take_readings() output>, "default": ...}``. When the node's
environment sets it, the GPU reading of that node comes from the file instead of NVML: a replay of recorded
readings on machines whose GPUs NVML cannot see (a local multi-raylet test cluster with fake GPUs)."""


def _read_gpus_on_node() -> dict[str, Any]:
    """This node's GPUs: NVML, or the recorded readings named by ``$KIMI_K3_SERVE_NVML_READINGS``."""
    recorded = os.environ.get(RECORDED_READINGS_ENV)
    if recorded:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        with open(recorded, encoding="utf-8") as handle:
            table = json.load(handle)
        return table.get(node_id) or table.get("default") or {"unavailable": f"no recorded reading for node {node_id}"}
    from kimi_k3_serve.cluster.nvml import take_readings

    return take_readings()


def _fake_gpus(node_id: str, count: int, accelerator: str | None) -> tuple[GpuInfo, ...]:
    spec = find_gpu_by_device_name(accelerator) if accelerator else None
    return tuple(
        GpuInfo(
            index=index,
            uuid="",
            name=spec.name if spec else (accelerator or ""),
            total_bytes=None,
            free_bytes=None,
            compute_capability=spec.compute_capability if spec else None,
            nvlink_domain=f"node:{node_id}",
            memory_exact=False,
        )
        for index in range(count)
    )


def live_inventory(address: str | None = None, *, timeout_s: float = 120.0) -> ClusterInventory:
    """Inventory of the Ray cluster at ``address`` (or the one this process is connected to)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    connected_here = False
    if not ray.is_initialized():
        try:
            ray.init(address=address or "auto", logging_level="ERROR", log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise ConfigError("address", address or "auto", f"a reachable Ray cluster ({exc})") from None
        connected_here = True
    try:
        alive = [node for node in ray.nodes() if node.get("Alive")]
        available = _available_per_node()
        read_gpus = ray.remote(num_cpus=0)(_read_gpus_on_node)
        pending = {
            node["NodeID"]: read_gpus.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False),
                name="kimi_k3_serve.read_gpus",
            ).remote()
            for node in alive
            if node.get("Resources", {}).get("GPU", 0) > 0
        }
        readings = dict(zip(pending, ray.get(list(pending.values()), timeout=timeout_s))) if pending else {}
        head_id = _head_node_id(ray)
        nodes, notes = [], []
        for node in alive:
            node_id = node["NodeID"]
            nodes.append(_node_info(node, readings.get(node_id), available.get(node_id), node_id == head_id, notes))
        return ClusterInventory(
            nodes=tuple(nodes),
            source=f"live:{address or 'current'}",
            autoscaling=_autoscaling(),
            notes=tuple(notes),
        )
    finally:
        if connected_here:
            ray.shutdown()


AUTH_PROBE_TIMEOUT_S = 5.0


def accepts_unauthenticated(gcs_address: str, *, timeout_s: float = AUTH_PROBE_TIMEOUT_S) -> bool | None:
    """Whether the GCS at ``host:port`` answers a request that carries no token: True (Ray's control plane is open
    to anyone who reaches it), False (it refused it: token authentication), None (no answer either way).

    A plain gRPC channel, without Ray's own client interceptor that would add this process's token; the request
    (``GetClusterId``) reads nothing but the cluster's id."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False if exc.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return True


def _node_info(node: dict, reading: dict | None, available: dict | None, is_head: bool, notes: list) -> NodeInfo:
    from kimi_k3_serve.cluster.nvml import parse_readings

    node_id = node["NodeID"]
    resources = {str(k): float(v) for k, v in node.get("Resources", {}).items()}
    labels = {str(k): str(v) for k, v in (node.get("Labels") or {}).items()}
    advertised = int(resources.get("GPU", 0))
    gpus: tuple[GpuInfo, ...] = ()
    if advertised:
        parsed, reason = parse_readings(reading or {"unavailable": "no reading"}, node_domain=f"node:{node_id}")
        if parsed:
            gpus = tuple(parsed)
            if len(parsed) != advertised:
                notes.append(f"node {node_id}: NVML sees {len(parsed)} GPUs, Ray advertises {advertised}")
        else:
            accelerator = next((k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")), None)
            gpus = _fake_gpus(node_id, advertised, accelerator or labels.get("ray.io/accelerator-type"))
            notes.append(f"node {node_id}: {advertised} GPU resource(s) without NVML ({reason}); memory unknown")
    free_gpus = None if available is None else int(available.get("GPU", 0))
    node_type = next((labels[key] for key in NODE_GROUP_LABELS if key in labels), None)
    return NodeInfo(
        node_id=node_id,
        address=str(node.get("NodeManagerAddress", "")),
        resources=resources,
        labels=labels,
        gpus=gpus,
        node_type=node_type,
        is_head=is_head,
        alive=True,
        available_gpus=free_gpus if advertised else None,
    )


def _available_per_node() -> dict[str, dict]:
    try:
        from ray._private.state import available_resources_per_node  # DeveloperAPI in Ray 2.60

        return available_resources_per_node()
    except Exception:  # best effort: without it, every GPU counts as free
        return {}


def _head_node_id(ray: Any) -> str | None:
    try:
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        return None


def _autoscaling() -> tuple[NodeTypeCapacity, ...]:
    """Node groups the autoscaler may grow (empty when the cluster has no autoscaler)."""
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except Exception:
        return ()
    if config is None:
        return ()
    groups = []
    for group in config.node_group_configs:
        resources = {str(k): float(v) for k, v in group.resources.items()}
        accelerator = next((k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")), None)
        spec = find_gpu_by_device_name(accelerator) if accelerator else None
        groups.append(
            NodeTypeCapacity(
                name=group.name,
                gpu=spec.name if spec else None,
                gpus_per_node=int(resources.get("GPU", 0)),
                min_count=int(group.min_count),
                max_count=int(group.max_count) if group.max_count >= 0 else int(group.min_count),
                resources=resources,
            )
        )
    return tuple(groups)
