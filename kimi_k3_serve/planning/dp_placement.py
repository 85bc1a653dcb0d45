"""Where the DP ranks of a DP x EP layout are, in words: each rank's GPUs, nodes and NVLink domains, and which ranks
share a domain (their EP all-to-all stays on NVLink). Pure: the build-time check prints it from the plan, the
replica-start check (``checks.dp_replica``) from the placement group Serve reserved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class DpRankPlacement:
    dp_rank: int
    bundles: tuple[int, ...]
    """In the order vLLM's ranks take them (TP groups in one NVLink domain)."""
    nodes: tuple[str, ...]
    domains: tuple[str, ...]


def domain_sharing(ranks: Sequence[DpRankPlacement]) -> dict[str, list[int]]:
    """NVLink domain -> the DP ranks with a GPU in it."""
    out: dict[str, list[int]] = {}
    for rank in ranks:
        for domain in dict.fromkeys(rank.domains):
            out.setdefault(domain, []).append(rank.dp_rank)
    return out


def describe_dp_ranks(ranks: Sequence[DpRankPlacement], *, max_lines: int = 8) -> list[str]:
    """One line per DP rank (the first ``max_lines``), then which ranks share an NVLink domain."""
    lines = []
    for rank in ranks[:max_lines]:
        nodes = ", ".join(dict.fromkeys(rank.nodes))
        domains = ", ".join(dict.fromkeys(rank.domains))
        lines.append(f"DP rank {rank.dp_rank}: {len(rank.bundles)} GPU(s) on {nodes} (NVLink domain {domains})")
    if len(ranks) > max_lines:
        lines.append(f"... and {len(ranks) - max_lines} more DP ranks")
    sharing = domain_sharing(ranks)
    shared = {d: r for d, r in sharing.items() if len(r) > 1}
    if shared:
        lines.append("DP ranks sharing an NVLink domain (their EP all-to-all stays on NVLink): "
                     + "; ".join(f"{d}: {r}" for d, r in shared.items()))
    if len(sharing) > 1:
        lines.append(f"the EP group spans {len(sharing)} NVLink domains: all-to-all between them crosses the network")
    else:
        lines.append("every DP rank is in one NVLink domain")
    return lines


def dp_placement_lines(layout: Any, placements: Sequence[Any]) -> list[str]:
    """The planner's placement (``planner.Plan.placements``) of a DP layout, in words, with the NVLink domains."""
    ranks = []
    for dp_rank in range(layout.dp):
        mine = [p for p in placements if p.dp_rank == dp_rank]
        ranks.append(DpRankPlacement(dp_rank, tuple(p.gpu_index for p in mine), tuple(p.node_id for p in mine),
                                     tuple(p.nvlink_domain for p in mine)))
    return [f"{layout.describe()}: {layout.dp} DP ranks of {layout.tp * layout.pp} GPU(s)"] + describe_dp_ranks(ranks)
