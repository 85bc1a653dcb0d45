"""How vLLM built its CUDA-graph estimate, logged from inside the engine: a vLLM general plugin for rehearsals.

vLLM 0.32's ``profile_cudagraph_memory`` (v1/worker/gpu/cudagraph_utils.py) captures every PIECEWISE and speculator
graph, but only the 2 largest FULL graphs, and ``_extrapolate_full_graph_memory`` charges the rest at the second
one's drop in free device memory (at least 1 MiB). vLLM logs only the total, so the plan cannot tell what it
measured from what it extrapolated. This plugin wraps that function in each worker and prints one line with its
inputs and result (the wrapped function's answer is returned unchanged):

    KIMI_K3_REHEARSAL_FULL_GRAPHS {"pid": 123, "samples": [first, second], "full_graphs": 48, "extrapolated": X}

``vllm_log`` reads the line. vLLM loads general plugins in every engine process (``load_general_plugins`` in the
engine core and in ``WorkerWrapperBase.init_worker``), whether they were forked or spawned; its plugins are entry
points, so ``install`` writes a distribution's metadata (no code: the entry point names this module) into a folder
that the rehearsal puts on the engine's ``PYTHONPATH``. Where the deploy config sets ``VLLM_PLUGINS`` (the only
plugins vLLM may load), the rehearsal names this one there too (``commands/rehearse.py engine_env``).

Each sampled capture's drop is negative on the H200: ``torch.cuda.graph`` empties the caching allocator as the capture
begins, so the drop nets the graph against the cache the graph's eager warm-up left, and vLLM's estimate holds the
second sample's release. What that cache is made of, the plugin also logs as each sampled capture begins (before the
cache is emptied; vLLM's ``free_before`` is already read, so nothing it measures changes): the segments
``empty_cache`` gives back, by size, and for the second, which allocations made them (the allocator's history, with
Python frames, recorded from the end of the first sampled capture to the start of the second; set
``KIMI_K3_REHEARSAL_CACHE_SITES=0`` to leave the history off):

    KIMI_K3_REHEARSAL_RELEASED_CACHE {"pid": 123, "capture": 2, "releasable": B, "segments": [[size, count], ...],
                                      "sites": [["vllm/...py:12 fn", bytes, segments], ...], "untraced": B}
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from kimi_k3_serve.rehearsal import profile_peak, warmup_peak
from kimi_k3_serve.rehearsal.import_hook import wrap_on_import

MARKER = "KIMI_K3_REHEARSAL_FULL_GRAPHS"
CACHE_MARKER = "KIMI_K3_REHEARSAL_RELEASED_CACHE"
SITES_ENV = "KIMI_K3_REHEARSAL_CACHE_SITES"
SAMPLED_CAPTURES = 2
"""vLLM 0.32's ``_FULL_GRAPH_PROFILING_SAMPLES``: the first FULL captures of the profiling phase are its samples."""
MAX_SITES = 12
PLUGIN_NAME = "kimi_k3_rehearsal_full_graphs"
_DIST = "kimi_k3_rehearsal_full_graphs-0.dist-info"
_MODULE = "vllm.v1.worker.gpu.cudagraph_utils"


def register() -> None:
    """vLLM's general-plugin hook. The wrap waits for vLLM to import the module itself: importing it here would
    import vLLM's worker code into every process that loads plugins (the rehearsal's own among them, before its
    engine forks), and nothing here may stop an engine from starting."""
    wrap_on_import(_MODULE, _wrap)


def _wrap(module) -> None:
    _wrap_profiling_scope(module)
    _wrap_capture_pool(module)
    original = getattr(module, "_extrapolate_full_graph_memory", None)
    if original is None or getattr(original, "_kimi_k3_logged", False):
        return

    def extrapolate_and_log(mem_samples: list[int], total_graphs: int) -> int:
        extrapolated = original(mem_samples, total_graphs)
        try:
            line = {"pid": os.getpid(), "samples": [int(s) for s in mem_samples], "full_graphs": int(total_graphs),
                    "extrapolated": int(extrapolated)}
            print(f"{MARKER} {json.dumps(line)}", flush=True)
        except Exception:  # a log line never stops the engine
            pass
        return extrapolated

    extrapolate_and_log._kimi_k3_logged = True
    module._extrapolate_full_graph_memory = extrapolate_and_log


_profiling = {"active": False, "captures": 0, "recording": False}
"""Where the worker is: inside vLLM's profiling capture, and how many FULL captures it has begun there."""


def _wrap_profiling_scope(module) -> None:
    """``capture_outside_cumem_pool`` is entered by ``profile_cudagraph_memory`` alone, around its whole capture."""
    original = getattr(module, "capture_outside_cumem_pool", None)
    if original is None or getattr(original, "_kimi_k3_logged", False):
        return

    @contextlib.contextmanager
    def profiling_scope(*args, **kwargs):
        _profiling.update(active=True, captures=0)
        try:
            with original(*args, **kwargs):
                yield
        finally:
            _profiling["active"] = False
            _stop_history()

    profiling_scope._kimi_k3_logged = True
    module.capture_outside_cumem_pool = profiling_scope


def _wrap_capture_pool(module) -> None:
    """The module's ``capture_pool`` is entered for each FULL capture only, just before ``torch.cuda.graph``
    (which empties the cache) and just after vLLM reads ``free_before``; it is left once the capture has ended."""
    original = getattr(module, "capture_pool", None)
    if original is None or getattr(original, "_kimi_k3_logged", False):
        return

    @contextlib.contextmanager
    def capture_pool_logged(*args, **kwargs):
        capture = 0
        if _profiling["active"]:
            _profiling["captures"] += 1
            capture = _profiling["captures"]
            if capture <= SAMPLED_CAPTURES:
                _log_releasable(capture)
        with original(*args, **kwargs) as pool:
            yield pool
        if capture == 1:
            _start_history()

    capture_pool_logged._kimi_k3_logged = True
    module.capture_pool = capture_pool_logged


def _log_releasable(capture: int) -> None:
    try:
        import torch

        if not torch.cuda.is_available():
            return
        snapshot = torch.cuda.memory._snapshot()
        device = torch.cuda.current_device()
        traces = snapshot.get("device_traces") or []
        summary = releasable_cache(snapshot["segments"], traces[device] if device < len(traces) else (), device)
        print(f"{CACHE_MARKER} {json.dumps({'pid': os.getpid(), 'capture': capture, **summary})}", flush=True)
    except Exception:  # a log line never stops the engine
        pass
    finally:
        if capture >= SAMPLED_CAPTURES:
            _stop_history()


def _start_history() -> None:
    if os.environ.get(SITES_ENV, "1") == "0":
        return
    try:
        import torch

        kwargs = {"context": "alloc", "stacks": "python", "max_entries": 200_000}
        try:
            torch.cuda.memory._record_memory_history("all", skip_actions=["free_requested", "free_completed"],
                                                     **kwargs)
        except TypeError:  # a torch without skip_actions
            torch.cuda.memory._record_memory_history("all", **kwargs)
        _profiling["recording"] = True
    except Exception:
        pass


def _stop_history() -> None:
    if not _profiling["recording"]:
        return
    _profiling["recording"] = False
    try:
        import torch

        torch.cuda.memory._record_memory_history(enabled=None)
    except Exception:
        pass


def releasable_cache(segments: Iterable[Mapping[str, Any]], traces: Sequence[Mapping[str, Any]],
                     device: int = 0) -> dict[str, Any]:
    """What ``torch.cuda.empty_cache()`` would give back now, from a ``torch.cuda.memory._snapshot()``: the default
    pool's segments of ``device`` with nothing allocated in them (``releasable``, bytes), as ``[size, count]`` from the
    largest size down, and the allocation that made each segment (its ``segment_alloc`` trace entry, the latest for
    its address, or where that has no frames the latest allocation at the segment's start: the innermost frame
    outside torch's own package) summed by site, largest first; a segment made before the history began is
    ``untraced``."""
    free = [seg for seg in segments if seg.get("device", device) == device and not seg.get("allocated_size")
            and tuple(seg.get("segment_pool_id") or (0, 0)) == (0, 0)]
    made_by: dict[int, Sequence[Mapping[str, Any]]] = {}
    for entry in traces:
        action, frames = entry.get("action"), entry.get("frames") or ()
        if action == "segment_alloc":
            made_by[entry["addr"]] = frames
        elif action == "alloc" and frames and entry.get("addr") in made_by and not made_by[entry["addr"]]:
            made_by[entry["addr"]] = frames
    sites: dict[str, list[int]] = {}
    untraced = 0
    for seg in free:
        frames = made_by.get(seg["address"])
        if frames is None:
            untraced += seg["total_size"]
            continue
        total = sites.setdefault(allocation_site(frames), [0, 0])
        total[0] += seg["total_size"]
        total[1] += 1
    by_size = Counter(seg["total_size"] for seg in free)
    return {"releasable": sum(seg["total_size"] for seg in free),
            "segments": [[size, count] for size, count in sorted(by_size.items(), reverse=True)],
            "sites": [[site, size, count] for site, (size, count) in sorted(sites.items(), key=lambda kv: -kv[1][0])
                      ][:MAX_SITES],
            "untraced": untraced}


def allocation_site(frames: Sequence[Mapping[str, Any]]) -> str:
    """The innermost frame (frames come innermost first) outside torch's own package, as ``path:line function``,
    the path from its package down (inductor's generated code keeps its file name)."""
    for frame in frames:
        path = str(frame.get("filename", "")).replace("\\", "/")
        if not path or path.startswith("<") or ("/torch/" in path and "torchinductor" not in path):
            continue
        short = path.rsplit("site-packages/", 1)[-1] if "site-packages/" in path else path.rsplit("/", 1)[-1]
        return f"{short}:{frame.get('line', 0)} {frame.get('name', '')}"
    return "torch"


PLUGIN_NAMES = (PLUGIN_NAME, profile_peak.PLUGIN_NAME, warmup_peak.PLUGIN_NAME)
"""The distribution's entry points: this module's, ``profile_peak``'s and ``warmup_peak``'s (their ``PLUGIN_NAME``)."""


def install(folder: Path) -> Path:
    """Write the plugin's entry points (this module's, ``profile_peak``'s and ``warmup_peak``'s) into ``folder`` (a
    path entry for the engine's ``PYTHONPATH``); returns it."""
    dist = folder / _DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN_NAME}\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN_NAME} = {__name__}:register\n"
                                           f"{profile_peak.PLUGIN_NAME} = {profile_peak.__name__}:register\n"
                                           f"{warmup_peak.PLUGIN_NAME} = {warmup_peak.__name__}:register\n")
    return folder
