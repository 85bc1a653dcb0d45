"""Soak the CPU dev deployment: a fixed concurrency of streamed and non-streamed requests for a fixed time.

    .venv/bin/python scripts/soak.py                        # serves deploy/dev.yaml itself, 10 min, 16 at once
    .venv/bin/python scripts/soak.py --url http://127.0.0.1:8000 --app kimi-k3-serve-dev   # a running one

Prints throughput, p50/p99 latency (and time to first token of the streamed requests), every error, and the
resident memory (RSS) of the replica's vLLM processes -- the replica actor, the EngineCore and its workers --
at the start and the end. Bounded in time (``--duration-s``) and in count (``--max-requests``), and it only
talks to loopback addresses. Exit code 0 when every request succeeded, 1 otherwise. Not part of the test
suite: it runs for minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

# Ray's loopback mode, set before anything imports Ray: on Linux Ray turns 127.0.0.1 into the machine's outward
# address, so this script's Ray head (GCS, raylets, workers) would listen where other machines reach it.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
RAY_HOST = "127.0.0.1"

REPO_ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
PROMPTS = [
    "Tell me a story about a lighthouse.",
    "List five colours.",
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Explain what a GPU does in one paragraph.",
    "Count from one to twenty.",
    "Hello! How are you today?",
    "Describe the weather on a windy day.",
]


def replica_processes(app_name: str, deployment_prefix: str = "LLMServer") -> list[Any]:
    """The replica actor of ``app_name``'s LLM deployment on this machine and every process under it (vLLM's
    EngineCore and its workers): Ray titles the actor ``ray::ServeReplica:<app>:<deployment>``."""
    import psutil

    marker = f"ServeReplica:{app_name}:{deployment_prefix}"
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(process.info["cmdline"] or ()):
                found.append(process)
                found.extend(process.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def memory_snapshot(app_name: str) -> dict[str, int]:
    """RSS in bytes of each process of the replica, by ``title (pid)``."""
    import psutil

    snapshot = {}
    for process in replica_processes(app_name):
        try:
            title = " ".join(process.cmdline())[:60] or process.name()
            snapshot[f"{title} ({process.pid})"] = process.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return snapshot


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    tokens: int = 0
    streamed: int = 0
    plain: int = 0
    empty: int = 0
    rss_timeline: list[tuple[int, float]] = field(default_factory=list)
    """(seconds into the soak, total RSS of the replica's processes in MiB)."""
    """Streams that finished without any text (the model's first token was its end)."""
    errors: list[str] = field(default_factory=list)


async def _one(client: Any, model: str, stream: bool, rng: random.Random, tally: Tally, max_tokens: int) -> None:
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    start = time.perf_counter()
    try:
        if stream:
            first = None
            pieces = 0
            finish = None
            response = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True},
            )
            usage = None
            async for chunk in response:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces += 1
                    if first is None:
                        first = time.perf_counter() - start
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    usage = chunk.usage
            if finish is None:
                raise RuntimeError(f"stream ended without a finish_reason ({pieces} pieces of text)")
            if first is not None:  # a random-weight model may end at once (EOS first): no text, still a success
                tally.first_token.append(first)
            else:
                tally.empty += 1
            tally.tokens += usage.completion_tokens if usage else pieces
            tally.streamed += 1
        else:
            result = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
            if not result.choices or result.choices[0].finish_reason is None:
                raise RuntimeError(f"answer without a finish_reason: {result}")
            tally.tokens += result.usage.completion_tokens
            tally.plain += 1
        tally.latencies.append(time.perf_counter() - start)
    except Exception as exc:  # every failure is counted and shown, none stops the soak
        tally.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")


async def soak(url: str, model: str, *, duration_s: float, concurrency: int, max_requests: int, max_tokens: int,
               timeout_s: float, seed: int, app: str = "", sample_every_s: float = 60.0) -> Tally:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=os.environ.get("KIMI_K3_SERVE_API_KEY", "none"),
                                timeout=timeout_s, max_retries=0)
    tally = Tally()
    deadline = time.monotonic() + duration_s
    issued = 0

    async def worker(index: int) -> None:
        nonlocal issued
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < deadline and issued < max_requests:
            issued += 1
            await _one(client, model, stream=rng.random() < 0.5, rng=rng, tally=tally, max_tokens=max_tokens)

    async def sample_memory() -> None:  # a leak grows steadily; a warm-up (KV-cache pages touched) levels off
        start = time.monotonic()
        while time.monotonic() < deadline:
            await asyncio.sleep(min(sample_every_s, max(0.0, deadline - time.monotonic())))
            total = sum((await asyncio.to_thread(memory_snapshot, app)).values())
            tally.rss_timeline.append((round(time.monotonic() - start), round(total / 2**20, 1)))

    await asyncio.gather(sample_memory(), *(worker(i) for i in range(concurrency)))
    await client.close()
    return tally


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def start_ray_head(temp_dir: str) -> None:
    """This process's own Ray head on 127.0.0.1 only (loopback mode above), no dashboard; Ray 2.60 turns token
    authentication on for a head that ``ray.init`` starts."""
    import ray

    ray.init(num_cpus=8, include_dashboard=False, _temp_dir=temp_dir, _node_ip_address=RAY_HOST, log_to_driver=False)


class LocalDeployment:
    """deploy/dev.yaml on a Ray head of its own (own temp dir, loopback port), removed on exit."""

    def __init__(self, config: Path, app_name: str) -> None:
        self.config, self.app_name = config, app_name
        self.temp_dir = tempfile.mkdtemp(prefix="kk3-soak-")
        from kimi_k3_serve.serving.ports import free_loopback_port

        self.port = free_loopback_port()  # Serve's proxy binds it after Ray has started

    def __enter__(self) -> str:
        import ray
        from ray import serve
        from ray.serve.api import RunTarget

        sys.path.insert(0, str(REPO_ROOT / "scripts"))
        import make_tiny_models

        cache = make_tiny_models.default_cache_dir()
        os.environ.setdefault(make_tiny_models.MODEL_CACHE_ENV, str(cache))
        make_tiny_models.ensure_tiny_models(cache)

        from kimi_k3_serve.app import build_app
        from kimi_k3_serve.config.serve_config import load_serve_app

        raw_args = load_serve_app(self.config).raw_args
        start_ray_head(self.temp_dir)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": self.port}, proxy_location="HeadOnly")
            start = time.perf_counter()
            serve.run_many([RunTarget(target=build_app(raw_args), name=self.app_name, route_prefix="/")])
        except BaseException:
            self.__exit__()
            raise
        print(f"[{self.config.name} served as {self.app_name} in {time.perf_counter() - start:.1f} s on port {self.port}]")
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: Any) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _report(tally: Tally, seconds: float, before: dict[str, int], after: dict[str, int], args: argparse.Namespace) -> dict:
    done = len(tally.latencies)
    report = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()} {platform.release()}",
        "duration_s": round(seconds, 1),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "requests_ok": done,
        "streamed": tally.streamed,
        "non_streamed": tally.plain,
        "streams_without_text": tally.empty,
        "errors": len(tally.errors),
        "requests_per_s": round(done / seconds, 3),
        "output_tokens_per_s": round(tally.tokens / seconds, 1),
        "latency_p50_s": round(_percentile(tally.latencies, 50), 3),
        "latency_p99_s": round(_percentile(tally.latencies, 99), 3),
        "first_token_p50_s": round(_percentile(tally.first_token, 50), 3),
        "first_token_p99_s": round(_percentile(tally.first_token, 99), 3),
        "rss_start_bytes": before,
        "rss_end_bytes": after,
        "rss_total_start_mib": round(sum(before.values()) / 2**20, 1),
        "rss_total_end_mib": round(sum(after.values()) / 2**20, 1),
        "rss_timeline_mib": tally.rss_timeline,
        "first_errors": tally.errors[:10],
    }
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running deployment (loopback only); default: serve --config here")
    parser.add_argument("--config", default=str(REPO_ROOT / "deploy" / "dev.yaml"))
    parser.add_argument("--app", default="soak", help="Serve application name (to find the replica's processes)")
    parser.add_argument("--model", help="model id (default: the config's args.model.id)")
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-requests", type=int, default=200_000, help="upper bound on requests sent")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = parser.parse_args(argv)
    if not (0 < args.duration_s <= 3 * 3600 and 0 < args.concurrency <= 256 and args.max_requests > 0):
        parser.error("--duration-s in (0, 10800], --concurrency in [1, 256], --max-requests >= 1")
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        parser.error(f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))}), got {args.url}")

    from kimi_k3_serve.config.serve_config import load_serve_app

    model = args.model or load_serve_app(args.config).args.model.id

    def run(url: str) -> int:
        before = memory_snapshot(args.app)
        if not before:
            print(f"warning: no processes titled ServeReplica:{args.app}:LLMServer on this machine; RSS not measured")
        print(f"[soak: {args.duration_s:.0f} s at concurrency {args.concurrency} against {url}, model {model}]")
        start = time.perf_counter()
        tally = asyncio.run(soak(url, model, duration_s=args.duration_s, concurrency=args.concurrency,
                                 max_requests=args.max_requests, max_tokens=args.max_tokens, timeout_s=args.timeout_s,
                                 seed=args.seed, app=args.app))
        seconds = time.perf_counter() - start
        report = _report(tally, seconds, before, memory_snapshot(args.app), args)
        print(json.dumps(report, indent=2))
        print(f"{report['requests_ok']} requests ok ({report['streamed']} streamed), {report['errors']} errors in "
              f"{seconds:.0f} s: {report['requests_per_s']} req/s, {report['output_tokens_per_s']} output tokens/s, "
              f"latency p50 {report['latency_p50_s']} s p99 {report['latency_p99_s']} s; replica RSS "
              f"{report['rss_total_start_mib']} MiB -> {report['rss_total_end_mib']} MiB")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        return 0 if not tally.errors else 1

    if args.url:
        return run(args.url)
    from kimi_k3_serve.errors import KimiK3ServeError

    try:
        with LocalDeployment(Path(args.config), args.app) as url:
            return run(url)
    except KimiK3ServeError as exc:  # refused before it started (bad config, not enough memory): nothing ran
        print(f"soak not started: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
