"""The fabric check: bus bandwidth as nccl-tests defines it, which network NCCL says it uses (on NCCL's own log
line formats), the judgement against the hardware catalogue's interconnect, and the measuring code itself run for
real over gloo between two raylets of a Ray test cluster. The NCCL path runs in tests/test_gpu.py (2 GPUs)."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

import pytest

from kimi_k3_serve.checks.fabric import judge_fabric, measurement, nccl_transport
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.hardware import INTERCONNECTS, Interconnect, interconnect_of
from kimi_k3_serve.units import GB, MiB

REPO = Path(__file__).resolve().parents[1]

P5EN = INTERCONNECTS["p5en.48xlarge"]


def test_bus_bandwidth_is_nccl_tests_definition():
    two = measurement("all_reduce", 256 * MiB, 0.01, 2)
    assert two.algbw == 256 * MiB / 0.01 and two.busbw == two.algbw  # 2(n-1)/n = 1
    eight = measurement("all_reduce", 256 * MiB, 0.01, 8)
    assert eight.busbw == pytest.approx(eight.algbw * 14 / 8)
    pair = measurement("send_recv", 256 * MiB, 0.01, 2)
    assert pair.busbw == pair.algbw
    with pytest.raises(ConfigError) as caught:
        measurement("broadcast", 1, 1.0, 2)
    assert caught.value.field == "fabric.op"


def test_catalogue_rail_per_gpu():
    assert P5EN.bytes_per_s_per_gpu == 50 * GB  # 3,200 Gbps over 8 GPUs
    assert P5EN.transport == "ofi" and any("FI_PROVIDER" in s for s in P5EN.settings)
    assert interconnect_of("H200", "P5EN.48xlarge") is P5EN
    assert interconnect_of("H200").bytes_per_s_per_gpu == 50 * GB  # a pod names no instance type
    assert interconnect_of("GB300").transport == "nvlink"
    assert interconnect_of("L40S") is None
    for interconnect in INTERCONNECTS.values():
        assert interconnect.source and interconnect.settings


# Lines as NCCL and aws-ofi-nccl print them (NVIDIA/nccl#1053, #952, #1597; aws/aws-ofi-nccl#24).
SOCKET_AFTER_IB_FAILED = [
    "gpu02:20868:20914 [0] NCCL INFO NET/IB : No device found.",
    "axa:3048391:3048566 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>",
    "axa:3048391:3048566 [0] NCCL INFO Using network Socket",
]
EFA = [
    "8h200-2:6831:6840 [0] NCCL INFO NET/Plugin: Failed to find ncclCollNetPlugin_v8 symbol.",
    "8h200-3:6310:6318 [0] NCCL INFO NET/OFI Selected Provider is efa (found 16 nics)",
    "8h200-2:6831:6840 [0] NCCL INFO Using network Libfabric",
]
IB = ["node1:101:202 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eth0:10.0.0.1<0>",
      "node1:101:202 [0] NCCL INFO Using network IB"]
CHANNELS_ONLY = [
    "<cluster_name>:919:1150 [0] NCCL INFO Channel 01/0 : 8[0] -> 15[7] via P2P/IPC/read",
    "<cluster_name>:926:1151 [7] NCCL INFO Channel 03/0 : 15[7] -> 6[6] [send] via NET/Socket/3",
]
OLD_EFA_RING = ["[1,7]<stdout>:ip-172-32-38-1:21471:22316 [7] NCCL INFO Ring 00 : 7 -> 8 [send] via NET/AWS Libfabric/0"]
NVLINK_ONLY = ["tray0:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] via P2P/CUMEM/read",
               "tray0:1:2 [0] NCCL INFO Channel 00/1 : 0[0] -> 1[0] via NVLS"]


@pytest.mark.parametrize("lines, expected", [
    (SOCKET_AFTER_IB_FAILED, "socket"),
    (SOCKET_AFTER_IB_FAILED[:2], "socket"),  # without the "Using network" line: "No device found" is no choice
    (EFA, "ofi"),
    (EFA[:2], "ofi"),
    (IB, "ib"),
    (IB[:1], "ib"),
    (CHANNELS_ONLY, "socket"),
    (OLD_EFA_RING, "ofi"),
    (NVLINK_ONLY, "nvlink"),
    (["NCCL version 2.29.7+cuda13.0"], None),
])
def test_nccl_transport_from_its_log_lines(lines, expected):
    assert nccl_transport(lines) == expected


def _at(busbw_bytes_per_s: float):
    seconds = 256 * MiB / busbw_bytes_per_s
    return [measurement("all_reduce", 256 * MiB, seconds, 2), measurement("send_recv", 256 * MiB, seconds, 2)]


def test_healthy_efa_passes_quietly():
    verdict = judge_fabric(_at(40 * GB), transport="ofi", expected=P5EN, node_type="p5en.48xlarge")
    assert not verdict.refused and verdict.warnings == ()
    assert "80% of p5en.48xlarge's EFAv3 at 50.0 GB/s per GPU" in verdict.line and "busbw 40.00 GB/s" in verdict.line


def test_sockets_warn_and_name_the_settings_of_the_node_type():
    verdict = judge_fabric(_at(2 * GB), transport="socket", expected=P5EN, node_type="p5en.48xlarge")
    (warning,) = verdict.warnings
    assert not verdict.refused
    assert "NCCL is using TCP sockets (NET/Socket), not EFAv3" in warning
    assert "2.00 GB/s is 4% of the 50.0 GB/s" in warning
    for setting in ("FI_PROVIDER=efa", "aws-ofi-nccl", "NCCL_SOCKET_IFNAME"):
        assert setting in warning
    azure = judge_fabric(_at(2 * GB), transport="socket", expected=INTERCONNECTS["Standard_ND96isr_H200_v5"],
                         node_type="Standard_ND96isr_H200_v5")
    assert "NCCL_IB_HCA" in azure.warnings[0] and "FI_PROVIDER" not in azure.warnings[0]


def test_far_below_on_the_fabric_warns_and_the_flag_refuses():
    slow = judge_fabric(_at(10 * GB), transport="ofi", expected=P5EN, node_type="p5en.48xlarge")
    assert not slow.refused and "below 25%" in slow.warnings[0] and "TCP sockets" not in slow.warnings[0]
    refused = judge_fabric(_at(30 * GB), transport="ofi", expected=P5EN, node_type="p5en.48xlarge",
                           min_fabric_fraction=0.7)
    assert refused.refused and "Refused: args.fabric.min_fabric_fraction is 0.7" in refused.warnings[0]
    assert not judge_fabric(_at(40 * GB), transport="ofi", expected=P5EN, node_type="p5en.48xlarge",
                            min_fabric_fraction=0.7).refused
    with pytest.raises(ConfigError) as caught:
        judge_fabric(_at(1 * GB), transport="ofi", expected=P5EN, node_type="x", min_fabric_fraction=1.5)
    assert caught.value.field == "args.fabric.min_fabric_fraction"


def test_the_flag_is_in_the_deploy_args():
    from kimi_k3_serve.config.args import load_args

    args = {"model": {"id": "m", "source": "/tmp/m"}, "limits": {"max_model_len": 128},
            "fabric": {"node_type": "p5en.48xlarge", "min_fabric_fraction": 0.5}}
    assert load_args(args).fabric.min_fabric_fraction == 0.5
    with pytest.raises(ConfigError) as caught:
        load_args({**args, "fabric": {"min_fabric_fraction": 2}})
    assert caught.value.field == "args.fabric.min_fabric_fraction"


# --- the measuring code, for real, over gloo between two raylets ------------------------------------------------


@pytest.fixture(scope="module")
def two_node_pg():
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    started = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
    ray.get(pg.ready(), timeout=60)
    table = placement_group_table(pg)["bundles_to_node_id"]
    print(f"\n[3-raylet Ray cluster and a 2-node placement group in {time.perf_counter() - started:.1f} s]")
    try:
        yield pg, [table[0][:8], table[1][:8]]
    finally:
        remove_placement_group(pg)
        ray.shutdown()
        cluster.shutdown()


def test_gloo_measures_a_bandwidth_between_two_nodes(two_node_pg, caplog):
    from kimi_k3_serve.checks.replica import comm_smoke_test

    pg, nodes = two_node_pg
    with caplog.at_level(logging.WARNING, logger="kimi_k3_serve.checks.replica"):
        lines = comm_smoke_test(pg, [0, 1], nodes, backend="gloo", timeout_s=120, measure_bytes=8 * MiB).split("\n")
    assert lines[0].startswith("communication: gloo all-reduce and stage-to-stage send/recv across 2 nodes")
    fabric = lines[1]
    assert fabric.startswith("fabric: all/reduce busbw ") and "send/recv busbw" in fabric and "over gloo" in fabric
    busbw = float(fabric.split("busbw ")[1].split(" GB/s")[0])
    assert busbw > 0.0, fabric
    assert not caplog.records  # nothing to judge against: reported only


def test_gloo_bandwidth_far_below_a_fabric_warns_and_refuses_under_the_flag(two_node_pg, caplog):
    """Throttling, the other way round: the loopback TCP the raylets share is judged against a rail of 10 TB/s
    per GPU, far above anything it carries, so the verdict is "far below" from a real measurement."""
    from kimi_k3_serve.checks.replica import FabricExpectation, ReplicaCheckError, comm_smoke_test

    pg, nodes = two_node_pg
    rail = Interconnect("a 10 TB/s test rail", 10_000 * GB, "ib", ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"), "this test")
    with caplog.at_level(logging.WARNING, logger="kimi_k3_serve.checks.replica"):
        comm_smoke_test(pg, [0, 1], nodes, backend="gloo", timeout_s=120, measure_bytes=8 * MiB,
                        expectation=FabricExpectation("test-node", rail))
    (record,) = caplog.records
    assert "fabric between the stage nodes (test-node): the bus bandwidth" in record.message
    assert "NCCL_IB_HCA" in record.message and "Refused" not in record.message
    with pytest.raises(ReplicaCheckError, match=r"Refused: args.fabric.min_fabric_fraction is 0.5"):
        comm_smoke_test(pg, [0, 1], nodes, backend="gloo", timeout_s=120, measure_bytes=8 * MiB,
                        expectation=FabricExpectation("test-node", rail, min_fabric_fraction=0.5))
    slow_rail = Interconnect("a 1 kB/s test rail", 1000, "ib", ("NCCL_IB_HCA",), "this test")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kimi_k3_serve.checks.replica"):
        line = comm_smoke_test(pg, [0, 1], nodes, backend="gloo", timeout_s=120, measure_bytes=8 * MiB,
                               expectation=FabricExpectation("test-node", slow_rail, min_fabric_fraction=0.5))
    assert not caplog.records and "of test-node's a 1 kB/s test rail" in line


def _busbw(fabric_line: str) -> list[float]:
    """The bus bandwidths (bytes/s) a ``fabric:`` line reports."""
    return [float(x) * GB for x in re.findall(r"busbw ([\d.]+) GB/s", fabric_line.replace(",", ""))]


THROTTLE = "tc qdisc add dev lo root tbf rate 80mbit burst 256kb latency 500ms"
"""10 MB/s on the namespace's loopback: a fabric that fell back to a slow path, for real."""


def test_a_throttled_link_is_measured_far_below_the_unthrottled_one_and_warns(two_node_pg, caplog):
    """Throttling on CPU: the gloo measurement between two raylets, first on this host's loopback (the "expected"
    rail, and judged against it: no warning), then in a network namespace whose loopback ``tc`` holds to 10 MB/s,
    judged against the same rail: the check reports the lower bandwidth and warns, naming what to check."""
    import shutil
    import subprocess
    import sys

    from kimi_k3_serve.checks.replica import FabricExpectation, comm_smoke_test

    if not (shutil.which("unshare") and shutil.which("tc") and shutil.which("ip")):
        pytest.skip("needs unshare, ip and tc (iproute2) to throttle a private loopback")
    probe = subprocess.run(["unshare", "-n", "--", "sh", "-c", f"ip link set lo up && {THROTTLE}"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot throttle a private network namespace here: {probe.stderr.decode()[-200:]}")
    pg, nodes = two_node_pg
    measure = 4 * MiB
    fabric = comm_smoke_test(pg, [0, 1], nodes, backend="gloo", timeout_s=120, measure_bytes=measure).split("\n")[1]
    unthrottled = min(_busbw(fabric))
    rail = Interconnect("this host's unthrottled loopback", int(unthrottled), "socket", ("tc qdisc show dev lo",), "here")
    with caplog.at_level(logging.WARNING, logger="kimi_k3_serve.checks.replica"):
        comm_smoke_test(pg, [0, 1], nodes, backend="gloo", timeout_s=120, measure_bytes=measure,
                        expectation=FabricExpectation("loopback", rail))
    assert not caplog.records, [r.message for r in caplog.records]  # unthrottled against itself: no warning

    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    script = f"ip link set lo up && {THROTTLE} && exec {sys.executable} tests/throttled_fabric.py {measure} {int(unthrottled)}"
    done = subprocess.run(["unshare", "-n", "--", "sh", "-c", script], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    throttled = min(_busbw(result["lines"].split("\n")[1]))
    assert throttled < 0.25 * unthrottled and throttled < 0.02 * GB, (throttled, unthrottled)
    (warning,) = result["warnings"]
    assert "fabric between the stage nodes (throttled-loopback): the bus bandwidth" in warning
    assert "tc qdisc show dev lo" in warning, warning
    print(f"\n[fabric over gloo: {unthrottled / GB:.3g} GB/s on this host's loopback, {throttled / GB:.3g} GB/s "
          f"throttled to 10 MB/s by tc]")
