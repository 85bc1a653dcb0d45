"""Start-up budgets from the load-time estimate (``kimi_k3_serve.planning.startup``): the arithmetic, the measured
engine start it rests on (read again from the GPU run's logs), and the shipped files carrying exactly what the
estimate gives (the deploy configs' ``RAYLLM_ENGINE_START_TIMEOUT_S`` and its comment, the KubeRay liveness probe)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.startup import (
    ENGINE_START_RUN,
    ENGINE_START_S,
    KUBERAY_LIVENESS_FAILURE_THRESHOLD,
    NodeLoad,
    stage_checkpoint_bytes,
    startup_budgets,
)
from kimi_k3_serve.units import GB

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "tests" / "fixtures" / "gpu" / "2026-12-01"
FULL_DEPTH_RANK_RUNS = ("r49-s0", "r44-s1-dspark", "r44-s1-dspark-u095", "r44-s1-eagle3-mla")
"""The runs of one TP8 rank of deploy/config.yaml's stages at full depth (``rehearse --rank-of``)."""
DEPLOY_CONFIGS = sorted((REPO / "deploy").glob("config*.yaml"))


def test_engine_start_is_the_slowest_full_depth_rank_run_read_from_its_logs():
    seconds = {name: json.loads((RUNS / name / "job.json").read_text())["seconds"] for name in FULL_DEPTH_RANK_RUNS}
    slowest = max(seconds, key=seconds.get)
    assert ENGINE_START_S == seconds[slowest] == 360.0, seconds
    assert ENGINE_START_RUN == f"tests/fixtures/gpu/2026-12-01/{slowest}"
    log = (RUNS / slowest / "vllm.log").read_text()
    init = [float(x) for x in re.findall(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", log)]
    loading = [float(x) for x in re.findall(r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds", log)]
    assert init == [196.62] and loading == [21.597665]
    # the engine's own steps fit inside the process's wall time the constant takes
    assert init[0] + loading[0] < ENGINE_START_S


def test_budget_arithmetic():
    budgets = startup_budgets(
        nodes=[NodeLoad("a", 10 * GB, 5 * GB), NodeLoad("b", 10 * GB, 8 * GB)],
        network_bytes_per_s=1 * GB,
        disk_read_bytes_per_s=2 * GB,
        engine_start_s=100,
    )
    assert budgets.slowest.node == "b" and budgets.load_s == 14.0  # 10 GB at 1 GB/s + 8 GB at 2 GB/s
    assert budgets.estimate_s == 114.0
    assert budgets.engine_start_timeout_s == 180  # 2 x 14 + 1.5 x 100 = 178 s -> whole minutes
    assert budgets.liveness_failure_threshold == KUBERAY_LIVENESS_FAILURE_THRESHOLD  # 28 s: KubeRay's 600 s is longer


def test_slow_nodes_widen_the_liveness_window_and_the_timeout():
    nodes = [NodeLoad("stage 0", 1_560 * GB, 815 * GB)]
    fast = startup_budgets(nodes=nodes, network_bytes_per_s=4 * GB, disk_read_bytes_per_s=4 * GB)
    slow = startup_budgets(nodes=nodes, network_bytes_per_s=GB // 2, disk_read_bytes_per_s=GB // 2)
    assert slow.load_s == 2 * (1_560 + 815) and fast.load_s == (1_560 + 815) / 4
    assert slow.engine_start_timeout_s == 10_080  # 2 x 4,750 s + 1.5 x 360 s = 10,040 s -> 168 minutes
    assert slow.liveness_failure_threshold == 1_900  # 2 x 4,750 s / 5 s
    assert slow.liveness_window_s >= 2 * slow.load_s > fast.liveness_window_s
    assert fast.engine_start_timeout_s == 1_740  # 2 x 593.75 + 540 = 1,727.5 s -> 29 minutes


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"nodes": []}, "nodes"),
        ({"network_bytes_per_s": 0}, "network_bytes_per_s"),
        ({"disk_read_bytes_per_s": 1.5e9}, "disk_read_bytes_per_s"),
        ({"engine_start_s": -1}, "engine_start_s"),
        ({"load_margin": 0.5}, "load_margin"),
    ],
)
def test_bad_input_names_the_field(kwargs, field):
    args = {"nodes": [NodeLoad("a", 1, 1)], "network_bytes_per_s": GB, "disk_read_bytes_per_s": GB, **kwargs}
    with pytest.raises(ConfigError) as caught:
        startup_budgets(**args)
    assert caught.value.field == field


def test_bad_node_bytes_name_the_field():
    with pytest.raises(ConfigError) as caught:
        NodeLoad("a", -1, 0)
    assert caught.value.field == "node_load.download_bytes"


def _plan(config: Path):
    from kimi_k3_serve.commands.render import plan_replica
    from kimi_k3_serve.config.serve_config import load_serve_app
    from kimi_k3_serve.planning.hardware import lookup_gpu

    args = load_serve_app(config).args
    return args, plan_replica(args, gpus_per_node=lookup_gpu(args.accelerator.type).gpus_per_node)


def test_stage_bytes_split_the_checkpoint_as_vllm_does():
    from kimi_k3_serve.commands.render import node_loads_of_plan
    from kimi_k3_serve.planning.memory import stage_layer_ranges

    _, plan = _plan(REPO / "deploy" / "config.yaml")
    stages = stage_checkpoint_bytes(plan.model, stage_layer_ranges(plan.model.num_layers, plan.layout))
    vision = sum(t.checkpoint_bytes for t in plan.model.vision)
    assert len(stages) == 2 and sum(stages) == plan.model.checkpoint_bytes - vision
    assert stages[0] > stages[1]  # 49 layers and the embedding against 44, lm_head and the draft
    loads = node_loads_of_plan(plan)
    assert [n.read_bytes for n in loads] == list(stages)
    assert {n.download_bytes for n in loads} == {plan.model.checkpoint_bytes}  # every node downloads it all today


@pytest.mark.parametrize("config", DEPLOY_CONFIGS, ids=[p.name for p in DEPLOY_CONFIGS])
def test_deploy_config_carries_the_start_timeout_its_estimate_gives(config):
    from kimi_k3_serve.commands.render import startup_of_plan

    args, plan = _plan(config)
    budgets = startup_of_plan(plan)
    assert args.runtime_env.env_vars["RAYLLM_ENGINE_START_TIMEOUT_S"] == str(budgets.engine_start_timeout_s), (
        f"{config.name}: set RAYLLM_ENGINE_START_TIMEOUT_S to {budgets.engine_start_timeout_s} (the estimate's)")
    lines = [line.strip() for line in config.read_text().split("\n")]
    at = lines.index(f'RAYLLM_ENGINE_START_TIMEOUT_S: "{budgets.engine_start_timeout_s}"')
    assert lines[at - 2: at] == [f"# {text}" for text in budgets.deploy_comment()], config.name
    assert budgets.engine_start_timeout_s >= budgets.load_margin * budgets.load_s + budgets.engine_start_s


KUBERAY_FILES = sorted(p for p in (REPO / "cluster_configs").glob("kuberay-*.yaml"))


@pytest.mark.parametrize("cluster_file", KUBERAY_FILES, ids=[p.name for p in KUBERAY_FILES])
def test_kuberay_worker_liveness_outlasts_the_load_and_keeps_kuberays_check(cluster_file):
    from kimi_k3_serve.commands.render import startup_of_plan

    document = next(yaml.safe_load_all(cluster_file.read_text()))
    spec = document["spec"]
    config = yaml.safe_load(spec["serveConfigV2"])
    env = config["applications"][0]["args"]["runtime_env"]["env_vars"]
    source = re.search(r"--config (\S+)", cluster_file.read_text()).group(1)
    _, plan = _plan(REPO / source)
    budgets = startup_of_plan(plan)
    assert env["RAYLLM_ENGINE_START_TIMEOUT_S"] == str(budgets.engine_start_timeout_s)
    (worker,) = spec["rayClusterConfig"]["workerGroupSpecs"]
    container = worker["template"]["spec"]["containers"][0]
    probe = container["livenessProbe"]
    assert probe["failureThreshold"] == budgets.liveness_failure_threshold
    assert probe["failureThreshold"] * probe["periodSeconds"] >= budgets.load_margin * budgets.load_s
    assert probe["exec"]["command"][-1].endswith("http://localhost:52365/api/local_raylet_healthz | grep success")
    assert "readinessProbe" not in container  # KubeRay's own: the raylet and the Serve proxy, traffic only
    head = spec["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "livenessProbe" not in head


def test_launcher_header_states_the_budget():
    from kimi_k3_serve.commands.render import startup_of_plan

    _, plan = _plan(REPO / "deploy" / "config.yaml")
    budgets = startup_of_plan(plan)
    text = (REPO / "cluster_configs" / "aws-h200-p5en.yaml").read_text()
    for line in budgets.lines():
        assert f"# {line}\n" in text
    assert f'RAYLLM_ENGINE_START_TIMEOUT_S: "{budgets.engine_start_timeout_s}"' in text
