#!/usr/bin/env python3
"""What one engine metric observation costs the process that serves the tokens: vLLM's inter-token-latency histogram
through Ray's metrics API (``RayHistogramWrapper``, what Ray Serve LLM installs while ``log_engine_metrics`` is on, its
default) against vLLM's own ``prometheus_client`` histogram (bare ``vllm serve``).

vLLM 0.32 observes that histogram once per running request per engine step (``PrometheusStatLogger.record``:
``for itl in iteration_stats.inter_token_latencies_iter``), in the process that holds ``AsyncLLM``: the API server, or
under Ray Serve LLM the LLM replica, where it competes with streaming the tokens. At 256 streams and 23 ms a step
(Llama-3.1-8B's shape on one H200) that is about 11,000 observations a second.

    .venv/bin/python scripts/bench_engine_metrics.py            # a local Ray instance of its own; about 20 s

Prints microseconds per observation (median of rounds) and the share of one core each would take at the rate above.
"""

from __future__ import annotations

import argparse
import statistics
import time

OBSERVATIONS_PER_S_AT_256 = 256 / 0.023
"""256 running streams, one step every 23 ms (bare vLLM's ITL p50 at 256 on the H200, 2026-12-03)."""


def per_observation_us(observe, count: int) -> float:
    started = time.perf_counter()
    for index in range(count):
        observe(0.005 + (index % 50) * 1e-4)
    return (time.perf_counter() - started) / count * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20_000, help="observations per round (default 20000)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.count < 1 or args.rounds < 1:
        parser.error("--count and --rounds: at least 1")

    import prometheus_client
    import ray
    from vllm.v1.metrics.buckets import histogram_buckets
    from vllm.v1.metrics.ray_wrappers import RayHistogramWrapper

    buckets = histogram_buckets("inter_token_latency")
    labels = ("model_name", "engine")
    registry = prometheus_client.CollectorRegistry()
    bare = prometheus_client.Histogram("vllm:inter_token_latency_seconds", "ITL", labelnames=labels,
                                       buckets=buckets, registry=registry).labels("m", "0")
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)  # never a running cluster
    try:
        through_ray = RayHistogramWrapper("vllm:inter_token_latency_seconds", "ITL", labelnames=list(labels),
                                          buckets=buckets).labels("m", "0")
        rows = {"vLLM's prometheus_client histogram (bare vllm serve)": bare.observe,
                "Ray's metrics API (RayHistogramWrapper, Ray Serve LLM's default)": through_ray.observe}
        print(f"{len(buckets)} buckets, {args.count} observations a round, {args.rounds} rounds")
        for name, observe in rows.items():
            per_observation_us(observe, min(args.count, 1000))  # warm-up
            median = statistics.median(per_observation_us(observe, args.count) for _ in range(args.rounds))
            share = median * 1e-6 * OBSERVATIONS_PER_S_AT_256
            print(f"{name}: {median:.2f} us per observation; {100 * share:.1f} % of one core at "
                  f"{OBSERVATIONS_PER_S_AT_256:,.0f} observations/s (256 streams, 23 ms steps)")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
