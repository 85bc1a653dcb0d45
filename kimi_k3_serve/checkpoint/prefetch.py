"""``prefetch``: one Ray task per node of the live cluster puts that node's part of the checkpoint in its download
folder, all nodes at once; and the disk check that runs on every node first.

Which node holds which stages: the cluster's worker nodes (those with the config's accelerator; on CPU every
node) sorted by node id, node ``i`` taking replica position ``i % nodes_per_replica``
(``planning.checkpoint.replica_node_stages``); every other node (a CPU head of a GPU cluster) takes the configs and
tokenizer only, so the app can be built there. The replica check then puts each stage on a node that holds its
files (``kimi_k3_serve.checks.replica``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from kimi_k3_serve.checkpoint.local_copy import MANIFEST, disk_report, fetch_node, node_folder
from kimi_k3_serve.planning.checkpoint import (INDEX_NAME, CheckpointFile, CheckpointListing, CheckpointPlan, NodeNeed,
                                               disk_verdict, file_stages, node_index)
from kimi_k3_serve.units import GB, fmt_size


@dataclass(frozen=True)
class LiveNode:
    node_id: str
    ip: str
    worker: bool
    """Runs ranks of a replica (has the accelerator); False: configs only."""
    gpus: int


@dataclass(frozen=True)
class NodeAssignment:
    node: LiveNode
    need: NodeNeed | None
    """None: a node that runs no rank (configs and tokenizer only)."""

    def files(self, plan: CheckpointPlan) -> tuple[tuple[CheckpointFile, ...], tuple[CheckpointFile, ...]]:
        """(target files, draft files) this node fetches; the source's index is replaced by the node's own."""
        if self.need is not None:
            target, draft = self.need.files, self.need.draft_files
        else:
            target = tuple(f for f in plan.target.files if not f.is_weights and not f.is_other_weights)
            draft = tuple(f for f in (plan.draft.files if plan.draft else ()) if not f.is_weights and not f.is_other_weights)
        return (tuple(f for f in target if f.name != INDEX_NAME), tuple(f for f in draft if f.name != INDEX_NAME))

    def label(self) -> str:
        what = self.need.describe_stages() if self.need is not None else "configs only"
        return f"node {self.node.node_id[:12]} ({self.node.ip}, {what})"


def assign_nodes(nodes: Sequence[LiveNode], plan: CheckpointPlan) -> list[NodeAssignment]:
    workers = sorted((n for n in nodes if n.worker), key=lambda n: n.node_id)
    others = sorted((n for n in nodes if not n.worker), key=lambda n: n.node_id)
    out = [NodeAssignment(n, plan.nodes[i % len(plan.nodes)]) for i, n in enumerate(workers)]
    return out + [NodeAssignment(n, None) for n in others]


def live_nodes(*, accelerator: str | None) -> list[LiveNode]:
    """Alive nodes of the connected Ray cluster; workers: nodes with a GPU (and ``accelerator_type:<T>`` when the
    config names one), or every node when ``accelerator`` is None (CPU)."""
    import ray

    found = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        gpus = int(resources.get("GPU", 0))
        if accelerator is None:
            worker = True
        else:
            worker = gpus > 0 and (accelerator == "" or f"accelerator_type:{accelerator}" in resources)
        found.append(LiveNode(node["NodeID"], node.get("NodeManagerAddress", "?"), worker, gpus))
    return found


def _entries(files: Sequence[CheckpointFile]) -> list[dict[str, Any]]:
    return [{"name": f.name, "size": f.size_bytes, "sha256": f.sha256, "tensors": list(f.tensors)} for f in files]


def node_spec(assignment: NodeAssignment, plan: CheckpointPlan, *, download_dir: str,
              endpoint: str | None = None) -> dict[str, Any]:
    """What ``local_copy.fetch_node`` needs for one node: its files, its own index and manifest per part."""
    target, draft = assignment.files(plan)
    stages = list(assignment.need.stages) if assignment.need else []
    stage_files = {str(s): {f.name: f.size_bytes for f in plan.target.files if f.is_weights
                            and s in file_stages(f, plan.stage_ranges, has_index=plan.target.has_index)}
                   for s in range(len(plan.stage_ranges))}
    parts = [{"subdir": "model", "source": plan.target.source, "files": _entries(target),
              "index": node_index(target) if plan.target.has_index else None,
              "manifest": {"source": plan.target.source, "stages": stages, "stage_files": stage_files,
                           "stage_ranges": [list(r) for r in plan.stage_ranges],
                           "files": {f.name: f.size_bytes for f in target}}}]
    if plan.draft is not None:
        parts.append({"subdir": "draft", "source": plan.draft.source, "files": _entries(draft),
                      "index": node_index(draft) if plan.draft.has_index else None,
                      "manifest": {"source": plan.draft.source, "files": {f.name: f.size_bytes for f in draft},
                                   "weights": any(f.is_weights for f in draft)}})
    return {"folder": download_dir, "parts": parts, "endpoint": endpoint}


def spec_sizes(spec: Mapping[str, Any]) -> dict[str, int]:
    return {f"{p['subdir']}/{e['name']}": int(e["size"]) for p in spec["parts"] for e in p["files"]}


# ---------------------------------------------------------------------------------------------------------------
# Ray: the disk check, then the downloads, with a progress board
# ---------------------------------------------------------------------------------------------------------------


def _on_node(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def check_disks(assignments: Sequence[NodeAssignment], specs: Sequence[Mapping[str, Any]], *,
                timeout_s: float = 60.0) -> list[tuple[NodeAssignment, Any]]:
    """One Ray task per node: its download folder's free disk against what it still lacks (``DiskVerdict`` each)."""
    import ray

    task = ray.remote(num_cpus=0, max_retries=0)(_disk_on_node)
    refs = [task.options(scheduling_strategy=_on_node(a.node.node_id), name="kimi_k3_serve.disk_check").remote(
        spec["folder"], spec_sizes(spec)) for a, spec in zip(assignments, specs)]
    reports = ray.get(refs, timeout=timeout_s)
    return [(a, disk_verdict(a.node.node_id, r["folder"], need_bytes=sum(spec_sizes(s).values()),
                             present_bytes=r["present_bytes"], free_bytes=r["free_bytes"]))
            for a, s, r in zip(assignments, specs, reports)]


def _disk_on_node(download_dir: str | None, sizes: Mapping[str, int]) -> dict[str, Any]:
    return disk_report(node_folder(download_dir), files=sizes)


def _board_class():
    import ray

    @ray.remote(num_cpus=0)
    class ProgressBoard:
        """Where the nodes' tasks post (done, total, state); the driver reads it once a second."""

        def __init__(self) -> None:
            self.state: dict[str, tuple[int, int, str, float]] = {}

        def report(self, node: str, done: int, total: int, state: str) -> None:
            self.state[node] = (done, total, state, time.time())

        def read(self) -> dict[str, tuple[int, int, str, float]]:
            return dict(self.state)

    return ProgressBoard


def _fetch_on_node(spec: Mapping[str, Any], node: str, board: Any, interval_s: float) -> dict[str, Any]:
    def report(done: int, total: int, state: str) -> None:
        board.report.remote(node, done, total, state)

    return fetch_node(spec, report, interval_s=interval_s)


class ProgressPrinter:
    """A line per node: bytes done of its total, throughput since the start, time left at that rate."""

    def __init__(self, labels: Mapping[str, str], totals: Mapping[str, int], out: Callable[[str], None]) -> None:
        self.labels, self.totals, self.out = labels, totals, out
        self.started = time.monotonic()
        self.first: dict[str, int] = {}

    def line(self, node: str, done: int, total: int, state: str) -> str:
        base = self.first.setdefault(node, done)
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = (done - base) / elapsed
        left = f"{(total - done) / rate:,.0f} s left" if rate > 0 and done < total else ("done" if done >= total else "waiting")
        return (f"prefetch: {self.labels[node]}: {fmt_size(done)} of {fmt_size(total)} ({state}), "
                f"{rate / GB:,.3f} GB/s, {left}")

    def final(self, node: str, result: Mapping[str, Any]) -> str:
        if not result.get("ok"):
            return f"prefetch: {self.labels[node]}: not done ({result.get('error') or 'refused: disk too small'})"
        fetched, seconds = result["fetched_bytes"], max(result["seconds"], 1e-6)
        return (f"prefetch: {self.labels[node]}: {fmt_size(result['total_bytes'])} in place, {fmt_size(fetched)} "
                f"fetched in {seconds:,.1f} s ({fetched / seconds / GB:,.3f} GB/s), done")

    def show(self, state: Mapping[str, tuple[int, int, str, float]]) -> None:
        for node, (done, total, what, _) in sorted(state.items()):
            self.out(self.line(node, done, total, what))


def run_prefetch(assignments: Sequence[NodeAssignment], specs: Sequence[Mapping[str, Any]], *,
                 interval_s: float = 1.0, timeout_s: float | None = None,
                 out: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One task per node, in parallel, pinned to it (``NodeAffinitySchedulingStrategy``, not soft); progress lines
    every ``interval_s``. Returns each node's result (``local_copy.fetch_node``)."""
    import ray

    board = _board_class().remote()
    task = ray.remote(num_cpus=0, max_retries=0)(_fetch_on_node)
    labels = {a.node.node_id: a.label() for a in assignments}
    printer = ProgressPrinter(labels, {a.node.node_id: sum(spec_sizes(s).values()) for a, s in zip(assignments, specs)}, out)
    refs = [task.options(scheduling_strategy=_on_node(a.node.node_id), name="kimi_k3_serve.prefetch").remote(
        spec, a.node.node_id, board, interval_s) for a, spec in zip(assignments, specs)]
    pending = list(refs)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=interval_s)
        if pending:
            printer.show(ray.get(board.read.remote()))
        if deadline is not None and time.monotonic() > deadline:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise TimeoutError(f"prefetch did not finish in {timeout_s:.0f} s")
    results = ray.get(refs)
    ray.kill(board)
    for a, result in zip(assignments, results):
        out(printer.final(a.node.node_id, result))
    return results


def summary_lines(plan: CheckpointPlan, assignments: Sequence[NodeAssignment], specs: Sequence[Mapping[str, Any]]) -> list[str]:
    """Bytes per node and in all, against every node taking the whole checkpoint."""
    lines = []
    total = 0
    for a, spec in zip(assignments, specs):
        nbytes = sum(spec_sizes(spec).values())
        total += nbytes
        files = sum(len(p["files"]) for p in spec["parts"])
        lines.append(f"{a.label()}: {files} files, {fmt_size(nbytes)}")
    workers = sum(1 for a in assignments if a.need is not None)
    whole = plan.whole_bytes * workers
    saved = whole - total
    lines.append(f"in all: {fmt_size(total)} on {len(assignments)} node(s); every worker node reading the whole "
                 f"checkpoint: {fmt_size(whole)} ({fmt_size(plan.whole_bytes)} each on {workers}); saved "
                 f"{fmt_size(saved)} ({100 * saved / whole if whole else 0:.1f}%)")
    return lines


def print_line(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


__all__ = ["LiveNode", "NodeAssignment", "assign_nodes", "live_nodes", "node_spec", "check_disks", "run_prefetch",
           "summary_lines", "MANIFEST", "CheckpointListing"]
