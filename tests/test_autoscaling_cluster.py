"""Real cluster autoscaling on this machine, with the node type of the rendered fake cluster file.

Ray's fake multi-node provider starts real raylets (fake GPUs, the same custom resources as the production
cluster files) when the autoscaler sees a pending placement group. The test asks for the planner's placement
group of one Kimi-K3 replica of deploy/config.yaml (16 one-GPU bundles with ``accelerator_type:H200``, PACK;
Serve adds the replica actor's CPU to bundle 0), checks the cluster grows from
zero to exactly the nodes one replica needs with 8 bundles on each, that a second replica doubles it, that the
worker cap (max_replicas x nodes per replica) holds a third replica back, and that releasing the groups
removes the nodes after the idle timeout.

Isolation: ``ray stop`` would kill every Ray process on the machine, including other people's test clusters.
This cluster uses its own free ports and temp dir, binds 127.0.0.1 only (conftest), and ``ray start`` runs in a
new session, so every process of the cluster (GCS, raylets, the autoscaler monitor and the worker nodes it
launches) shares one process group; Ray's worker processes, which run in process groups of their own, are their
children. Teardown signals exactly these processes (the group, their descendants, anything naming the temp dir)
by pid.
(``ray.cluster_utils.AutoscalingCluster`` is not used: in the 2.60 wheel it reads an example file the wheel
does not ship, and its start/shutdown run a global ``ray stop --force``.)
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import LOOPBACK, assert_ray_stays_on_this_machine, free_ports
from kimi_k3_serve.commands.render import load_deploy_config, plan_replica, replica_shape_from_plan

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]
FAKE_CLUSTER_FILE = REPO / "cluster_configs" / "fake-h200.yaml"
DEPLOY_CONFIG = REPO / "deploy" / "config.yaml"
HEAD_NODE_TYPE = "ray.head.default"


def _cluster_processes(pgid: int, temp_dir: str) -> list[psutil.Process]:
    """Every process of this cluster: the process group ``ray start`` created (GCS, raylets, autoscaler and the
    worker nodes it launches), their descendants (Ray workers run in process groups of their own), and anything
    whose command line names the cluster's temp dir."""
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid == os.getpid():
            continue
        try:
            in_group = os.getpgid(proc.pid) == pgid
        except OSError:
            continue
        if in_group or temp_dir in " ".join(proc.info["cmdline"] or ()):
            found[proc.pid] = proc
    for proc in list(found.values()):
        try:
            for child in proc.children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def _kill_cluster(pgid: int, temp_dir: str) -> int:
    """Stop exactly this cluster, process by process; returns how many processes were signalled."""
    processes = _cluster_processes(pgid, temp_dir)
    for proc in processes:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return len(processes)


@pytest.fixture
def fake_autoscaling_cluster():
    """A head started by hand with the rendered fake cluster file as its autoscaling config."""
    import ray

    config = yaml.safe_load(FAKE_CLUSTER_FILE.read_text())
    head = config["available_node_types"][HEAD_NODE_TYPE]["resources"]
    # One draw for every port the head binds: ports drawn one by one can repeat, and `ray start` refuses that.
    gcs_port, dashboard, client, agent_http, agent_grpc, runtime_env, metrics = free_ports(7)
    config["provider"]["gcs_address"] = f"{LOOPBACK}:{gcs_port}"  # the provider assumes 6379 otherwise
    # Short: Ray puts Unix sockets under it, and socket paths are limited to 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="k3fake")
    config_path = Path(temp_dir) / "autoscaling.json"
    config_path.write_text(json.dumps(config))
    ray_cli = Path(sys.executable).with_name("ray")
    command = [
        str(ray_cli), "start", "--head",
        f"--port={gcs_port}",
        f"--node-ip-address={LOOPBACK}",
        f"--num-cpus={head['CPU']}",
        "--num-gpus=0",
        f"--temp-dir={temp_dir}",
        f"--autoscaling-config={config_path}",
        "--include-dashboard=false",
        f"--dashboard-port={dashboard}",  # a minimal dashboard still starts, on 8265 unless told otherwise
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}",
        "--object-store-memory=100000000",
        "--disable-usage-stats",
    ]
    # Token auth switches itself on when ~/.ray/auth_token exists; this cluster opts out explicitly so the driver
    # below (which does not read that file) can connect. Without auth it must be reachable from this machine
    # only: asserted once the head is up and again when the autoscaler's nodes are.
    env = dict(os.environ, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    log_path = Path(temp_dir) / "ray-start.log"
    with open(log_path, "w") as log:
        starter = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = starter.wait(timeout=120)
        assert rc == 0, f"ray start failed ({rc}):\n{log_path.read_text()[-3000:]}"
        ray.init(address=f"{LOOPBACK}:{gcs_port}", logging_level="WARNING", log_to_driver=False)
        assert_ray_stays_on_this_machine()
        yield config
    finally:
        ray.shutdown()
        stopped = _kill_cluster(starter.pid, temp_dir)
        left = [p.pid for p in _cluster_processes(starter.pid, temp_dir)]
        print(f"\nfake cluster stopped: {stopped} processes of group {starter.pid} and their children, {len(left)} left")
        if not left:
            shutil.rmtree(temp_dir, ignore_errors=True)
            # This process's own Ray log writers may still flush into the session dir: remove it again at exit.
            atexit.register(shutil.rmtree, temp_dir, True)
        assert not left, f"processes of the test cluster survived teardown: {left}"


def _gpu_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0]


def _replica_plan():
    """The planner's plan for one replica of deploy/config.yaml and the shape it gives the cluster files."""
    args = load_deploy_config(DEPLOY_CONFIG).args
    plan = plan_replica(args, gpus_per_node=8)
    shape = replica_shape_from_plan(plan, gpus_per_node=8, cpus_per_node=0, memory_bytes_per_node=0)
    return plan, shape


def _replica_bundles(plan) -> tuple[list[dict[str, float]], str]:
    """The plan's placement group as Serve creates it: the replica actor's CPU merged into bundle 0."""
    config = plan.placement_group_config
    bundles = [dict(b) for b in config["bundles"]]
    bundles[0]["CPU"] = bundles[0].get("CPU", 0) + 1.0
    return bundles, config["strategy"]


def _wait_ready(pg, timeout_s: float, peak: list[int]) -> float:
    import ray

    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        peak[0] = max(peak[0], len(_gpu_nodes()))
        if pg.wait(timeout_seconds=0.5):
            return time.monotonic() - start
    raise AssertionError(f"placement group not ready after {timeout_s:.0f} s; {ray.cluster_resources()}")


def test_plan_placement_group_scales_fake_cluster_up_and_down(fake_autoscaling_cluster):
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    config = fake_autoscaling_cluster
    worker_type = next(name for name in config["available_node_types"] if name != HEAD_NODE_TYPE)
    node_type = config["available_node_types"][worker_type]
    gpus_per_node = node_type["resources"]["GPU"]
    idle_timeout_s = config["idle_timeout_minutes"] * 60
    plan, shape = _replica_plan()
    bundles, strategy = _replica_bundles(plan)
    nodes_per_replica = shape.nodes_per_replica
    assert (len(bundles), strategy, shape.bundles_per_node) == (16, "PACK", (8, 8))
    assert gpus_per_node == shape.gpus_per_node and node_type["max_workers"] == 2 * nodes_per_replica
    assert _gpu_nodes() == [], "the fake cluster must start without GPU nodes"

    peak = [0]
    first = placement_group(bundles, strategy=strategy)
    t_first = _wait_ready(first, 90, peak)
    table = placement_group_table(first)
    per_node = Counter(table["bundles_to_node_id"].values())
    gpu_node_ids = {n["NodeID"] for n in _gpu_nodes()}
    print(f"\nreplica 1: 0 -> {len(gpu_node_ids)} GPU nodes, placement group ready in {t_first:.1f} s, bundles per node "
          f"{sorted(per_node.values())}")
    assert len(gpu_node_ids) == nodes_per_replica and peak[0] == nodes_per_replica
    assert sorted(per_node.values()) == sorted(shape.bundles_per_node)
    assert set(per_node) == gpu_node_ids
    for node in _gpu_nodes():
        assert node["Resources"]["accelerator_type:H200"] == node_type["resources"]["accelerator_type:H200"]

    second = placement_group(bundles, strategy=strategy)
    t_second = _wait_ready(second, 90, peak)
    print(f"replica 2: {len(_gpu_nodes())} GPU nodes, ready in {t_second:.1f} s")
    assert len(_gpu_nodes()) == 2 * nodes_per_replica

    # max_workers = max_replicas x nodes_per_replica: a third replica cannot get nodes.
    third = placement_group(bundles, strategy=strategy)
    held_back = not third.wait(timeout_seconds=10)
    print(f"replica 3 (over max_replicas): pending after 10 s = {held_back}, GPU nodes {len(_gpu_nodes())}")
    assert held_back and len(_gpu_nodes()) == node_type["max_workers"]
    assert_ray_stays_on_this_machine()  # the raylets the autoscaler started as well

    released = time.monotonic()
    for group in (third, second, first):
        remove_placement_group(group)
    still_up_at = released + idle_timeout_s / 2
    while time.monotonic() < still_up_at:
        time.sleep(0.5)
    assert len(_gpu_nodes()) == node_type["max_workers"], "nodes went away before the idle timeout"
    while _gpu_nodes():
        assert time.monotonic() - released < idle_timeout_s + 90, "idle nodes were not removed"
        time.sleep(0.5)
    t_down = time.monotonic() - released
    print(f"released: all GPU nodes gone {t_down:.1f} s later (idle timeout {idle_timeout_s:.0f} s)")
    assert t_down >= idle_timeout_s
    assert ray.cluster_resources().get("GPU", 0) == 0
