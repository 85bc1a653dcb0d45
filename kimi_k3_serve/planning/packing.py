"""Bin-packing placement groups onto a cluster's nodes, as Ray would place them, adding the nodes an autoscaler
may start. Pure: plain data in (available resources per node, the node types that may still grow), a verdict out
with the resource that is short. The build-time check and ``check`` run it (``checks.preflight``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.inventory import capacity_resources

EPSILON = 1e-9
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")




@dataclass(frozen=True)
class NodeSlot:
    """A node as the packer sees it: what Ray can still hand out there."""

    name: str
    available: dict[str, float]
    node_type: str | None = None


@dataclass(frozen=True)
class GrowableType:
    """A node type the autoscaler may still add ``count`` nodes of, each with ``resources``."""

    name: str
    resources: dict[str, float]
    count: int


@dataclass(frozen=True)
class PackResult:
    fits: bool
    placements: tuple[tuple[tuple[int, str], ...], ...]
    """Per placement group: (bundle index, node name) pairs."""
    added: dict[str, int]
    """Nodes the autoscaler would have to add, per node type."""
    reason: str | None = None
    short: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Resource -> (needed by the groups, offered by the cluster incl. what it may add) when one is short."""


def _fits(need: Mapping[str, float], have: Mapping[str, float]) -> bool:
    return all(amount <= have.get(resource, 0.0) + EPSILON for resource, amount in need.items() if amount > 0)


def _take(have: dict[str, float], need: Mapping[str, float]) -> None:
    for resource, amount in need.items():
        have[resource] = have.get(resource, 0.0) - amount


def sum_resources(bundles: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Resource -> the total the bundles ask for."""
    total: dict[str, float] = {}
    for bundle in bundles:
        for resource, amount in bundle.items():
            total[resource] = total.get(resource, 0.0) + float(amount)
    return total


def _missing(need: Mapping[str, float], have: Mapping[str, float]) -> str:
    parts = [f"{r} {amount:g} (has {have.get(r, 0.0):g})" for r, amount in sorted(need.items())
             if amount > have.get(r, 0.0) + EPSILON]
    return ", ".join(parts)


def pack_bundles(
    groups: Sequence[tuple[Sequence[Mapping[str, float]], str]],
    nodes: Sequence[NodeSlot],
    growable: Sequence[GrowableType] = (),
) -> PackResult:
    """Place every placement group ``(bundles, strategy)`` on ``nodes`` (available resources), adding nodes of
    ``growable`` types when nothing present can hold a bundle. First fit, bundles of one group on the nodes it
    already uses first (what PACK prefers); a group that cannot be placed ends the search with the reason."""
    free = {node.name: dict(node.available) for node in nodes}
    order = [node.name for node in nodes]
    remaining = {g.name: g.count for g in growable}
    types = {g.name: g for g in growable}
    added: dict[str, int] = {}
    placements: list[tuple[tuple[int, str], ...]] = []

    def grow(need: Mapping[str, float]) -> str | None:
        for g in growable:
            if remaining[g.name] > 0 and _fits(need, g.resources):
                remaining[g.name] -= 1
                added[g.name] = added.get(g.name, 0) + 1
                name = f"(new {g.name} #{added[g.name]})"
                free[name] = dict(types[g.name].resources)
                order.append(name)
                return name
        return None

    # Everything the groups ask for against everything the cluster offers (present nodes' available resources
    # plus every node the autoscaler may add): the resources short in total, when any is.
    demand = sum_resources([b for bundles, _ in groups for b in bundles])
    offered = sum_resources([dict(node.available) for node in nodes] + [
        {r: a * g.count for r, a in g.resources.items()} for g in growable])
    total_short = {r: (a, offered.get(r, 0.0)) for r, a in demand.items() if a > offered.get(r, 0.0) + EPSILON}

    def totals(_: Mapping[str, float]) -> dict[str, tuple[float, float]]:
        return total_short

    for number, (bundles, strategy) in enumerate(groups):
        if strategy not in STRATEGIES:
            raise ConfigError("placement_group_strategy", strategy, f"one of {', '.join(STRATEGIES)}")
        placed: list[tuple[int, str]] = []
        if strategy == "STRICT_PACK":
            need = sum_resources(bundles)
            host = next((n for n in order if _fits(need, free[n])), None) or grow(need)
            if host is None:
                best = max(order, key=lambda n: sum(min(free[n].get(r, 0), a) / a for r, a in need.items() if a > 0),
                           default=None)
                detail = f"; the closest node {best} lacks {_missing(need, free[best])}" if best else ""
                return PackResult(False, tuple(placements), added,
                                  f"placement group {number + 1} is STRICT_PACK: one node must hold all "
                                  f"{len(bundles)} bundles ({_fmt(need)}); no node has that{detail}",
                                  totals(need))
            _take(free[host], need)
            placed = [(i, host) for i in range(len(bundles))]
        else:
            used: list[str] = []
            for index, bundle in enumerate(bundles):
                if strategy == "STRICT_SPREAD":
                    candidates = [n for n in order if n not in used]
                elif strategy == "PACK":
                    candidates = used + [n for n in order if n not in used]
                else:  # SPREAD: prefer a node this group does not use yet
                    candidates = [n for n in order if n not in used] + used
                host = next((n for n in candidates if _fits(bundle, free[n])), None) or grow(bundle)
                if host is None:
                    need = sum_resources(bundles[index:])
                    spread = " on a node of its own (STRICT_SPREAD)" if strategy == "STRICT_SPREAD" else ""
                    after = f" once bundles 0..{index - 1} are placed" if index else ""
                    return PackResult(False, tuple(placements), added,
                                      f"placement group {number + 1}: bundle {index} ({_fmt(bundle)}) fits on no "
                                      f"node{spread}{after}; still to place: {_fmt(need)}", totals(need))
                _take(free[host], bundle)
                placed.append((index, host))
                if host not in used:
                    used.append(host)
        placements.append(tuple(placed))
    return PackResult(True, tuple(placements), added)


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{r}: {a:g}" for r, a in sorted(resources.items()) if a) + "}"


def describe_bundles(bundles: Sequence[Mapping[str, float]]) -> str:
    """``1 x {CPU: 1, GPU: 1} + 15 x {GPU: 1}``: runs of identical bundles, in order."""
    runs: list[list] = []
    for bundle in bundles:
        text = _fmt(bundle)
        if runs and runs[-1][1] == text:
            runs[-1][0] += 1
        else:
            runs.append([1, text])
    return " + ".join(f"{n} x {text}" for n, text in runs)


def growable_types(inventory: Any, *, undeclared: float | None = None) -> tuple[GrowableType, ...]:
    """The node types the autoscaler may still add nodes of, as the packer sees them (``ClusterInventory.growth``,
    the rule the memory plan's ``at_capacity`` grows by). ``undeclared``: the amount of CPU and GPU to assume
    where a declared type does not state it (a cluster file often leaves CPU out)."""
    growable = []
    for capacity, _, more in inventory.growth():
        if more <= 0:
            continue
        resources = capacity_resources(capacity.resources)
        if undeclared is not None:
            resources.setdefault("GPU", float(capacity.gpus_per_node))
            resources.setdefault("CPU", undeclared)
        growable.append(GrowableType(capacity.name, resources, more))
    return tuple(growable)
