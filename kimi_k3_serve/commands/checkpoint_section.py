"""The checkpoint part of ``check``: per node of one replica, the bytes it needs, the free disk of its download
folder, the estimated download and load time; a node whose disk is too small refuses the config (exit 1).

Where the numbers come from:
- the listing: read from the source when it is a local folder (or ``cache:NAME``), or with ``--checkpoint-index read``
  from the hub or a bucket; otherwise estimated from config.json (``planning.checkpoint.synthetic_listing``: exact
  bytes per layer, ``save_pretrained``'s 5 GB shard cuts), and the line says so;
- free disk: on a live cluster a Ray task per node (``shutil.disk_usage`` of the folder on that node, less what it
  already holds of its files); on a declared cluster the launcher file's EBS volume (``VolumeSize``), else unknown;
- bandwidth: ``planning.checkpoint.node_bandwidth``: the catalogue's network for the node's instance type
  (``hardware.NODE_IO``), the cluster file's EBS volume (``hardware.ebs_volume_read``: its ``Throughput``, else its
  type's), ``hardware.DEFAULT_NODE_IO`` where either is not known (a KubeRay file, a live node), said in the line;
- the load estimate: ``planning.checkpoint.node_load``, the one the start-up budgets (``planning.startup``) use;
  ``check`` prints those budgets under the per-node lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kimi_k3_serve.config.args import ServeArgs, resolve_source, source_kind
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.checkpoint import (CheckpointListing, CheckpointPlan, DiskVerdict, NodeBandwidth, NodeNeed,
                                               disk_verdict, node_bandwidth, node_load, plan_checkpoint,
                                               synthetic_listing)
from kimi_k3_serve.units import GiB, fmt_size


@dataclass(frozen=True)
class DeclaredDisk:
    instance: str | None
    volume_bytes: int | None
    read_bytes_per_s: int | None
    source: str
    read_source: str | None = None
    """Where ``read_bytes_per_s`` comes from (or why there is none)."""


def declared_disks(cluster_path: str) -> dict[str, DeclaredDisk]:
    """Node type -> its declared download disk, from a Ray cluster launcher file's ``node_config`` (AWS:
    ``InstanceType``, the largest ``BlockDeviceMappings[].Ebs`` volume, its ``VolumeType`` / ``Throughput``)."""
    from kimi_k3_serve.cluster.files import ray_document
    from kimi_k3_serve.inputs import load_yaml, read_text_file
    from kimi_k3_serve.planning.hardware import ebs_volume_read

    document = ray_document(load_yaml(read_text_file(cluster_path, "cluster", what="a cluster file"), "cluster",
                                      cluster_path, all_documents=True), source=cluster_path)
    out: dict[str, DeclaredDisk] = {}
    types = document.get("available_node_types") if isinstance(document, dict) else None
    for name, node_type in (types if isinstance(types, dict) else {}).items():
        config = node_type.get("node_config") if isinstance(node_type, dict) else None
        config = config if isinstance(config, dict) else {}
        instance = config.get("InstanceType") or config.get("machineType")
        volumes = _ebs_volumes(config, f"available_node_types.{name}.node_config", cluster_path)
        if not volumes:
            out[name] = DeclaredDisk(instance, None, None, "no volume declared")
            continue
        volume = max(volumes, key=lambda v: v["VolumeSize"])
        kind = str(volume.get("VolumeType", "gp3"))
        rate, why = ebs_volume_read(volume)
        out[name] = DeclaredDisk(instance, volume["VolumeSize"] * GiB, rate,
                                 f"EBS {kind} {volume['VolumeSize']:,} GiB (cluster file); read: {why}", why)
    return out


def _ebs_volumes(config: dict, where: str, source: str) -> list[dict]:
    """The EBS volumes a launcher file's ``node_config`` declares, each with a whole positive ``VolumeSize`` (GiB):
    a size or throughput that is not one is bad input, not a volume silently left out."""
    mappings = config.get("BlockDeviceMappings")
    if mappings is None:
        return []
    if not isinstance(mappings, list):
        raise ConfigError(f"{where}.BlockDeviceMappings", mappings, "expected a list of {DeviceName, Ebs} mappings",
                          source=source)
    volumes = []
    for i, mapping in enumerate(mappings):
        here = f"{where}.BlockDeviceMappings[{i}]"
        if not isinstance(mapping, dict):
            raise ConfigError(here, mapping, "expected a mapping such as {DeviceName: /dev/sda1, Ebs: {VolumeSize: "
                                             "1000}}", source=source)
        volume = mapping.get("Ebs")
        if volume is None:
            continue
        if not isinstance(volume, dict):
            raise ConfigError(f"{here}.Ebs", volume, "expected a mapping such as {VolumeSize: 1000, VolumeType: gp3}",
                              source=source)
        for key, unit in (("VolumeSize", "GiB"), ("Throughput", "MiB/s")):
            value = volume.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{here}.Ebs.{key}", value, f"expected a whole number of {unit} of at least 1",
                                  source=source)
        if volume.get("VolumeSize") is not None:  # without it AWS sizes the volume from its snapshot: not known here
            volumes.append(volume)
    return volumes


def listing_of(source: str, *, field: str, model: Any, mode: str) -> CheckpointListing:
    """The checkpoint's listing: read (folders always, remote sources with ``mode == "read"``) or estimated."""
    from kimi_k3_serve.checkpoint.listing import read_listing

    from pathlib import Path

    kind = source_kind(source)
    if kind != "remote":
        resolved = resolve_source(source, field=field)
        if not any(Path(resolved).glob("*.safetensors")):  # a folder of config.json alone (planning only): estimate
            return synthetic_listing(model, source=source)
        return read_listing(resolved, field=field)
    if mode == "read":
        return read_listing(source, field=field)
    return synthetic_listing(model, source=source)


def checkpoint_plan(args: ServeArgs, *, ranks_per_node: int, mode: str) -> CheckpointPlan:
    from kimi_k3_serve.config.args_adapter import layout_of, planner_inputs

    model, engine, _ = planner_inputs(args)
    target = listing_of(args.model.source, field="args.model.source", model=model, mode=mode)
    draft = None
    if args.speculative is not None and engine.speculative is not None and engine.speculative.draft is not None:
        draft = listing_of(args.speculative.model, field="args.speculative.model", model=engine.speculative.draft,
                           mode=mode)
    return plan_checkpoint(target, draft, layout_of(args), num_layers=model.num_layers, ranks_per_node=ranks_per_node)


@dataclass(frozen=True)
class NodeRow:
    name: str
    need: NodeNeed
    instance: str | None
    verdict: DiskVerdict
    bandwidth: NodeBandwidth


@dataclass(frozen=True)
class CheckpointSection:
    lines: tuple[str, ...]
    refusals: tuple[str, ...]
    document: dict[str, Any]


def section(args: ServeArgs, plan: CheckpointPlan, rows: list[NodeRow]) -> CheckpointSection:
    """Lines, refusals and JSON of the plan, each node's row, and the start-up budgets derived from the same
    per-node estimates (``planning.startup``)."""
    from kimi_k3_serve.planning.startup import startup_budgets

    estimated = " (estimated from config.json: exact bytes per layer, 5 GB shards; --checkpoint-index read lists it)" \
        if plan.target.estimated else ""
    lines = [f"checkpoint: {plan.target.source}: {fmt_size(plan.target.total_bytes)} in {len(plan.target.files)} files"
             f"{estimated}" + (f"; draft {plan.draft.source}: {fmt_size(plan.draft.total_bytes)}" if plan.draft else "")]
    per_copy = args.model.download_dir is not None
    nodes_json, refusals, loads = [], [], []
    for row in rows:
        load = node_load(plan, row.need, node=f"{row.name}, {row.need.describe_stages()}", per_node_copy=per_copy,
                         bandwidth=row.bandwidth)
        loads.append(load)
        verdict = row.verdict
        free = ("free disk not declared" if verdict.free_bytes is None
                else f"{fmt_size(verdict.free_bytes)} free in {verdict.folder}")
        lines.append(f"checkpoint node {row.name} ({row.need.describe_stages()}): needs {fmt_size(load.nbytes)}"
                     f"{'' if per_copy else ' (the whole checkpoint: no args.model.download_dir)'}; {free}; "
                     f"{load.describe()}")
        if not verdict.fits:
            refusals.append(verdict.refusal())
        nodes_json.append({"node": row.name, "stages": list(row.need.stages), "bytes": load.nbytes,
                           "folder": verdict.folder, "free_bytes": verdict.free_bytes,
                           "missing_bytes": verdict.need_bytes, "fits": verdict.fits, **load.to_json()})
    split = sum(n.bytes for n in plan.nodes)
    lines.append(f"checkpoint per replica: {fmt_size(split)} with a per-node copy (prefetch), "
                 f"{fmt_size(plan.whole_total_bytes)} when each of its {len(plan.nodes)} node(s) reads the whole checkpoint")
    startup = None
    if loads:
        budgets = startup_budgets(nodes=loads, node_type=rows[0].instance)
        lines += list(budgets.lines())
        configured = (args.runtime_env.env_vars or {}).get("RAYLLM_ENGINE_START_TIMEOUT_S") if args.runtime_env else None
        startup = {**budgets.to_json(), "configured_timeout_s": configured}
        if configured is None:
            lines.append(f"  The deploy config sets no RAYLLM_ENGINE_START_TIMEOUT_S: Ray Serve LLM's 3600 s applies"
                         + (f", shorter than this budget: set it to \"{budgets.engine_start_timeout_s}\""
                            if budgets.engine_start_timeout_s > 3600 else ""))
        elif str(configured).isdigit() and int(configured) < budgets.engine_start_timeout_s:
            lines.append(f"  warning: the deploy config's RAYLLM_ENGINE_START_TIMEOUT_S \"{configured}\" is shorter than "
                         f"this budget: set it to \"{budgets.engine_start_timeout_s}\"")
        else:
            lines.append(f"  The deploy config's RAYLLM_ENGINE_START_TIMEOUT_S \"{configured}\" covers it.")
    document = {"source": plan.target.source, "estimated": plan.target.estimated, "total_bytes": plan.target.total_bytes,
                "files": len(plan.target.files), "draft_bytes": plan.draft.total_bytes if plan.draft else 0,
                "stage_ranges": [list(r) for r in plan.stage_ranges], "per_node_copy": per_copy, "nodes": nodes_json,
                "replica_bytes_split": split, "replica_bytes_whole": plan.whole_total_bytes, "startup": startup}
    return CheckpointSection(tuple(lines), tuple(refusals), document)


def declared_rows(args: ServeArgs, plan: CheckpointPlan, cluster_path: str, inventory: Any) -> list[NodeRow]:
    """One row per node of one replica, from the cluster file's GPU node type (its volume, its instance type)."""
    disks = declared_disks(cluster_path)
    nodes = inventory.gpu_nodes if args.accelerator.kind == "gpu" else inventory.nodes
    node_type = next((n.node_type for n in nodes if n.node_type), None)
    disk = disks.get(node_type or "", DeclaredDisk(None, None, None, "not declared"))
    folder = (args.model.download_dir or "the Hugging Face cache") + (
        f" (free: the whole {disk.source.split(' (')[0]} volume)" if disk.volume_bytes else "")
    bandwidth = node_bandwidth(disk.instance, disk_read_bytes_per_s=disk.read_bytes_per_s,
                               disk_source=disk.read_source or "the cluster file declares no volume",
                               unknown="the cluster file names no instance type")
    rows = []
    for need in plan.nodes:
        name = f"{need.position + 1} of {len(plan.nodes)} [{node_type or 'node'}]"
        verdict = disk_verdict(name, folder, need_bytes=plan.node_bytes(need, per_node_copy=args.model.download_dir
                                                                         is not None), free_bytes=disk.volume_bytes)
        rows.append(NodeRow(name, need, disk.instance, verdict, bandwidth))
    return rows


def live_rows(args: ServeArgs, plan: CheckpointPlan) -> list[NodeRow]:
    """A Ray task per worker node of the connected cluster: its folder's free disk less what it already holds."""
    from kimi_k3_serve.checkpoint import prefetch as pf

    gpu = args.accelerator.kind == "gpu"
    nodes = pf.live_nodes(accelerator=(args.accelerator.ray_accelerator_type or "") if gpu else None)
    assignments = [a for a in pf.assign_nodes(nodes, plan) if a.need is not None]
    if args.model.download_dir:
        specs = [pf.node_spec(a, plan, download_dir=args.model.download_dir) for a in assignments]
    else:  # vLLM downloads the whole checkpoint into the node's hub cache
        whole = [{"name": f.name, "size": f.size_bytes} for f in plan.target.files if not f.is_other_weights]
        specs = [{"folder": None, "parts": [{"subdir": ".", "files": whole}]} for _ in assignments]
    # A live node's instance type is not known here (Ray does not report it): the default, said in the line.
    bandwidth = node_bandwidth(None, disk_source="a live node's volume is not measured",
                               unknown="a live node: Ray does not report its instance type")
    return [NodeRow(a.node.node_id, a.need, None, verdict, bandwidth) for a, verdict in pf.check_disks(assignments, specs)]
