"""GPU catalogue for declared clusters: the memory CUDA lets a process see, the architecture, and how many
GPUs share one NVLink domain.

``total_bytes`` is what ``torch.cuda.mem_get_info()`` / ``get_device_properties().total_memory`` reports,
which is what vLLM multiplies by ``gpu_memory_utilization`` -- not the marketing number and not NVML's v1
total (which includes memory the driver keeps). Each entry says where its number comes from and whether it
was measured on the exact part or read from a public log at two-decimal GiB precision (about +-5 MiB).
Pure data: no NVML, torch or Ray import.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.units import GiB


@dataclass(frozen=True)
class GpuSpec:
    name: str
    """Canonical name, as used in ``--gpu`` and cluster files."""
    total_bytes: int
    """Device memory visible to CUDA (torch ``total_memory``), bytes."""
    compute_capability: tuple[int, int]
    gpus_per_nvlink_domain: int
    """GPUs that share one NVLink domain: 8 on an HGX board, 72 in a GB200/GB300 NVL72 rack, 1 on PCIe cards."""
    ray_accelerator_type: str | None
    """Ray's ``accelerator_type`` name (``ray.util.accelerators``), None where Ray has none."""
    source: str
    aliases: tuple[str, ...] = ()
    measured: bool = False
    """True when ``total_bytes`` was read on the part itself (NVML/torch), not derived from a log line."""

    @property
    def architecture(self) -> str:
        major = self.compute_capability[0]
        return {7: "volta/turing", 8: "ampere/ada", 9: "hopper", 10: "blackwell", 12: "blackwell-geforce"}.get(
            major, f"sm{major}x"
        )

    @property
    def is_sm100_family(self) -> bool:
        """Data-center Blackwell (SM100/SM103): what GEMM-AR/RS and the latent-MoE tail fusion require."""
        return self.compute_capability[0] == 10


def _gib(x: float) -> int:
    return round(x * GiB)


CATALOGUE: tuple[GpuSpec, ...] = (
    GpuSpec(
        name="H200",
        total_bytes=150_109_880_320,
        compute_capability=(9, 0),
        gpus_per_nvlink_domain=8,
        ray_accelerator_type="H200",
        source="torch total_memory measured on an H200 SXM (kimi-k3-facts.md S37); NVML fixture in tests/fixtures",
        aliases=("H200-SXM", "H200-141GB", "NVIDIA H200"),
        measured=True,
    ),
    GpuSpec(
        name="H100",
        total_bytes=_gib(79.19),
        compute_capability=(9, 0),
        gpus_per_nvlink_domain=8,
        ray_accelerator_type="H100",
        source="vLLM startup logs 'Free memory on device (.../79.19 GiB)' (vllm-memory.md 1.8, llm-d H100 sweep)",
        aliases=("H100-80GB", "H100-SXM", "NVIDIA H100 80GB HBM3"),
    ),
    GpuSpec(
        name="B200",
        total_bytes=_gib(178.35),
        compute_capability=(10, 0),
        gpus_per_nvlink_domain=8,
        ray_accelerator_type="B200",
        source="vLLM startup logs '.../178.35 GiB' on 180 GB Blackwell (vllm-memory.md 1.8)",
        aliases=("NVIDIA B200",),
    ),
    GpuSpec(
        name="B300",
        total_bytes=268 * 10**9,
        compute_capability=(10, 3),
        gpus_per_nvlink_domain=8,
        ray_accelerator_type=None,
        source="vLLM Kimi-K3 recipe hardware table: 268 GB per B300/GB300 GPU (kimi-k3-facts.md 0, S15); nominal",
        aliases=("NVIDIA B300",),
    ),
    GpuSpec(
        name="GB200",
        total_bytes=_gib(184.31),
        compute_capability=(10, 0),
        gpus_per_nvlink_domain=72,
        ray_accelerator_type="GB200",
        source="186 GB HBM3e per GB200 GPU less the driver reserve seen on B200 (~0.7 GiB); estimate",
        aliases=("GB200-NVL72", "NVIDIA GB200"),
    ),
    GpuSpec(
        name="GB300",
        total_bytes=268 * 10**9,
        compute_capability=(10, 3),
        gpus_per_nvlink_domain=72,
        ray_accelerator_type=None,
        source="vLLM Kimi-K3 recipe hardware table: 268 GB per B300/GB300 GPU (kimi-k3-facts.md 0, S15); nominal",
        aliases=("GB300-NVL72", "NVIDIA GB300"),
    ),
    GpuSpec(
        name="A100-80GB",
        total_bytes=_gib(79.15),
        compute_capability=(8, 0),
        gpus_per_nvlink_domain=8,
        ray_accelerator_type="A100-80G",
        source="PyTorch OOM messages 'GPU 0; 79.15 GiB total capacity' on A100-SXM4-80GB",
        aliases=("A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB"),
    ),
    GpuSpec(
        name="A100-40GB",
        total_bytes=_gib(39.39),
        compute_capability=(8, 0),
        gpus_per_nvlink_domain=8,
        ray_accelerator_type="A100-40G",
        source="PyTorch OOM messages 'GPU 0; 39.39 GiB total capacity' on A100-SXM4-40GB",
        aliases=("A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB", "A100"),
    ),
    GpuSpec(
        name="L40S",
        total_bytes=_gib(44.39),
        compute_capability=(8, 9),
        gpus_per_nvlink_domain=1,
        ray_accelerator_type="L40S",
        source="PyTorch OOM messages 'GPU 0; 44.39 GiB total capacity' on L40S (PCIe, no NVLink)",
        aliases=("NVIDIA L40S",),
    ),
    GpuSpec(
        name="RTX-4090",
        total_bytes=_gib(23.65),
        compute_capability=(8, 9),
        gpus_per_nvlink_domain=1,
        ray_accelerator_type=None,
        source="PyTorch OOM messages 'GPU 0; 23.65 GiB total capacity' on GeForce RTX 4090 (no NVLink)",
        aliases=("4090", "RTX4090", "NVIDIA GeForce RTX 4090"),
    ),
    GpuSpec(
        name="RTX-3090",
        total_bytes=_gib(23.69),
        compute_capability=(8, 6),
        gpus_per_nvlink_domain=1,
        ray_accelerator_type=None,
        source="PyTorch OOM messages 'GPU 0; 23.69 GiB total capacity' on GeForce RTX 3090 (NVLink bridge pairs ignored)",
        aliases=("3090", "RTX3090", "NVIDIA GeForce RTX 3090"),
    ),
)


def _key(name: str) -> str:
    return "".join(ch for ch in name.upper() if ch.isalnum())


_BY_KEY = {_key(alias): spec for spec in CATALOGUE for alias in (spec.name, *spec.aliases)}


def gpu_names() -> list[str]:
    return [spec.name for spec in CATALOGUE]


def lookup_gpu(name: str, *, field: str = "gpu") -> GpuSpec:
    """The catalogue entry for ``name`` (case, spaces and dashes ignored), or a ConfigError listing the names."""
    spec = _BY_KEY.get(_key(str(name)))
    if spec is None:
        raise ConfigError(field, name, f"expected one of {', '.join(gpu_names())}")
    return spec


def find_gpu_by_device_name(device_name: str) -> GpuSpec | None:
    """Best match for an NVML/torch device name such as 'NVIDIA H200' (None if unknown)."""
    return _BY_KEY.get(_key(device_name))
