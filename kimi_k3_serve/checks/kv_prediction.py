"""Predicted vs actual KV cache, at every replica start.

The replica-start check (``kimi_k3_serve.checks.replica_callback.ReplicaPreflight``) sizes the KV pool on the GPUs Serve
reserved (``CheckReport.num_blocks`` / ``kv_cache_tokens``) before vLLM starts; once vLLM is up, its engine
client holds what the engine core really made (``vllm_config.cache_config.num_gpu_blocks``, and
``kv_cache_size_tokens`` / ``kv_cache_max_concurrency``, all sent back in vLLM 0.32's
``EngineCoreReadyResponse``). ``compare_kv_cache`` (pure) puts them side by side in one line:

    KV cache: plan N blocks (T tokens), vLLM M blocks (U tokens): error +x.x %

``error`` is ``(plan - vLLM) / vLLM`` of the KV capacity in tokens (max concurrency x max_model_len, the same
definition on both sides), else of the blocks: positive when the plan promised more than vLLM made. Tokens
first, because for hybrid models (Kimi-K3's KDA + MLA groups) vLLM's ``num_gpu_blocks`` counts its pool's
blocks per KV-cache group while the plan counts whole block sets: on the H200 Kimi-K3 slice run the plan's
3,460 and vLLM's 9,743 blocks were the same capacity (233.00x vs 231.98x concurrency). It is within the plan's
margin when ``|error| <= margin`` (the report's ``kv_cache_margin_ratio`` when it states one: the measured error band
of the binding pool, ``planning/bands.py``; else ``DEFAULT_MARGIN``).
``report_kv_cache_prediction`` is the glue the replica runs after the engine starts: it logs the line
(a warning beyond the margin) and sets the Ray gauge ``kimi_k3_serve_kv_cache_prediction_error_ratio``
(tag ``model_id``); it never raises.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MARGIN = 0.03
"""The margin when the plan states none: 3 % of vLLM's blocks."""
MARGIN_KEY = "kv_cache_margin_ratio"
"""Where a report may state its margin: an attribute, or a key of ``CheckReport.extra``."""
METRIC_NAME = "kimi_k3_serve_kv_cache_prediction_error_ratio"


@dataclass(frozen=True)
class KvComparison:
    plan_blocks: int | None
    plan_tokens: int | None
    vllm_blocks: int
    vllm_tokens: int | None
    error: float | None
    """(plan - vLLM) / vLLM of tokens (else blocks); None without a plan, or when vLLM made no block."""
    margin: float

    @property
    def within_margin(self) -> bool:
        return self.error is None or abs(self.error) <= self.margin

    @property
    def line(self) -> str:
        def tokens(value: int | None) -> str:
            return "? tokens" if value is None else f"{value:,} tokens"

        vllm = f"vLLM {self.vllm_blocks:,} blocks ({tokens(self.vllm_tokens)})"
        if self.plan_blocks is None:
            return f"KV cache: plan none (the replica check sized no GPU pool), {vllm}"
        text = f"KV cache: plan {self.plan_blocks:,} blocks ({tokens(self.plan_tokens)}), {vllm}: "
        if self.error is None:
            return text + "error undefined (vLLM made no block)"
        text += f"error {self.error * 100:+.1f} %"
        if not self.within_margin:
            text += f", beyond the plan's margin of {self.margin * 100:.1f} %"
        return text


def margin_of(report: Any) -> float:
    """The report's stated KV margin (a ratio), else ``DEFAULT_MARGIN``."""
    if report is None:
        return DEFAULT_MARGIN
    value = getattr(report, MARGIN_KEY, None)
    if value is None:
        value = (getattr(report, "extra", None) or {}).get(MARGIN_KEY)
    try:
        value = float(value)
    except (TypeError, ValueError):
        return DEFAULT_MARGIN
    return value if math.isfinite(value) and value >= 0 else DEFAULT_MARGIN


def compare_kv_cache(plan_blocks: int | None, plan_tokens: int | None, vllm_blocks: int, vllm_tokens: int | None,
                     margin: float = DEFAULT_MARGIN) -> KvComparison:
    """The plan's KV pool against the one vLLM made."""
    error = None
    if plan_tokens is not None and vllm_tokens:
        error = (plan_tokens - vllm_tokens) / vllm_tokens
    elif plan_blocks is not None and vllm_blocks > 0:
        error = (plan_blocks - vllm_blocks) / vllm_blocks
    return KvComparison(plan_blocks, plan_tokens, int(vllm_blocks), vllm_tokens, error, margin)


def comparison_of(report: Any, cache_config: Any) -> KvComparison:
    """``compare_kv_cache`` of a ``CheckReport`` (None: no plan) and vLLM's ``CacheConfig`` after start."""
    blocks = getattr(cache_config, "num_gpu_blocks", None)
    if blocks is None:
        raise ValueError("vLLM's cache_config.num_gpu_blocks is not set: the engine has not sized its KV cache")
    tokens = getattr(cache_config, "kv_cache_size_tokens", None)
    return compare_kv_cache(
        None if report is None else int(report.num_blocks),
        None if report is None else int(report.kv_cache_tokens),
        int(blocks), None if tokens is None else int(tokens), margin_of(report))


_gauge = None


def _error_gauge():
    global _gauge
    if _gauge is None:
        from ray.util.metrics import Gauge

        _gauge = Gauge(METRIC_NAME, description="(plan - vLLM) / vLLM KV cache blocks at replica start: how far the "
                                                "memory plan's KV pool was from the one vLLM made.",
                       tag_keys=("model_id",))
    return _gauge


def report_kv_cache_prediction(report: Any, engine_client: Any, model_id: str) -> KvComparison | None:
    """Log the comparison line (a warning beyond the margin) and set the gauge. Never raises: a replica that
    serves must not fail on its own bookkeeping."""
    try:
        comparison = comparison_of(report, engine_client.vllm_config.cache_config)
    except Exception as exc:
        logger.warning("KV cache: plan vs vLLM not compared: %s: %s", type(exc).__name__, exc)
        return None
    if comparison.within_margin:
        logger.info("%s", comparison.line)
    else:
        logger.warning("%s", comparison.line)
    if comparison.error is not None:
        try:
            _error_gauge().set(comparison.error, tags={"model_id": model_id})
        except Exception as exc:
            logger.warning("KV cache: gauge %s not set: %s: %s", METRIC_NAME, type(exc).__name__, exc)
    return comparison
