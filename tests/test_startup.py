"""Start-up budgets from the load-time estimate (``kimi_k3_serve.planning.startup``): the arithmetic, the measured
engine start it rests on (read again from the GPU run's logs), and the shipped files carrying exactly what the
estimate gives (the deploy configs' ``RAYLLM_ENGINE_START_TIMEOUT_S`` and its comment, the KubeRay liveness probe)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kimi_k3_serve import recorded
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.checkpoint import NodeBandwidth, NodeLoad
from kimi_k3_serve.planning.startup import (
    ENGINE_START_RUN,
    ENGINE_START_S,
    KUBERAY_LIVENESS_FAILURE_THRESHOLD,
    startup_budgets,
)
from kimi_k3_serve.units import GB, MiB

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
    log = recorded.read_text(RUNS / slowest / "vllm.log")
    init = [float(x) for x in re.findall(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", log)]
    loading = [float(x) for x in re.findall(r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds", log)]
    assert init == [196.62] and loading == [21.597665]
    # the engine's own steps fit inside the process's wall time the constant takes
    assert init[0] + loading[0] < ENGINE_START_S


def _bw(network: int, disk: int) -> NodeBandwidth:
    return NodeBandwidth(network, disk, "test")


def test_budget_arithmetic():
    budgets = startup_budgets(
        nodes=[NodeLoad("a", 5 * GB, False, _bw(GB, 2 * GB)), NodeLoad("b", 8 * GB, False, _bw(GB, 2 * GB)),
               NodeLoad("c", 20 * GB, True, _bw(GB, 2 * GB))],
        engine_start_s=100,
    )
    # b: 8 GB downloaded at 1 GB/s, then read at 2 GB/s; c holds a prefetched copy: read only, 20 GB at 2 GB/s
    assert budgets.slowest.node == "b" and budgets.load_s == 12.0 and budgets.nodes[2].start_s == 10.0
    assert budgets.estimate_s == 112.0
    assert budgets.engine_start_timeout_s == 180  # 2 x 12 + 1.5 x 100 s = 174 s -> whole minutes
    assert budgets.liveness_failure_threshold == KUBERAY_LIVENESS_FAILURE_THRESHOLD  # 24 s: KubeRay's 600 s is longer


def test_a_download_onto_a_slow_disk_goes_at_the_disks_speed():
    node = NodeLoad("gp3", 1_000 * MiB, False, _bw(12_500_000_000, 125 * MiB))
    assert node.download_s == node.read_s == 8.0 and node.start_s == 16.0


def test_slow_nodes_widen_the_liveness_window_and_the_timeout():
    fast = startup_budgets(nodes=[NodeLoad("stage 0", 1_560 * GB, False, _bw(4 * GB, 4 * GB))])
    slow = startup_budgets(nodes=[NodeLoad("stage 0", 1_560 * GB, False, _bw(GB // 2, GB // 2))])
    assert slow.load_s == 2 * 2 * 1_560 and fast.load_s == 2 * 1_560 / 4
    assert slow.engine_start_timeout_s == 13_020  # 2 x 6,240 s + 1.5 x 360 s = 13,020 s: 217 minutes
    assert slow.liveness_failure_threshold == 2_496  # 2 x 6,240 s / 5 s
    assert slow.liveness_window_s >= 2 * slow.load_s > fast.liveness_window_s
    assert fast.engine_start_timeout_s == 2_100  # 2 x 780 + 540 = 2,100 s


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"nodes": []}, "nodes"),
        ({"engine_start_s": -1}, "engine_start_s"),
        ({"load_margin": 0.5}, "load_margin"),
    ],
)
def test_bad_input_names_the_field(kwargs, field):
    args = {"nodes": [NodeLoad("a", 1, False, _bw(GB, GB))], **kwargs}
    with pytest.raises(ConfigError) as caught:
        startup_budgets(**args)
    assert caught.value.field == field


@pytest.mark.parametrize("make, field", [
    (lambda: NodeLoad("a", -1, False, _bw(GB, GB)), "node_load.nbytes"),
    (lambda: _bw(0, GB), "node_bandwidth.network_bytes_per_s"),
    (lambda: _bw(GB, 1.5e9), "node_bandwidth.disk_read_bytes_per_s"),
])
def test_bad_node_numbers_name_the_field(make, field):
    with pytest.raises(ConfigError) as caught:
        make()
    assert caught.value.field == field


def _args(config: Path):
    from kimi_k3_serve.config.serve_config import load_serve_app

    return load_serve_app(config).args


def _offering(args, platform: str):
    from kimi_k3_serve.clusterfiles.render import find_offering
    from kimi_k3_serve.planning.hardware import lookup_gpu

    return find_offering(platform, lookup_gpu(args.accelerator.type).name)


def test_the_budgets_and_check_read_the_same_per_node_bytes():
    """The budgets' bytes are the checkpoint plan's per-node needs: the whole checkpoint on every node without a
    per-node copy (Ray Serve LLM downloads it, vLLM reads every file), only the node's stage files with one."""
    from kimi_k3_serve.commands.checkpoint_section import checkpoint_plan
    from kimi_k3_serve.commands.render import startup_on

    args = _args(REPO / "deploy" / "config.yaml")
    offering = _offering(args, "aws")
    plan = checkpoint_plan(args, ranks_per_node=offering.gpus, mode="auto")
    whole = startup_on(args, offering)
    assert [n.nbytes for n in whole.nodes] == [plan.whole_bytes] * 2 and not any(n.prefetched for n in whole.nodes)
    copy = args.model_copy(update={"model": args.model.model_copy(update={"download_dir": "/mnt/nvme/kimi-k3"})})
    split = startup_on(copy, offering)
    assert [n.nbytes for n in split.nodes] == [n.bytes for n in plan.nodes] and all(n.prefetched for n in split.nodes)
    assert split.slowest.nbytes < 0.56 * plan.whole_bytes
    # prefetched: read only, about half the bytes -> about a quarter of the load
    assert split.load_s < 0.3 * whole.load_s and split.engine_start_timeout_s < whole.engine_start_timeout_s


def test_the_node_types_bandwidths_come_from_the_catalogue_and_the_rendered_volume():
    from kimi_k3_serve.clusterfiles.render import AWS_WORKER_VOLUME
    from kimi_k3_serve.commands.render import offering_bandwidth
    from kimi_k3_serve.planning.hardware import DEFAULT_NODE_IO, lookup_node_io

    args = _args(REPO / "deploy" / "config.yaml")
    aws = offering_bandwidth(_offering(args, "aws"))
    assert aws.network_bytes_per_s == lookup_node_io("p5en.48xlarge").network_bytes_per_s
    assert aws.disk_read_bytes_per_s == AWS_WORKER_VOLUME["Throughput"] * MiB == aws.download_bytes_per_s
    assert not aws.defaulted
    pod = offering_bandwidth(_offering(args, "kubernetes"))
    assert pod.defaulted and (pod.network_bytes_per_s, pod.disk_read_bytes_per_s) == (
        DEFAULT_NODE_IO.network_bytes_per_s, DEFAULT_NODE_IO.disk_read_bytes_per_s)
    assert "default (h200-8gpu-pod: not in hardware.NODE_IO)" in pod.source


@pytest.mark.parametrize("config", DEPLOY_CONFIGS, ids=[p.name for p in DEPLOY_CONFIGS])
def test_deploy_config_carries_the_start_timeout_its_estimate_gives(config):
    from kimi_k3_serve.commands.render import deploy_comment, deploy_startup

    args = _args(config)
    budgets = deploy_startup(args)
    assert args.runtime_env.env_vars["RAYLLM_ENGINE_START_TIMEOUT_S"] == str(budgets.engine_start_timeout_s), (
        f"{config.name}: set RAYLLM_ENGINE_START_TIMEOUT_S to {budgets.engine_start_timeout_s} (the estimate's)")
    lines = [line.strip() for line in config.read_text().split("\n")]
    at = lines.index(f'RAYLLM_ENGINE_START_TIMEOUT_S: "{budgets.engine_start_timeout_s}"')
    comment = deploy_comment(args)
    assert lines[at - len(comment): at] == [f"# {text}" for text in comment], config.name
    assert budgets.engine_start_timeout_s >= budgets.load_margin * budgets.load_s + budgets.engine_start_s
    if config.name == "config.yaml":  # README.md derives this config's budget in numbers: they are the estimate's
        slowest = max(budgets.nodes, key=lambda node: node.start_s)
        quoted = (f"all {slowest.nbytes / 1e9:,.0f} GB: {budgets.load_s:,.0f} s, so `RAYLLM_ENGINE_START_TIMEOUT_S` "
                  f"{budgets.engine_start_timeout_s} s")
        assert quoted in " ".join((REPO / "README.md").read_text().split()), quoted


KUBERAY_FILES = sorted(p for p in (REPO / "cluster_configs").glob("kuberay-*.yaml"))


@pytest.mark.parametrize("cluster_file", KUBERAY_FILES, ids=[p.name for p in KUBERAY_FILES])
def test_kuberay_worker_liveness_outlasts_the_load_and_keeps_kuberays_check(cluster_file):
    from kimi_k3_serve.commands.render import deploy_startup, startup_on

    text = cluster_file.read_text()
    spec = next(yaml.safe_load_all(text))["spec"]
    config = yaml.safe_load(spec["serveConfigV2"])
    env = config["applications"][0]["args"]["runtime_env"]["env_vars"]
    args = _args(REPO / re.search(r"--config (\S+)", text).group(1))
    assert env["RAYLLM_ENGINE_START_TIMEOUT_S"] == str(deploy_startup(args).engine_start_timeout_s)
    budgets = startup_on(args, _offering(args, "kubernetes"))  # the pod's own load, at the default bandwidths
    assert budgets.slowest.bandwidth.defaulted
    (worker,) = spec["rayClusterConfig"]["workerGroupSpecs"]
    container = worker["template"]["spec"]["containers"][0]
    probe = container["livenessProbe"]
    assert probe["failureThreshold"] == budgets.liveness_failure_threshold
    assert probe["failureThreshold"] * probe["periodSeconds"] >= budgets.load_margin * budgets.load_s
    assert probe["exec"]["command"][-1].endswith("http://localhost:52365/api/local_raylet_healthz | grep success")
    assert "readinessProbe" not in container  # KubeRay's own: the raylet and the Serve proxy, traffic only
    head = spec["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "livenessProbe" not in head
    for line in budgets.lines():  # the default, and why, in the header
        assert f"# {line}\n" in text


def test_launcher_header_states_the_budget_on_its_volume():
    from kimi_k3_serve.commands.render import deploy_startup, startup_on

    args = _args(REPO / "deploy" / "config.yaml")
    budgets = startup_on(args, _offering(args, "aws"))
    text = (REPO / "cluster_configs" / "aws-h200-p5en.yaml").read_text()
    for line in budgets.lines():
        assert f"# {line}\n" in text
    assert "Throughput: 1000" in text and "EBS gp3 Throughput: 1,000 MiB/s (cluster file)" in text
    assert budgets.engine_start_timeout_s == deploy_startup(args).engine_start_timeout_s  # p5en binds for H200
    assert f'RAYLLM_ENGINE_START_TIMEOUT_S: "{budgets.engine_start_timeout_s}"' in text
