"""Where each vLLM rank runs: the planner's intended GPU for every rank, the Ray Serve LLM placement group
request, and ``VLLM_RAY_BUNDLE_INDICES`` for a placement group Ray has actually reserved.

vLLM 0.32's Ray executor (``vllm/v1/executor/ray_executor_v2.py``, ``ray_utils.py``) gives rank *i* the
*i*-th bundle of ``VLLM_RAY_BUNDLE_INDICES`` (or, without it, the GPU bundles sorted driver-node first, then
by node id). A rank's PP stage is ``(rank // tp) % pp``, its TP rank ``rank % tp`` and its DP rank
``rank // (tp * pp)``; the last PP stage (which holds lm_head, the sampler and any speculative draft) is
ranks ``world - tp .. world - 1`` of each DP replica. Ray Serve LLM asks for one 1-GPU bundle per rank with
PACK, which is best effort: a TP group can land on two nodes. ``bundle_order`` repairs the order when the
reserved bundles allow it and says exactly why when they do not.

Pure: no Ray import. Bundle tables come in as plain lists.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from kimi_k3_serve.planning.inventory import ClusterInventory, GpuInfo, NodeInfo
from kimi_k3_serve.errors import KimiK3ServeError
from kimi_k3_serve.planning.hardware import GpuSpec
from kimi_k3_serve.planning.layout import Layout

ACCELERATOR_HINT = 0.001  # what Ray Serve LLM adds per bundle for accelerator_type (vllm_models.py)


class PlacementError(KimiK3ServeError):
    """The GPUs at hand cannot hold the layout's TP groups / stages as required."""


# ---------------------------------------------------------------------------------------------------------------
# The placement group Ray Serve LLM should request
# ---------------------------------------------------------------------------------------------------------------


def placement_group_config(layout: Layout, gpu: GpuSpec | None, gpus_per_node: int | None = None) -> dict:
    """``LLMConfig.placement_group_config`` for one engine replica: one 1-GPU bundle per rank (vLLM's Ray
    executor refuses bundles of more than one GPU), each with Ray Serve LLM's ``accelerator_type`` hint.

    STRICT_PACK when the whole engine fits one node (all ranks on one machine, nothing left to chance),
    PACK otherwise (STRICT_PACK could never be satisfied; the bundle order then fixes the TP groups).
    """
    bundle: dict[str, float] = {"GPU": 1.0}
    if gpu is not None and gpu.ray_accelerator_type:
        bundle[f"accelerator_type:{gpu.ray_accelerator_type}"] = ACCELERATOR_HINT
    per_node = gpus_per_node or (gpu.gpus_per_node if gpu else None)
    strategy = "STRICT_PACK" if per_node is not None and layout.world_size <= per_node else "PACK"
    return {"bundles": [dict(bundle) for _ in range(layout.world_size)], "strategy": strategy}


# ---------------------------------------------------------------------------------------------------------------
# VLLM_RAY_BUNDLE_INDICES for a reserved placement group
# ---------------------------------------------------------------------------------------------------------------


def bundle_order(
    layout: Layout,
    bundle_to_node: Sequence[str] | Mapping[int, str],
    node_domains: Mapping[str, str] | None = None,
    last_stage_node: str | None = None,
    gpu_bundles: Sequence[int] | None = None,
) -> list[int]:
    """The ``VLLM_RAY_BUNDLE_INDICES`` order for a reserved placement group.

    ``bundle_to_node``: bundle index -> node id, as in ``ray.util.placement_group_table(pg)
    ["bundles_to_node_id"]``. ``node_domains``: node id -> NVLink domain (default: each node its own);
    a TP group may span nodes only inside one domain (GB200/GB300 NVL72). ``last_stage_node``: where the last
    PP stage (lm_head, sampler, draft) must run, usually the node with the most memory headroom.
    ``gpu_bundles``: the bundles that carry a GPU (default: all).

    Stage 0 starts on bundle 0's node when it can (the engine core runs there), and stages of one DP replica
    go to distinct nodes where the bundles allow. Raises ``PlacementError`` naming the bundles per node when
    a TP group cannot stay inside one domain or the last stage cannot sit on ``last_stage_node``.
    """
    table = dict(bundle_to_node) if isinstance(bundle_to_node, Mapping) else dict(enumerate(bundle_to_node))
    indices = sorted(table) if gpu_bundles is None else list(gpu_bundles)
    missing = [i for i in indices if i not in table]
    if missing:
        raise PlacementError(f"bundles {missing} are not in the placement group's bundle-to-node table")
    world, tp = layout.world_size, layout.tp
    if len(indices) < world:
        raise PlacementError(f"the placement group has {len(indices)} GPU bundles; {layout.describe()} needs {world}")
    domains = {node: (node_domains or {}).get(node, f"node:{node}") for node in set(table[i] for i in indices)}
    first_node = table[min(indices)]

    # Bundles per domain, each domain's bundles ordered node by node (a TP group spans as few nodes as it can).
    node_order = sorted(domains, key=lambda node: (node != first_node, node))
    by_domain: dict[str, list[int]] = {}
    for node in node_order:
        by_domain.setdefault(domains[node], []).extend(sorted(i for i in indices if table[i] == node))

    def shortage(reason: str) -> PlacementError:
        counts = Counter(table[i] for i in indices)
        per_node = ", ".join(f"{node}: {counts[node]}" for node in node_order)
        return PlacementError(
            f"{reason}. {layout.describe()} needs {layout.pp * layout.dp} TP group(s) of {tp} GPU bundles, each "
            f"inside one NVLink domain; the reserved bundles per node are {per_node}. Ask for bundles that "
            f"match whole nodes (STRICT_PACK per node, or bundle label selectors) and retry."
        )

    last_groups: list[list[int]] = []
    if last_stage_node is not None:
        if last_stage_node not in domains:
            raise shortage(f"the last-stage node {last_stage_node} holds none of the reserved bundles")
        domain = domains[last_stage_node]
        pool = by_domain[domain]
        # Prefer the chosen node's own bundles, then its domain-mates (NVL72 trays).
        pool.sort(key=lambda i: (table[i] != last_stage_node, node_order.index(table[i]), i))
        for _ in range(layout.dp):
            if len(pool) < tp or table[pool[0]] != last_stage_node:
                break
            last_groups.append(pool[:tp])
            del pool[:tp]
        if not last_groups:
            raise shortage(f"the last PP stage cannot sit on {last_stage_node}: its NVLink domain holds fewer "
                           f"than {tp} free bundles")

    # Carve the remaining TP groups domain by domain.
    groups: list[list[int]] = []
    for pool in by_domain.values():
        while len(pool) >= tp:
            groups.append(pool[:tp])
            del pool[:tp]
    needed = layout.pp * layout.dp - len(last_groups)
    if len(groups) < needed:
        raise shortage("the reserved bundles cannot keep every TP group inside one NVLink domain")

    order: list[int] = []
    for dp_rank in range(layout.dp):
        stages: list[list[int]] = []
        used_nodes: set[str] = set()
        last = last_groups[dp_rank] if dp_rank < len(last_groups) else None
        if last is not None:
            used_nodes.add(table[last[0]])
        for _ in range(layout.pp - (1 if last is not None else 0)):
            # Next group on a node this replica does not use yet, else the next group.
            pick = next((g for g in groups if table[g[0]] not in used_nodes), groups[0])
            groups.remove(pick)
            used_nodes.add(table[pick[0]])
            stages.append(pick)
        if last is not None:
            stages.append(last)
        for group in stages:
            order.extend(group)
    return order


def roomiest_node(
    layout: Layout,
    bundle_to_node: Sequence[str] | Mapping[int, str],
    free_bytes_by_node: Mapping[str, int],
    gpu_bundles: Sequence[int] | None = None,
) -> str | None:
    """The node to hold the last PP stage: among nodes with at least ``tp`` reserved bundles, the one whose
    GPUs have the most free memory (``free_bytes_by_node``: the smallest free figure of each node's GPUs,
    e.g. from NVML). None when no node holds a whole TP group (NVL72 groups span trays)."""
    table = dict(bundle_to_node) if isinstance(bundle_to_node, Mapping) else dict(enumerate(bundle_to_node))
    indices = sorted(table) if gpu_bundles is None else list(gpu_bundles)
    counts = Counter(table[i] for i in indices)
    eligible = [node for node, n in counts.items() if n >= layout.tp]
    if not eligible:
        return None
    # Most free memory wins; ties go to the node sorting last, so bundle 0's node keeps stage 0.
    return max(eligible, key=lambda node: (free_bytes_by_node.get(node, 0), node != table[min(indices)], node))


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    dp_rank: int
    pp_stage: int
    tp_rank: int
    node_id: str
    gpu_index: int
    nvlink_domain: str


def ranks_on_nodes(layout: Layout, order: Sequence[int], bundle_to_node: Sequence[str] | Mapping[int, str]) -> list[str]:
    """Node of every rank when vLLM follows ``order`` (rank i <- bundle order[i])."""
    table = dict(bundle_to_node) if isinstance(bundle_to_node, Mapping) else dict(enumerate(bundle_to_node))
    return [table[bundle] for bundle in order[: layout.world_size]]


# ---------------------------------------------------------------------------------------------------------------
# The planner's intended GPU for every rank on a cluster inventory
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TpGroup:
    gpus: tuple[tuple[NodeInfo, GpuInfo], ...]
    order: int

    @functools.cached_property
    def nodes(self) -> frozenset[str]:
        return frozenset(node.node_id for node, _ in self.gpus)

    @property
    def min_free(self) -> int:
        return min((gpu.free if gpu.free is not None else 0) for _, gpu in self.gpus)


def _usable_gpus(node: NodeInfo) -> list[GpuInfo]:
    """The node's GPUs a new engine may take: the ones with the most free memory, up to its free count."""
    ranked = sorted(node.gpus, key=lambda gpu: (-(gpu.free or 0), gpu.index))
    return sorted(ranked[: node.free_gpu_count], key=lambda gpu: gpu.index)


def tp_groups(cluster: ClusterInventory, tp: int) -> list[_TpGroup]:
    """Every disjoint TP group of ``tp`` GPUs inside one NVLink domain the cluster offers, node by node,
    the ones with the most free memory first. Computed once per TP size by the planner."""
    by_domain: dict[str, list[tuple[NodeInfo, GpuInfo]]] = {}
    for node in cluster.gpu_nodes:
        for gpu in _usable_gpus(node):
            by_domain.setdefault(gpu.nvlink_domain, []).append((node, gpu))
    groups: list[_TpGroup] = []
    for members in by_domain.values():
        for start in range(0, len(members) - tp + 1, tp):
            groups.append(_TpGroup(tuple(members[start : start + tp]), len(groups)))
    return sorted(groups, key=lambda g: (-g.min_free, g.order))


def assign_ranks(
    layout: Layout, cluster: ClusterInventory, groups: list[_TpGroup] | None = None
) -> tuple[list[RankPlacement] | None, str | None]:
    """The intended node and GPU of every rank, or (None, why not).

    Each TP group inside one NVLink domain; the PP stages of one DP replica on disjoint sets of nodes (stage
    traffic crosses the network, TP traffic stays on NVLink); the groups with the most free memory first;
    within a replica the last stage (lm_head, sampler, draft) on the roomiest group, ties going to the later
    node so stage 0 keeps the first; never more GPUs of a node than it has free.
    """
    if groups is None:
        groups = tp_groups(cluster, layout.tp)
    if len(groups) < layout.pp * layout.dp:
        domains = {gpu.nvlink_domain for node in cluster.gpu_nodes for gpu in node.gpus}
        largest = max((sum(1 for n in cluster.gpu_nodes for g in _usable_gpus(n) if g.nvlink_domain == d)
                       for d in domains), default=0)
        return None, (
            f"needs {layout.pp * layout.dp} TP group(s) of {layout.tp} GPUs inside one NVLink domain; the cluster "
            f"offers {len(groups)} (largest domain: {largest} free GPUs, {cluster.total_gpus} GPUs in all)"
        )
    taken: set[int] = set()
    placements: list[RankPlacement] = []
    first_free = 0  # groups before it are all taken: a wide DP layout does not rescan them for every DP rank
    for dp_rank in range(layout.dp):
        used_nodes: set[str] = set()
        replica: list[_TpGroup] = []
        while first_free < len(groups) and groups[first_free].order in taken:
            first_free += 1
        for group in groups[first_free:]:
            if len(replica) == layout.pp:
                break
            nodes = group.nodes
            if group.order in taken or nodes & used_nodes:
                continue
            replica.append(group)
            used_nodes |= nodes
        if len(replica) < layout.pp:
            return None, (
                f"needs {layout.pp} PP stages on distinct nodes, each a TP group of {layout.tp} GPUs in one NVLink "
                f"domain; the cluster has room for {len(replica)} such stage(s) per replica"
            )
        taken |= {group.order for group in replica}
        last = max(replica, key=lambda g: (g.min_free, g.order))
        stages = sorted((g for g in replica if g is not last), key=lambda g: g.order) + [last]
        for stage, group in enumerate(stages):
            for tp_rank, (node, gpu) in enumerate(group.gpus):
                rank = (dp_rank * layout.pp + stage) * layout.tp + tp_rank
                placements.append(RankPlacement(rank, dp_rank, stage, tp_rank, node.node_id, gpu.index, gpu.nvlink_domain))
    placements.sort(key=lambda p: p.rank)
    return placements, None
