"""``kimi-k3-serve render``: write the Ray cluster launcher, KubeRay or fake-provider file for a deploy config.

The planner first checks the deploy config's own layout (TP, PP, EP, layer split, limits, draft) on the nodes
one replica occupies; a layout that does not fit gets no cluster file (exit 1, with the per-GPU shortfall).
The node type, the custom resources it must declare and the bundles per node come from that plan's placement
group and rank placement, and the worker counts from the autoscaling range, so a cluster file cannot drift
from the plan: the shipped files under ``cluster_configs/`` are this command's output, and a test renders them
again. The plan's verdict is copied into the file's header.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kimi_k3_serve.commands.argtypes import nonempty
from kimi_k3_serve.tokens import mask_tokens
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.inputs import read_text_file
from kimi_k3_serve.planning.hardware import lookup_gpu
from kimi_k3_serve.planning.startup import StartupBudgets, startup_budgets
from kimi_k3_serve.clusterfiles.render import (
    AWS_WORKER_VOLUME,
    FORMATS,
    OFFERINGS,
    PLATFORM_OF_FORMAT,
    ClusterFileRequest,
    ReplicaScaling,
    ReplicaShape,
    bundle_custom_resources,
    find_offering,
    render,
)
from kimi_k3_serve.units import cdiv, fmt_gib

if TYPE_CHECKING:
    from kimi_k3_serve.config.args import ServeArgs

FAKE_IDLE_TIMEOUT_S = 12
"""The fake cluster is for tests: nodes go away 12 s (0.2 min) after the placement group is released."""
IDLE_TIMEOUT_S = 1800


@dataclass(frozen=True)
class DeployConfig:
    """A Serve deploy file (checked against Ray's ``ServeDeploySchema``) and our application's ``args``."""

    path: Path
    text: str
    app_name: str
    args: ServeArgs


def load_deploy_config(path: str | Path, *, app: str | None = None) -> DeployConfig:
    from kimi_k3_serve.config.serve_config import load_serve_app

    serve_app = load_serve_app(path, app_name=app)
    args = serve_app.args
    if args.accelerator.kind != "gpu" or args.accelerator.type is None:
        raise ConfigError(
            "args.accelerator.type", args.accelerator.type, "a GPU type: cluster files are for GPU deployments", source=str(path)
        )
    text = read_text_file(path, "config", what="a Serve config YAML")  # already read once: cannot be a FIFO or too large
    return DeployConfig(Path(path), text, serve_app.name, args)


def plan_replica(args: ServeArgs, *, gpus_per_node: int):
    """The planner's check of the deploy config's own layout on the nodes one replica occupies.

    Raises ``DoesNotFitError`` (exit 1) with the per-GPU shortfall when it does not fit: a cluster file is not
    written for a replica that cannot load.
    """
    from kimi_k3_serve.config.args_adapter import planner_inputs
    from kimi_k3_serve.planning.inventory import declared_cluster
    from kimi_k3_serve.planning.planner import plan

    model, engine, pins = planner_inputs(args)
    nodes = cdiv(args.parallel.world_size, gpus_per_node)
    cluster = declared_cluster(args.accelerator.type, nodes, gpus_per_node)
    return plan(model, engine, cluster, pins)


def replica_shape_from_plan(plan: Any, *, gpus_per_node: int, cpus_per_node: int, memory_bytes_per_node: int) -> ReplicaShape:
    """One replica as the plan places it: the placement group's bundles and the GPUs each node holds."""
    per_node = Counter(p.node_id for p in plan.placements)
    layout = tuple(per_node[node] for node in sorted(per_node))
    gpu = lookup_gpu(plan.gpu_name)
    return ReplicaShape(
        gpu=gpu.name,
        accelerator_type=gpu.ray_accelerator_type,
        gpus_per_node=gpus_per_node,
        nodes_per_replica=len(layout),
        bundles_per_node=layout,
        bundle_resources=bundle_custom_resources(plan.placement_group_config["bundles"]),
        cpus_per_node=cpus_per_node,
        memory_bytes_per_node=memory_bytes_per_node,
    )


def plan_verdict(plan: Any) -> tuple[str, ...]:
    """The planner's numbers, for the cluster file's header."""
    report = plan.report
    tightest = min(report.ranks, key=lambda r: r.headroom_bytes)
    engine = plan.engine
    on = [item.name for item in plan.optimisations.items if item.on]
    return (
        f"Planner (vLLM 0.32 memory accounting): {plan.layout.describe()} on {plan.layout.world_size} x {plan.gpu_name} "
        f"fits at gpu_memory_utilization {engine.gpu_memory_utilization}.",
        f"  KV cache {report.kv_cache_tokens} tokens ({report.num_blocks} blocks): {float(report.max_concurrency):.2f} "
        f"requests of max_model_len {engine.max_model_len} at once, {float(report.banded_max_concurrency):.2f} with the "
        f"measured error bands against it (max_num_seqs {report.max_num_seqs}).",
        *((f"  Per DP engine; {plan.layout.dp} DP engines (one Serve replica each, gang-scheduled) hold "
           f"{sum(report.engine_concurrency):.2f} in all.",) if plan.layout.dp > 1 else ()),
        f"  Tightest GPU: rank {tightest.rank} (stage {tightest.pp_stage}), headroom {fmt_gib(tightest.headroom_bytes)}.",
        "  Kernel optimisations on: " + (", ".join(on) if on else "none") + ".",
    )


def offering_bandwidth(offering: Any):
    """The bandwidths of a node type as the file ``render`` writes for it declares them: the catalogue's network
    (``hardware.NODE_IO``) and, on AWS, the worker's EBS volume (``AWS_WORKER_VOLUME``, read as ``check`` reads a
    launcher file); the default (``hardware.DEFAULT_NODE_IO``) for what is not known, and the source says so."""
    from kimi_k3_serve.planning.checkpoint import node_bandwidth
    from kimi_k3_serve.planning.hardware import ebs_volume_read

    if offering.platform == "aws":
        rate, why = ebs_volume_read(AWS_WORKER_VOLUME)
        return node_bandwidth(offering.name, disk_read_bytes_per_s=rate, disk_source=why)
    why = {"gcp": "the worker's persistent disk: no declared throughput",
           "kubernetes": "a pod's volume is the cluster's, not in this file",
           "fake": "fake nodes"}.get(offering.platform)
    return node_bandwidth(offering.name, disk_source=why)


def startup_on(args: ServeArgs, offering: Any, plan: Any = None) -> StartupBudgets:
    """The start-up budgets of one replica of ``args`` on ``offering``'s nodes: each node's load
    (``planning.checkpoint.node_load``, the estimate ``check`` prints) at the node type's bandwidths."""
    from kimi_k3_serve.commands.checkpoint_section import checkpoint_plan
    from kimi_k3_serve.planning.checkpoint import node_load

    plan = plan or checkpoint_plan(args, ranks_per_node=offering.gpus, mode="auto")
    bandwidth = offering_bandwidth(offering)
    per_copy = args.model.download_dir is not None
    loads = [node_load(plan, need, node=f"{need.position + 1} of {len(plan.nodes)} [{offering.name}], "
                                       f"{need.describe_stages()}", per_node_copy=per_copy, bandwidth=bandwidth)
             for need in plan.nodes]
    return startup_budgets(nodes=loads, node_type=offering.name)


def deploy_startup(args: ServeArgs) -> StartupBudgets:
    """The budgets a deploy config carries (``RAYLLM_ENGINE_START_TIMEOUT_S``): the slowest of the node types
    ``render`` writes a file for with the config's GPU, so that the timeout holds on each."""
    from kimi_k3_serve.commands.checkpoint_section import checkpoint_plan

    gpu = lookup_gpu(args.accelerator.type)
    offerings = [o for o in OFFERINGS if o.gpu == gpu.name and o.platform != "fake"]
    plans: dict[int, Any] = {}
    budgets = []
    for offering in offerings:
        if offering.gpus not in plans:
            plans[offering.gpus] = checkpoint_plan(args, ranks_per_node=offering.gpus, mode="auto")
        budgets.append(startup_on(args, offering, plans[offering.gpus]))
    return max(budgets, key=lambda b: (b.engine_start_timeout_s, b.load_s))


def deploy_comment(args: ServeArgs) -> tuple[str, ...]:
    """The comment above a deploy config's ``RAYLLM_ENGINE_START_TIMEOUT_S`` (a test checks the file carries it)."""
    from kimi_k3_serve.units import GB

    budgets = deploy_startup(args)
    bw = budgets.slowest.bandwidth
    return budgets.deploy_comment(
        f"On {budgets.node_type}, the slowest node type `render` writes for {lookup_gpu(args.accelerator.type).name}: "
        f"{bw.download_bytes_per_s / GB:,.2f} GB/s download, {bw.disk_read_bytes_per_s / GB:,.2f} GB/s read"
        + (" (the default: not in the catalogue)." if bw.defaulted else "."))


def _display_path(path: Path) -> str:
    """The config path as a user would type it from the repository root: relative when it lies below the
    working directory, so a rendered file names no machine path."""
    if path.is_absolute():
        try:
            return path.relative_to(Path.cwd()).as_posix()
        except ValueError:
            return path.as_posix()
    return path.as_posix()


def default_cluster_name(config_path: Path) -> str:
    """``kimi-k3`` and the config file's name past ``config``, made a legal cluster name (lowercase letters, digits
    and '-', at most 50 characters): My_Config.yaml gives kimi-k3-my-config."""
    import re

    suffix = re.sub(r"[^a-z0-9]+", "-", config_path.stem.lower().removeprefix("config")).strip("-")
    return ("kimi-k3" + (f"-{suffix}" if suffix else ""))[:50].rstrip("-")


def build_request(
    config: DeployConfig,
    fmt: str,
    *,
    instance_type: str | None = None,
    cluster_name: str | None = None,
    idle_timeout_s: int | None = None,
    display_path: str | None = None,
) -> ClusterFileRequest:
    if fmt not in FORMATS:
        raise ConfigError("--format", fmt, f"expected one of {', '.join(FORMATS)}")
    args = config.args
    gpu = lookup_gpu(args.accelerator.type)
    offering = find_offering(PLATFORM_OF_FORMAT[fmt], gpu.name, instance_type)
    replica_plan = plan_replica(args, gpus_per_node=offering.gpus)
    shape = replica_shape_from_plan(
        replica_plan, gpus_per_node=offering.gpus, cpus_per_node=offering.cpus, memory_bytes_per_node=offering.memory_bytes
    )
    scaling = ReplicaScaling(args.autoscaling.min_replicas, args.autoscaling.max_replicas)
    extra: list[str] = []
    if instance_type is not None:
        extra += ["--instance-type", instance_type]
    if cluster_name is not None:
        extra += ["--cluster-name", cluster_name]
    if idle_timeout_s is not None:
        extra += ["--idle-timeout-s", str(idle_timeout_s)]
    name = cluster_name or default_cluster_name(config.path)
    if fmt == "fake":
        name += "-fake"
    if idle_timeout_s is None:
        idle_timeout_s = FAKE_IDLE_TIMEOUT_S if fmt == "fake" else IDLE_TIMEOUT_S
    return ClusterFileRequest(
        format=fmt,
        shape=shape,
        scaling=scaling,
        offering=offering,
        cluster_name=name,
        deploy_config=display_path or _display_path(config.path),
        serve_config_text=config.text,
        verdict=plan_verdict(replica_plan),
        extra_options=tuple(extra),
        idle_timeout_s=idle_timeout_s,
        startup=startup_on(args, offering),
        deploy_startup=deploy_startup(args),
        direct_streaming=args.deployment.direct_streaming,
    )


def render_deploy_config(path: str | Path, fmt: str, **options: Any) -> str:
    """The cluster file text for ``path`` in format ``fmt`` (what the command writes)."""
    app = options.pop("app", None)
    config = load_deploy_config(path, app=app)
    return render(build_request(config, fmt, **options))


EXAMPLES = """\
examples:
  kimi-k3-serve render --config deploy/config.yaml --format kuberay --output cluster_configs/kuberay-h200.yaml
  kimi-k3-serve render --config deploy/config.yaml --format launcher-aws --instance-type p5en.48xlarge

exit codes: 0 written, 1 the deploy config's layout does not fit (no file), 2 bad input
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument("--config", required=True, help="the Serve deploy config (deploy/*.yaml)")
    parser.add_argument("--format", required=True, choices=FORMATS, help="which cluster file to write")
    parser.add_argument("--output", type=nonempty, help="write here instead of standard output")
    parser.add_argument("--app", help="the application in the config, when it holds more than one of ours")
    parser.add_argument("--instance-type", help="node type to use instead of the default for the GPU and platform")
    parser.add_argument("--cluster-name", type=nonempty,
                        help="cluster / RayService name (default: from the config file name)")
    parser.add_argument(
        "--idle-timeout-s",
        type=int,
        help=f"seconds before an idle GPU node is released (default {IDLE_TIMEOUT_S}; fake: {FAKE_IDLE_TIMEOUT_S})",
    )


def run(args: argparse.Namespace) -> int:
    text = render_deploy_config(
        args.config,
        args.format,
        app=args.app,
        instance_type=args.instance_type,
        cluster_name=args.cluster_name,
        idle_timeout_s=args.idle_timeout_s,
    )
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as exc:
            raise ConfigError("--output", args.output, f"a writable file path ({exc.strerror})") from None
        print(f"wrote {mask_tokens(args.output)}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
