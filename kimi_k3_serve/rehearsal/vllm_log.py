"""What vLLM 0.32 measured at engine start, read from its log.

Every number here is one vLLM printed. The lines come from (vLLM 0.32 CUDA wheel):
- ``distributed/parallel_state.py``: "rank R in world size W is assigned as DP rank a, PP rank b, ... TP rank d";
- ``v1/worker/gpu_model_runner.py`` (and ``gpu/model_runner.py``): "Model loading took X GiB memory";
- ``v1/worker/gpu_worker.py``: "Available KV cache memory: X GiB" (budget - profiled non-KV - CUDA-graph estimate),
  and after warmup "Free memory on device (F/T GiB) on startup. Desired GPU memory utilization is (u, R GiB).
  Actual usage is C GiB for consumed memory (weights + non-torch), P GiB for peak activation, and G GiB for
  CUDAGraph memory. ... Current kv cache memory in use is K GiB.";
- ``gpu_model_runner.py``: "Estimated CUDA graph memory: X GiB total", and the worker's "CUDA graph pool memory:
  A GiB (actual), E GiB (estimated)"; before either, "The current --gpu-memory-utilization=U is equivalent to
  --gpu-memory-utilization=E without CUDA graph memory profiling" (U - E is the estimate over the total, to 1e-4);
- ``v1/core/kv_cache_utils.py``: "GPU KV cache size: N tokens, Maximum concurrency for L tokens per request: X.XXx";
- ``v1/engine/core.py``: "init engine (profile, create kv cache, warmup model) took S s";
- the rehearsal's own plugin (``graph_samples``): "KIMI_K3_REHEARSAL_FULL_GRAPHS {...}", the FULL graphs vLLM
  sampled for its CUDA-graph estimate and what it extrapolated from them, and "KIMI_K3_REHEARSAL_RELEASED_CACHE
  {...}", the allocator cache each sampled capture released and what allocated it; and (``profile_peak``)
  "KIMI_K3_REHEARSAL_PROFILE_PEAK {...}", the profile run's allocated and requested peaks; and (``warmup_peak``)
  "KIMI_K3_REHEARSAL_WARMUP_PEAK {...}", what kernel warmup's forwards held as they began and at their peak;
- torch: "CUDA out of memory. Tried to allocate X GiB. GPU g has a total capacity of T GiB of which F MiB is free".
vLLM rounds GiB to 2 decimals (``format_gib``), so each value read here is exact to +-0.005 GiB.

A log line carries its process as ``(Worker_PP1_TP0 pid=123)`` (mp executor) or ``(pid=123, ip=...)`` (Ray);
worker lines are tied to world ranks through the "is assigned as" line of the same pid. Pure: text in, data out.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from kimi_k3_serve.rehearsal import graph_samples, profile_peak, warmup_peak
from kimi_k3_serve.units import GiB, MiB

STEPS = ("start", "load", "profile", "kv_cache", "warmup", "cuda_graphs", "serving")
"""The engine start, in order; an OOM is placed in the step whose marker came last before it. ``kv_cache`` starts
when vLLM has sized the KV cache (the allocation of the cache and of the buffers vLLM's profile did not see).
vLLM's V2 model runner (DSpark drafts use it) captures CUDA graphs during the profile, to measure them: a capture
before the KV cache is sized belongs to ``profile``."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PID = re.compile(r"pid=(\d+)")
_ASSIGNED = re.compile(r"rank (\d+) in world size (\d+) is assigned as DP rank (\d+), PP rank (\d+), (?:PCP rank \d+, )?TP rank (\d+)")
_WORLD_RANK = re.compile(r"world_size=(\d+) rank=(\d+) local_rank=")
"""parallel_state's init line, logged by every worker; "is assigned as" is logged by rank 0 only under the mp executor."""
_WORKER_LABEL = re.compile(r"\(Worker((?:_[A-Z]+\d+)+) pid=")
"""vLLM's worker prefix, e.g. ``(Worker_PP1_TP0 pid=..)``, ``(Worker_TP1 pid=..)``: the parallel ranks it names."""
_LOADED = re.compile(r"Model loading took ([\d.]+) GiB memory")
_AVAILABLE = re.compile(r"Available KV cache memory: (-?[\d.]+) GiB")
_CG_ESTIMATE = re.compile(r"Estimated CUDA graph memory: ([\d.]+) GiB total")
_CG_POOL = re.compile(r"CUDA graph pool memory: ([\d.]+) GiB \(actual\), ([\d.]+) GiB \(estimated\)")
_CG_CAPTURED = re.compile(r"Graph capturing finished in \d+ secs, took ([\d.]+) GiB")
_SUMMARY = re.compile(
    r"Free memory on device \(([\d.]+)/([\d.]+) GiB\) on startup\. Desired GPU memory utilization is \(([\d.]+), ([\d.]+) GiB\)\. "
    r"Actual usage is ([\d.]+) GiB for consumed memory \(weights \+ non-torch\), ([\d.]+) GiB for peak activation, and "
    r"([\d.]+) GiB for CUDAGraph memory\..*?Current kv cache memory in use is (-?[\d.]+) GiB")
_CG_EQUIV = re.compile(r"The current --gpu-memory-utilization=([\d.]+) is equivalent to --gpu-memory-utilization=([\d.]+)")
_KV_SIZE = re.compile(r"(?:GPU|CUDA)[^:]* KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_INIT_DONE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)")
_OOM = re.compile(r"(?:CUDA out of memory|OutOfMemoryError).*?Tried to allocate ([\d.]+) (GiB|MiB|KiB)\.\s*GPU (\d+) has a total capacity of "
                  r"([\d.]+) (GiB|MiB) of which ([\d.]+) (GiB|MiB|KiB) is free")
_OOM_PLAIN = re.compile(r"(torch\.OutOfMemoryError|CUDA out of memory|No available memory for the cache blocks|"
                        r"Free memory on device .* is less than desired GPU memory utilization)")
_OOM_ALLOCATOR = re.compile(r"(?:memory allocation|expandable_segments: memory mapping) failed with OOM on device (\d+) "
                            r"while trying to (?:allocate|map) (\d+) bytes \(free: (\d+), total: (\d+)\)")
"""PyTorch's allocator warning, the only trace of an out-of-memory error raised inside a compiled op through the
stable ABI (FlashMLA's accumulators: the error itself says only "aten::new_empty ... API call failed"); its last
line is after the allocator freed its cache. Under expandable segments the allocator maps a segment's pages 20 MiB
at a time and says "memory mapping failed ... while trying to map": the bytes are that mapping's, not the request's."""
_FULL_GRAPHS = re.compile(rf"{graph_samples.MARKER} (\{{.*\}})")
"""The rehearsal's plugin line (``graph_samples``, a module of standard-library imports only)."""
_RELEASED_CACHE = re.compile(rf"{graph_samples.CACHE_MARKER} (\{{.*\}})")
_PROFILE_PEAK = re.compile(rf"{profile_peak.MARKER} (\{{.*\}})")
_WARMUP_PEAK = re.compile(rf"{warmup_peak.MARKER} (\{{.*\}})")
_MARKERS = (
    ("load", re.compile(r"Starting to load model|Loading model from scratch|is assigned as")),
    ("profile", _LOADED),
    ("kv_cache", _AVAILABLE),
    ("kv_cache", re.compile(r"KV cache size: ")),
    ("warmup", re.compile(r"Compile and warming up model|JIT kernel warmup starting")),
    ("cuda_graphs", re.compile(r"Capturing CUDA graphs|Profiling CUDA graph memory: .*capture")),
    ("serving", _INIT_DONE),
)
_UNITS = {"GiB": GiB, "MiB": MiB, "KiB": 1024}


def _gib(text: str) -> int:
    return round(float(text) * GiB)


@dataclass(frozen=True)
class ReleasedCache:
    """The allocator cache that a sampled FULL capture released as it began (``graph_samples.releasable_cache``)."""
    capture: int
    releasable_bytes: int
    segments: tuple[tuple[int, int], ...]
    """``(segment size, count)``, the largest size first."""
    sites: tuple[tuple[str, int, int], ...]
    """``(allocation site, bytes, segments)``, the largest first: what made the segments, where the history ran."""
    untraced_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"capture": self.capture, "releasable_bytes": self.releasable_bytes,
                "segments": [list(x) for x in self.segments], "sites": [list(x) for x in self.sites],
                "untraced_bytes": self.untraced_bytes}


@dataclass(frozen=True)
class WarmupPeak:
    """One warmup function's allocations (``warmup_peak``): held as it began, and the allocator's peak as it ended
    (before the failed request, where it ran out of memory)."""

    scope: str
    allocated_at_entry_bytes: int
    allocated_peak_bytes: int
    peak_at_entry_bytes: int
    failed: bool

    @property
    def transient_bytes(self) -> int | None:
        """What its forwards held at their peak beyond what it began with; None where it set no new peak."""
        if self.allocated_peak_bytes <= self.peak_at_entry_bytes:
            return None
        return self.allocated_peak_bytes - self.allocated_at_entry_bytes

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"transient_bytes": self.transient_bytes}


@dataclass(frozen=True)
class WorkerReading:
    """One worker's numbers, as vLLM logged them (bytes; None where the log has no such line)."""

    pid: int
    rank: int | None = None
    pp_rank: int | None = None
    tp_rank: int | None = None
    model_load_bytes: int | None = None
    available_kv_bytes: int | None = None
    cuda_graph_estimate_bytes: int | None = None
    cuda_graph_actual_bytes: int | None = None
    free_at_start_bytes: int | None = None
    total_bytes: int | None = None
    requested_bytes: int | None = None
    consumed_bytes: int | None = None
    peak_activation_bytes: int | None = None
    kv_in_use_bytes: int | None = None
    full_graph_samples: tuple[int, ...] | None = None
    """The drops in free memory of the FULL graphs vLLM captured to estimate them all (the 2 largest; ``graph_samples``)."""
    full_graphs: int | None = None
    full_graph_extrapolated_bytes: int | None = None
    """What vLLM's estimate charged for its ``full_graphs`` FULL graphs: the first sample + the rest at the second's."""
    released_caches: tuple[ReleasedCache, ...] = ()
    profile_allocated_peak_bytes: int | None = None
    """The profile run's torch peak as vLLM reads it, whole allocator blocks (``profile_peak``; with weights)."""
    profile_requested_peak_bytes: int | None = None
    """The same run's peak of the bytes its tensors asked for: the difference is at least what the allocator charged
    beyond them at the peak."""
    warmup_peaks: tuple[WarmupPeak, ...] = ()
    """What kernel warmup's forwards allocated, one per wrapped function (``warmup_peak``)."""

    @property
    def non_torch_bytes(self) -> int | None:
        """Post-snapshot memory that is not weights: ``consumed`` is weights + non-torch growth (gpu_worker.py)."""
        if self.consumed_bytes is None or self.model_load_bytes is None:
            return None
        return self.consumed_bytes - self.model_load_bytes

    @property
    def profiled_non_kv_bytes(self) -> int | None:
        """What vLLM's profile charged to the budget besides weights (activation peak, non-torch growth, profiled
        workspaces): requested - CUDA-graph estimate - KV cache - weights, as ``determine_available_memory`` does."""
        parts = (self.requested_bytes, self.cuda_graph_estimate_bytes, self.available_kv_bytes, self.model_load_bytes)
        if any(p is None for p in parts):
            return None
        return self.requested_bytes - self.cuda_graph_estimate_bytes - self.available_kv_bytes - self.model_load_bytes

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["released_caches"] = [c.to_json() for c in self.released_caches]
        out["warmup_peaks"] = [p.to_json() for p in self.warmup_peaks]
        out["non_torch_bytes"] = self.non_torch_bytes
        out["profiled_non_kv_bytes"] = self.profiled_non_kv_bytes
        return out


@dataclass(frozen=True)
class OomEvent:
    """An out-of-memory error and the engine-start step it happened in."""

    step: str
    pid: int | None
    tried_bytes: int | None
    free_bytes: int | None
    device_index: int | None
    message: str

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class EngineReading:
    """What the engine as a whole logged: the KV cache it settled on (min over ranks), and how its start ended."""

    workers: tuple[WorkerReading, ...]
    kv_cache_tokens: int | None = None
    max_model_len: int | None = None
    max_concurrency: float | None = None
    init_seconds: float | None = None
    last_step: str = "start"
    oom: OomEvent | None = None
    errors: tuple[str, ...] = field(default_factory=tuple)
    caught_ooms: tuple[OomEvent, ...] = ()
    """Allocations that failed for memory where the engine went on (FlashInfer's autotuner skips a tactic it cannot
    fit; in the capture, the caching allocator releases its cached blocks and retries): the start reached them at its
    edge. Each once, in the order logged."""

    @property
    def started(self) -> bool:
        return self.init_seconds is not None and self.oom is None

    def worker_of_rank(self, rank: int) -> WorkerReading | None:
        return next((w for w in self.workers if w.rank == rank), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "workers": [w.to_json() for w in self.workers], "kv_cache_tokens": self.kv_cache_tokens,
            "max_model_len": self.max_model_len, "max_concurrency": self.max_concurrency, "init_seconds": self.init_seconds,
            "last_step": self.last_step, "started": self.started, "oom": self.oom.to_json() if self.oom else None,
            "errors": list(self.errors), "caught_ooms": [o.to_json() for o in self.caught_ooms],
        }


def parse_vllm_log(text: str, device_total_bytes: int | None = None) -> EngineReading:
    """Read a vLLM 0.32 engine start (stdout and stderr together) into per-worker and engine numbers.

    ``device_total_bytes``: the GPU's total memory, where the caller knows it. vLLM prints it only in the summary
    that ends a start; a start that stopped before it (a near-miss) still printed the utilization line, whose
    fractions give the budget and the CUDA-graph estimate once the total is known."""
    workers: dict[int, dict[str, Any]] = {}
    order: list[int] = []
    engine: dict[str, Any] = {}
    step_index = 0
    oom: OomEvent | None = None
    allocator_oom: OomEvent | None = None
    allocator_ooms: list[OomEvent] = []
    errors: list[str] = []

    def worker(pid: int | None) -> dict[str, Any]:
        key = pid if pid is not None else -1
        if key not in workers:
            workers[key] = {"pid": key}
            order.append(key)
        return workers[key]

    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        pids = _PID.findall(line)
        pid = int(pids[-1]) if pids else None
        for name, pattern in _MARKERS:
            if pattern.search(line):
                if not (name == "cuda_graphs" and step_index < STEPS.index("kv_cache")):  # V2: a profiling capture
                    step_index = max(step_index, STEPS.index(name))
                break
        if (label := _WORKER_LABEL.search(line)) and pid is not None:
            ranks = dict(re.findall(r"_([A-Z]+)(\d+)", label[1]))
            w = worker(pid)
            w.setdefault("_pp", int(ranks.get("PP", 0)))
            w.setdefault("_tp", int(ranks.get("TP", 0)))
        if m := _ASSIGNED.search(line):
            worker(pid).update(rank=int(m[1]), pp_rank=int(m[4]), tp_rank=int(m[5]))
        elif m := _WORLD_RANK.search(line):
            worker(pid).setdefault("_world_rank", int(m[2]))
        elif m := _LOADED.search(line):
            worker(pid)["model_load_bytes"] = _gib(m[1])
        elif m := _AVAILABLE.search(line):
            worker(pid)["available_kv_bytes"] = _gib(m[1])
        elif m := _CG_ESTIMATE.search(line):
            worker(pid)["cuda_graph_estimate_bytes"] = _gib(m[1])
        elif m := _CG_EQUIV.search(line):
            worker(pid).update(_util=float(m[1]), _cg_fraction=float(m[1]) - float(m[2]))
        elif m := _CG_POOL.search(line):
            worker(pid).update(cuda_graph_actual_bytes=_gib(m[1]), cuda_graph_estimate_bytes=_gib(m[2]))
        elif m := _CG_CAPTURED.search(line):
            worker(pid).setdefault("cuda_graph_actual_bytes", _gib(m[1]))
        elif m := _SUMMARY.search(line):
            worker(pid).update(free_at_start_bytes=_gib(m[1]), total_bytes=_gib(m[2]), requested_bytes=_gib(m[4]),
                               consumed_bytes=_gib(m[5]), peak_activation_bytes=_gib(m[6]),
                               cuda_graph_actual_bytes=_gib(m[7]), kv_in_use_bytes=_gib(m[8]))
        elif m := _KV_SIZE.search(line):
            engine.setdefault("kv_cache_tokens", int(m[1].replace(",", "")))
            engine.setdefault("max_model_len", int(m[2].replace(",", "")))
            engine.setdefault("max_concurrency", float(m[3]))
        elif m := _INIT_DONE.search(line):
            engine["init_seconds"] = float(m[1])
        elif m := _RELEASED_CACHE.search(line):
            logged = json.loads(m[1])
            w = worker(int(logged["pid"]))
            w["released_caches"] = w.get("released_caches", ()) + (ReleasedCache(
                capture=int(logged["capture"]), releasable_bytes=int(logged["releasable"]),
                segments=tuple((int(size), int(count)) for size, count in logged.get("segments", ())),
                sites=tuple((str(site), int(size), int(count)) for site, size, count in logged.get("sites", ())),
                untraced_bytes=int(logged.get("untraced", 0))),)
        elif m := _PROFILE_PEAK.search(line):
            logged = json.loads(m[1])
            if logged.get("scope") != "load_model":  # the weights' load enters the same allocator scope first
                worker(int(logged["pid"])).update(profile_allocated_peak_bytes=int(logged["allocated_peak"]),
                                                  profile_requested_peak_bytes=int(logged["requested_peak"]))
        elif m := _WARMUP_PEAK.search(line):
            logged = json.loads(m[1])
            w = worker(int(logged["pid"]))
            w["warmup_peaks"] = w.get("warmup_peaks", ()) + (WarmupPeak(
                scope=str(logged.get("scope", "")), allocated_at_entry_bytes=int(logged["allocated_at_entry"]),
                allocated_peak_bytes=int(logged["allocated_peak"]), peak_at_entry_bytes=int(logged["peak_at_entry"]),
                failed=bool(logged.get("failed"))),)
        elif m := _FULL_GRAPHS.search(line):
            sampled = json.loads(m[1])
            worker(int(sampled["pid"])).update(full_graph_samples=tuple(sampled["samples"]),
                                               full_graphs=sampled["full_graphs"],
                                               full_graph_extrapolated_bytes=sampled["extrapolated"])
        if alloc := _OOM_ALLOCATOR.search(line):
            allocator_oom = OomEvent(step=STEPS[step_index], pid=pid, tried_bytes=int(alloc[2]),
                                     free_bytes=int(alloc[3]), device_index=int(alloc[1]),
                                     message=line.strip()[-400:])
            if not any(o.tried_bytes == allocator_oom.tried_bytes and o.free_bytes == allocator_oom.free_bytes
                       for o in allocator_ooms):  # the allocator logs one failure on two lines at times
                allocator_ooms.append(allocator_oom)
        if oom is None and _OOM_PLAIN.search(line):
            detail = _OOM.search(line)
            step = STEPS[step_index]
            if detail:
                worker(pid).setdefault("total_bytes", round(float(detail[4]) * _UNITS[detail[5]]))
            oom = OomEvent(
                step=step, pid=pid,
                tried_bytes=round(float(detail[1]) * _UNITS[detail[2]]) if detail else None,
                free_bytes=round(float(detail[6]) * _UNITS[detail[7]]) if detail else None,
                device_index=int(detail[3]) if detail else None,
                message=line.strip()[-400:],
            )
        elif ("Error" in line or "error:" in line) and ("Traceback" not in line) and len(errors) < 20:
            stripped = line.strip()
            if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", stripped) or "ERROR" in line:
                errors.append(stripped[-300:])
    if oom is None and allocator_oom is not None and STEPS[step_index] != "serving" and errors:
        oom = allocator_oom  # the engine failed and no torch error said why: the allocator's own line does (a
        # request that FlashInfer's autotuner or vLLM catches logs the same line, and the engine goes on)
    for w in workers.values():  # ranks the "is assigned as" line did not give: the init line's and the label's
        world_rank, pp, tp = w.pop("_world_rank", None), w.pop("_pp", None), w.pop("_tp", None)
        if w.get("rank") is None and world_rank is not None:
            w.update(rank=world_rank, pp_rank=pp, tp_rank=tp)
    for w in workers.values():  # what the utilization line implies, where the summary line never came
        util, fraction = w.pop("_util", None), w.pop("_cg_fraction", None)
        total = w.get("total_bytes") or device_total_bytes
        if total and util is not None:
            w.setdefault("requested_bytes", math.ceil(util * total))
            w.setdefault("cuda_graph_estimate_bytes", round(fraction * total))
    readings = tuple(WorkerReading(**workers[k]) for k in order if k != -1 or len(workers[k]) > 1)
    readings = tuple(sorted(readings, key=lambda w: (w.rank is None, w.rank if w.rank is not None else 0, w.pid)))
    caught = tuple(allocator_ooms) if oom is None else ()
    return EngineReading(workers=readings, last_step=STEPS[step_index], oom=oom, errors=tuple(errors),
                         caught_ooms=caught, **engine)


def captures_against_estimates(text: str) -> list[tuple[int, int]]:
    """``(vLLM's CUDA-graph estimate, the real capture)`` of each worker that logged both, from gpu_worker.py's
    "CUDA graph pool memory: A GiB (actual), E GiB (estimated)" (one line per worker, after the real capture). The
    plan budgets the estimate, which vLLM deducts before it sizes the KV cache; the real capture then runs into the
    memory the estimate left, so a capture above its estimate lands outside the budget."""
    return [(_gib(m[2]), _gib(m[1])) for m in _CG_POOL.finditer(text)]
