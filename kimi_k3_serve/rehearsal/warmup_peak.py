"""What kernel warmup's forwards allocated: a third entry point of the rehearsal's vLLM plugin
(``graph_samples.install`` writes all three).

vLLM 0.32 runs its first forward with a KV cache in FlashInfer's autotune (model_executor/warmup/kernel_warmup.py
``flashinfer_autotune``: ``max_num_batched_tokens`` tokens), after the KV cache is allocated and before any CUDA
graph is captured; for Kimi-K3 its MLA takes the decode path the profile run never does (``planning/warmup.py``).
Then the v2 runner's ``warmup_kernels`` (v1/worker/gpu/warmup.py) runs short prefills and decodes. The plugin wraps
both in each worker and, as each returns or raises, prints one line:

    KIMI_K3_REHEARSAL_WARMUP_PEAK {"pid": 123, "scope": "flashinfer_autotune", "allocated_at_entry": E,
                                   "allocated_peak": P, "peak_at_entry": Q, "failed": false}

``E`` is what the weights, the KV cache, the workspace lanes and vLLM's buffers hold as warmup begins; ``P`` the
allocator's peak as it ends (``Q`` the peak before it: when ``P == Q`` the warmup set no new peak). On an
out-of-memory error ``P`` is the peak before the failed request. Nothing vLLM measures changes.
"""

from __future__ import annotations

import functools
import json
import os

from kimi_k3_serve.rehearsal.import_hook import wrap_on_import

MARKER = "KIMI_K3_REHEARSAL_WARMUP_PEAK"
PLUGIN_NAME = "kimi_k3_rehearsal_warmup_peak"
WRAPPED = (("vllm.model_executor.warmup.kernel_warmup", "flashinfer_autotune"),
           ("vllm.v1.worker.gpu_worker", "warmup_kernels"))
"""(module, function): the function as the worker calls it, looked up in that module at each call."""


def register() -> None:
    """vLLM's general-plugin hook: wraps the functions once vLLM imports their modules itself."""
    for module, function in WRAPPED:
        wrap_on_import(module, functools.partial(_wrap, function=function))


def _wrap(module, function: str) -> None:
    original = getattr(module, function, None)
    if original is None or getattr(original, "_kimi_k3_logged", False):
        return

    @functools.wraps(original)
    def logged(*args, **kwargs):
        entry = _stats()
        failed = True
        try:
            result = original(*args, **kwargs)
            failed = False
            return result
        finally:
            _log(function, entry, failed)

    logged._kimi_k3_logged = True
    setattr(module, function, logged)


def _stats() -> dict[str, int] | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        stats = torch.cuda.memory_stats()
        return {"allocated_at_entry": int(stats.get("allocated_bytes.all.current", 0)),
                "peak_at_entry": int(stats.get("allocated_bytes.all.peak", 0))}
    except Exception:  # a log line never stops the engine
        return None


def _log(scope: str, entry: dict[str, int] | None, failed: bool) -> None:
    try:
        import torch

        if entry is None:
            return
        peak = int(torch.cuda.memory_stats().get("allocated_bytes.all.peak", 0))
        line = {"pid": os.getpid(), "scope": scope, **entry, "allocated_peak": peak, "failed": failed}
        print(f"{MARKER} {json.dumps(line)}", flush=True)
    except Exception:
        pass
