"""This machine's GPUs as CUDA will see them, read through NVML (``pynvml`` from ``nvidia-ml-py``).

Two halves kept apart so tests can replay real readings: ``take_readings()`` calls NVML and returns plain
JSON-able numbers exactly as NVML gave them; ``parse_readings()`` turns them into ``GpuInfo`` without
touching NVML. No NVML library, no driver or no GPU is a normal answer (zero GPUs and the reason).

Memory: NVML's v1 ``total`` counts memory the driver and firmware keep for themselves, which CUDA never
offers a process. The v2 call (``nvmlDeviceGetMemoryInfo_v2``) reports that part as ``reserved``;
``total - reserved`` is the figure CUDA reports (``cudaMemGetInfo`` / ``torch.cuda.mem_get_info``), checked
on an H200 (tests/fixtures/nvml/h200-2026-11-29.json). Older drivers without v2 fall back to the v1 total,
marked ``memory_exact: false``.

NVLink domain: on multi-node NVLink (GB200/GB300 NVL72) every GPU of one NVLink partition reports the same
fabric cluster UUID and clique id (``nvmlDeviceGetGpuFabricInfoV``); those GPUs share a domain across Ray
nodes. Everywhere else (HGX boards, PCIe cards, fabric not supported) the domain is the node.

``python -m kimi_k3_serve.cluster.nvml`` prints ``{"gpus": [...], "reason": ..., "readings": {...}}`` as JSON.
"""

from __future__ import annotations

import ctypes
import json
import socket
import sys
from typing import Any

from kimi_k3_serve.planning.inventory import GpuInfo

FABRIC_STATE_COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED
NVML_SUCCESS = 0
_ZERO_UUID = "0" * 32


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _call(readings: dict, key: str, fn, *args) -> Any:
    """Run one NVML query; on failure record why under ``errors`` instead of raising (old drivers lack some)."""
    try:
        return fn(*args)
    except Exception as exc:  # NVMLError subclasses per code; any failure here means "not available"
        readings.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"
        return None


def take_readings() -> dict[str, Any]:
    """Query NVML for every GPU; plain numbers only. Never raises: a missing library or driver is a reading."""
    readings: dict[str, Any] = {"host": socket.gethostname(), "devices": []}
    try:
        import pynvml
    except ImportError as exc:
        readings["unavailable"] = f"pynvml is not installed ({exc}); install nvidia-ml-py"
        return readings
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        readings["unavailable"] = f"NVML could not start: {type(exc).__name__}: {exc}"
        return readings
    try:
        readings["driver_version"] = _text(_call(readings, "driver_version", pynvml.nvmlSystemGetDriverVersion))
        readings["cuda_driver_version"] = _call(readings, "cuda_driver_version", pynvml.nvmlSystemGetCudaDriverVersion)
        count = _call(readings, "device_count", pynvml.nvmlDeviceGetCount) or 0
        for index in range(count):
            readings["devices"].append(_read_device(pynvml, index))
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return readings


def _read_device(pynvml: Any, index: int) -> dict[str, Any]:
    device: dict[str, Any] = {"index": index}
    handle = _call(device, "handle", pynvml.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        return device
    device["uuid"] = _text(_call(device, "uuid", pynvml.nvmlDeviceGetUUID, handle))
    device["name"] = _text(_call(device, "name", pynvml.nvmlDeviceGetName, handle))
    cc = _call(device, "compute_capability", pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    device["compute_capability"] = list(cc) if cc else None
    v1 = _call(device, "memory_v1", pynvml.nvmlDeviceGetMemoryInfo, handle)
    if v1 is not None:
        device["memory_v1"] = {"total": v1.total, "free": v1.free, "used": v1.used}
    v2 = _call(device, "memory_v2", pynvml.nvmlDeviceGetMemoryInfo, handle, pynvml.nvmlMemory_v2)
    if v2 is not None:
        device["memory_v2"] = {"total": v2.total, "reserved": v2.reserved, "free": v2.free, "used": v2.used}
    device["fabric"] = _read_fabric(pynvml, handle, device)
    return device


def _read_fabric(pynvml: Any, handle: Any, device: dict) -> dict[str, Any] | None:
    info = pynvml.c_nvmlGpuFabricInfoV_t()  # sets its own version field (v2)
    # pynvml passes the struct straight to C: it must be given by reference, or NVML writes through garbage.
    if _call(device, "fabric", pynvml.nvmlDeviceGetGpuFabricInfoV, handle, ctypes.byref(info)) is None:
        return None
    return {
        "cluster_uuid": bytes(info.clusterUuid).hex(),
        "status": int(info.status),
        "clique_id": int(info.cliqueId),
        "state": int(info.state),
        "health_mask": int(info.healthMask),
    }


def fabric_domain(fabric: dict[str, Any] | None) -> str | None:
    """The multi-node NVLink domain of a GPU, or None when it has none (the node is its domain)."""
    if not fabric:
        return None
    if fabric.get("state") != FABRIC_STATE_COMPLETED or fabric.get("status") != NVML_SUCCESS:
        return None
    cluster_uuid = str(fabric.get("cluster_uuid", ""))
    if not cluster_uuid or cluster_uuid == _ZERO_UUID:
        return None
    return f"fabric:{cluster_uuid}:{fabric.get('clique_id', 0)}"


def cuda_visible_memory(device: dict[str, Any]) -> tuple[int | None, int | None, bool]:
    """(total, free, exact) as CUDA reports them, from one device's readings."""
    v2 = device.get("memory_v2")
    if v2:
        return int(v2["total"]) - int(v2["reserved"]), int(v2["free"]), True
    v1 = device.get("memory_v1")
    if v1:
        return int(v1["total"]), int(v1["free"]), False
    return None, None, False


def parse_readings(readings: dict[str, Any], node_domain: str | None = None) -> tuple[list[GpuInfo], str | None]:
    """GPUs from ``take_readings()`` output, and the reason when there are none.

    ``node_domain`` names the NVLink domain of GPUs without a fabric clique (default: ``node:<host>``).
    """
    if readings.get("unavailable"):
        return [], str(readings["unavailable"])
    node_domain = node_domain or f"node:{readings.get('host', 'localhost')}"
    gpus = []
    for device in readings.get("devices", []):
        total, free, exact = cuda_visible_memory(device)
        cc = device.get("compute_capability")
        gpus.append(
            GpuInfo(
                index=int(device["index"]),
                uuid=device.get("uuid") or "",
                name=device.get("name") or "",
                total_bytes=total,
                free_bytes=free,
                compute_capability=(int(cc[0]), int(cc[1])) if cc else None,
                nvlink_domain=fabric_domain(device.get("fabric")) or node_domain,
                memory_exact=exact,
            )
        )
    if not gpus:
        return [], "NVML found no GPU on this machine"
    return gpus, None


def local_gpus(node_domain: str | None = None) -> tuple[list[GpuInfo], str | None, dict[str, Any]]:
    """Read and parse this machine's GPUs: (gpus, reason when none, raw readings)."""
    readings = take_readings()
    gpus, reason = parse_readings(readings, node_domain)
    return gpus, reason, readings


def main() -> int:
    gpus, reason, readings = local_gpus()
    json.dump({"gpus": [gpu.to_json() for gpu in gpus], "reason": reason, "readings": readings}, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
