"""What the allocator charged at vLLM's profile peak beyond the tensors' own sizes: a second entry point of the
rehearsal's vLLM plugin (``graph_samples.install`` writes both).

vLLM 0.32 sizes the KV cache from the profile run's torch peak, ``memory_stats()["allocated_bytes.all.peak"]``
(utils/mem_utils.py ``memory_profiling``), and runs the profile under ``max_split_size_mb:20``
(v1/worker/gpu_worker.py ``Worker._scoped_allocator_max_split``, entered around ``load_model`` and around the
profile run, and left before vLLM measures): a cached block of 20 MiB or more is never split, so a request may take
one up to 20 MiB larger, and the whole block counts as allocated. The allocator also counts the bytes the tensors
asked for (``requested_bytes``). The plugin wraps that scope in each worker and, as it is left, prints one line:

    KIMI_K3_REHEARSAL_PROFILE_PEAK {"pid": 123, "scope": "determine_available_memory", "allocated_peak": A,
                                    "requested_peak": R, "reserved_peak": S}

``scope`` is the worker method that entered it. ``A - R`` is at least what the allocator charged beyond the
tensors at the allocated peak (requested bytes never exceed allocated ones, and ``R`` is their largest). Nothing
vLLM measures changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Mapping

from kimi_k3_serve.rehearsal.import_hook import wrap_on_import

MARKER = "KIMI_K3_REHEARSAL_PROFILE_PEAK"
PLUGIN_NAME = "kimi_k3_rehearsal_profile_peak"
_MODULE = "vllm.v1.worker.gpu_worker"


def register() -> None:
    """vLLM's general-plugin hook: wraps the scope once vLLM imports the worker module itself."""
    wrap_on_import(_MODULE, _wrap)


def _wrap(module) -> None:
    worker = getattr(module, "Worker", None)
    original = getattr(worker, "_scoped_allocator_max_split", None)
    if original is None or getattr(original, "_kimi_k3_logged", False):
        return

    def scoped_and_logged(self, *args, **kwargs):
        scope = sys._getframe(1).f_code.co_name  # the worker method entering it: load_model or the profile's

        @contextlib.contextmanager
        def logged():
            with original(self, *args, **kwargs):
                yield
            _log(scope)

        return logged()

    scoped_and_logged._kimi_k3_logged = True
    worker._scoped_allocator_max_split = scoped_and_logged


def _log(scope: str) -> None:
    try:
        import torch

        if not torch.cuda.is_available():
            return
        line = {"pid": os.getpid(), "scope": scope, **peaks(torch.cuda.memory_stats())}
        print(f"{MARKER} {json.dumps(line)}", flush=True)
    except Exception:  # a log line never stops the engine
        pass


def peaks(stats: Mapping[str, Any]) -> dict[str, int]:
    """The peaks of ``torch.cuda.memory_stats()`` since vLLM last reset them: bytes allocated (whole blocks), bytes
    the tensors requested, and bytes reserved."""
    return {"allocated_peak": int(stats.get("allocated_bytes.all.peak", 0)),
            "requested_peak": int(stats.get("requested_bytes.all.peak", 0)),
            "reserved_peak": int(stats.get("reserved_bytes.all.peak", 0))}
