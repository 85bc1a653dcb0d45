"""The NVML reader: real H200 readings replayed through the parser, and a machine without NVML."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kimi_k3_serve.planning.hardware import lookup_gpu
from kimi_k3_serve.cluster.nvml import cuda_visible_memory, fabric_domain, parse_readings, take_readings

FIXTURE = Path(__file__).parent / "fixtures" / "nvml" / "h200-2026-11-29.json"


def _fixture() -> dict:
    return json.loads(FIXTURE.read_text())


def test_h200_reading_matches_what_torch_saw():
    captured = _fixture()
    torch_gpu = captured["torch"]["devices"][0]
    for key in ("nvml_before_cuda_init", "nvml_after_cuda_init"):
        (gpu,), reason = parse_readings(captured[key])
        assert reason is None
        # NVML v2 total - reserved is exactly what CUDA reports as the device's memory.
        assert gpu.total_bytes == torch_gpu["total_memory"] == torch_gpu["mem_get_info_total"]
        assert gpu.memory_exact
        assert gpu.name == "NVIDIA H200" and gpu.compute_capability == (9, 0)
        assert gpu.uuid.removeprefix("GPU-") == torch_gpu["uuid"]
        assert gpu.nvlink_domain == "node:vm"  # fabric state NOT_SUPPORTED on an HGX H200: the node
    # After torch made its context, NVML's free equals torch's free to the byte.
    (after,), _ = parse_readings(captured["nvml_after_cuda_init"])
    assert after.free_bytes == torch_gpu["mem_get_info_free"]
    # And the v1 total is larger by the driver's reserve, which CUDA never offers.
    device = captured["nvml_after_cuda_init"]["devices"][0]
    assert device["memory_v1"]["total"] - after.total_bytes == device["memory_v2"]["reserved"] > 0


def test_catalogue_h200_is_the_measured_figure():
    (gpu,), _ = parse_readings(_fixture()["nvml_before_cuda_init"])
    assert lookup_gpu(gpu.name).total_bytes == gpu.total_bytes


def test_catalogue_h100_is_what_the_h100_host_measured():
    """The one H100 host (2026-12-05): NVML v2 total - reserved, as parsed, is what torch saw, and the catalogue's."""
    host = json.loads((FIXTURE.parents[1] / "gpu" / "2026-12-05-round24" / "host.json").read_text())
    (gpu,), reason = parse_readings(host["nvml"])
    assert reason is None and gpu.memory_exact and gpu.name == "NVIDIA H100 80GB HBM3"
    assert gpu.total_bytes == host["torch_devices"][0]["total_bytes"]
    spec = lookup_gpu(gpu.name)
    assert spec.name == "H100" and spec.measured and spec.total_bytes == gpu.total_bytes


def test_module_output_on_the_h200_is_what_the_parser_gives():
    captured = _fixture()
    printed = captured["module_output"]
    gpus, reason = parse_readings(printed["readings"])
    assert [gpu.to_json() for gpu in gpus] == printed["gpus"] and reason == printed["reason"]


def test_v1_only_driver_falls_back_and_says_so():
    device = {"index": 0, "memory_v1": {"total": 100, "free": 60, "used": 40}}
    assert cuda_visible_memory(device) == (100, 60, False)


def test_fabric_clique_names_a_multi_node_domain():
    fabric = {"cluster_uuid": "ab" * 16, "status": 0, "clique_id": 7, "state": 3, "health_mask": 0}
    assert fabric_domain(fabric) == f"fabric:{'ab' * 16}:7"
    assert fabric_domain({**fabric, "state": 2}) is None  # training not completed: not usable yet
    assert fabric_domain({**fabric, "cluster_uuid": "0" * 32}) is None
    readings = {"host": "tray-3", "devices": [{"index": 0, "name": "NVIDIA GB300", "fabric": fabric,
                                               "memory_v2": {"total": 10, "reserved": 1, "free": 9, "used": 0}}]}
    (gpu,), _ = parse_readings(readings)
    assert gpu.nvlink_domain.startswith("fabric:") and gpu.total_bytes == 9


def test_no_nvml_is_zero_gpus_with_a_reason():
    gpus, reason = parse_readings({"host": "x", "devices": [], "unavailable": "NVML could not start: no driver"})
    assert gpus == [] and "NVML" in reason
    gpus, reason = parse_readings({"host": "x", "devices": []})
    assert gpus == [] and reason == "NVML found no GPU on this machine"


def test_command_on_this_machine_never_crashes():
    readings = take_readings()
    done = subprocess.run([sys.executable, "-m", "kimi_k3_serve.cluster.nvml"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    if readings.get("unavailable") or not readings["devices"]:
        assert printed["gpus"] == [] and printed["reason"]
    else:
        assert len(printed["gpus"]) == len(readings["devices"])
