"""The checkpoint part of ``check``: per node of one replica, the bytes it needs, the free disk of its download
folder, the estimated download and load time; a node whose disk is too small refuses the config (exit 1).

Where the numbers come from:
- the listing: read from the source when it is a local folder (or ``cache:NAME``), or with ``--checkpoint-index read``
  from the hub or a bucket; otherwise estimated from config.json (``planning.checkpoint.synthetic_listing``: exact
  bytes per layer, ``save_pretrained``'s 5 GB shard cuts), and the line says so;
- free disk: on a live cluster a Ray task per node (``shutil.disk_usage`` of the folder on that node, less what it
  already holds of its files); on a declared cluster the launcher file's EBS volume (``VolumeSize``), else unknown;
- bandwidth: ``hardware.lookup_node_io`` (network) and the EBS volume type or ``Throughput`` (disk read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kimi_k3_serve.config.args import ServeArgs, resolve_source, source_kind
from kimi_k3_serve.planning.checkpoint import (CheckpointListing, CheckpointPlan, DiskVerdict, NodeNeed, disk_verdict,
                                               estimate_times, plan_checkpoint, synthetic_listing)
from kimi_k3_serve.units import GiB, MiB, fmt_size


@dataclass(frozen=True)
class DeclaredDisk:
    instance: str | None
    volume_bytes: int | None
    read_bytes_per_s: int | None
    source: str


def declared_disks(cluster_path: str) -> dict[str, DeclaredDisk]:
    """Node type -> its declared download disk, from a Ray cluster launcher file's ``node_config`` (AWS:
    ``InstanceType``, the largest ``BlockDeviceMappings[].Ebs`` volume, its ``VolumeType`` / ``Throughput``)."""
    from kimi_k3_serve.cluster.files import ray_document
    from kimi_k3_serve.inputs import load_yaml, read_text_file
    from kimi_k3_serve.planning.hardware import EBS_VOLUME_READ

    document = ray_document(load_yaml(read_text_file(cluster_path, "cluster", what="a cluster file"), "cluster",
                                      cluster_path, all_documents=True), source=cluster_path)
    out: dict[str, DeclaredDisk] = {}
    types = document.get("available_node_types") if isinstance(document, dict) else None
    for name, node_type in (types or {}).items():
        config = (node_type or {}).get("node_config") or {}
        instance = config.get("InstanceType") or config.get("machineType")
        volumes = [m.get("Ebs") or {} for m in config.get("BlockDeviceMappings") or () if isinstance(m, dict)]
        volumes = [v for v in volumes if isinstance(v.get("VolumeSize"), int)]
        if not volumes:
            out[name] = DeclaredDisk(instance, None, None, "no volume declared")
            continue
        volume = max(volumes, key=lambda v: v["VolumeSize"])
        kind = str(volume.get("VolumeType", "gp3"))
        rate, why = EBS_VOLUME_READ.get(kind, (None, f"EBS {kind}: no declared throughput"))
        if isinstance(volume.get("Throughput"), int):
            rate, why = volume["Throughput"] * MiB, f"EBS {kind} Throughput: {volume['Throughput']} MiB/s (cluster file)"
        out[name] = DeclaredDisk(instance, volume["VolumeSize"] * GiB, rate,
                                 f"EBS {kind} {volume['VolumeSize']:,} GiB (cluster file); read: {why}")
    return out


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
    disk_read_bytes_per_s: int | None


@dataclass(frozen=True)
class CheckpointSection:
    lines: tuple[str, ...]
    refusals: tuple[str, ...]
    document: dict[str, Any]


def node_bytes(args: ServeArgs, plan: CheckpointPlan, need: NodeNeed) -> int:
    """A node's bytes: its part with a per-node copy (``download_dir``), else the whole checkpoint (vLLM's download)."""
    return need.bytes if args.model.download_dir else plan.whole_bytes


def section(args: ServeArgs, plan: CheckpointPlan, rows: list[NodeRow]) -> CheckpointSection:
    """Lines, refusals and JSON of the plan and each node's row."""
    from kimi_k3_serve.planning.hardware import lookup_node_io

    estimated = " (estimated from config.json: exact bytes per layer, 5 GB shards; --checkpoint-index read lists it)" \
        if plan.target.estimated else ""
    lines = [f"checkpoint: {plan.target.source}: {fmt_size(plan.target.total_bytes)} in {len(plan.target.files)} files"
             f"{estimated}" + (f"; draft {plan.draft.source}: {fmt_size(plan.draft.total_bytes)}" if plan.draft else "")]
    per_copy = args.model.download_dir is not None
    nodes_json, refusals = [], []
    for row in rows:
        nbytes = node_bytes(args, plan, row.need)
        io = lookup_node_io(row.instance)
        times = estimate_times(nbytes, network_bytes_per_s=io.network_bytes_per_s if io else None,
                               disk_read_bytes_per_s=row.disk_read_bytes_per_s)
        verdict = row.verdict
        free = ("free disk not declared" if verdict.free_bytes is None
                else f"{fmt_size(verdict.free_bytes)} free in {verdict.folder}")
        lines.append(f"checkpoint node {row.name} ({row.need.describe_stages()}): needs {fmt_size(nbytes)}"
                     f"{'' if per_copy else ' (the whole checkpoint: no args.model.download_dir)'}; {free}; "
                     f"{times.describe()}")
        if not verdict.fits:
            refusals.append(verdict.refusal())
        nodes_json.append({"node": row.name, "stages": list(row.need.stages), "bytes": nbytes, "folder": verdict.folder,
                           "free_bytes": verdict.free_bytes, "missing_bytes": verdict.need_bytes, "fits": verdict.fits,
                           "download_s": times.download_s, "load_s": times.load_s,
                           "network_bytes_per_s": times.network_bytes_per_s,
                           "disk_read_bytes_per_s": times.disk_read_bytes_per_s})
    split = sum(n.bytes for n in plan.nodes)
    lines.append(f"checkpoint per replica: {fmt_size(split)} with a per-node copy (prefetch), "
                 f"{fmt_size(plan.whole_total_bytes)} when each of its {len(plan.nodes)} node(s) reads the whole checkpoint")
    document = {"source": plan.target.source, "estimated": plan.target.estimated, "total_bytes": plan.target.total_bytes,
                "files": len(plan.target.files), "draft_bytes": plan.draft.total_bytes if plan.draft else 0,
                "stage_ranges": [list(r) for r in plan.stage_ranges], "per_node_copy": per_copy, "nodes": nodes_json,
                "replica_bytes_split": split, "replica_bytes_whole": plan.whole_total_bytes}
    return CheckpointSection(tuple(lines), tuple(refusals), document)


def declared_rows(args: ServeArgs, plan: CheckpointPlan, cluster_path: str, inventory: Any) -> list[NodeRow]:
    """One row per node of one replica, from the cluster file's GPU node type (its volume, its instance type)."""
    disks = declared_disks(cluster_path)
    nodes = inventory.gpu_nodes if args.accelerator.kind == "gpu" else inventory.nodes
    node_type = next((n.node_type for n in nodes if n.node_type), None)
    disk = disks.get(node_type or "", DeclaredDisk(None, None, None, "not declared"))
    folder = (args.model.download_dir or "the Hugging Face cache") + (
        f" (free: the whole {disk.source.split(' (')[0]} volume)" if disk.volume_bytes else "")
    rows = []
    for need in plan.nodes:
        name = f"{need.position + 1} of {len(plan.nodes)} [{node_type or 'node'}]"
        verdict = disk_verdict(name, folder, need_bytes=node_bytes(args, plan, need), free_bytes=disk.volume_bytes)
        rows.append(NodeRow(name, need, disk.instance, verdict, disk.read_bytes_per_s))
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
    return [NodeRow(a.node.node_id, a.need, None, verdict, None) for a, verdict in pf.check_disks(assignments, specs)]
