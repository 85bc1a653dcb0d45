"""Cluster files written from the shape of one model replica, so node counts and resources never drift from
the plan.

One replica of a multi-node model is one Ray placement group: ``nodes_per_replica`` nodes of one type, each
holding ``bundles_per_node[i]`` one-GPU bundles that also ask for a custom resource such as
``accelerator_type:H200: 0.001``. Ray's autoscaler adds nodes for a pending group only when a node type
*declares* every resource the bundles ask for (KubeRay does not infer ``accelerator_type:*`` from
``nvidia.com/gpu``), and the worker group must be able to hold ``max_replicas`` whole replicas. This module
turns a :class:`ReplicaShape` and the Serve replica range into the text of a Ray cluster launcher file (AWS,
GCP), a KubeRay ``RayService`` or a local file for the fake multi-node provider.

Pure: data in, text out (hand-written YAML so the files carry comments). No Ray, vLLM or YAML import.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from kimi_k3_serve import __version__
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.hardware import lookup_gpu
from kimi_k3_serve.planning.startup import (
    KUBERAY_LIVENESS_INITIAL_DELAY_S,
    KUBERAY_LIVENESS_PERIOD_S,
    KUBERAY_LIVENESS_TIMEOUT_S,
    StartupBudgets,
)
from kimi_k3_serve.units import GB, GiB

FORMATS = ("launcher-aws", "launcher-gcp", "kuberay", "fake")
PLATFORM_OF_FORMAT = {"launcher-aws": "aws", "launcher-gcp": "gcp", "kuberay": "kubernetes", "fake": "fake"}

RAY_VERSION = "2.60.0"
VLLM_VERSION = "0.32.0"
KUBERAY_MIN_VERSION = "1.5.1"
"""Group-level ``resources`` and ``autoscalerOptions.version`` are in the RayCluster CRD from KubeRay 1.4,
``authOptions: {mode: token}`` (Ray's token authentication, the token in a Secret KubeRay makes) from 1.5.1."""

RAY_TOKEN_PATH = "~/.ray/auth_token"
"""Where Ray 2.60 looks for its token by default (``ray get-auth-token --generate`` writes it there). Launcher files
copy the operator's own file to every node: the rendered file names the path, never the token."""
DASHBOARD_PORT = 8265
CLUSTER_LABEL = "kimi-k3-serve/ray-cluster"
"""Pod label of a KubeRay file's head and workers, which its NetworkPolicy selects."""
OPERATOR_NAMESPACE = "kuberay-system"
INGRESS_NAMESPACE = "ingress-nginx"

_CLUSTER_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,48}[a-z0-9])?")

# Resources Ray itself accounts for; everything else a bundle asks for is a custom resource that every node
# of the worker type must declare.
_STANDARD_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


# --------------------------------------------------------------------------------------------------------------
# What one replica needs
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaShape:
    """The nodes one replica of the model occupies, as its placement group asks for them."""

    gpu: str
    """Catalogue GPU name (``kimi_k3_serve.planning.hardware``), e.g. ``H200``."""
    accelerator_type: str | None
    """Ray ``accelerator_type`` the LLM config sets (adds ``accelerator_type:<T>: 0.001`` to every bundle)."""
    gpus_per_node: int
    nodes_per_replica: int
    bundles_per_node: tuple[int, ...]
    """The intended one-GPU bundles on each node of the replica, e.g. ``(8, 8)`` for TP8 x PP2 on 8-GPU nodes."""
    bundle_resources: tuple[tuple[str, float], ...] = ()
    """Custom resources each bundle asks for besides CPU/GPU, sorted by name."""
    cpus_per_node: int = 0
    memory_bytes_per_node: int = 0

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nodes_per_replica"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"replica_shape.{name}", value, "expected an integer >= 1")
        if len(self.bundles_per_node) != self.nodes_per_replica:
            raise ConfigError(
                "replica_shape.bundles_per_node",
                list(self.bundles_per_node),
                f"expected {self.nodes_per_replica} entries (one per node of the replica)",
            )
        for count in self.bundles_per_node:
            if not 1 <= count <= self.gpus_per_node:
                raise ConfigError(
                    "replica_shape.bundles_per_node",
                    list(self.bundles_per_node),
                    f"each node holds 1..{self.gpus_per_node} one-GPU bundles",
                )
        for key, amount in self.bundle_resources:
            if key in _STANDARD_RESOURCES or not amount > 0:
                raise ConfigError("replica_shape.bundle_resources", dict(self.bundle_resources), "custom resources > 0 only")

    @property
    def gpus_per_replica(self) -> int:
        return sum(self.bundles_per_node)

    def declared_custom_resources(self) -> dict[str, int]:
        """What each node of the worker type must declare so the busiest node can hold its bundles.

        Launcher and KubeRay resources are integers; Ray's own auto-detection declares
        ``accelerator_type:<T>: 1`` on a node, which holds any number of 0.001 requests.
        """
        busiest = max(self.bundles_per_node)
        return {key: max(1, math.ceil(round(amount * busiest, 9))) for key, amount in self.bundle_resources}

    def ray_resources(self) -> dict[str, int]:
        """Ray resources one worker node declares: CPU, GPU and the custom resources."""
        resources: dict[str, int] = {}
        if self.cpus_per_node:
            resources["CPU"] = self.cpus_per_node
        resources["GPU"] = self.gpus_per_node
        resources.update(self.declared_custom_resources())
        return resources

    def describe(self) -> str:
        per_node = "/".join(str(n) for n in self.bundles_per_node)
        return (
            f"{self.nodes_per_replica} node(s) x {self.gpus_per_node} {self.gpu} per replica, "
            f"{self.gpus_per_replica} one-GPU bundles laid out {per_node}"
        )


@dataclass(frozen=True)
class ReplicaScaling:
    """Serve's replica range for the model deployment; worker nodes follow it times ``nodes_per_replica``."""

    min_replicas: int
    max_replicas: int

    def __post_init__(self) -> None:
        if not isinstance(self.min_replicas, int) or self.min_replicas < 0:
            raise ConfigError("autoscaling_config.min_replicas", self.min_replicas, "expected an integer >= 0")
        if not isinstance(self.max_replicas, int) or self.max_replicas < max(1, self.min_replicas):
            raise ConfigError(
                "autoscaling_config.max_replicas",
                self.max_replicas,
                f"expected an integer >= max(1, min_replicas={self.min_replicas})",
            )

    def min_workers(self, shape: ReplicaShape) -> int:
        return self.min_replicas * shape.nodes_per_replica

    def max_workers(self, shape: ReplicaShape) -> int:
        return self.max_replicas * shape.nodes_per_replica


def even_bundles_per_node(world_size: int, gpus_per_node: int) -> tuple[int, ...]:
    """Fill whole nodes first: 16 bundles on 8-GPU nodes -> (8, 8); 12 on 8 -> (8, 4). PACK does the same
    when the nodes are empty, and it keeps each TP group of up to ``gpus_per_node`` ranks on one node."""
    if world_size < 1 or gpus_per_node < 1:
        raise ConfigError("world_size", world_size, "expected >= 1 GPU per replica")
    full, rest = divmod(world_size, gpus_per_node)
    return (gpus_per_node,) * full + ((rest,) if rest else ())


def bundle_custom_resources(bundles: Iterable[Mapping[str, float]]) -> tuple[tuple[str, float], ...]:
    """The custom resources a placement group's bundles ask for (largest amount per key), sorted by name."""
    found: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            if key not in _STANDARD_RESOURCES and amount:
                found[key] = max(found.get(key, 0.0), float(amount))
    return tuple(sorted(found.items()))


# --------------------------------------------------------------------------------------------------------------
# Where the nodes come from
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeOffering:
    """A machine (or pod) shape a platform provides: its GPUs and what a Ray node on it may use."""

    platform: str
    """``aws``, ``gcp``, ``kubernetes`` or ``fake``."""
    name: str
    """Instance type (AWS), machine type (GCP) or a pod shape name (Kubernetes)."""
    gpu: str
    gpus: int
    cpus: int
    """vCPUs a Ray node declares (on Kubernetes: what the pod requests, leaving room for the kubelet)."""
    memory_bytes: int
    source: str
    node_config_note: str = ""


OFFERINGS: tuple[NodeOffering, ...] = (
    NodeOffering(
        "aws", "p5en.48xlarge", "H200", 8, 192, 2048 * GiB,
        "AWS EC2 P5en: 8x H200 141 GB, 192 vCPU, 2 TiB, 3,200 Gbps EFAv3",
    ),
    NodeOffering(
        "aws", "p6-b200.48xlarge", "B200", 8, 192, 2048 * GiB,
        "AWS EC2 P6-B200: 8x B200 180 GB, 192 vCPU, 2 TiB, 3,200 Gbps EFAv4",
    ),
    NodeOffering(
        "gcp", "a3-ultragpu-8g", "H200", 8, 224, 2952 * GB,
        "Google Cloud A3 Ultra: 8x H200 141 GB, 224 vCPU, 2,952 GB; GPUs come with the machine type",
    ),
    NodeOffering(
        "gcp", "a4-highgpu-8g", "B200", 8, 224, 3968 * GB,
        "Google Cloud A4: 8x B200 180 GB, 224 vCPU, 3,968 GB; GPUs come with the machine type",
    ),
    NodeOffering(
        "kubernetes", "h200-8gpu-pod", "H200", 8, 180, 1800 * GiB,
        "one pod per 8x H200 node (p5en / a3-ultra class): 180 of 192+ vCPUs and 1,800 GiB requested",
    ),
    NodeOffering(
        "kubernetes", "b200-8gpu-pod", "B200", 8, 180, 1800 * GiB,
        "one pod per 8x B200 node (p6-b200 / a4 class): 180 of 192+ vCPUs and 1,800 GiB requested",
    ),
    NodeOffering(
        "kubernetes", "gb300-tray-pod", "GB300", 4, 128, 800 * GiB,
        "one pod per GB300 NVL72 compute tray: 4 GPUs, 2 Grace CPUs (144 Arm cores, ~960 GB LPDDR5X); "
        "all 72 GPUs of the rack share one NVLink domain",
    ),
    NodeOffering(
        "fake", "fake-8gpu", "H200", 8, 8, 0,
        "Ray's fake multi-node provider on one machine: fake GPUs, a few logical CPUs",
    ),
    NodeOffering(
        "fake", "fake-8gpu-b200", "B200", 8, 8, 0,
        "Ray's fake multi-node provider on one machine: fake GPUs, a few logical CPUs",
    ),
    NodeOffering(
        "fake", "fake-4gpu-gb300", "GB300", 4, 8, 0,
        "Ray's fake multi-node provider on one machine: fake GPUs, a few logical CPUs",
    ),
)


def find_offering(platform: str, gpu: str, name: str | None = None) -> NodeOffering:
    """The node offering for ``gpu`` on ``platform`` (or the one called ``name``); a ConfigError lists choices."""
    candidates = [o for o in OFFERINGS if o.platform == platform]
    if name is not None:
        for offering in candidates:
            if offering.name == name:
                if offering.gpu != gpu:
                    raise ConfigError("instance_type", name, f"carries {offering.gpu} GPUs but the deploy config uses {gpu}")
                return offering
        raise ConfigError("instance_type", name, f"expected one of {', '.join(o.name for o in candidates)}")
    for offering in candidates:
        if offering.gpu == gpu:
            return offering
    known = ", ".join(f"{o.gpu} ({o.name})" for o in candidates)
    raise ConfigError("gpu", gpu, f"no {platform} node type for this GPU; known: {known}")


# --------------------------------------------------------------------------------------------------------------
# What gets rendered
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterFileRequest:
    """Everything a cluster file is written from."""

    format: str
    shape: ReplicaShape
    scaling: ReplicaScaling
    offering: NodeOffering
    cluster_name: str
    deploy_config: str
    """Repository-relative path of the deploy config, named in the file's header and commands."""
    serve_config_text: str = ""
    """The deploy config itself; KubeRay embeds it as ``serveConfigV2``."""
    verdict: tuple[str, ...] = ()
    """The planner's verdict lines, copied into the header."""
    extra_options: tuple[str, ...] = ()
    """Command-line options beyond --config/--format that produced this file, echoed in its header so the file
    says exactly how to render it again."""
    idle_timeout_s: int = 1800
    """How long an idle GPU node is kept. Long: a replica takes many minutes to load 1.5 TB of weights,
    so releasing nodes on a short lull costs more than it saves."""
    startup: StartupBudgets | None = None
    """The replica's start-up budgets on this file's node type (``planning.startup``): written into the header, and
    into a KubeRay file's worker liveness probe."""
    deploy_startup: StartupBudgets | None = None
    """The budgets the deploy config's ``RAYLLM_ENGINE_START_TIMEOUT_S`` carries (the slowest node type ``render``
    writes for the GPU); None: this file's own."""
    direct_streaming: bool = False
    """``args.deployment.direct_streaming``: every node starts Ray with ``direct_streaming_env``."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError("format", self.format, f"expected one of {', '.join(FORMATS)}")
        if PLATFORM_OF_FORMAT[self.format] != self.offering.platform:
            raise ConfigError("instance_type", self.offering.name, f"is a {self.offering.platform} node, not {self.format}")
        if self.offering.gpus != self.shape.gpus_per_node:
            raise ConfigError(
                "instance_type",
                self.offering.name,
                f"has {self.offering.gpus} GPUs per node but the plan lays out {self.shape.gpus_per_node} per node",
            )
        if self.format == "kuberay" and not self.serve_config_text.strip():
            raise ConfigError("serve_config_text", "", "KubeRay needs the deploy config to embed as serveConfigV2")
        if not _CLUSTER_NAME.fullmatch(self.cluster_name):
            # A Kubernetes object name (RFC 1123 label) is the strictest of the three; GCP wants lowercase too.
            raise ConfigError("cluster_name", self.cluster_name, "lowercase letters, digits and '-', 1-50 characters")
        if not isinstance(self.idle_timeout_s, int) or self.idle_timeout_s < 0:
            raise ConfigError("idle_timeout_s", self.idle_timeout_s, "expected an integer >= 0 seconds")

    @property
    def worker_type(self) -> str:
        return f"gpu_{self.shape.gpus_per_node}x{self.shape.gpu.lower()}"


def render_command(request: ClusterFileRequest) -> str:
    """The command line that writes this file (quoted in its header; a test runs it again)."""
    words = ["kimi-k3-serve", "render", "--config", request.deploy_config, "--format", request.format]
    return " ".join(words + list(request.extra_options))


LAUNCHER_HAPROXY = "$HOME/kimi-k3-serve-env/bin/kimi-k3-serve-haproxy"
"""The console script in the launcher files' venv (``_setup_commands``)."""
IMAGE_HAPROXY = "/opt/kimi-k3-serve/bin/kimi-k3-serve-haproxy"
"""The console script in the GPU image's venv (deploy/Dockerfile)."""


THROUGHPUT_OPTIMIZED_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
"""Ray Serve's throughput-optimized mode (``ray/serve/_private/constants.py``): user code and the router on the
replica's own event loop, buffered request logs, gRPC between proxy and replicas, GC frozen after start. Read when
Ray Serve is imported, so it is set for the whole node (proxy, controller, replicas)."""


def direct_streaming_env(haproxy: str) -> dict[str, str]:
    """What Ray Serve LLM's direct streaming needs in a node's environment before ``ray start``: the mode, Ray's
    HAProxy in front, and HAProxy's stats and metrics ports on loopback (``serving.haproxy_loopback``).

    Ray Serve's throughput-optimized mode too: on the H200 with 256 streams in the KV cache at once, direct
    streaming gave 0.966x of bare vLLM's throughput with it (median of 3 rounds; 0.99x-1.00x at 1 to 64 streams) and
    0.61x without, and TTFT at 8 streams +4.8 ms against +11.1 ms (docs/benchmarks.md, 2026-12-03 and 04). It also
    sends Serve's logs to its log files only, not to stderr."""
    return {"RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_HAPROXY_BINARY_PATH": haproxy, **THROUGHPUT_OPTIMIZED_ENV}


def render(request: ClusterFileRequest) -> str:
    writer = {
        "launcher-aws": _render_launcher_aws,
        "launcher-gcp": _render_launcher_gcp,
        "kuberay": _render_kuberay,
        "fake": _render_fake,
    }[request.format]
    return writer(request)


# --------------------------------------------------------------------------------------------------------------
# YAML text helpers: JSON scalars and flow maps are valid YAML, and keep the output unambiguous.
# --------------------------------------------------------------------------------------------------------------


def _scalar(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return json.dumps(value)
    text = str(value)
    plain_ok = text and text[0].isalnum() and all(ch.isalnum() or ch in "-_./" for ch in text)
    looks_typed = text.lower() in {"true", "false", "yes", "no", "on", "off", "null"} or _is_number(text)
    return text if plain_ok and not looks_typed else json.dumps(text)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _flow(mapping: Mapping[str, object]) -> str:
    return "{" + ", ".join(f"{_scalar(k)}: {_scalar(v)}" for k, v in mapping.items()) + "}"


def _header(request: ClusterFileRequest, what: str, how: str) -> list[str]:
    shape, scaling = request.shape, request.scaling
    lines = [
        f"# {what}",
        f"# Written by `{render_command(request)}`:",
        "# do not edit the sizes here; change the deploy config and render again (a test compares the two).",
        f"# {how}",
        "#",
        f"# One replica: {shape.describe()}.",
        f"# Serve replicas {scaling.min_replicas}..{scaling.max_replicas} -> GPU worker nodes "
        f"{scaling.min_workers(shape)}..{scaling.max_workers(shape)} (replicas x {shape.nodes_per_replica} nodes per replica).",
    ]
    declared = shape.declared_custom_resources()
    if declared:
        lines.append(
            "# Every GPU node declares " + _flow(declared) + ": each placement-group bundle asks for "
            + _flow(dict(shape.bundle_resources)) + ", and the autoscaler adds a node only for resources it declares."
        )
    if request.verdict:
        lines.append("#")
        lines.extend(f"# {line}" if line else "#" for line in request.verdict)
    lines.append(f"# Node: {request.offering.name}: {request.offering.source}.")
    if request.startup is not None:
        lines.append("#")
        lines.extend(f"# {line}" for line in request.startup.lines())
        deploy = request.deploy_startup or request.startup
        lines.append(f"# The deploy config's runtime_env sets RAYLLM_ENGINE_START_TIMEOUT_S: "
                     f"\"{deploy.engine_start_timeout_s}\" (a test checks that it does): "
                     + deploy_budget_why(deploy, request.shape.gpu) + ".")
    return lines


def deploy_budget_why(deploy: StartupBudgets, gpu: str) -> str:
    """Why a deploy config carries the budget it does: the slowest node type ``render`` writes a file for (the
    timeout must hold on every one of them; a longer one only waits longer for a replica that is stuck)."""
    return f"the budget on {deploy.node_type}, the slowest node type `kimi-k3-serve render` writes for {gpu}"


AWS_WORKER_VOLUME = {"VolumeSize": 3000, "VolumeType": "gp3", "Iops": 4000, "Throughput": 1000}
"""The GPU worker's EBS volume in an AWS launcher file: the download folder (the hub cache, or
``args.model.download_dir``). gp3 with its throughput provisioned to its most, 1,000 MiB/s (``Iops`` 4,000: AWS allows
at most 0.25 MiB/s per provisioned IOPS): at gp3's baseline 125 MiB/s, writing and then reading the 1.56 TB
checkpoint would take 6.6 h on every node. ``check`` and the start-up budgets read this volume's throughput
(``hardware.ebs_volume_read``)."""


GPU_IMAGE = f"kimi-k3-serve:{__version__}-gpu"
"""The node image ``deploy/Dockerfile`` builds (x86_64); GB300 trays (Grace, arm64) get ``GPU_IMAGE + "-arm64"``."""
GPU_LOCK = "deploy/requirements-gpu.lock"
"""The locked node environment (``scripts/make_gpu_lock.py``): Python 3.12, x86_64, pins with hashes."""
UV_VERSION = "0.13.9"
"""uv for the launcher nodes' setup: it brings Python 3.12 where the machine image has another Python."""
NODE_VENV = "~/kimi-k3-serve-env"


def _arm64(gpu: str) -> bool:
    """Grace-based trays (GB200/GB300) have arm64 CPUs."""
    return gpu.startswith("GB")


def gpu_image(gpu: str) -> str:
    """The image a node of ``gpu`` runs: the arm64 build on Grace-based trays."""
    return GPU_IMAGE + ("-arm64" if _arm64(gpu) else "")


def gpu_lock(gpu: str) -> str:
    """The lock a node of ``gpu`` installs: ``scripts/make_gpu_lock.py`` writes one per CPU architecture."""
    return GPU_LOCK.replace(".lock", "-arm64.lock") if _arm64(gpu) else GPU_LOCK


def _setup_commands(indent: str, gpu: str) -> list[str]:
    """Every node: Python 3.12 in its own venv, the locked environment, then this package without dependencies.
    The venv is activated from ~/.bashrc, which the launcher sources before each command (ray start too)."""
    python = f"{NODE_VENV}/bin/python"
    return [
        f"{indent}# The locked environment of deploy/Dockerfile (ray[serve]=={RAY_VERSION}, vllm=={VLLM_VERSION}, torch),",
        f"{indent}# written by scripts/make_gpu_lock.py; the nodes need an NVIDIA driver for CUDA 13 (>= 580).",
        f"{indent}- test -x ~/.local/bin/uv || curl -LsSf https://astral.sh/uv/{UV_VERSION}/install.sh | sh",
        f"{indent}- ~/.local/bin/uv venv --allow-existing --python 3.12 {NODE_VENV}",
        f"{indent}- ~/.local/bin/uv pip install --python {python} -r ~/kimi-k3-serve/{gpu_lock(gpu)}",
        f"{indent}- ~/.local/bin/uv pip install --python {python} --no-deps -e ~/kimi-k3-serve",
        f"{indent}- grep -qs kimi-k3-serve-env/bin/activate ~/.bashrc || echo 'source {NODE_VENV}/bin/activate' >> ~/.bashrc",
    ]


def _launcher_common(request: ClusterFileRequest, provider: list[str], auth: list[str],
                     head_config: list[str], worker_config: list[str]) -> list[str]:
    shape, scaling = request.shape, request.scaling
    max_workers = scaling.max_workers(shape)
    start_env = "".join(f"{k}={v} " for k, v in direct_streaming_env(LAUNCHER_HAPROXY).items()) \
        if request.direct_streaming else ""
    lines = [
        f"cluster_name: {_scalar(request.cluster_name)}",
        f"max_workers: {max_workers}  # = max_replicas {scaling.max_replicas} x {shape.nodes_per_replica} nodes per replica",
        "upscaling_speed: 1.0",
        f"idle_timeout_minutes: {_scalar(request.idle_timeout_s / 60)}  # a replica takes many minutes to load; "
        "keep idle nodes through short lulls",
        "provider:",
        *provider,
        "auth:",
        *auth,
        "available_node_types:",
        "  head:",
        "    # Serve controller, HTTP proxy and the OpenAI ingress replicas; no GPU.",
        "    resources: {}",
        "    node_config:",
        *head_config,
        f"  {request.worker_type}:",
        f"    min_workers: {scaling.min_workers(shape)}  # = min_replicas {scaling.min_replicas} x "
        f"{shape.nodes_per_replica} nodes per replica",
        f"    max_workers: {max_workers}",
        f"    resources: {_flow(shape.ray_resources())}",
        f"    idle_timeout_s: {request.idle_timeout_s}",
        "    node_config:",
        *worker_config,
        "head_node_type: head",
        "file_mounts:",
        '  # Run `ray up` from the repository root: the project (and its deploy configs) is copied to every node.',
        '  "~/kimi-k3-serve": "."',
        "  # Ray's token authentication: the token file you made (`ray get-auth-token --generate` writes it here; keep",
        "  # it out of the repository), copied to every node. ray up fails while it is missing: nothing starts open.",
        f'  "{RAY_TOKEN_PATH}": "{RAY_TOKEN_PATH}"',
        "setup_commands:",
        *_setup_commands("  ", request.shape.gpu),
        f"  - chmod 600 {RAY_TOKEN_PATH}",
        "  # Every command the launcher runs (ray exec, serve deploy) is a client of the token-authenticated cluster.",
        "  - grep -qs RAY_AUTH_MODE ~/.bashrc || echo 'export RAY_AUTH_MODE=token' >> ~/.bashrc",
        "head_start_ray_commands:",
        "  - ray stop",
        "  # Token authentication on (RAY_AUTH_MODE=token, the token from ~/.ray/auth_token); the dashboard and its Jobs",
        "  # API listen on the head's loopback only: reach them through `ray dashboard <this file>` (an SSH tunnel).",
        *(["  # args.deployment.direct_streaming: HAProxy in front of vLLM's own app, its stats and metrics on loopback."]
          if request.direct_streaming else []),
        f"  - ulimit -n 65536; RAY_AUTH_MODE=token {start_env}ray start --head --port=6379 --num-gpus=0 "
        "--autoscaling-config=~/ray_bootstrap_config.yaml --dashboard-host=127.0.0.1",
        "worker_start_ray_commands:",
        "  - ray stop",
        f"  - ulimit -n 65536; RAY_AUTH_MODE=token {start_env}ray start --address=$RAY_HEAD_IP:6379",
        "# Then: ray up <this file>; ray exec <this file> 'cd ~/kimi-k3-serve && "
        f"kimi-k3-serve check --config {request.deploy_config} && serve deploy {request.deploy_config}'",
        f"# Dashboard: ray dashboard <this file>, then http://127.0.0.1:{DASHBOARD_PORT} (it asks for the token).",
    ]
    return lines


def _render_launcher_aws(request: ClusterFileRequest) -> str:
    lines = _header(
        request,
        f"Ray cluster launcher file (AWS) for {request.deploy_config}.",
        "Schema: ray/autoscaler/ray-schema.json (Ray " + RAY_VERSION + "). Start with `ray up`.",
    )
    lines += _launcher_common(
        request,
        provider=[
            "  type: aws",
            "  region: us-east-1  # EDIT: a region with capacity for " + request.offering.name,
            "  cache_stopped_nodes: false  # terminate idle GPU nodes instead of keeping stopped ones",
        ],
        auth=["  ssh_user: ubuntu"],
        head_config=[
            "      InstanceType: m7i.8xlarge",
            "      ImageId: ami-REPLACE-ME  # EDIT: an Ubuntu AMI in your region (setup_commands bring Python 3.12)",
        ],
        worker_config=[
            f"      InstanceType: {request.offering.name}",
            "      ImageId: ami-REPLACE-ME  # EDIT: a Deep Learning AMI with an NVIDIA driver >= 580 (CUDA 13), EFA and NCCL plugin",
            "      # EDIT: a capacity reservation / placement group and EFA network interfaces for cross-node NCCL.",
            "      BlockDeviceMappings:",
            "        - DeviceName: /dev/sda1",
            "          # The download folder: the 1.56 TB checkpoint plus the image, on gp3 provisioned to its most throughput",
            "          # (1,000 MiB/s; Iops 4,000 for it): at the 125 MiB/s baseline, writing then reading the checkpoint takes",
            "          # 6.6 h per node. Or put the folder (args.model.download_dir) on the instance's local NVMe.",
            f"          Ebs: {_flow(AWS_WORKER_VOLUME)}",
        ],
    )
    return "\n".join(lines) + "\n"


def _render_launcher_gcp(request: ClusterFileRequest) -> str:
    lines = _header(
        request,
        f"Ray cluster launcher file (Google Cloud) for {request.deploy_config}.",
        "Schema: ray/autoscaler/ray-schema.json (Ray " + RAY_VERSION + "). Start with `ray up`.",
    )
    image = "projects/deeplearning-platform-release/global/images/family/common-cu128-ubuntu-2204-nvidia-570"
    lines += _launcher_common(
        request,
        provider=[
            "  type: gcp",
            "  region: us-central1  # EDIT: a region with " + request.offering.name + " capacity",
            "  availability_zone: us-central1-b  # EDIT",
            "  project_id: REPLACE-ME  # EDIT: your project id",
        ],
        auth=["  ssh_user: ubuntu"],
        head_config=[
            "      machineType: n2-standard-32",
            "      disks:",
            "        - boot: true",
            "          autoDelete: true",
            "          type: PERSISTENT",
            f"          initializeParams: {{diskSizeGb: 200, sourceImage: {image}}}",
        ],
        worker_config=[
            f"      machineType: {request.offering.name}",
            "      disks:",
            "        - boot: true",
            "          autoDelete: true",
            "          type: PERSISTENT",
            "          # EDIT: the image needs an NVIDIA driver >= 580 for the lock's CUDA 13 wheels.",
            f"          initializeParams: {{diskSizeGb: 3000, sourceImage: {image}}}  # the 1.56 TB checkpoint",
            "      scheduling:",
            "        - onHostMaintenance: TERMINATE  # GPU VMs cannot live-migrate",
            "      # EDIT: reservationAffinity for your A3/A4 reservation and the extra RDMA NICs for cross-node NCCL.",
        ],
    )
    return "\n".join(lines) + "\n"


def _container_env(indent: str, request: ClusterFileRequest) -> list[str]:
    """A KubeRay container's ``env`` for ``args.deployment.direct_streaming`` (none otherwise)."""
    if not request.direct_streaming:
        return []
    return [f"{indent}# args.deployment.direct_streaming: HAProxy in front of vLLM's own app, its stats and metrics "
            "on loopback.",
            f"{indent}env:",
            *(f"{indent}  - {{name: {k}, value: {_scalar(v)}}}" for k, v in direct_streaming_env(IMAGE_HAPROXY).items())]


def _render_fake(request: ClusterFileRequest) -> str:
    shape, scaling = request.shape, request.scaling
    max_workers = scaling.max_workers(shape)
    idle_minutes = request.idle_timeout_s / 60
    resources = dict(shape.ray_resources())
    # Each fake node is a real raylet on this machine: a small object store keeps it light.
    resources["object_store_memory"] = 200 * 1000 * 1000
    lines = _header(
        request,
        f"Local autoscaling cluster (Ray's fake multi-node provider) with the node type of {request.deploy_config}.",
        "Fake GPUs, the same custom resources and node counts as the production files. Start the head with "
        "RAY_FAKE_CLUSTER=1 ray start --head --node-ip-address=127.0.0.1 --autoscaling-config=<this file as JSON> "
        "in Ray's loopback mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), so that it is reachable from this machine "
        "only; set provider.gcs_address when the GCS is not on port 6379."
        + (" args.deployment.direct_streaming: start it with "
           + " ".join(f"{k}={v}" for k, v in direct_streaming_env("$(command -v kimi-k3-serve-haproxy)").items())
           + " too." if request.direct_streaming else ""),
    )
    lines += [
        f"cluster_name: {_scalar(request.cluster_name)}",
        f"max_workers: {max_workers}",
        "upscaling_speed: 1.0",
        f"idle_timeout_minutes: {_scalar(idle_minutes)}",
        "provider:",
        "  type: fake_multinode",
        "  use_node_id_as_ip: true",
        "  disable_node_updaters: true",
        "  disable_launch_config_check: true",
        "auth: {}",
        "docker: {}",
        "head_node_type: ray.head.default",
        "available_node_types:",
        "  ray.head.default:",
        "    resources: {CPU: 2}",
        "    node_config: {}",
        "    max_workers: 0",
        f"  {request.worker_type}:",
        f"    min_workers: 0  # production files: {scaling.min_workers(shape)}; this cluster starts empty to show "
        "scale-up from zero",
        f"    max_workers: {max_workers}",
        f"    resources: {_flow(resources)}",
        "    node_config: {}",
        "file_mounts: {}",
        "cluster_synced_files: []",
        "file_mounts_sync_continuously: false",
        "rsync_exclude: []",
        "rsync_filter: []",
        "initialization_commands: []",
        "setup_commands: []",
        "head_setup_commands: []",
        "worker_setup_commands: []",
        "head_start_ray_commands: []",
        "worker_start_ray_commands: []",
    ]
    return "\n".join(lines) + "\n"


def _k8s_quantity_gib(nbytes: int) -> str:
    return f"{nbytes // GiB}Gi"


def _render_kuberay(request: ClusterFileRequest) -> str:
    shape, scaling = request.shape, request.scaling
    offering = request.offering
    declared = {key: str(value) for key, value in shape.declared_custom_resources().items()}
    lines = _header(
        request,
        f"KubeRay RayService for {request.deploy_config} (apiVersion ray.io/v1, KubeRay >= {KUBERAY_MIN_VERSION}).",
        "serveConfigV2 below is the deploy config, verbatim; the NetworkPolicy after it closes Ray's control plane. "
        "Apply both with `kubectl apply -f <this file>`.",
    )
    min_workers, max_workers = scaling.min_workers(shape), scaling.max_workers(shape)
    image = gpu_image(shape.gpu)
    lines += [
        "apiVersion: ray.io/v1",
        "kind: RayService",
        "metadata:",
        f"  name: {_scalar(request.cluster_name)}",
        "spec:",
        "  # A new cluster is brought up (and must load the weights) before traffic moves; keep the old one",
        "  # long enough for in-flight requests to drain.",
        "  upgradeStrategy: {type: NewCluster}",
        "  rayClusterDeletionDelaySeconds: 600",
        "  serveConfigV2: |",
        *("    " + line if line.strip() else "" for line in request.serve_config_text.rstrip("\n").split("\n")),
        "  rayClusterConfig:",
        f"    rayVersion: {_scalar(RAY_VERSION)}",
        "    # Ray's token authentication (RAY_AUTH_MODE=token in every pod): KubeRay makes the token and keeps it in a",
        "    # Secret named after the RayCluster (key auth_token); nothing secret is in this file (README, \"Security\").",
        "    authOptions: {mode: token}",
        "    enableInTreeAutoscaling: true",
        "    autoscalerOptions:",
        "      version: v2",
        "      upscalingMode: Default",
        f"      idleTimeoutSeconds: {request.idle_timeout_s}",
        "    headGroupSpec:",
        "      # No GPU and no Ray CPUs: replicas and placement groups go to the GPU workers; the Serve controller",
        "      # and proxy (zero-CPU actors) stay here. The dashboard listens on the pod's address because the KubeRay",
        "      # operator deploys serveConfigV2 through it (with the token); the NetworkPolicy below admits only the",
        "      # operator and this cluster's pods; people reach it with kubectl port-forward.",
        '      rayStartParams: {num-cpus: "0", dashboard-host: 0.0.0.0}',
        "      template:",
        f"        metadata: {{labels: {{{CLUSTER_LABEL}: {_scalar(request.cluster_name)}}}}}",
        "        spec:",
        "          containers:",
        "            - name: ray-head",
        f"              # deploy/Dockerfile: ray[serve]=={RAY_VERSION}, vllm=={VLLM_VERSION} from "
        + gpu_lock(shape.gpu) + (" (docker build --platform linux/arm64)." if _arm64(shape.gpu) else "."),
        "              # EDIT: push it to a registry the cluster pulls from and prefix the name with it (README).",
        f"              image: {image}",
        "              resources:",
        '                limits: {cpu: "16", memory: 64Gi}',
        '                requests: {cpu: "16", memory: 64Gi}',
        "              ports:",
        "                - {containerPort: 6379, name: gcs-server}",
        "                - {containerPort: 8265, name: dashboard}",
        "                - {containerPort: 10001, name: client}",
        "                - {containerPort: 8000, name: serve}",
        *_container_env("              ", request),
        "    workerGroupSpecs:",
        f"      - groupName: {request.worker_type.replace('_', '-')}",
        f"        replicas: {min_workers}",
        f"        minReplicas: {min_workers}  # = min_replicas {scaling.min_replicas} x {shape.nodes_per_replica} pods per replica",
        f"        maxReplicas: {max_workers}  # = max_replicas {scaling.max_replicas} x {shape.nodes_per_replica} pods per replica",
        f"        idleTimeoutSeconds: {request.idle_timeout_s}",
        "        # REQUIRED for scale-from-zero: the autoscaler reads custom resources only from here, never from",
        "        # nvidia.com/gpu, and the placement group asks for them.",
        f"        resources: {_flow(declared)}" if declared else "        resources: {}",
        "        rayStartParams: {}",
        "        template:",
        f"          metadata: {{labels: {{{CLUSTER_LABEL}: {_scalar(request.cluster_name)}}}}}",
        "          spec:",
        "            containers:",
        "              - name: ray-worker",
        f"                image: {image}",
        *_container_env("                ", request),
        "                resources:",
        f'                  limits: {{cpu: "{offering.cpus}", memory: {_k8s_quantity_gib(offering.memory_bytes)}, '
        f'nvidia.com/gpu: "{shape.gpus_per_node}"}}',
        f'                  requests: {{cpu: "{offering.cpus}", memory: {_k8s_quantity_gib(offering.memory_bytes)}, '
        f'nvidia.com/gpu: "{shape.gpus_per_node}"}}',
        *_worker_liveness_probe(request.startup),
        "                volumeMounts:",
        "                  - {name: dshm, mountPath: /dev/shm}  # NCCL and vLLM's shared-memory queues",
        "            volumes:",
        "              - {name: dshm, emptyDir: {medium: Memory}}",
        "            tolerations:",
        "              - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}",
        "            # EDIT: a nodeSelector for your " + shape.gpu + " node pool, and the RDMA/IB device plugin "
        "resources for cross-node NCCL.",
    ]
    if _nvlink_spans_nodes(shape):
        # A TP group spans trays: the pods need IMEX channels of one NVLink domain, which the NVIDIA DRA
        # driver hands out through a ComputeDomain's ResourceClaimTemplate.
        at = next(i for i, line in enumerate(lines) if line.startswith("                  requests: ")) + 1
        lines[at:at] = ["                  claims: [{name: nvlink-domain}]"]  # resources.claims of the worker container
        lines += [
            "            # One NVLink domain across trays (multi-node NVLink): create a ComputeDomain with the NVIDIA DRA",
            "            # driver whose channel template is named below, so every pod of a replica joins the same domain.",
            "            resourceClaims:",
            f"              - {{name: nvlink-domain, resourceClaimTemplateName: {request.cluster_name}-compute-domain-channel}}",
        ]
    lines += _network_policy(request.cluster_name)
    return "\n".join(lines) + "\n"


RAYLET_HEALTH_COMMAND = (
    f"wget --tries 1 -T {KUBERAY_LIVENESS_TIMEOUT_S} -q -O- http://localhost:52365/api/local_raylet_healthz | grep success"
)
"""KubeRay's own worker check (``BaseWgetHealthCommand`` on the dashboard agent's ``RayAgentRayletHealthPath``)."""


def _worker_liveness_probe(startup: StartupBudgets | None) -> list[str]:
    """KubeRay's worker liveness check with a failure window that outlasts the node's load (KubeRay injects its own,
    600 s, only where the container sets none; the readiness probe stays KubeRay's)."""
    if startup is None:
        return []
    return [
        f"                # KubeRay's raylet check, with {startup.liveness_failure_threshold} failures x "
        f"{KUBERAY_LIVENESS_PERIOD_S} s = {startup.liveness_window_s} s",
        f"                # (KubeRay's own: 600 s), so a node busy with its checkpoint ({startup.load_s:,.0f} s estimated) "
        "is not restarted; readiness stays KubeRay's (it gates traffic, restarts nothing).",
        "                livenessProbe:",
        f"                  exec: {{command: [bash, -c, {json.dumps(RAYLET_HEALTH_COMMAND)}]}}",
        f"                  initialDelaySeconds: {KUBERAY_LIVENESS_INITIAL_DELAY_S}",
        f"                  periodSeconds: {KUBERAY_LIVENESS_PERIOD_S}",
        f"                  timeoutSeconds: {KUBERAY_LIVENESS_TIMEOUT_S}",
        f"                  failureThreshold: {startup.liveness_failure_threshold}",
    ]


def _network_policy(cluster_name: str) -> list[str]:
    """A second document: who may reach the pods of the cluster at all. Ray's own ports (GCS, raylets, object
    transfer, the dashboard and its Jobs API) only from the cluster's pods and the KubeRay operator; Serve's port
    from the ingress controller. ``kubectl port-forward`` goes through the kubelet and is not subject to it."""
    selector = f"{{{CLUSTER_LABEL}: {_scalar(cluster_name)}}}"
    return [
        "---",
        "# Ray's control plane, closed: only this cluster's own pods and the KubeRay operator reach the Ray ports. The",
        f"# dashboard: kubectl port-forward svc/{cluster_name}-head-svc {DASHBOARD_PORT}:{DASHBOARD_PORT}, the token from",
        "# the RayCluster's Secret (README, \"Security\"). Needs a CNI that enforces NetworkPolicy.",
        "apiVersion: networking.k8s.io/v1",
        "kind: NetworkPolicy",
        "metadata:",
        f"  name: {_scalar(cluster_name + '-ray')}",
        "spec:",
        "  podSelector:",
        f"    matchLabels: {selector}",
        "  policyTypes: [Ingress]",
        "  ingress:",
        "    # The cluster's own pods: GCS, raylets, object transfer, NCCL, calls between Serve replicas.",
        "    - from:",
        "        - podSelector:",
        f"            matchLabels: {selector}",
        "    # The KubeRay operator deploys serveConfigV2 and reads Serve's status through the head's dashboard.",
        "    - from:",
        "        - namespaceSelector:",
        f"            matchLabels: {{kubernetes.io/metadata.name: {OPERATOR_NAMESPACE}}}  # EDIT: the operator's namespace",
        "          podSelector:",
        "            matchLabels: {app.kubernetes.io/name: kuberay-operator}",
        f"      ports: [{{port: {DASHBOARD_PORT}, protocol: TCP}}]",
        "    # OpenAI clients, through the ingress controller or load balancer that terminates TLS (the API key guards /v1).",
        "    - from:",
        "        - namespaceSelector:",
        f"            matchLabels: {{kubernetes.io/metadata.name: {INGRESS_NAMESPACE}}}  # EDIT: your ingress controller's",
        "      ports: [{port: 8000, protocol: TCP}]",
        "    # Nothing else: add a rule of your own for a Prometheus that scrapes Ray's metrics port (8080), or port 8000's",
        "    # /metrics with the API key as a bearer token where args.deployment.engine_metrics is vllm (vLLM's engine metrics).",
    ]


def _nvlink_spans_nodes(shape: ReplicaShape) -> bool:
    return lookup_gpu(shape.gpu).gpus_per_nvlink_domain > shape.gpus_per_node
