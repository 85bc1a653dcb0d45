"""The capacity verdict as people and machines read it: a per-GPU table, JSON, and a stacked-bar picture.

A ``CheckReport`` is built from what the planner produced for one layout (a ``Plan``, or the closest
``Candidate`` when nothing fits): where every rank runs (node, GPU, PP stage, TP rank), the memory model's
per-rank figures, the engine's KV capacity, the kernel optimisations with their reasons, and how long the
verdict took. Every printed size carries its unit. Pure Python; matplotlib is imported only by ``plot``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from kimi_k3_serve.planning.memory import raise_utilization_advice
from kimi_k3_serve.units import GiB, fmt_gib

# (key in the per-rank JSON, column title). Sizes in GiB.
SIZE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("total_bytes", "total"),
    ("free_bytes", "free"),
    ("weights_bytes", "weights"),
    ("kv_cache_bytes", "KV pool"),
    ("state_bytes", "state/req"),
    ("draft_bytes", "draft"),
    ("workspace_bytes", "workspaces"),
    ("activation_bytes", "activation"),
    ("cuda_graph_bytes", "CUDA graph"),
    ("headroom_bytes", "headroom"),
)

# The parts of one GPU's budget, bottom to top, as the picture stacks them.
BAR_PARTS: tuple[tuple[str, str, str], ...] = (
    ("weights_bytes", "weights", "#4C72B0"),
    ("draft_bytes", "draft", "#8172B2"),
    ("activation_bytes", "activation", "#DD8452"),
    ("cuda_graph_bytes", "CUDA graph", "#CCB974"),
    ("non_torch_bytes", "non-torch", "#937860"),
    ("workspace_bytes", "workspaces", "#64B5CD"),
    ("kv_cache_bytes", "KV pool", "#55A868"),
)


@dataclass(frozen=True)
class RankRow:
    """One GPU of the layout: where it runs and what the memory model charges there."""

    rank: int
    node: str
    gpu_index: int | None
    pp_stage: int
    tp_rank: int
    sizes: dict[str, int]
    shortfall_bytes: int

    @property
    def fits(self) -> bool:
        return self.shortfall_bytes == 0


@dataclass(frozen=True)
class CheckReport:
    fits: bool
    verdict: str
    """One line: fits / does not fit, with the binding rank and the shortfall."""
    model: str
    cluster: str
    gpu: str
    layout: str
    world_size: int
    max_model_len: int
    gpu_memory_utilization: float
    rows: tuple[RankRow, ...]
    max_concurrency: float
    kv_cache_tokens: int
    num_blocks: int
    optimisations: tuple[dict[str, Any], ...]
    seconds: float
    notes: tuple[str, ...] = ()
    engine_verdict: str = "fits"
    """What vLLM 0.32 would do (``memory.VERDICTS``): fits, cannot_start, oom_at_load, no_kv_space,
    seqs_over_state_blocks, oom_at_warmup, at_risk (fits only at the point estimates)."""
    safe_gpu_memory_utilization: float | None = None
    """The largest utilization that leaves room for what vLLM allocates after sizing the KV cache."""
    kv_cache_margin_ratio: float | None = None
    """The measured error band of the binding pool, as a share of it: the replica warns when vLLM's KV cache is
    further from the plan's than this (``checks/kv_prediction.py``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else the caller wants in the JSON (engine kwargs, env vars, closest candidates, resources)."""

    @property
    def shortfall_bytes(self) -> int:
        return max((row.shortfall_bytes for row in self.rows), default=0)

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "verdict": self.verdict,
            "engine_verdict": self.engine_verdict,
            "safe_gpu_memory_utilization": self.safe_gpu_memory_utilization,
            "kv_cache_margin_ratio": self.kv_cache_margin_ratio,
            "model": self.model,
            "cluster": self.cluster,
            "gpu": self.gpu,
            "layout": self.layout,
            "world_size": self.world_size,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "max_concurrency": self.max_concurrency,
            "kv_cache_tokens": self.kv_cache_tokens,
            "num_blocks": self.num_blocks,
            "shortfall_bytes": self.shortfall_bytes,
            "ranks": [
                {"rank": r.rank, "node": r.node, "gpu_index": r.gpu_index, "pp_stage": r.pp_stage, "tp_rank": r.tp_rank,
                 **r.sizes, "shortfall_bytes": r.shortfall_bytes, "fits": r.fits}
                for r in self.rows
            ],
            "optimisations": list(self.optimisations),
            "seconds": round(self.seconds, 4),
            "notes": list(self.notes),
            **self.extra,
        }


def _band_ratio(memory: Any) -> float | None:
    """The KV band (``planning/bands.py``) over the smallest pool it applies to."""
    pool = min((r.kv_cache_bytes for r in memory.ranks), default=0)
    return memory.kv_band_bytes / pool if pool > 0 and memory.kv_band_bytes else None


def build_report(
    *,
    model_name: str,
    cluster_source: str,
    gpu_name: str,
    memory: Any,
    placements: Sequence[Any] | None,
    optimisations: Any,
    seconds: float,
    notes: Sequence[str] = (),
    extra: dict[str, Any] | None = None,
) -> CheckReport:
    """A report from the memory model's ``MemoryReport`` and the ranks' placements (``RankPlacement``; None
    when the layout was sized without a placement)."""
    by_rank = {p.rank: p for p in placements or ()}
    rows = []
    for r in memory.ranks:
        placed = by_rank.get(r.rank)
        sizes = {
            "total_bytes": r.total_bytes,
            "free_bytes": r.free_bytes,
            "budget_bytes": r.budget_bytes,
            "weights_bytes": r.weights_bytes,
            "kv_cache_bytes": r.kv_cache_bytes,
            "state_bytes": r.state_bytes_per_seq,
            "draft_bytes": r.draft_bytes,
            "workspace_bytes": r.workspace_bytes,
            "activation_bytes": r.activation_bytes,
            "cuda_graph_bytes": r.cuda_graph_bytes,
            "non_torch_bytes": r.non_torch_bytes,
            "headroom_bytes": r.headroom_bytes,
        }
        sizes["after_kv_bytes"] = r.after_kv_bytes
        rows.append(RankRow(r.rank, placed.node_id if placed else "-", placed.gpu_index if placed else None,
                            r.pp_stage, r.tp_rank, sizes, int(r.shortfall_bytes + r.warmup_shortfall_bytes)))
    layout = memory.layout
    fits = bool(memory.fits)
    if fits:
        verdict = (f"fits: {layout.describe()} on {layout.world_size} x {gpu_name}, every GPU within its budget with every "
                   f"measured error band against it; {float(memory.banded_max_concurrency):.2f} requests of "
                   f"{memory.engine.max_model_len} tokens at once ({float(memory.max_concurrency):.2f} at the point "
                   "estimates)")
    elif memory.verdict == "at_risk":
        verdict = (f"at risk: {layout.describe()} on {layout.world_size} x {gpu_name} fits at the plan's point estimates "
                   f"({float(memory.max_concurrency):.2f} requests of {memory.engine.max_model_len} tokens), not with "
                   f"the measured error bands against it (up to {fmt_gib(memory.kv_band_bytes)} of KV pool per GPU); "
                   "lower max_model_len"
                   + raise_utilization_advice(memory.engine.gpu_memory_utilization, memory.safe_gpu_memory_utilization)
                   + ", or rehearse it")
    elif memory.verdict == "oom_at_warmup":
        worst_rank = max(memory.ranks, key=lambda x: x.warmup_shortfall_bytes)
        worst = next(row for row in rows if row.rank == worst_rank.rank)
        safe = memory.safe_gpu_memory_utilization
        verdict = (f"does not fit: vLLM would OOM during warmup on rank {worst.rank} (node {worst.node}, GPU "
                   f"{worst.gpu_index}) by {fmt_gib(worst_rank.warmup_shortfall_bytes)}: {fmt_gib(worst_rank.after_kv_bytes)} "
                   "that vLLM's KV sizing does not see (its shared workspace past the profile's: TRITON_MLA's decode "
                   "logits for a DSpark draft, FlashKDA's prefill buffers; what kernel warmup's MLA decode path holds "
                   "beyond the CUDA-graph estimate; KDA's gathered states at the largest CUDA-graph capture, with "
                   "the allocator's reserve; the capture's graph pool and DSpark's first eager forward) does not fit "
                   "outside the budget"
                   + (f"; set gpu_memory_utilization to {safe} or lower" if safe else "")
                   + (f"; no gpu_memory_utilization fits: {memory.no_safe_utilization}"
                      if memory.no_safe_utilization else ""))
    elif memory.verdict == "seqs_over_state_blocks":
        verdict = (f"does not fit: max_num_seqs {memory.max_num_seqs:,} exceeds the {memory.num_blocks:,} KV-cache blocks "
                   "and each decoding sequence holds one KDA state block, so vLLM would refuse to capture CUDA graphs; "
                   f"set max_num_seqs to at most {memory.num_blocks:,}"
                   + raise_utilization_advice(memory.engine.gpu_memory_utilization, memory.safe_gpu_memory_utilization))
    elif memory.shortfall_bytes > 0:
        worst = max(rows, key=lambda row: row.shortfall_bytes)
        short = [row for row in rows if not row.fits]
        verdict = (f"does not fit: {len(short)} of {len(rows)} GPUs short, worst rank {worst.rank} "
                   f"(node {worst.node}, GPU {worst.gpu_index}, stage {worst.pp_stage}) short {fmt_gib(worst.shortfall_bytes)}")
    else:
        verdict = (f"does not fit: the KV cache holds {memory.num_blocks} blocks, fewer than the "
                   f"{memory.blocks_per_request} one request of {memory.engine.max_model_len} tokens needs")
    return CheckReport(
        fits=fits,
        verdict=verdict,
        model=model_name,
        cluster=cluster_source,
        gpu=gpu_name,
        layout=layout.describe(),
        world_size=layout.world_size,
        max_model_len=memory.engine.max_model_len,
        gpu_memory_utilization=memory.engine.gpu_memory_utilization,
        rows=tuple(rows),
        max_concurrency=float(memory.max_concurrency),
        kv_cache_tokens=int(memory.kv_cache_tokens),
        num_blocks=int(memory.num_blocks),
        optimisations=tuple(optimisations.to_json()) if optimisations is not None else (),
        seconds=seconds,
        notes=tuple(notes) + tuple(memory.notes),
        engine_verdict=memory.verdict,
        safe_gpu_memory_utilization=memory.safe_gpu_memory_utilization,
        kv_cache_margin_ratio=_band_ratio(memory),
        extra=dict(extra or {}),
    )


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GiB:.2f}"


def format_table(report: CheckReport) -> str:
    """The per-GPU table (sizes in GiB), the verdict, the KV capacity, the optimisations and the time."""
    head = f"{'node':<20} {'gpu':>3} {'stage':>5} {'tp':>3} " + " ".join(f"{title:>10}" for _, title in SIZE_COLUMNS)
    lines = [
        f"{report.model} on {report.cluster}: {report.layout} = {report.world_size} x {report.gpu} "
        f"(gpu_memory_utilization {report.gpu_memory_utilization})",
        "sizes in GiB (2^30 bytes); 'state/req' is the recurrent state one request holds inside the KV pool",
        head,
        "-" * len(head),
    ]
    for row in report.rows:
        mark = "" if row.fits else f"  SHORT {fmt_gib(row.shortfall_bytes)}"
        lines.append(
            f"{row.node[:20]:<20} {('-' if row.gpu_index is None else row.gpu_index):>3} {row.pp_stage:>5} {row.tp_rank:>3} "
            + " ".join(f"{_gib(row.sizes.get(key)):>10}" for key, _ in SIZE_COLUMNS)
            + mark
        )
    lines.append("")
    lines.append(report.verdict)
    lines.append(f"max concurrency at max_model_len {report.max_model_len}: {report.max_concurrency:.2f} requests "
                 f"({report.kv_cache_tokens:,} KV tokens in {report.num_blocks:,} blocks)")
    if report.optimisations:
        lines.append("optimisations:")
        for item in report.optimisations:
            lines.append(f"  {item['name']:<24} {'on ' if item['on'] else 'off'}  {item['reason']}")
    for note in report.notes:
        lines.append(f"note: {note}")
    lines.append(f"time to verdict: {report.seconds:.3f} s")
    return "\n".join(lines)


def plot(report: CheckReport, path: str, *, title: str | None = None) -> str:
    """Per-GPU stacked bars of the budget (weights, draft, activation, CUDA graph, non-torch, workspaces,
    KV pool), the budget line (``gpu_memory_utilization x total``), the GPU's total and free memory, and any
    shortfall in red. Writes a PNG to ``path`` and returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = report.rows
    n = len(rows)
    width = min(max(7.0, 0.45 * n + 3.0), 28.0)
    fig, ax = plt.subplots(figsize=(width, 5.6), dpi=110)
    xs = list(range(n))
    bottoms = [0.0] * n
    for key, label, colour in BAR_PARTS:
        values = [max(0, row.sizes.get(key, 0)) / GiB for row in rows]
        ax.bar(xs, values, bottom=bottoms, color=colour, width=0.78, label=label, edgecolor="white", linewidth=0.3)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    shortfalls = [row.shortfall_bytes / GiB for row in rows]
    budgets = [row.sizes["budget_bytes"] / GiB for row in rows]
    if any(shortfalls):
        # What a GPU lacks, drawn from what it can give (its budget, or its free memory when another process
        # already holds part of the budget) up by the shortfall.
        starts = [min(b, row.sizes["free_bytes"] / GiB) for b, row in zip(budgets, rows)]
        ax.bar(xs, shortfalls, bottom=starts, color="#D62728", alpha=0.55, width=0.86, hatch="//",
               edgecolor="#7F0000", linewidth=0.8, label="shortfall (what the GPU lacks)")
    for i, row in enumerate(rows):
        budget = budgets[i]
        total = row.sizes["total_bytes"] / GiB
        free = row.sizes["free_bytes"] / GiB
        ax.hlines(budget, i - 0.45, i + 0.45, colors="black", linewidth=1.8)
        ax.hlines(total, i - 0.45, i + 0.45, colors="grey", linewidth=1.0, linestyles="dotted")
        if free < total - 1e-6:
            ax.hlines(free, i - 0.45, i + 0.45, colors="#D62728" if free < budget else "#555555", linewidth=1.4,
                      linestyles="dashed")
    stage_edges = [i for i in range(1, n) if rows[i].pp_stage != rows[i - 1].pp_stage]
    for edge in stage_edges:
        ax.axvline(edge - 0.5, color="#444444", linewidth=0.8)
    tick = [f"GPU {row.gpu_index}" if row.gpu_index is not None else f"rank {row.rank}" for row in rows]
    step = max(1, n // 32)
    ax.set_xticks(xs[::step])
    ax.set_xticklabels([f"r{row.rank} s{row.pp_stage}\n{t}" for row, t in zip(rows[::step], tick[::step])],
                       fontsize=7 if n > 16 else 8)
    # Node names once per run of bars on the same node (long names would overlap as per-bar ticks).
    start = 0
    for i in range(1, n + 1):
        if i == n or rows[i].node != rows[start].node:
            ax.annotate(str(rows[start].node), xy=((start + i - 1) / 2, 0), xycoords=("data", "axes fraction"),
                        xytext=(0, -30), textcoords="offset points", ha="center", va="top", fontsize=8)
            start = i
    ax.set_ylabel("GiB (2^30 bytes)")
    ax.set_xlim(-0.6, n - 0.4)
    top = max(max(row.sizes["total_bytes"] for row in rows) / GiB, max(bottoms),
              max(b + s for b, s in zip(budgets, shortfalls)))
    ax.set_ylim(0, top * 1.08)
    status = "FITS" if report.fits else "DOES NOT FIT"
    fig.suptitle(title or f"{report.model}: {report.layout} on {report.world_size} x {report.gpu} -- {status}",
                 fontsize=12, color="black" if report.fits else "#B00000", x=0.01, ha="left")
    subtitle = (f"{report.cluster}   max concurrency at {report.max_model_len} tokens: {report.max_concurrency:.2f}   "
                f"tightest headroom: {min(row.sizes['headroom_bytes'] for row in rows) / GiB:.2f} GiB")
    if not report.fits:
        subtitle = f"worst shortfall: {report.shortfall_bytes / GiB:,.2f} GiB   " + subtitle
    ax.set_title(subtitle, fontsize=8.5, loc="left")
    handles, _ = ax.get_legend_handles_labels()
    handles += [
        Line2D([], [], color="black", linewidth=1.8, label=f"budget ({report.gpu_memory_utilization:g} x total)"),
        Line2D([], [], color="grey", linewidth=1.0, linestyle="dotted", label="GPU total"),
    ]
    if any(row.sizes["free_bytes"] < row.sizes["total_bytes"] for row in rows):
        handles.append(Line2D([], [], color="#D62728", linewidth=1.4, linestyle="dashed", label="free now"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="y", color="#DDDDDD", linewidth=0.6)
    ax.set_axisbelow(True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
