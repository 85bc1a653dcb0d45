"""The plan's per-GPU prediction beside what vLLM measured, and both verdicts. Pure.

Rows, per world rank (vLLM's names in brackets):
- weights: our stage weights + draft [``Model loading took``, which loads the target and the drafter];
- profile: our activation peak + non-torch + profiled workspaces [what vLLM's profile charged besides weights:
  requested - CUDA-graph estimate - KV cache - weights];
- CUDA graphs: our estimate [vLLM's estimate, deducted from the budget; and the pool it then captured];
- KV cache: our pool [``Available KV cache memory``].
The engine row compares max concurrency at max_model_len [``Maximum concurrency for L tokens per request``].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kimi_k3_serve.rehearsal.vllm_log import EngineReading, ReleasedCache, WarmupPeak
from kimi_k3_serve.units import GiB, MiB

MEASURED_VERDICT_OF_STEP = {
    "start": "cannot_start", "load": "oom_at_load", "profile": "no_kv_space", "kv_cache": "oom_at_warmup",
    "warmup": "oom_at_warmup", "cuda_graphs": "oom_at_warmup", "serving": "fits",
}
"""Where an OOM happened -> the verdict it proves (an OOM while profiling leaves no room for the KV cache)."""


@dataclass(frozen=True)
class Row:
    name: str
    predicted_bytes: int | None
    measured_bytes: int | None

    @property
    def error_bytes(self) -> int | None:
        if self.predicted_bytes is None or self.measured_bytes is None:
            return None
        return self.predicted_bytes - self.measured_bytes

    @property
    def error_fraction(self) -> float | None:
        if self.error_bytes is None or not self.measured_bytes:
            return None
        return self.error_bytes / self.measured_bytes

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "predicted_bytes": self.predicted_bytes, "measured_bytes": self.measured_bytes,
                "error_bytes": self.error_bytes, "error_fraction": self.error_fraction}


@dataclass(frozen=True)
class RankComparison:
    rank: int
    pp_stage: int
    tp_rank: int
    rows: tuple[Row, ...]
    full_graph_samples: tuple[int, ...] | None = None
    """vLLM's 2 sampled FULL graphs' drops in free memory, where rehearse's plugin logged them."""
    full_graphs: int | None = None
    second_release: ReleasedCache | None = None
    """The cache the second sampled capture released, and what allocated it, where the plugin logged it."""
    profile_block_slack_bytes: int | None = None
    """The profile run's allocated peak less its requested peak (``profile_peak``), where the plugin logged them."""
    warmup_peaks: tuple[WarmupPeak, ...] = ()
    """What kernel warmup's forwards held (``warmup_peak``), where the plugin logged them."""
    planned_warmup_forward_bytes: int = 0
    """The plan's peak of FlashInfer's autotune forward over what it begins with (0: not modelled)."""

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    def full_graph_line(self) -> str | None:
        """How vLLM built its CUDA-graph estimate's FULL-graph part, in a sentence (None where it was not logged)."""
        if not self.full_graph_samples or len(self.full_graph_samples) < 2 or self.full_graphs is None:
            return None
        first, second = self.full_graph_samples[:2]
        line = (f"vLLM captured 2 of its {self.full_graphs} FULL graphs to estimate them (free memory changed by "
                f"{-first / GiB:+.2f} / {-second / GiB:+.2f} GiB) and charged each other one "
                f"{max(second, MiB) / MiB:,.0f} MiB")
        if second < 0:
            line += (f"; {-second / GiB:.2f} GiB of its estimate is the allocator cache released as the second capture "
                     "began, which no graph holds")
        if (release := self.second_release) is not None:
            segments = ", ".join(f"{count} x {size / MiB:,.0f}" for size, count in release.segments[:6])
            line += f"; the cache was {release.releasable_bytes / MiB:,.0f} MiB in segments of MiB: {segments}"
            if release.sites:
                line += "; made by " + ", ".join(f"{site} ({size / MiB:,.0f} MiB)" for site, size, _ in release.sites[:4])
        return line

    def profile_peak_line(self) -> str | None:
        """What vLLM's profile figure holds besides the tensors themselves, in a sentence (None where not logged)."""
        if self.profile_block_slack_bytes is None:
            return None
        slack = self.profile_block_slack_bytes / MiB
        return (f"at the profile's peak the allocator charged at least {slack:,.0f} MiB beyond the tensors' own sizes "
                "(whole cached blocks, vLLM's max_split_size_mb:20), counted in vLLM's profile")

    def warmup_line(self) -> str | None:
        """What kernel warmup's forwards held, in a sentence (None where the plugin did not log it)."""
        said = []
        for p in self.warmup_peaks:
            extra = ("set no new peak" if p.transient_bytes is None
                     else f"peaked {p.transient_bytes / GiB:.2f} GiB above that")
            if p.scope == "flashinfer_autotune" and self.planned_warmup_forward_bytes:
                extra += f" (plan {self.planned_warmup_forward_bytes / GiB:.2f} GiB)"
            said.append(f"{p.scope} began with {p.allocated_at_entry_bytes / GiB:.2f} GiB allocated and {extra}"
                        + (" before it ran out of memory" if p.failed else ""))
        return ("kernel warmup: " + "; ".join(said)) if said else None

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "pp_stage": self.pp_stage, "tp_rank": self.tp_rank, "rows": [r.to_json() for r in self.rows],
                "full_graph_samples": list(self.full_graph_samples) if self.full_graph_samples else None,
                "full_graphs": self.full_graphs,
                "second_release": None if self.second_release is None else self.second_release.to_json(),
                "profile_block_slack_bytes": self.profile_block_slack_bytes,
                "warmup_peaks": [p.to_json() for p in self.warmup_peaks],
                "planned_warmup_forward_bytes": self.planned_warmup_forward_bytes}


@dataclass(frozen=True)
class Comparison:
    ranks: tuple[RankComparison, ...]
    predicted_verdict: str
    measured_verdict: str
    predicted_concurrency: float
    measured_concurrency: float | None
    oom: dict[str, Any] | None
    caught_ooms: tuple[dict[str, Any], ...] = ()
    """Allocations that failed for memory where vLLM went on (``EngineReading.caught_ooms``)."""

    @property
    def verdicts_agree(self) -> bool:
        return self.predicted_verdict == self.measured_verdict

    def to_json(self) -> dict[str, Any]:
        return {"ranks": [r.to_json() for r in self.ranks], "predicted_verdict": self.predicted_verdict,
                "measured_verdict": self.measured_verdict, "verdicts_agree": self.verdicts_agree,
                "predicted_concurrency": self.predicted_concurrency, "measured_concurrency": self.measured_concurrency,
                "oom": self.oom, "caught_ooms": list(self.caught_ooms)}


def measured_verdict(reading: EngineReading) -> str:
    if reading.oom is not None:
        if "less than desired GPU memory utilization" in reading.oom.message:
            return "cannot_start"
        if "No available memory for the cache blocks" in reading.oom.message:
            return "no_kv_space"
        return MEASURED_VERDICT_OF_STEP[reading.oom.step]
    if reading.started:
        return "fits"
    if any("exceeds available Mamba cache blocks" in e for e in reading.errors):
        return "seqs_over_state_blocks"
    if any("AssertionError" in e for e in reading.errors):
        return "refused"  # vLLM asserted against the settings before sizing anything (fp8 KV without its flag)
    if any("page size is not divisible by the maximum page size" in e for e in reading.errors):
        return "refused"  # unify_kv_cache_spec_page_size: KV-cache specs vLLM cannot put in one pool
    if any("KV cache" in e and ("needed" in e or "larger than" in e or "not enough" in e.lower()) for e in reading.errors):
        return "no_kv_space"
    return "unknown"


def compare(report: Any, reading: EngineReading) -> Comparison:
    """``report``: a ``memory.MemoryReport`` of the same layout and engine settings as the run that ``reading`` read."""
    ranks = []
    for r in report.ranks:
        w = reading.worker_of_rank(r.rank)
        if w is None and len(report.ranks) == 1 and len(reading.workers) == 1:
            w = reading.workers[0]
        get = (lambda name: getattr(w, name)) if w is not None else (lambda name: None)
        rows = (
            Row("weights", r.weights_bytes + r.draft_bytes, get("model_load_bytes")),
            Row("profile_non_kv", r.activation_bytes + r.non_torch_bytes + r.workspace_bytes,
                w.profiled_non_kv_bytes if w is not None else None),
            Row("cuda_graph_estimate", r.cuda_graph_bytes, get("cuda_graph_estimate_bytes")),
            Row("cuda_graph_pool", r.cuda_graph_bytes, get("cuda_graph_actual_bytes")),
            Row("kv_cache", r.kv_cache_bytes, get("available_kv_bytes")),
        )
        second = next((c for c in (get("released_caches") or ()) if c.capture == 2), None)
        allocated, requested = get("profile_allocated_peak_bytes"), get("profile_requested_peak_bytes")
        slack = allocated - requested if allocated is not None and requested is not None else None
        ranks.append(RankComparison(r.rank, r.pp_stage, r.tp_rank, rows, get("full_graph_samples"), get("full_graphs"),
                                    second, slack, get("warmup_peaks") or (), r.warmup_forward_bytes))
    return Comparison(
        ranks=tuple(ranks), predicted_verdict=report.verdict, measured_verdict=measured_verdict(reading),
        predicted_concurrency=report.max_concurrency, measured_concurrency=reading.max_concurrency,
        oom=reading.oom.to_json() if reading.oom else None,
        caught_ooms=tuple(o.to_json() for o in reading.caught_ooms),
    )


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:,.2f}"


def _err(row: Row) -> str:
    if row.error_bytes is None:
        return "-"
    pct = f" ({row.error_fraction * 100:+.1f}%)" if row.error_fraction is not None else ""
    return f"{row.error_bytes / GiB:+.2f}{pct}"


def _why_it_went_on(step: str) -> str:
    """What let vLLM 0.32 go on after a failed allocation, by the step it failed in: in warmup, FlashInfer's
    autotuner skips the tactic it cannot fit (round 48, H100); in the capture, the caching allocator released its
    cached blocks and the retry fitted (round 53: DSpark's first graph, 40 MiB asked for with 26 MiB free)."""
    if step == "cuda_graphs":
        return "the caching allocator released its cached blocks and the capture's retry fitted"
    return "FlashInfer's autotuner skips a tactic it cannot fit, and that tactic went untried"


def render_table(comparison: Comparison, gpu_of_rank: Sequence[str] | None = None) -> str:
    """Per GPU: predicted, measured and error (GiB, and % of measured) for every row."""
    lines = [f"{'GPU':<10} {'stage':>5}  {'what':<20} {'plan GiB':>10} {'vLLM GiB':>10} {'error GiB':>16}"]
    gpus = [gpu_of_rank[rc.rank] if gpu_of_rank and rc.rank < len(gpu_of_rank) else f"rank {rc.rank}"
            for rc in comparison.ranks]
    for gpu, rc in zip(gpus, comparison.ranks):
        for i, row in enumerate(rc.rows):
            lines.append(f"{gpu if i == 0 else '':<10} {rc.pp_stage if i == 0 else '':>5}  {row.name:<20} "
                         f"{_gib(row.predicted_bytes):>10} {_gib(row.measured_bytes):>10} {_err(row):>16}")
    for gpu, rc in zip(gpus, comparison.ranks):
        for said in (rc.full_graph_line(), rc.profile_peak_line(), rc.warmup_line()):
            if said:
                lines.append(f"{gpu}: {said}")
    conc = "-" if comparison.measured_concurrency is None else f"{comparison.measured_concurrency:.2f}x"
    lines.append(f"max concurrency: plan {comparison.predicted_concurrency:.2f}x, vLLM {conc}")
    agree = "agree" if comparison.verdicts_agree else "DISAGREE"
    lines.append(f"verdict: plan {comparison.predicted_verdict}, vLLM {comparison.measured_verdict} ({agree})")
    if comparison.oom:
        o = comparison.oom
        tried = f", tried to allocate {_gib(o['tried_bytes'])} GiB with {_gib(o['free_bytes'])} GiB free" if o.get("tried_bytes") else ""
        lines.append(f"vLLM ran out of memory during {o['step']}{tried}")
    for o in comparison.caught_ooms:
        lines.append(f"vLLM went on after an allocation of {_gib(o['tried_bytes'])} GiB failed with "
                     f"{_gib(o['free_bytes'])} GiB free during {o['step']} ({_why_it_went_on(o['step'])}): this "
                     "utilization is at vLLM's edge")
    return "\n".join(lines)
