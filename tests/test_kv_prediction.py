"""Predicted vs actual KV cache: the pure comparison, the margin, and the glue on vLLM's own ``CacheConfig``
(as its engine client holds it after start) with a real ``CheckReport`` of the memory model."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kimi_k3_serve.checks.kv_prediction import (
    DEFAULT_MARGIN,
    METRIC_NAME,
    compare_kv_cache,
    comparison_of,
    margin_of,
    report_kv_cache_prediction,
)


def test_line_and_error_within_margin():
    c = compare_kv_cache(10_200, 163_200, 10_000, 160_000)
    assert c.error == pytest.approx(0.02) and c.within_margin and c.margin == DEFAULT_MARGIN
    assert c.line == "KV cache: plan 10,200 blocks (163,200 tokens), vLLM 10,000 blocks (160,000 tokens): error +2.0 %"


def test_beyond_margin_says_so():
    c = compare_kv_cache(9_000, None, 10_000, None)
    assert c.error == pytest.approx(-0.1) and not c.within_margin
    assert c.line == ("KV cache: plan 9,000 blocks (? tokens), vLLM 10,000 blocks (? tokens): error -10.0 %, "
                      "beyond the plan's margin of 3.0 %")
    assert compare_kv_cache(9_000, None, 10_000, None, margin=0.1).within_margin


def test_no_plan_and_no_blocks():
    assert compare_kv_cache(None, None, 512, 65_536).line == (
        "KV cache: plan none (the replica check sized no GPU pool), vLLM 512 blocks (65,536 tokens)")
    none = compare_kv_cache(100, 1600, 0, 0)
    assert none.error is None and none.line.endswith("error undefined (vLLM made no block)")


def test_margin_of_a_report():
    assert margin_of(None) == DEFAULT_MARGIN
    assert margin_of(SimpleNamespace(extra={})) == DEFAULT_MARGIN
    assert margin_of(SimpleNamespace(extra={"kv_cache_margin_ratio": 0.05})) == 0.05
    assert margin_of(SimpleNamespace(kv_cache_margin_ratio=0.01, extra={})) == 0.01
    assert margin_of(SimpleNamespace(extra={"kv_cache_margin_ratio": "nan"})) == DEFAULT_MARGIN


@pytest.fixture(scope="module")
def planned():
    """A real CheckReport: the memory model on tiny Llama, TP=1, one 24 GiB GPU."""
    from pathlib import Path

    from kimi_k3_serve.planning.layout import EngineSettings, Layout, RankDevice
    from kimi_k3_serve.planning.memory import estimate_memory
    from kimi_k3_serve.models import load_model
    from kimi_k3_serve.planning.report import build_report

    model = load_model(Path(__file__).parent / "fixtures" / "configs" / "tiny-llama.json")
    memory = estimate_memory(model, Layout(tp=1), EngineSettings(max_model_len=2048, gpu_memory_utilization=0.5),
                             RankDevice(24 * 2**30, (8, 6), name="RTX-3090"))
    return build_report(model_name="tiny-llama", cluster_source="test", gpu_name="RTX-3090", memory=memory,
                        placements=None, optimisations=None, seconds=0.0)


def _cache_config(blocks: int | None, tokens: int | None):
    """vLLM's CacheConfig as the engine client holds it after ``EngineCoreReadyResponse``."""
    from vllm.config.cache import CacheConfig

    cache = CacheConfig(block_size=16)
    cache.num_gpu_blocks = blocks
    cache.kv_cache_size_tokens = tokens
    return cache


def test_comparison_of_a_report_and_vllms_cache_config(planned):
    assert planned.num_blocks > 0
    actual = int(planned.num_blocks * 0.98)
    c = comparison_of(planned, _cache_config(actual, actual * 16))
    assert (c.plan_blocks, c.plan_tokens, c.vllm_blocks, c.vllm_tokens) == (
        planned.num_blocks, planned.kv_cache_tokens, actual, actual * 16)
    assert c.error == pytest.approx(planned.num_blocks / actual - 1)
    assert c.line.startswith(f"KV cache: plan {planned.num_blocks:,} blocks ({planned.kv_cache_tokens:,} tokens), "
                             f"vLLM {actual:,} blocks")
    with pytest.raises(ValueError, match="num_gpu_blocks is not set"):
        comparison_of(planned, _cache_config(None, None))


def test_glue_logs_warns_and_never_raises(planned, caplog):
    client = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=_cache_config(planned.num_blocks // 2, None)))
    with caplog.at_level(logging.INFO, logger="kimi_k3_serve.checks.kv_prediction"):
        c = report_kv_cache_prediction(planned, client, "tiny-llama")
        assert c is not None and c.error == pytest.approx(planned.num_blocks / (planned.num_blocks // 2) - 1)
        assert report_kv_cache_prediction(planned, SimpleNamespace(), "tiny-llama") is None  # no vllm_config
    records = [r for r in caplog.records if r.name == "kimi_k3_serve.checks.kv_prediction"]
    assert records[0].levelno == logging.WARNING and "beyond the plan's margin" in records[0].getMessage()
    assert records[-1].getMessage().startswith("KV cache: plan vs vLLM not compared: AttributeError")


def test_gauge_is_exported_with_the_model_id(planned):
    """The gauge through Ray's own metrics agent: a local Ray, the glue run in a task, read back over HTTP."""
    import re
    import time
    import urllib.request

    ray = pytest.importorskip("ray")
    from conftest import free_port

    if ray.is_initialized():
        pytest.skip("a Ray instance is already initialised in this process")
    port = free_port()
    ray.init(num_cpus=1, include_dashboard=False, _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 500}, log_to_driver=False)
    try:
        blocks = int(planned.num_blocks / 1.05)

        @ray.remote(num_cpus=0)
        def replica_start(report, blocks):  # self-contained: the test module is not importable on the worker
            import time
            from types import SimpleNamespace

            from vllm.config.cache import CacheConfig

            from kimi_k3_serve.checks.kv_prediction import report_kv_cache_prediction

            cache = CacheConfig(block_size=16)
            cache.num_gpu_blocks = blocks
            # A model id of its own: the gauge set by an earlier test in this process (the driver) is exported
            # too, with model_id tiny-llama, and the first series read back would be that one.
            c = report_kv_cache_prediction(report, SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache)),
                                           "tiny-llama-gauge")
            time.sleep(3)  # let the worker's metrics reach the agent
            return c.error

        error = ray.get(replica_start.remote(planned, blocks), timeout=120)
        pattern = rf'^ray_{METRIC_NAME}\{{[^}}]*model_id="tiny-llama-gauge"[^}}]*\}} ([0-9.eE+-]+)$'
        deadline, value = time.monotonic() + 60, None
        while value is None and time.monotonic() < deadline:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            match = re.search(pattern, text, flags=re.MULTILINE)
            value = float(match.group(1)) if match else None
            time.sleep(1)
        print(f"\n[{METRIC_NAME}{{model_id=tiny-llama-gauge}} = {value}]")
        assert value == pytest.approx(error, rel=1e-6) and error == pytest.approx(planned.num_blocks / blocks - 1)
    finally:
        ray.shutdown()


def test_the_replica_warns_outside_the_measured_band(planned):
    """The plan states its KV margin as its measured error band over the binding pool (planning/bands.py): a vLLM
    pool inside the band logs at INFO, one outside it warns."""
    ratio = planned.kv_cache_margin_ratio
    assert ratio is not None and 0 < ratio < 1 and margin_of(planned) == ratio
    inside = int(planned.kv_cache_tokens / (1 + ratio * 0.5))
    outside = int(planned.kv_cache_tokens / (1 + ratio * 1.5))
    assert compare_kv_cache(planned.num_blocks, planned.kv_cache_tokens, 1, inside, margin_of(planned)).within_margin
    assert not compare_kv_cache(planned.num_blocks, planned.kv_cache_tokens, 1, outside, margin_of(planned)).within_margin
