"""The replica-start check's decision (``replica.decide_replica``) on recorded probes, without Ray.

The GPU probes carry the NVML reading recorded on the H200 host where ``deploy/gpu-rehearsal.yaml`` ran (two
raylets, one GPU each: ``tests/fixtures/gpu/2026-11-30/host.json``), as ``nvml.parse_readings`` is tested on it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from conftest import load_script
from kimi_k3_serve.errors import DoesNotFitError
from kimi_k3_serve.checks.preflight import CpuMemoryNeed
from kimi_k3_serve.checks.replica import BundleProbe, ReplicaProbes, decide_replica
from kimi_k3_serve.config.serve_config import load_serve_app
from kimi_k3_serve.units import GiB

REPO = Path(__file__).resolve().parents[1]
READING = json.loads((REPO / "tests" / "fixtures" / "gpu" / "2026-11-30" / "host.json").read_text())["nvml"]


@pytest.fixture(scope="module")
def rehearsal_args(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    load_script("make_kimi_slice").make_slice(cache, 4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KIMI_K3_SERVE_MODEL_CACHE", str(cache))
        yield load_serve_app(REPO / "deploy" / "gpu-rehearsal.yaml").args


def two_raylets(reading=READING, *, same_node: bool = False) -> ReplicaProbes:
    """gpu-rehearsal.yaml's placement group (TP1 x PP2) on the host's two raylets: bundle i got GPU i."""
    b = "node-a" if same_node else "node-b"
    probes = (BundleProbe(0, "node-a", "10.0.0.1", ("0",), reading, 0),
              BundleProbe(1, b, "10.0.0.1" if same_node else "10.0.0.2", ("1",), reading, 0))
    return ReplicaProbes({0: "node-a", 1: b}, 2, (0, 1), probes)


def test_the_recorded_host_holds_the_rehearsal_and_the_stages_link_two_nodes(rehearsal_args):
    decision = decide_replica(rehearsal_args, two_raylets())
    assert sorted(decision.bundle_indices) == [0, 1]
    assert decision.report is not None and decision.report.fits
    assert any(line.startswith("GPU memory on the reserved GPUs: fits") for line in decision.lines)
    assert decision.link_bundles == tuple(decision.bundle_indices)  # stage 0's node, then stage 1's
    assert set(decision.link_names) == {"node-a (10.0.0.1)", "node-b (10.0.0.2)"}


def test_a_gpu_taken_since_the_build_time_check_is_refused_naming_its_node(rehearsal_args):
    reading = copy.deepcopy(READING)
    for key in ("memory_v1", "memory_v2"):
        reading["devices"][1][key]["free"] = 8 * GiB  # another process holds the rest of GPU 1
    crowded = two_raylets(reading)
    with pytest.raises(DoesNotFitError, match="the GPUs Serve reserved no longer hold it") as refused:
        decide_replica(rehearsal_args, crowded)
    short = [row for row in refused.value.report.rows if not row.fits]
    assert [(row.node, row.gpu_index) for row in short] == [("node-b", 1)]


def test_without_a_reading_the_order_is_still_set_and_memory_not_checked(rehearsal_args):
    probes = two_raylets()
    blind = ReplicaProbes(probes.table, 2, (0, 1), (probes.probes[0], BundleProbe(1, "node-b", "10.0.0.2", ("1",),
                                                                                   {"unavailable": "no NVML"}, 0)))
    decision = decide_replica(rehearsal_args, blind)
    assert decision.report is None and decision.bundle_indices is not None
    assert any(line.startswith("GPU memory: not checked again -- node node-b") for line in decision.lines)


def test_stages_on_one_node_have_no_link_to_test(rehearsal_args):
    decision = decide_replica(rehearsal_args, two_raylets(same_node=True))
    assert decision.link_bundles == () and decision.link_names == ()
    assert "communication: the pipeline stages share node node-a; no cross-node link to test" in decision.lines


def test_cpu_replica_host_memory():
    args = load_serve_app(REPO / "deploy" / "dev.yaml").args
    probes = (BundleProbe(0, "cpu-node", "127.0.0.1", (), None, 6 * GiB), BundleProbe(1, "cpu-node", "127.0.0.1", (), None, 6 * GiB))
    gathered = ReplicaProbes({0: "cpu-node", 1: "cpu-node"}, 2, (0, 1), probes)
    need = CpuMemoryNeed(5 * GiB, {"KV space": 2 * GiB, "processes": 3 * GiB})
    decision = decide_replica(args, gathered, cpu_need=need)
    assert "host memory: node cpu-node needs 5.00 GiB, has 6.00 GiB available" in decision.lines
    assert decision.bundle_indices is None and decision.link_bundles == ()
    with pytest.raises(DoesNotFitError, match="needs 7.00 GiB of host memory on node cpu-node") as refused:
        decide_replica(args, gathered, cpu_need=CpuMemoryNeed(7 * GiB, {"processes": 7 * GiB}))
    assert refused.value.details == {"node": "cpu-node", "need_bytes": 7 * GiB, "available_bytes": 6 * GiB}
