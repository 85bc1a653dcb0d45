"""The planner: (model inventory, serving target, cluster inventory, pinned choices) -> a checked ``Plan``.

It searches the layouts vLLM 0.32 accepts for the model -- TP (dividing every count the model asserts on,
inside one NVLink domain), PP (at most one stage per layer), expert parallelism on/off for MoE models, data-
parallel attention with the experts over the TP x DP ranks for MoE models (``kimi_k3_serve.planning.wide_ep``: DP sizes,
per-engine KV pools, EPLB; PP = 1 unless pinned), and the PP layer partition (vLLM's default, or uneven ones that move layers off the last stage, which
also holds lm_head and the draft) -- places every rank on a GPU (``placement.assign_ranks``), decides the
kernel optimisations for that placement, and checks every GPU with the memory model. The best layout wins by
the objective; when none fits, ``NoLayoutFitsError`` carries the closest candidates and their shortfalls.

Objectives:
- ``fewest-nodes`` (default): fits, then the fewest nodes, then the most requests the KV cache holds at
  ``max_model_len`` (over all DP engines, each capped at ``max_num_seqs``), then the fewest GPUs. A replica is sized in whole nodes (that is what a cluster scales
  by); more throughput comes from more replicas, not from ever longer pipelines;
- ``max-concurrency``: fits, then the most requests the KV cache holds at ``max_model_len`` (counted
  up to ``max_num_seqs``, beyond which vLLM cannot use it), then the fewest GPUs;
- ``fewest-gpus``: fits, then the fewest GPUs, then the most concurrency (the smallest replica; Serve adds
  replicas for throughput).
Pure: no torch, vLLM or Ray import.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from kimi_k3_serve.planning.inventory import ClusterInventory, NodeInfo, rank_device
from kimi_k3_serve.errors import ConfigError, DoesNotFitError
from kimi_k3_serve.planning.hardware import find_gpu_by_device_name
from kimi_k3_serve.planning.layout import EngineSettings, Layout
from kimi_k3_serve.planning.memory import estimate_memory, resolved_batch, stage_layer_ranges
from kimi_k3_serve.models.inventory import ModelInventory
from kimi_k3_serve.planning.optimisations import Optimisations, decide_optimisations
from kimi_k3_serve.planning.placement import RankPlacement, assign_ranks, placement_group_config, tp_groups
from kimi_k3_serve.units import fmt_gib
from kimi_k3_serve.planning.vllm_args import vllm_engine_args
from kimi_k3_serve.planning.wide_ep import dp_sizes, rationale, search_dp, total_concurrency

OBJECTIVES = ("fewest-nodes", "max-concurrency", "fewest-gpus")
TP_CHOICES = (1, 2, 4, 8, 16, 32, 64)
MAX_LAST_STAGE_SHIFT = 3
"""Uneven partitions tried: up to this many layers moved off the last stage."""


@dataclass(frozen=True)
class Pins:
    """Choices the user fixed; None leaves one to the search."""

    tp: int | None = None
    pp: int | None = None
    ep: bool | None = None
    dp: int | None = None
    layer_partition: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Candidate:
    """One layout the search checked, with its placement and memory verdict (or why it could not be placed)."""

    layout: Layout
    placements: tuple[RankPlacement, ...] | None
    report: Any | None
    """``memory.MemoryReport``; None when the layout could not be placed."""
    optimisations: Optimisations | None
    reason: str | None = None

    @property
    def fits(self) -> bool:
        return self.report is not None and bool(self.report.fits)

    @property
    def shortfall_bytes(self) -> int | None:
        return None if self.report is None else int(self.report.shortfall_bytes)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layout": layout_json(self.layout), "gpus": self.layout.world_size, "fits": self.fits}
        if self.report is not None:
            out["max_concurrency"] = self.report.max_concurrency
            out["total_concurrency"] = total_concurrency(self.report, self.report.max_num_seqs or 1024)
            out["shortfall_bytes"] = self.shortfall_bytes
            out["binding_rank"] = self.report.binding_rank
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True)
class Plan:
    """Everything a deployment needs for one engine replica, and the proof that it fits."""

    model: ModelInventory
    engine: EngineSettings
    layout: Layout
    placements: tuple[RankPlacement, ...]
    report: Any
    optimisations: Optimisations
    gpu_name: str
    engine_kwargs: dict[str, Any]
    env_vars: dict[str, str]
    placement_group_config: dict[str, Any]
    cluster_source: str
    objective: str
    considered: tuple[Candidate, ...] = field(default=(), repr=False)
    search_seconds: float = 0.0
    rationale: str = ""
    """Why this layout: the objective's criterion against the best layout of the other family (TP x PP / DP x EP)."""

    @property
    def fits(self) -> bool:
        return bool(self.report.fits)

    @property
    def last_stage_nodes(self) -> list[str]:
        last = self.layout.pp - 1
        return sorted({p.node_id for p in self.placements if p.pp_stage == last})

    def to_json(self) -> dict[str, Any]:
        report = self.report.to_json()
        by_rank = {p.rank: p for p in self.placements}
        ranks = []
        for rank in report.get("ranks", []):
            placed = by_rank.get(rank.get("rank"))
            ranks.append({**rank, "node": placed.node_id if placed else None,
                          "gpu_index": placed.gpu_index if placed else None,
                          "nvlink_domain": placed.nvlink_domain if placed else None})
        return {
            "fits": self.fits,
            "model": self.model.name,
            "gpu": self.gpu_name,
            "cluster": self.cluster_source,
            "objective": self.objective,
            "layout": layout_json(self.layout),
            "max_concurrency": self.report.max_concurrency,
            "total_concurrency": total_concurrency(self.report, self.report.max_num_seqs or 1024),
            "rationale": self.rationale,
            "kv_cache_tokens": self.report.kv_cache_tokens,
            "num_blocks": self.report.num_blocks,
            "optimisations": {item["name"]: item for item in self.optimisations.to_json()},
            "ranks": ranks,
            "engine_kwargs": self.engine_kwargs,
            "env_vars": self.env_vars,
            "placement_group_config": self.placement_group_config,
            "last_stage_nodes": self.last_stage_nodes,
            "memory": report,
            "considered": [c.summary() for c in _closest(self.considered, 5)],
            "search_seconds": round(self.search_seconds, 4),
        }


class NoLayoutFitsError(DoesNotFitError):
    """No layout fits; ``candidates`` are the closest ones (smallest shortfall first), each with its memory report."""

    def __init__(self, message: str, candidates: list[Candidate]) -> None:
        super().__init__(message)
        self.candidates = candidates

    def to_json(self) -> dict[str, Any]:
        return {"fits": False, "reason": str(self), "candidates": [c.summary() for c in self.candidates]}


def layout_json(layout: Layout) -> dict[str, Any]:
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "ep": layout.ep,
        "dp": layout.dp,
        "layer_partition": list(layout.layer_partition) if layout.layer_partition else None,
        "describe": layout.describe(),
    }


def default_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    """vLLM 0.32's ``get_pp_indices`` split, as the memory model reads it."""
    return tuple(end - start for start, end in stage_layer_ranges(num_layers, Layout(pp=pp)))


def _lighter_last_stage(num_layers: int, pp: int, shift: int) -> tuple[int, ...] | None:
    """vLLM's split with ``shift`` more layers moved from the last stage to the others, front stages first."""
    parts = list(default_partition(num_layers, pp))
    if parts[-1] - shift < 1:
        return None
    parts[-1] -= shift
    order = sorted(range(pp - 1), key=lambda i: (parts[i], i))
    for k in range(shift):
        parts[order[k % (pp - 1)]] += 1
    return tuple(parts)


# ---------------------------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------------------------


VOCAB_PADDING = 64
"""vLLM's VocabParallelEmbedding / ParallelLMHead pad the vocabulary to a multiple of this (DEFAULT_VOCAB_PADDING_SIZE),
then ``divide`` it among the TP ranks, which asserts that TP divides the padded size."""


def tp_refusal(model: ModelInventory, tp: int) -> str | None:
    """Why vLLM refuses tensor parallel size ``tp`` for the model, or None: a count it divides by TP and asserts
    on (Kimi-K3: the 96 heads, and the vocabulary padded to a multiple of 64: 163,840, which 3 does not divide),
    or, for GQA models, KV heads that TP neither divides nor is a multiple of (replicated KV heads)."""
    padded_vocab = -(-model.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    counts = [*model.tp_divisors, (f"vocab_size (padded to a multiple of {VOCAB_PADDING})", padded_vocab)]
    for name, count in counts:
        if count % tp:
            return f"{tp} does not divide {name} = {count:,} (vLLM asserts it)"
    kv = model.num_kv_heads
    if not model.uses_mla and kv and (kv % tp if tp <= kv else tp % kv):
        return f"{tp} neither divides num_key_value_heads = {kv} nor is a multiple of it"
    return None


def legal_tp_sizes(model: ModelInventory) -> list[int]:
    """The TP sizes the planner searches (``TP_CHOICES``) that vLLM accepts for the model (``tp_refusal``)."""
    return [tp for tp in TP_CHOICES if tp_refusal(model, tp) is None]


def validate_length(model: ModelInventory, max_model_len: int, *, field: str = "engine.max_model_len") -> None:
    """A length beyond the model's positions is bad input, as vLLM refuses it (without
    VLLM_ALLOW_LONG_MAX_MODEL_LEN), not a memory shortfall."""
    limit = model.max_model_len_limit
    if limit and max_model_len > limit:
        raise ConfigError(field, max_model_len, f"expected at most {limit:,} tokens: the positions {model.name} has "
                                                f"(config.json max_position_embeddings, with its RoPE scaling)")


def validate_pins(model: ModelInventory, pins: Pins) -> None:
    """Refuse pins vLLM would refuse for this model, naming the pin and what is allowed."""
    legal = legal_tp_sizes(model)
    if pins.tp is not None and pins.tp not in legal:
        reason = tp_refusal(model, pins.tp) or f"the planner searches powers of two up to {TP_CHOICES[-1]}"
        raise ConfigError("tp", pins.tp, f"expected one of {legal}: {reason}")
    if pins.pp is not None and not (isinstance(pins.pp, int) and 1 <= pins.pp <= model.num_layers):
        raise ConfigError("pp", pins.pp, f"an integer from 1 to the model's {model.num_layers} layers")
    if pins.ep and not model.is_moe:
        raise ConfigError("ep", pins.ep, f"{model.name} has no experts: expert parallelism needs a MoE model")
    if pins.dp is not None and not (isinstance(pins.dp, int) and pins.dp >= 1):
        raise ConfigError("dp", pins.dp, "an integer >= 1")
    if pins.layer_partition is not None:
        parts = pins.layer_partition
        if pins.pp is not None and len(parts) != pins.pp:
            raise ConfigError("layer_partition", list(parts), f"{pins.pp} entries (one per PP stage)")
        if sum(parts) != model.num_layers or any(n < 1 for n in parts):
            raise ConfigError("layer_partition", list(parts), f"positive layer counts summing to {model.num_layers}")


def _check_cluster(cluster: ClusterInventory) -> list[NodeInfo]:
    nodes = list(cluster.gpu_nodes)
    if not nodes:
        raise ConfigError("cluster", cluster.source, "a cluster with at least one GPU node")
    for node in nodes:
        for gpu in node.gpus:
            if gpu.total_bytes is None or gpu.compute_capability is None:
                raise ConfigError(
                    "cluster",
                    f"{node.node_id} GPU {gpu.index}",
                    "GPUs of known memory: a Ray GPU resource without NVML (a test cluster) cannot be sized; "
                    "describe the GPUs in a cluster file instead",
                )
    return nodes


def _usable_concurrency(candidate: Candidate) -> float:
    """Requests the KV cache holds at max_model_len, counted up to the engine's resolved max_num_seqs."""
    report = candidate.report
    return total_concurrency(report, report.max_num_seqs) if report is not None else 0.0


def _score(candidate: Candidate, objective: str) -> tuple:
    concurrency = _usable_concurrency(candidate)
    gpus = candidate.layout.world_size
    default_split = candidate.layout.layer_partition is None
    if objective == "fewest-gpus":
        return (candidate.fits, -gpus, concurrency, default_split, -candidate.layout.pp)
    if objective == "fewest-nodes":
        nodes = len({p.node_id for p in candidate.placements}) if candidate.placements else 0
        return (candidate.fits, -nodes, concurrency, -gpus, default_split, -candidate.layout.pp)
    return (candidate.fits, concurrency, -gpus, default_split, -candidate.layout.pp)


def _closest(candidates: tuple[Candidate, ...] | list[Candidate], n: int) -> list[Candidate]:
    sized = [c for c in candidates if c.report is not None]
    fitting = sorted((c for c in sized if c.fits), key=lambda c: -float(c.report.max_concurrency))
    short = sorted((c for c in sized if not c.fits), key=lambda c: (c.shortfall_bytes, c.layout.world_size))
    unplaced = [c for c in candidates if c.report is None]
    return (fitting + short + unplaced)[:n]


class _ClusterView:
    """Per-plan caches over the cluster: the node table and the TP groups of each size."""

    def __init__(self, cluster: ClusterInventory) -> None:
        self.cluster = cluster
        self.nodes = {node.node_id: node for node in cluster.gpu_nodes}
        self._groups: dict[int, list] = {}

    def groups(self, tp: int) -> list:
        if tp not in self._groups:
            self._groups[tp] = tp_groups(self.cluster, tp)
        return self._groups[tp]


def evaluate(
    model: ModelInventory, engine: EngineSettings, cluster: ClusterInventory | _ClusterView, layout: Layout
) -> Candidate:
    """Place one layout on the cluster and check its memory on every rank's GPU."""
    view = cluster if isinstance(cluster, _ClusterView) else _ClusterView(cluster)
    placements, reason = assign_ranks(layout, view.cluster, view.groups(layout.tp))
    if placements is None:
        return Candidate(layout, None, None, None, reason)
    nodes = view.nodes
    devices = []
    for p in placements:
        node = nodes[p.node_id]
        devices.append(rank_device(node, next(g for g in node.gpus if g.index == p.gpu_index)))
    domains_of: dict[tuple[int, int], set[str]] = {}
    for p in placements:
        domains_of.setdefault((p.dp_rank, p.pp_stage), set()).add(p.nvlink_domain)
    one_domain = all(len(domains) == 1 for domains in domains_of.values())
    try:
        report, optimisations = memory_on_devices(model, engine, layout, devices, one_domain=one_domain)
    except ConfigError as exc:  # a layout vLLM would refuse (e.g. the draft's TP): not a candidate
        return Candidate(layout, tuple(placements), None, None, f"vLLM would refuse it: {exc}")
    return Candidate(layout, tuple(placements), report, optimisations)


def memory_on_devices(
    model: ModelInventory, engine: EngineSettings, layout: Layout, devices: list, *, one_domain: bool
):
    """(MemoryReport, Optimisations) of ``layout`` on ``devices`` (one ``RankDevice`` per rank, in vLLM's rank
    order): the kernel optimisations decided for the weakest GPU and the engine's batch defaults, then the
    memory model. Used by the planner for each candidate and by the replica-start check on the reserved GPUs."""
    capability = min(d.compute_capability for d in devices)
    tokens, seqs = resolved_batch(engine, min(devices, key=lambda d: d.total_bytes))
    optimisations = decide_optimisations(model, layout, engine, capability, one_domain,
                                         max_num_batched_tokens=tokens, max_num_seqs=seqs,
                                         mega_moe=engine.moe_backend == "deep_gemm_mega_moe")
    return estimate_memory(model, layout, engine, devices, optimisations=optimisations), optimisations


def plan(
    model: ModelInventory,
    engine: EngineSettings,
    cluster: ClusterInventory,
    pins: Pins = Pins(),
    *,
    objective: str = "fewest-nodes",
) -> Plan:
    """The best layout of ``model`` for ``engine`` on ``cluster``; ``NoLayoutFitsError`` when none fits."""
    started = time.perf_counter()
    if objective not in OBJECTIVES:
        raise ConfigError("objective", objective, f"one of {', '.join(OBJECTIVES)}")
    validate_pins(model, pins)
    validate_length(model, engine.max_model_len)
    nodes = _check_cluster(cluster)
    total_gpus = sum(node.free_gpu_count for node in nodes)
    domain_sizes: dict[str, int] = {}
    for node in nodes:
        for gpu in node.gpus[: node.free_gpu_count]:
            domain_sizes[gpu.nvlink_domain] = domain_sizes.get(gpu.nvlink_domain, 0) + 1
    largest_domain = max(domain_sizes.values())

    tps = [pins.tp] if pins.tp else [tp for tp in legal_tp_sizes(model) if tp <= largest_domain] or [1]
    eps = [pins.ep] if pins.ep is not None else ([False, True] if model.is_moe else [False])
    candidates: list[Candidate] = []
    view = _ClusterView(cluster)
    for tp in tps:
        for ep in eps:
            # TP x PP (one engine), unless DP is pinned above 1.
            if (pins.dp or 1) == 1:
                if pins.pp is not None or pins.layer_partition is not None:
                    pp = pins.pp or len(pins.layer_partition)
                    _best_partition(model, engine, view, tp, pp, ep, 1, pins, objective, candidates)
                else:
                    max_pp = min(model.num_layers, total_gpus // tp)
                    _search_pp(model, engine, view, tp, ep, 1, pins, max_pp, objective, candidates)
            # DP x TP x EP: data-parallel attention, the experts over the TP x DP ranks (kimi_k3_serve.planning.wide_ep).
            # Unpinned, only with EP: without it FusedMoE TP-shards every expert over all TP x DP ranks.
            if not ep and pins.dp is None:
                continue
            pp = pins.pp or (len(pins.layer_partition) if pins.layer_partition is not None else 1)
            sizes = dp_sizes(model, tp, total_gpus // pp, pins.dp)

            def at_dp(dp: int, tp: int = tp, ep: bool = ep, pp: int = pp) -> Candidate | None:
                return _best_partition(model, engine, view, tp, pp, ep, dp, pins, objective, candidates)

            search_dp(sizes, at_dp, lambda c: _reaches_goal(c, objective))
    if not candidates and pins.tp and pins.tp > largest_domain:
        raise ConfigError("tp", pins.tp, f"at most {largest_domain}, the largest NVLink domain of the cluster: tensor "
                                         "parallelism stays inside one (pipeline stages span nodes)")
    if not candidates:
        raise ConfigError("cluster", cluster.source, f"room for at least one rank of {model.name}")
    best = max(candidates, key=lambda c: _score(c, objective))
    elapsed = time.perf_counter() - started
    if not best.fits:
        closest = _closest(candidates, 5)
        head = closest[0]
        if head.report is not None:
            detail = (f"closest: {head.layout.describe()} on {head.layout.world_size} GPUs is "
                      f"{fmt_gib(head.shortfall_bytes)} short on rank {head.report.binding_rank}")
        else:
            detail = f"no layout could be placed: {head.reason}"
        raise NoLayoutFitsError(
            f"no layout of {model.name} fits {cluster.source} ({total_gpus} GPUs) at max_model_len "
            f"{engine.max_model_len}; {detail}", closest)
    return _make_plan(model, engine, cluster, best, objective, tuple(candidates), elapsed)


def _reaches_goal(candidate: Candidate, objective: str) -> bool:
    """Whether more stages could still improve this (TP, EP) for the objective."""
    if not candidate.fits:
        return False
    return (objective in ("fewest-gpus", "fewest-nodes")
            or _usable_concurrency(candidate) >= candidate.report.max_num_seqs * candidate.layout.dp)


def _search_pp(model, engine, view, tp, ep, dp, pins, max_pp, objective, sink) -> None:
    """Evaluate the PP sizes worth a look for one (TP, EP), each with its best layer partition.

    Placement only gets harder with more stages, and more stages (each with its best split) lower the weights
    per GPU, so "fits" and "concurrency reaches max_num_seqs" each switch on once as PP grows. Small ranges
    are scanned; large ones (big clusters) are searched by doubling then bisection, which keeps a 1,024-node
    plan to a few dozen memory checks.
    """
    if max_pp < 1:
        return
    best: dict[int, Candidate | None] = {}

    def state(pp: int) -> str:
        if pp not in best:
            best[pp] = _best_partition(model, engine, view, tp, pp, ep, dp, pins, objective, sink)
        c = best[pp]
        return "unplaced" if c is None else ("goal" if _reaches_goal(c, objective) else "short")

    if max_pp <= 12:
        for pp in range(1, max_pp + 1):
            if state(pp) != "short":
                return
        return
    lo, hi, pp = 0, None, 1  # state(lo) == "short" (or lo == 0); state(hi) != "short"
    while pp <= max_pp:
        if state(pp) != "short":
            hi = pp
            break
        lo, pp = pp, pp * 2
    if hi is None:
        state(max_pp)
        return
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if state(mid) == "short":
            lo = mid
        else:
            hi = mid


def _best_partition(model, engine, view, tp, pp, ep, dp, pins, objective, sink) -> Candidate | None:
    """Evaluate vLLM's split and the lighter-last-stage splits of one (TP, PP, EP); None if unplaceable."""
    if pins.layer_partition is not None:
        # vLLM's own split pinned is no split set: the layout says so, and no VLLM_PP_LAYER_PARTITION is needed
        pinned = None if pins.layer_partition == default_partition(model.num_layers, pp) else pins.layer_partition
        partitions: list[tuple[int, ...] | None] = [pinned]
    elif pp == 1:
        partitions = [None]
    else:
        partitions = [None] + [p for s in range(1, MAX_LAST_STAGE_SHIFT + 1)
                               if (p := _lighter_last_stage(model.num_layers, pp, s)) is not None]
    best = None
    for partition in partitions:
        candidate = evaluate(model, engine, view, Layout(tp=tp, pp=pp, ep=ep, dp=dp, layer_partition=partition))
        sink.append(candidate)
        if candidate.report is None:
            return None
        if best is None or _score(candidate, objective) > _score(best, objective):
            best = candidate
        if partition is None and candidate.fits and candidate.report.binding_rank is not None \
                and candidate.layout.stage_of_rank(candidate.report.binding_rank) != pp - 1:
            break  # the last stage does not bind: lightening it cannot help
    return best


def _make_plan(model, engine, cluster, best: Candidate, objective, considered, elapsed) -> Plan:
    layout = best.layout
    first_gpu = next(g for n in cluster.gpu_nodes for g in n.gpus if n.node_id == best.placements[0].node_id)
    spec = find_gpu_by_device_name(first_gpu.name)
    gpus_per_node = max(node.gpu_count for node in cluster.gpu_nodes)
    vllm = vllm_engine_args(layout, engine, best.optimisations, architecture=model.architecture)
    return Plan(
        model=model,
        engine=engine,
        layout=layout,
        placements=best.placements,
        report=best.report,
        optimisations=best.optimisations,
        gpu_name=spec.name if spec else first_gpu.name,
        engine_kwargs=vllm.engine_kwargs,
        env_vars=vllm.env_vars,
        # Per Serve replica: with DP, Ray Serve LLM's DP builder runs one replica per DP rank (TP x PP bundles each)
        # and gang-schedules the DP ranks (kimi_k3_serve.serving.dp_serve).
        placement_group_config=placement_group_config(replace(layout, dp=1), spec, gpus_per_node),
        cluster_source=cluster.source,
        objective=objective,
        considered=considered,
        search_seconds=elapsed,
        rationale=rationale(best, considered, objective, best.report.max_num_seqs),
    )
