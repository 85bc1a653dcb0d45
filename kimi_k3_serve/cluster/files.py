"""Declared clusters read from files: Ray cluster launcher YAML, KubeRay RayCluster/RayService and the
project's short ``nodes:`` format, into the planner's inventory types (``planning.inventory``). Every
problem is a ConfigError naming the field."""

from __future__ import annotations

import re

from typing import Any

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.inputs import load_yaml, read_text_file, refuse_token_text
from kimi_k3_serve.planning.hardware import GpuSpec, INSTANCE_TYPES, find_gpu_by_device_name, gpu_names, lookup_gpu, lookup_instance
from kimi_k3_serve.planning.inventory import ClusterInventory, NodeInfo, NodeTypeCapacity, _declared_nodes


# ---------------------------------------------------------------------------------------------------------------
# Cluster files: Ray cluster launcher YAML, KubeRay RayCluster / RayService, and the project's short format
# ---------------------------------------------------------------------------------------------------------------

_KUBE_GPU_LABELS = (
    "ray.io/accelerator-type",
    "cloud.google.com/gke-accelerator",
    "nvidia.com/gpu.product",
    "node.kubernetes.io/instance-type",
    "beta.kubernetes.io/instance-type",
)
_UNBOUNDED = 2**31 - 1  # "no limit" for the launcher's global max_workers


def load_cluster_file(path: str) -> ClusterInventory:
    """Read a cluster file; the format is recognised from its keys. Every problem is a ConfigError naming the
    field (``available_node_types.gpu_workers.resources.GPU``)."""
    text = read_text_file(path, "cluster", what="a cluster file (YAML or JSON)")
    refuse_token_text(text, "cluster", source=path)  # node and type names are printed, and the file is copied
    documents = load_yaml(text, "cluster", path, all_documents=True)
    return parse_cluster_document(ray_document(documents, source=path), source=path)


def ray_document(documents: list[Any], *, source: str) -> Any:
    """The one Ray document of a file: the file's only one, or its RayCluster / RayService among several (a
    rendered KubeRay file also holds the NetworkPolicy that closes the cluster)."""
    if len(documents) <= 1:
        return documents[0] if documents else None
    ray = [d for d in documents if isinstance(d, dict) and d.get("kind") in ("RayCluster", "RayService")]
    if len(ray) != 1:
        kinds = [d.get("kind") if isinstance(d, dict) else type(d).__name__ for d in documents]
        raise ConfigError("(documents)", kinds, "one RayCluster or RayService among the file's YAML documents",
                          source=source)
    return ray[0]


def parse_cluster_document(document: Any, source: str = "<cluster>") -> ClusterInventory:
    if not isinstance(document, dict):
        raise ConfigError("(top level)", type(document).__name__, "a mapping", source=source)
    kind = document.get("kind")
    try:
        if kind in ("RayCluster", "RayService"):
            return _from_kuberay(document, source)
        if "available_node_types" in document:
            return _from_launcher(document, source)
        if "nodes" in document:
            return _from_simple(document, source)
    except ConfigError as exc:
        if exc.source is None:  # raised by a shared helper (the GPU catalogue): say which file
            raise ConfigError(exc.field, exc.value, exc.allowed, source=source) from None
        raise
    raise ConfigError(
        "(top level)",
        _key_names(document),
        "a Ray cluster launcher file (available_node_types), a KubeRay RayCluster/RayService (kind), "
        "or a cluster description (nodes: [{count, gpu, gpus}])",
        source=source,
    )


def _key_names(document: dict) -> list[str]:
    """The top-level keys to show when a file is not a cluster file: those shaped like field names, so that a file
    given by mistake (a password file, a key) is not echoed line by line."""
    names = sorted(k for k in map(str, document) if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,39}", k))
    others = len(document) - len(names)
    return names[:8] + ([f"... {len(names) - 8} more"] if len(names) > 8 else []) + (
        [f"{others} key(s) not shaped like field names"] if others else [])


# Bounds that keep a typo (``count: 100000000``) from building millions of nodes in memory.
MAX_NODES_PER_TYPE = 4096
MAX_GPUS_PER_NODE = 72


def _int(value: Any, field_name: str, source: str, minimum: int = 0, maximum: int | None = MAX_NODES_PER_TYPE) -> int:
    if isinstance(value, str) and value.strip().isdecimal() and value.strip().isascii():
        value = int(value.strip())
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(field_name, value, f"expected an integer >= {minimum}", source=source)
    if maximum is not None and value > maximum:
        raise ConfigError(field_name, value, f"expected an integer between {minimum} and {maximum}", source=source)
    return value


def _resource_amounts(resources: dict, field_name: str, source: str) -> dict[str, float]:
    """The numeric Ray resources of a mapping (numbers or numeric strings); other values are not resources."""
    amounts: dict[str, float] = {}
    for key, value in resources.items():
        if isinstance(value, bool) or not (isinstance(value, (int, float)) or _is_number_text(value)):
            continue
        try:
            amount = float(value)
        except OverflowError:
            amount = float("inf")
        if amount != amount or amount < 0 or amount == float("inf"):
            raise ConfigError(f"{field_name}.{key}", value, "a finite resource amount >= 0", source=source)
        amounts[str(key)] = amount
    return amounts


def _is_number_text(value: Any) -> bool:
    return isinstance(value, str) and value.replace(".", "", 1).isdecimal() and value.isascii()


def _mapping(value: Any, field_name: str, source: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(field_name, value, "expected a mapping", source=source)
    return value


def _gpu_from_name(name: str) -> GpuSpec | None:
    """A catalogue GPU from an accelerator label or product name ('nvidia-h200-141gb', 'NVIDIA-H200', 'H200')."""
    text = str(name)
    for candidate in (text, text[len("nvidia-"):] if text.lower().startswith("nvidia-") else text):
        spec = find_gpu_by_device_name(candidate)
        if spec is not None:
            return spec
    instance = lookup_instance(text)
    return find_gpu_by_device_name(instance.gpu) if instance else None


def _accelerator_from_resources(resources: dict) -> str | None:
    for key in resources:
        if str(key).startswith("accelerator_type:"):
            return str(key).split(":", 1)[1]
    return None


def _resolve_gpu(candidates: list[tuple[str, Any]], field_name: str, source: str) -> str:
    """The first candidate (field, name) that names a known GPU; a ConfigError listing what was tried."""
    for where, name in candidates:
        if name is None:
            continue
        spec = _gpu_from_name(name)
        if spec is None:
            raise ConfigError(
                where,
                name,
                f"a GPU the catalogue knows ({', '.join(gpu_names())}) or a known instance type "
                f"({', '.join(instance.name for instance in INSTANCE_TYPES)})",
                source=source,
            )
        return spec.name
    raise ConfigError(
        field_name,
        None,
        "the GPU type is not named: add resources {'accelerator_type:<GPU>': 1}, a known instance type, "
        "or a ray.io/accelerator-type label",
        source=source,
    )


def _from_simple(document: dict, source: str) -> ClusterInventory:
    groups = document["nodes"]
    if not isinstance(groups, list) or not groups:
        raise ConfigError("nodes", groups, "a non-empty list of {count, gpu, gpus}", source=source)
    for key in document:
        if key != "nodes":  # a cluster description holds its node groups only: anything else is a typo
            raise ConfigError(str(key), document[key], "no other key beside nodes in a cluster description",
                              source=source)
    nodes: list[NodeInfo] = []
    autoscaling: list[NodeTypeCapacity] = []
    for i, group in enumerate(groups):
        where = f"nodes[{i}]"
        group = _mapping(group, where, source)
        unknown = set(group) - {"name", "count", "gpu", "gpus", "free_bytes", "max_count"}
        if unknown:
            raise ConfigError(f"{where}.{sorted(unknown)[0]}", group[sorted(unknown)[0]],
                              "allowed keys: name, count, gpu, gpus, free_bytes, max_count", source=source)
        count = _int(group.get("count", 1), f"{where}.count", source, minimum=0)
        gpu = group.get("gpu")
        if not isinstance(gpu, str):
            raise ConfigError(f"{where}.gpu", gpu, f"one of {', '.join(gpu_names())}", source=source)
        spec = lookup_gpu(gpu, field=f"{where}.gpu")
        gpus = _int(group.get("gpus", spec.gpus_per_node), f"{where}.gpus", source, minimum=1,
                    maximum=MAX_GPUS_PER_NODE)
        free = group.get("free_bytes")
        if free is not None:
            values = free if isinstance(free, list) else [free]
            if isinstance(free, list) and len(free) != gpus:
                raise ConfigError(f"{where}.free_bytes", free, f"one number or a list of {gpus} (one per GPU)",
                                  source=source)
            values = [_int(value, f"{where}.free_bytes", source, maximum=None) for value in values]
            for value in values:
                if value > spec.total_bytes:
                    raise ConfigError(f"{where}.free_bytes", value,
                                      f"at most the {spec.name} total of {spec.total_bytes} bytes", source=source)
            free = values if isinstance(free, list) else values[0]  # numeric strings read as integers
        name = group.get("name", f"{spec.name.lower()}-{i}")
        if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", name)):
            raise ConfigError(f"{where}.name", name, "a node group name: letters, digits, _ . and -, 1 to 63 "
                              "characters", source=source)
        nodes += _declared_nodes(name, spec.name, gpus, count, free_bytes=free, field_name=f"{where}.gpu")
        if "max_count" in group:
            max_count = _int(group["max_count"], f"{where}.max_count", source, minimum=count)
            autoscaling.append(NodeTypeCapacity(name, spec.name, gpus, count, max_count))
    return ClusterInventory(nodes=tuple(nodes), source=f"declared:{source}", autoscaling=tuple(autoscaling))


def _from_launcher(document: dict, source: str) -> ClusterInventory:
    types = _mapping(document["available_node_types"], "available_node_types", source)
    if not types:
        raise ConfigError("available_node_types", types, "at least one node type", source=source)
    head_type = document.get("head_node_type")
    if head_type is not None and (not isinstance(head_type, str) or head_type not in types):
        raise ConfigError("head_node_type", head_type, f"one of available_node_types: {', '.join(types)}",
                          source=source)
    global_max = _int(document.get("max_workers", _UNBOUNDED), "max_workers", source, maximum=None)
    nodes: list[NodeInfo] = []
    autoscaling: list[NodeTypeCapacity] = []
    for name, node_type in types.items():
        where = f"available_node_types.{name}"
        node_type = _mapping(node_type, where, source)
        resources = _mapping(node_type.get("resources"), f"{where}.resources", source)
        for key, amount in resources.items():  # Ray reads every one as a number: true or text is a typo here
            if isinstance(amount, bool) or not isinstance(amount, (int, float)):
                raise ConfigError(f"{where}.resources.{key}", amount, "a resource amount: a number >= 0",
                                  source=source)
        node_config = _mapping(node_type.get("node_config"), f"{where}.node_config", source)
        instance_field, instance_name = None, None
        for key in ("InstanceType", "machineType", "vmSize", "instance_type"):
            if key in node_config:
                instance_field, instance_name = f"{where}.node_config.{key}", node_config[key]
        azure = _mapping(node_config.get("azure_arm_parameters"), f"{where}.node_config.azure_arm_parameters", source)
        if "vmSize" in azure:
            instance_field, instance_name = f"{where}.node_config.azure_arm_parameters.vmSize", azure["vmSize"]
        instance = lookup_instance(str(instance_name)) if instance_name else None
        if "GPU" in resources:
            gpus = _int(resources["GPU"], f"{where}.resources.GPU", source, maximum=MAX_GPUS_PER_NODE)
        else:
            gpus = instance.gpus if instance else 0
        gpu = None
        if gpus:
            accelerator = _accelerator_from_resources(resources)
            candidates = [(f"{where}.resources.accelerator_type", accelerator)]
            if instance_name is not None:
                candidates.append((instance_field, instance.gpu if instance else instance_name))
            gpu = _resolve_gpu(candidates, f"{where}.resources", source)
        is_head = name == head_type
        if is_head:
            min_count = max_count = 1
        else:
            min_count = _int(node_type.get("min_workers", 0), f"{where}.min_workers", source)
            max_count = _int(node_type.get("max_workers", min_count), f"{where}.max_workers", source)
            if max_count < min_count:
                raise ConfigError(f"{where}.max_workers", max_count, f"at least min_workers ({min_count})",
                                  source=source)
            max_count = min(max_count, global_max)
        labels = {str(k): str(v) for k, v in _mapping(node_type.get("labels"), f"{where}.labels", source).items()}
        numeric = _resource_amounts(resources, f"{where}.resources", source)
        nodes += _declared_nodes(name, gpu, gpus, min_count, resources=numeric, labels=labels, is_head=is_head,
                                 field_name=f"{where}.resources")
        if not is_head and max_count > min_count:
            autoscaling.append(NodeTypeCapacity(name, gpu, gpus, min_count, max_count, numeric, labels))
    workers = sum(1 for node in nodes if not node.is_head)
    if workers > global_max:  # the autoscaler starts no worker beyond it: the nodes counted here would never come
        raise ConfigError("max_workers", global_max, f"at least the node types' min_workers together ({workers})",
                          source=source)
    return ClusterInventory(nodes=tuple(nodes), source=f"declared:{source}", autoscaling=tuple(autoscaling))


def _kube_group(group: dict, where: str, source: str) -> tuple[int, str | None, dict, dict]:
    """(GPUs per pod, GPU name, Ray resources, labels) of a KubeRay head or worker group."""
    resources_raw = _mapping(group.get("resources"), f"{where}.resources", source)
    start = _mapping(group.get("rayStartParams"), f"{where}.rayStartParams", source)
    start_resources: dict = {}
    if "resources" in start:
        import json

        text = str(start["resources"]).strip().strip("'\"")
        try:
            start_resources = json.loads(text.replace("\\\"", "\""))
        except (json.JSONDecodeError, RecursionError):
            raise ConfigError(f"{where}.rayStartParams.resources", start["resources"], "a JSON object of resources",
                              source=source) from None
        start_resources = _mapping(start_resources, f"{where}.rayStartParams.resources", source)
    template = _mapping(group.get("template"), f"{where}.template", source)
    pod_spec = _mapping(template.get("spec"), f"{where}.template.spec", source)
    containers = pod_spec.get("containers") or []
    if not isinstance(containers, list):
        raise ConfigError(f"{where}.template.spec.containers", containers, "a list of containers", source=source)
    gpus = None
    gpu_field = f"{where}.template.spec.containers[0].resources.limits.nvidia.com/gpu"
    for key, value in {**resources_raw, **start_resources}.items():
        if key == "GPU":
            gpus, gpu_field = value, f"{where}.resources.GPU"
    if gpus is None and "num-gpus" in start:
        gpus, gpu_field = start["num-gpus"], f"{where}.rayStartParams.num-gpus"
    if gpus is None:
        for c, container in enumerate(containers):
            resources = _mapping(_mapping(container, f"{where}.template.spec.containers[{c}]", source).get("resources"),
                                 f"{where}.template.spec.containers[{c}].resources", source)
            limits = _mapping(resources.get("limits"), f"{where}.template.spec.containers[{c}].resources.limits", source)
            for key, value in limits.items():
                if str(key).endswith("gpu"):
                    gpus, gpu_field = value, f"{where}.template.spec.containers[{c}].resources.limits.{key}"
    gpus = _int(gpus or 0, gpu_field, source, maximum=MAX_GPUS_PER_NODE)
    labels = {str(k): str(v) for k, v in _mapping(group.get("labels"), f"{where}.labels", source).items()}
    if "labels" in start:  # rayStartParams labels: "k1=v1,k2=v2"
        for item in str(start["labels"]).split(","):
            if "=" in item:
                key, value = item.split("=", 1)
                labels[key.strip()] = value.strip()
    numeric = _resource_amounts({**resources_raw, **start_resources}, f"{where}.resources", source)
    gpu = None
    if gpus:
        selector = _mapping(pod_spec.get("nodeSelector"), f"{where}.template.spec.nodeSelector", source)
        candidates = [(f"{where}.resources.accelerator_type", _accelerator_from_resources(numeric)),
                      (f"{where}.labels.ray.io/accelerator-type", labels.get("ray.io/accelerator-type"))]
        candidates += [(f"{where}.template.spec.nodeSelector.{key}", selector.get(key)) for key in _KUBE_GPU_LABELS]
        gpu = _resolve_gpu(candidates, f"{where}.resources", source)
    return gpus, gpu, numeric, labels


def _from_kuberay(document: dict, source: str) -> ClusterInventory:
    spec = _mapping(document.get("spec"), "spec", source)
    prefix = "spec"
    if document["kind"] == "RayService":
        spec, prefix = _mapping(spec.get("rayClusterConfig"), "spec.rayClusterConfig", source), "spec.rayClusterConfig"
    nodes: list[NodeInfo] = []
    autoscaling: list[NodeTypeCapacity] = []
    head = _mapping(spec.get("headGroupSpec"), f"{prefix}.headGroupSpec", source)
    gpus, gpu, resources, labels = _kube_group(head, f"{prefix}.headGroupSpec", source)
    nodes += _declared_nodes("head", gpu, gpus, 1, resources=resources, labels=labels, is_head=True)
    groups = spec.get("workerGroupSpecs") or []
    if not isinstance(groups, list):
        raise ConfigError(f"{prefix}.workerGroupSpecs", groups, "a list of worker groups", source=source)
    for i, group in enumerate(groups):
        where = f"{prefix}.workerGroupSpecs[{i}]"
        if not isinstance(group, dict):  # _mapping reads an absent section as empty; an empty list item is a typo
            raise ConfigError(where, group, "a worker group: a mapping with groupName, replicas and template",
                              source=source)
        group = _mapping(group, where, source)
        name = str(group.get("groupName") or f"group-{i}")
        gpus, gpu, resources, labels = _kube_group(group, where, source)
        hosts = _int(group.get("numOfHosts", 1), f"{where}.numOfHosts", source, minimum=1)
        min_replicas = _int(group.get("minReplicas", 0), f"{where}.minReplicas", source)
        replicas = _int(group.get("replicas", min_replicas), f"{where}.replicas", source)
        # Without maxReplicas the group does not autoscale for planning purposes (KubeRay's own default is
        # unbounded, which no plan can be checked against).
        max_replicas = _int(group.get("maxReplicas", max(replicas, min_replicas)), f"{where}.maxReplicas", source)
        if max_replicas < min_replicas:
            raise ConfigError(f"{where}.maxReplicas", max_replicas, f"at least minReplicas ({min_replicas})",
                              source=source)
        if not min_replicas <= replicas <= max_replicas:
            raise ConfigError(f"{where}.replicas", replicas, f"from minReplicas ({min_replicas}) to maxReplicas "
                              f"({max_replicas})", source=source)
        if max(replicas, max_replicas) * hosts > MAX_NODES_PER_TYPE:
            raise ConfigError(f"{where}.numOfHosts", hosts,
                              f"at most {MAX_NODES_PER_TYPE} pods per group (replicas x numOfHosts)", source=source)
        if group.get("suspend") is True:
            continue
        nodes += _declared_nodes(name, gpu, gpus, replicas * hosts, resources=resources, labels=labels,
                                 field_name=f"{where}.resources")
        if max_replicas > replicas:
            autoscaling.append(NodeTypeCapacity(name, gpu, gpus, replicas * hosts, max_replicas * hosts,
                                                resources, labels))
    return ClusterInventory(nodes=tuple(nodes), source=f"declared:{source}", autoscaling=tuple(autoscaling))
