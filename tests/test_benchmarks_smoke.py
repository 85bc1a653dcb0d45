"""The benchmark scripts still run: the planner benchmark's core on a small range, and its import-cost parser.

No timing is asserted (the machine is shared); only that the rows are there and say what they claim.
"""

from __future__ import annotations

import argparse

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
    for bad in ("serve@-1", "serve@x", "ray", "vllm@5"):
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
