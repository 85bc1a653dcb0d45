"""The checks of a DP x TP (x EP) layout: at build time, where the planner puts every DP rank; at replica start,
every DP rank of the gang Serve actually reserved.

Ray Serve LLM's ``DPServer`` (``kimi_k3_serve.serving.dp_serve``) gang-schedules one replica per DP rank into one placement
group and gives DP rank *r* the bundles ``sorted[r * B : (r + 1) * B]`` (``DPServer._compute_bundle_indices``), where
``sorted`` is the gang's bundles grouped by node with DP rank 0's node first (``get_bundle_indices_sorted_by_node``)
and ``B = TP x PP``. Each replica's check (``check_dp_replica``, run by ``replica_callback.ReplicaPreflight`` before vLLM
loads anything):

1. reads the gang's bundle-to-node table and DP rank 0's node (``GangMasterInfoRegistry``, which ``DPServer``
   filled before the engine starts), and derives every DP rank's bundle slice with ``DPServer``'s own functions;
2. probes its own bundles for the exact GPU Ray gave each (NVML), and the other DP ranks' bundles without asking for
   a GPU (their engines may already hold them): NVML on their nodes gives the NVLink domain, and the node's GPU with
   the least free memory stands for the bundle's (conservative);
3. for every DP rank, orders its slice so each TP group stays in one NVLink domain and the last PP stage sits on
   its roomiest node (``placement.bundle_order``, the single-engine rule); a DP rank whose slice cannot keep a TP
   group inside one domain fails the check, naming the rank and its bundles per node. This replica's own order
   goes to ``VLLM_RAY_BUNDLE_INDICES`` (a permutation of the slice ``DPServer`` set);
4. checks the memory model on every rank of every DP engine (``planner.memory_on_devices`` with the whole DP
   layout: the experts split over TP x DP, each engine's own KV pool), and says which DP ranks share an NVLink
   domain (the EP all-to-all between them stays on NVLink) and which cross the network;
5. DP rank 0 runs the communication smoke test across the gang's nodes (the EP all-to-all spans all of them),
   over gloo without a GPU (the other ranks' engines may hold theirs); the other ranks leave it to rank 0.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from kimi_k3_serve.errors import DoesNotFitError
from kimi_k3_serve.planning.dp_placement import DpRankPlacement, describe_dp_ranks


def dp_rank_slices(sorted_indices: Sequence[int], dp_size: int, bundles_per_rank: int, compute) -> list[list[int]]:
    """Every DP rank's bundles as ``DPServer`` hands them out (``compute`` is ``DPServer._compute_bundle_indices``)."""
    return [[int(i) for i in compute(r, bundles_per_rank, list(sorted_indices)).split(",")] for r in range(dp_size)]


def order_dp_ranks(layout: Any, slices: Sequence[Sequence[int]], table: Mapping[int, str],
                   domains: Mapping[str, str], free_by_node: Mapping[str, int]) -> list[DpRankPlacement]:
    """Each DP rank's slice in vLLM's rank order (``placement.bundle_order`` on the slice, the last PP stage on the
    slice's roomiest node). Raises ``PlacementError`` naming the DP rank whose slice cannot hold its TP groups."""
    from dataclasses import replace

    from kimi_k3_serve.planning.placement import PlacementError, bundle_order, roomiest_node

    engine = replace(layout, dp=1)
    out = []
    for dp_rank, bundles in enumerate(slices):
        sub = {b: table[b] for b in bundles}
        try:
            last = roomiest_node(engine, sub, free_by_node, list(bundles))
            order = bundle_order(engine, sub, domains, last_stage_node=last, gpu_bundles=list(bundles))
        except PlacementError as exc:
            raise PlacementError(f"DP rank {dp_rank} (bundles {list(bundles)}): {exc}") from None
        order = order[: engine.world_size]
        nodes = tuple(table[b] for b in order)
        out.append(DpRankPlacement(dp_rank, tuple(order), nodes,
                                   tuple(domains.get(n, f"node:{n}") for n in nodes)))
    return out


def tightest_gpu_by_bundle(probes: Sequence[Any]) -> tuple[dict[int, Any], list[str]]:
    """Bundle -> the ``GpuInfo`` with the least free memory on its node (probes that asked for no GPU: which GPU the
    bundle holds is not known, its node's tightest stands for it); and why any node has no reading."""
    from kimi_k3_serve.checks.replica import gpus_by_bundle

    return gpus_by_bundle(probes, lambda probe, gpus: (
        min(gpus, key=lambda g: (g.free if g.free is not None else g.total_bytes or 0, g.index)), None))


# ---------------------------------------------------------------------------------------------------------------
# The replica-start check of a DP rank (Ray)
# ---------------------------------------------------------------------------------------------------------------


def check_dp_replica(args: Any, pg: Any, *, dp_rank: int, dp_size: int, driver_node_id: str,
                     comm_backend: str | None = None, comm_timeout_s: float = 60.0,
                     env: Mapping[str, str] | None = None, probe_timeout_s: float = 60.0):
    """The replica-start check of DP rank ``dp_rank`` on the gang placement group ``pg`` (every DP rank's bundles);
    returns ``replica.ReplicaCheckResult`` whose ``bundle_indices`` are this rank's, in vLLM's rank order."""
    from ray.llm._internal.serve.utils.pg_utils import _sort_bundle_indices_by_node
    from ray.serve.llm.deployment import DPServer
    from ray.util.placement_group import placement_group_table

    from kimi_k3_serve.planning.inventory import NodeInfo, rank_device
    from kimi_k3_serve.planning.placement import PlacementError
    from kimi_k3_serve.planning.planner import memory_on_devices
    from kimi_k3_serve.config.args_adapter import planner_inputs
    from kimi_k3_serve.checks.replica import (
        ReplicaCheckError,
        ReplicaCheckResult,
        _gpus_by_bundle,
        _layout,
        _Placed,
        check_draft_target,
        comm_smoke_test,
        probe_bundles,
    )

    started = time.perf_counter()
    draft_line = check_draft_target(args)
    layout = _layout(args)
    if layout.dp != dp_size:
        raise ReplicaCheckError(f"the gang has {dp_size} DP ranks; args.parallel.data_parallel_size is {layout.dp}")
    table = {int(k): v for k, v in placement_group_table(pg)["bundles_to_node_id"].items()}
    per_rank = layout.tp * layout.pp
    if len(table) != per_rank * dp_size:
        raise ReplicaCheckError(f"the gang placement group has {len(table)} bundles; {dp_size} DP ranks of "
                                f"{layout.describe()} need {per_rank * dp_size}")
    slices = dp_rank_slices(_sort_bundle_indices_by_node(table, driver_node_id), dp_size, per_rank,
                            DPServer._compute_bundle_indices)
    own = set(slices[dp_rank])
    probes = probe_bundles(pg, sorted(own), gpu=True, timeout_s=probe_timeout_s)
    others = probe_bundles(pg, sorted(set(table) - own), gpu=False, read_gpus=True, timeout_s=probe_timeout_s)
    lines = [f"gang placement group: {len(table)} bundles on {len(set(table.values()))} node(s), {dp_size} DP ranks "
             f"of {per_rank} GPU(s); this replica is DP rank {dp_rank}"]
    if draft_line is not None:
        lines.insert(0, draft_line)
    by_bundle, missing = _gpus_by_bundle(probes)
    other_gpus, other_missing = tightest_gpu_by_bundle(others)
    by_bundle.update(other_gpus)
    missing += other_missing
    probes = probes + others
    domains = {p.node_id: by_bundle[p.bundle].nvlink_domain for p in probes if p.bundle in by_bundle}
    free_by_node: dict[str, int] = {}
    for probe in probes:
        info = by_bundle.get(probe.bundle)
        if info is not None:
            free_by_node[probe.node_id] = min(free_by_node.get(probe.node_id, info.free or 0), info.free or 0)
    try:
        ranks = order_dp_ranks(layout, slices, table, domains, free_by_node)
    except PlacementError as exc:
        raise ReplicaCheckError(f"the reserved gang cannot hold {layout.describe()}: {exc}") from None
    mine = ranks[dp_rank]
    lines.append(f"VLLM_RAY_BUNDLE_INDICES={','.join(map(str, mine.bundles))} (DP rank {dp_rank}'s slice, TP groups "
                 "in one NVLink domain)")
    lines.extend(describe_dp_ranks(ranks))
    report = None
    if missing:
        lines.append("GPU memory: not checked again -- " + "; ".join(missing[:4]))
    else:
        model, engine, _ = planner_inputs(args)
        order = [b for rank in ranks for b in rank.bundles]
        devices = [rank_device(NodeInfo(node_id=table[b], address="", resources={}, labels={}, gpus=(by_bundle[b],)),
                               by_bundle[b]) for b in order]
        one_domain = all(len({devices[g * layout.tp + t].nvlink_domain for t in range(layout.tp)}) == 1
                         for g in range(layout.pp * layout.dp))
        memory, optimisations = memory_on_devices(model, engine, layout, devices, one_domain=one_domain)
        from kimi_k3_serve.planning.report import build_report, format_table

        placements = [_Placed(rank, table[b], devices[rank].index) for rank, b in enumerate(order)]
        report = build_report(model_name=model.name, cluster_source="reserved gang placement group",
                              gpu_name=devices[0].name, memory=memory, placements=placements,
                              optimisations=optimisations, seconds=time.perf_counter() - started)
        if not report.fits:
            raise DoesNotFitError(
                f"DP rank {dp_rank} refused before loading {model.name}: the GPUs Serve reserved for the {dp_size} DP "
                f"ranks no longer hold it.\n{format_table(report)}", report=report)
        lines.append(f"GPU memory on every DP rank's reserved GPUs: {report.verdict} (smallest engine "
                     f"{float(memory.max_concurrency):.2f} requests of max_model_len; all {dp_size}: "
                     f"{sum(memory.engine_concurrency):.2f})")
    if dp_rank == 0:
        distinct: list[int] = []
        for rank in ranks:
            for bundle in rank.bundles:
                if table[bundle] not in [table[b] for b in distinct]:
                    distinct.append(bundle)
        if len(distinct) < 2:
            lines.append(f"communication: every DP rank is on node {table[distinct[0]]}; no cross-node link to test")
        else:
            ips = {p.node_id: p.node_ip for p in probes}
            names = [f"{table[b]} ({ips.get(table[b], '?')})" for b in distinct]
            # gloo, asking for no GPU: the other DP ranks' engines may already hold their bundles' GPUs, and a
            # probe waiting for one would time out. It proves the gang's nodes reach each other; NCCL over the
            # fabric is vLLM's own first collective.
            lines.append(comm_smoke_test(pg, distinct, names, backend=comm_backend or "gloo", timeout_s=comm_timeout_s,
                                         env=env))
    else:
        lines.append("communication: DP rank 0 tests the gang's cross-node links")
    return ReplicaCheckResult(tuple(lines), mine.bundles, report, time.perf_counter() - started)
