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
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
from pathlib import Path

MARKER = "KIMI_K3_REHEARSAL_FULL_GRAPHS"
PLUGIN_NAME = "kimi_k3_rehearsal_full_graphs"
_DIST = "kimi_k3_rehearsal_full_graphs-0.dist-info"
_MODULE = "vllm.v1.worker.gpu.cudagraph_utils"


def register() -> None:
    """vLLM's general-plugin hook. The wrap waits for vLLM to import the module itself: importing it here would
    import vLLM's worker code into every process that loads plugins (the rehearsal's own among them, before its
    engine forks), and nothing here may stop an engine from starting."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        _wrap(module)
    elif not any(isinstance(f, _WrapOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport())


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds ``_MODULE`` as the rest of ``sys.meta_path`` would, and wraps the function once the module has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            run_module = spec.loader.exec_module

            def exec_and_wrap(module) -> None:
                run_module(module)
                _wrap(module)

            spec.loader.exec_module = exec_and_wrap
        return spec


def _wrap(module) -> None:
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


def install(folder: Path) -> Path:
    """Write the plugin's entry point into ``folder`` (a path entry for the engine's ``PYTHONPATH``); returns it."""
    dist = folder / _DIST
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN_NAME}\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN_NAME} = {__name__}:register\n")
    return folder
