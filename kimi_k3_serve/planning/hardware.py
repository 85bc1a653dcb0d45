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
    gpus_per_node: int = 8
    """GPUs one machine (one Ray node) usually carries: 8 on HGX boards, 4 on a GB200/GB300 compute tray."""

    @property
    def architecture(self) -> str:
        major = self.compute_capability[0]
        return {7: "volta/turing", 8: "ampere/ada", 9: "hopper", 10: "blackwell", 12: "blackwell-geforce"}.get(
            major, f"sm{major}x"
        )


def _gib(x: float) -> int:
    return round(x * GiB)


CATALOGUE: tuple[GpuSpec, ...] = (
    GpuSpec(
        name="H200",
        total_bytes=150_109_880_320,
        compute_capability=(9, 0),
        gpus_per_nvlink_domain=8,
        ray_accelerator_type="H200",
        source="measured on an H200 SXM, 2026-11-29: torch total_memory = NVML v2 total - reserved = 150,109,880,320 B "
        "(tests/fixtures/nvml/h200-2026-11-29.json)",
        aliases=("H200-SXM", "H200-141GB", "NVIDIA H200"),
        measured=True,
    ),
    GpuSpec(
        name="H100",
        total_bytes=85_017_493_504,
        compute_capability=(9, 0),
        gpus_per_nvlink_domain=8,
        ray_accelerator_type="H100",
        source="measured on an H100 80GB HBM3, 2026-12-05: torch total_memory = NVML v2 total - reserved = "
        "85,017,493,504 B (tests/fixtures/gpu/2026-12-05-round24/host.json); public logs' '79.19 GiB' was "
        "11.6 MiB over",
        aliases=("H100-80GB", "H100-SXM", "NVIDIA H100 80GB HBM3"),
        measured=True,
    ),
    GpuSpec(
        name="B200",
        total_bytes=_gib(178.35),
        compute_capability=(10, 0),
        gpus_per_nvlink_domain=8,
        ray_accelerator_type="B200",
        source="PyTorch OOM messages 'GPU 0 has a total capacity of 178.35 GiB' from B200 SXM runs (public logs)",
        aliases=("NVIDIA B200",),
    ),
    GpuSpec(
        name="B300",
        total_bytes=_gib(267.69),
        compute_capability=(10, 3),
        gpus_per_nvlink_domain=8,
        ray_accelerator_type="B300",
        source="PyTorch OOM message 'GPU 0 has a total capacity of 267.69 GiB' on a 2x8 B300 run (public log); the "
        "Kimi-K3 recipe's '268 GB' is this figure in GiB",
        aliases=("NVIDIA B300",),
    ),
    GpuSpec(
        name="GB200",
        total_bytes=_gib(184.31),
        compute_capability=(10, 0),
        gpus_per_nvlink_domain=72,
        ray_accelerator_type="GB200",
        source="PyTorch OOM messages 'GPU 0 has a total capacity of 184.31 GiB' from GB200 NVL72 runs (public logs); "
        "4 GPUs per compute tray, 72 per NVLink domain (NVIDIA GB200 NVL72 spec)",
        aliases=("GB200-NVL72", "NVIDIA GB200"),
        gpus_per_node=4,
    ),
    GpuSpec(
        name="GB300",
        total_bytes=_gib(267.69),
        compute_capability=(10, 3),
        gpus_per_nvlink_domain=72,
        ray_accelerator_type="GB300",
        source="same Blackwell Ultra GPU and 288 GB HBM3e as B300, so B300's torch total 267.69 GiB (estimate, not "
        "read on a GB300); 4 GPUs per compute tray, 72 per NVLink domain (NVIDIA GB300 NVL72 spec)",
        aliases=("GB300-NVL72", "NVIDIA GB300"),
        gpus_per_node=4,
    ),
    GpuSpec(
        name="A100-80GB",
        total_bytes=_gib(79.15),
        compute_capability=(8, 0),
        gpus_per_nvlink_domain=8,
        ray_accelerator_type="A100-80G",
        source="PyTorch OOM messages 'GPU 0 has a total capacity of 79.15 GiB' on A100-SXM4-80GB (public logs)",
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
        source="PyTorch OOM messages '44.39 GiB total capacity' on L40S (PCIe, no NVLink; public logs)",
        aliases=("NVIDIA L40S",),
    ),
    GpuSpec(
        name="RTX-4090",
        total_bytes=_gib(23.65),
        compute_capability=(8, 9),
        gpus_per_nvlink_domain=1,
        ray_accelerator_type=None,
        source="PyTorch OOM messages 'GPU 0 has a total capacity of 23.65 GiB' on GeForce RTX 4090 (no NVLink)",
        aliases=("4090", "RTX4090", "NVIDIA GeForce RTX 4090"),
        gpus_per_node=4,
    ),
    GpuSpec(
        name="RTX-3090",
        total_bytes=_gib(23.69),
        compute_capability=(8, 6),
        gpus_per_nvlink_domain=1,
        ray_accelerator_type=None,
        source="PyTorch OOM messages 'GPU 0; 23.69 GiB total capacity' on GeForce RTX 3090 (NVLink bridge pairs ignored)",
        aliases=("3090", "RTX3090", "NVIDIA GeForce RTX 3090"),
        gpus_per_node=4,
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


@dataclass(frozen=True)
class InstanceType:
    """A cloud machine type that carries GPUs: what a cluster file's instance type means."""

    name: str
    gpu: str
    gpus: int
    source: str


INSTANCE_TYPES: tuple[InstanceType, ...] = (
    InstanceType("p5en.48xlarge", "H200", 8, "AWS EC2 P5en instances: 8x H200 141 GB (aws.amazon.com/ec2/instance-types/p5)"),
    InstanceType("p5e.48xlarge", "H200", 8, "AWS EC2 P5e instances: 8x H200 141 GB (aws.amazon.com/ec2/instance-types/p5)"),
    InstanceType("p5.48xlarge", "H100", 8, "AWS EC2 P5 instances: 8x H100 80 GB (aws.amazon.com/ec2/instance-types/p5)"),
    InstanceType("p6-b200.48xlarge", "B200", 8, "AWS EC2 P6-B200 instances: 8x B200 (aws.amazon.com/ec2/instance-types/p6)"),
    InstanceType("p6-b300.48xlarge", "B300", 8, "AWS EC2 P6-B300 instances: 8x B300 (aws.amazon.com/ec2/instance-types/p6)"),
    InstanceType("p4de.24xlarge", "A100-80GB", 8, "AWS EC2 P4de: 8x A100 80 GB (aws.amazon.com/ec2/instance-types/p4)"),
    InstanceType("p4d.24xlarge", "A100-40GB", 8, "AWS EC2 P4d: 8x A100 40 GB (aws.amazon.com/ec2/instance-types/p4)"),
    InstanceType("g6e.48xlarge", "L40S", 8, "AWS EC2 G6e: 8x L40S (aws.amazon.com/ec2/instance-types/g6e)"),
    InstanceType("a3-ultragpu-8g", "H200", 8, "GCP A3 Ultra: 8x H200 (cloud.google.com/compute/docs/gpus#h200-gpus)"),
    InstanceType("a3-megagpu-8g", "H100", 8, "GCP A3 Mega: 8x H100 80 GB (cloud.google.com/compute/docs/gpus)"),
    InstanceType("a3-highgpu-8g", "H100", 8, "GCP A3 High: 8x H100 80 GB (cloud.google.com/compute/docs/gpus)"),
    InstanceType("a4-highgpu-8g", "B200", 8, "GCP A4: 8x B200 (cloud.google.com/compute/docs/gpus#b200-gpus)"),
    InstanceType("a4x-highgpu-4g", "GB200", 4, "GCP A4X: 4x GB200 per VM, NVL72 racks (cloud.google.com/compute/docs/gpus)"),
    InstanceType("a2-ultragpu-8g", "A100-80GB", 8, "GCP A2 Ultra: 8x A100 80 GB (cloud.google.com/compute/docs/gpus)"),
    InstanceType("a2-highgpu-8g", "A100-40GB", 8, "GCP A2 High: 8x A100 40 GB (cloud.google.com/compute/docs/gpus)"),
    InstanceType("Standard_ND96isr_H200_v5", "H200", 8, "Azure ND H200 v5: 8x H200 (learn.microsoft.com ND-H200-v5 series)"),
    InstanceType("Standard_ND96isr_H100_v5", "H100", 8, "Azure ND H100 v5: 8x H100 (learn.microsoft.com ND-H100-v5 series)"),
    InstanceType("Standard_ND128isr_GB200_v6", "GB200", 4, "Azure ND GB200 v6: 4x GB200 per VM (learn.microsoft.com)"),
)

_INSTANCES = {_key(instance.name): instance for instance in INSTANCE_TYPES}


def lookup_instance(name: str) -> InstanceType | None:
    """The GPUs of a cloud instance / machine type, or None if the catalogue does not know it."""
    return _INSTANCES.get(_key(str(name)))


# ----------------------------------------------------------------------------------------------------------------
# Interconnect between nodes: what one GPU's share of a node's fabric should carry (the fabric check compares the
# bus bandwidth it measures between two nodes, one rank on each, against it).
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Interconnect:
    """The network between nodes of one node type, per GPU (each GPU has its own NIC rail on these machines)."""

    name: str
    """The fabric, for people: ``EFAv3``, ``InfiniBand NDR``, ``RoCE (GPUDirect-RDMA)``, ``NVLink 5 (NVL72)``."""
    bytes_per_s_per_gpu: int
    """Line rate of one GPU's rail, bytes per second (the node's total over its GPUs)."""
    transport: str
    """What NCCL should report using: ``ofi`` (the aws-ofi-nccl plugin over libfabric), ``ib`` (verbs: InfiniBand or
    RoCE), ``gib`` (Google's gIB plugin), ``nvlink`` (one NVLink domain across trays: no network at all)."""
    settings: tuple[str, ...]
    """What to check when NCCL is slow or falls back to sockets on this node type."""
    source: str


def _gbps(gbit_per_s: float) -> int:
    return round(gbit_per_s * 1e9 / 8)


_EFA_SETTINGS = (
    "FI_PROVIDER=efa (libfabric must find the EFA devices: fi_info -p efa)",
    "the aws-ofi-nccl plugin (libnccl-net-ofi.so on LD_LIBRARY_PATH, or NCCL_NET_PLUGIN=ofi)",
    "FI_EFA_USE_DEVICE_RDMA=1",
    "the instance's EFA interfaces and security group (all traffic to and from itself)",
    "NCCL_SOCKET_IFNAME for the bootstrap interface only (not the data path)",
)
_IB_SETTINGS = (
    "NCCL_IB_HCA (e.g. mlx5)",
    "NCCL_SOCKET_IFNAME (the bootstrap interface, e.g. eth0)",
    "the RDMA devices in the container (/dev/infiniband; the RDMA/IB device plugin on Kubernetes)",
    "NCCL_IB_DISABLE must not be 1",
    "NCCL_NET_GDR_LEVEL / nvidia-peermem for GPUDirect RDMA",
)
_GIB_SETTINGS = (
    "the gIB NCCL plugin (NCCL_NET=gIB, LD_LIBRARY_PATH with /usr/local/gib/lib64, its nccl-env-profile.sh)",
    "the extra RDMA NICs of the A3 Ultra VM (multi-NIC network interfaces)",
    "NCCL_SOCKET_IFNAME (the bootstrap interface)",
    "NCCL_IB_HCA",
)
_NVL72_SETTINGS = (
    "the IMEX channels of one NVLink domain in every pod (the ComputeDomain's ResourceClaimTemplate)",
    "NCCL_MNNVL_ENABLE must not be 0",
    "NCCL_CUMEM_ENABLE=1",
)

INTERCONNECTS: dict[str, Interconnect] = {
    "p5en.48xlarge": Interconnect(
        "EFAv3", _gbps(3200 / 8), "ofi", _EFA_SETTINGS,
        "AWS EC2 P5en: 3,200 Gbps EFAv3 per instance, 8 H200 (aws.amazon.com/ec2/instance-types/p5)"),
    "p5e.48xlarge": Interconnect(
        "EFAv2", _gbps(3200 / 8), "ofi", _EFA_SETTINGS,
        "AWS EC2 P5e: 3,200 Gbps EFAv2 per instance, 8 H200 (aws.amazon.com/ec2/instance-types/p5)"),
    "p5.48xlarge": Interconnect(
        "EFAv2", _gbps(3200 / 8), "ofi", _EFA_SETTINGS,
        "AWS EC2 P5: 3,200 Gbps EFAv2 per instance, 8 H100 (aws.amazon.com/ec2/instance-types/p5)"),
    "p6-b200.48xlarge": Interconnect(
        "EFAv4", _gbps(3200 / 8), "ofi", _EFA_SETTINGS,
        "AWS EC2 P6-B200: 3,200 Gbps EFAv4 per instance, 8 B200 (aws.amazon.com/ec2/instance-types/p6)"),
    "a3-ultragpu-8g": Interconnect(
        "RoCE (GPUDirect-RDMA)", _gbps(400), "gib", _GIB_SETTINGS,
        "Google Cloud A3 Ultra: 8 CX-7 NICs of 400 Gbps, one per H200, 3,200 Gbps (cloud.google.com/compute/docs/gpus)"),
    "a4-highgpu-8g": Interconnect(
        "RoCE (GPUDirect-RDMA)", _gbps(400), "gib", _GIB_SETTINGS,
        "Google Cloud A4: 8 CX-7 NICs of 400 Gbps, one per B200 (cloud.google.com/compute/docs/gpus)"),
    "Standard_ND96isr_H200_v5": Interconnect(
        "InfiniBand NDR", _gbps(400), "ib", _IB_SETTINGS,
        "Azure ND H200 v5: 8 x 400 Gb/s NDR InfiniBand, one per GPU (learn.microsoft.com ND-H200-v5 series)"),
    "Standard_ND96isr_H100_v5": Interconnect(
        "InfiniBand NDR", _gbps(400), "ib", _IB_SETTINGS,
        "Azure ND H100 v5: 8 x 400 Gb/s NDR InfiniBand, one per GPU (learn.microsoft.com ND-H100-v5 series)"),
}
"""Per instance type. Kubernetes pods name no instance type: they take their GPU's default below."""

GPU_DEFAULT_INTERCONNECT: dict[str, Interconnect] = {
    "H200": Interconnect(
        "400 Gbps per GPU (InfiniBand / RoCE / EFA)", _gbps(400), "ib", _IB_SETTINGS + _EFA_SETTINGS[:2],
        "every H200 offering in INTERCONNECTS carries 3,200 Gbps per 8 GPUs (p5en, A3 Ultra, ND H200 v5)"),
    "H100": Interconnect(
        "400 Gbps per GPU (InfiniBand / RoCE / EFA)", _gbps(400), "ib", _IB_SETTINGS + _EFA_SETTINGS[:2],
        "the H100 offerings with a full fabric (p5, ND H100 v5): 3,200 Gbps per 8 GPUs"),
    "B200": Interconnect(
        "400 Gbps per GPU (InfiniBand / RoCE / EFA)", _gbps(400), "ib", _IB_SETTINGS + _EFA_SETTINGS[:2],
        "p6-b200 and A4: 3,200 Gbps per 8 GPUs"),
    "GB200": Interconnect(
        "NVLink 5 (NVL72)", 900 * 10**9, "nvlink", _NVL72_SETTINGS,
        "NVIDIA GB200 NVL72: 1.8 TB/s of NVLink per GPU, both directions (900 GB/s each way) across the rack's trays"),
    "GB300": Interconnect(
        "NVLink 5 (NVL72)", 900 * 10**9, "nvlink", _NVL72_SETTINGS,
        "NVIDIA GB300 NVL72: 1.8 TB/s of NVLink per GPU, both directions (900 GB/s each way) across the rack's trays"),
}


def interconnect_of(gpu: str, node_type: str | None = None) -> Interconnect | None:
    """What the fabric between two nodes of ``node_type`` (else of ``gpu``'s usual machines) should carry per GPU."""
    if node_type is not None:
        found = {_key(name): ic for name, ic in INTERCONNECTS.items()}.get(_key(node_type))
        if found is not None:
            return found
    return GPU_DEFAULT_INTERCONNECT.get(lookup_gpu(gpu).name)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint I/O: how fast a node of a type can fetch a checkpoint and read it from its download disk
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeIo:
    """Declared bandwidths that bound a checkpoint's download and load on one node (issue 25). Upper bounds of what
    the node can do; a source that serves one client slower (the hub, one bucket prefix) takes longer."""

    instance: str
    network_bytes_per_s: int | None
    """What one node can pull from a bucket or the hub over its front-end network, bytes/s."""
    disk_read_bytes_per_s: int | None
    """Sequential read of the volume the download folder is on when the cluster file does not say, bytes/s."""
    source: str


_MiB = 2**20

_P5EN_IO = NodeIo(
    "p5en.48xlarge", 100 * 10**9 // 8, None,
    "network: Amazon S3 performance guidelines, 'up to 100 Gb/s' to one EC2 instance (docs.aws.amazon.com/AmazonS3/"
    "latest/userguide/optimizing-performance-guidelines.html); the 3,200 Gbps EFAv3 fabric does not carry S3/hub "
    "traffic. disk: the launcher files put the folder on EBS (EBS_VOLUME_READ); the 8x 3.84 TB instance-store "
    "NVMe has no published throughput",
)

NODE_IO: tuple[NodeIo, ...] = (
    _P5EN_IO,
    # p5en's figures: the S3 guideline it cites ("up to 100 Gb/s" to one EC2 instance) is the same for these types,
    # and none of them declares a disk read either.
    *(NodeIo(name, _P5EN_IO.network_bytes_per_s, _P5EN_IO.disk_read_bytes_per_s, "as p5en.48xlarge (same S3 guideline)")
      for name in ("p5e.48xlarge", "p5.48xlarge", "p6-b200.48xlarge")),
)

EBS_VOLUME_READ: dict[str, tuple[int, str]] = {
    "gp3": (125 * _MiB, "AWS EBS gp3: baseline 125 MiB/s, provisionable to 1,000 MiB/s with `Throughput` "
                        "(docs.aws.amazon.com/ebs/latest/userguide/general-purpose.html)"),
    "gp2": (250 * _MiB, "AWS EBS gp2: at most 250 MiB/s per volume (docs.aws.amazon.com/ebs/latest/userguide/"
                        "general-purpose.html)"),
    "io2": (4000 * _MiB, "AWS EBS io2 Block Express: at most 4,000 MiB/s per volume (docs.aws.amazon.com/ebs/latest/"
                         "userguide/provisioned-iops.html)"),
}
"""EBS volume type -> (its read bandwidth when the launcher file sets no ``Throughput``, source). A volume's
throughput counts reads and writes alike: a download onto it is bound by it too."""

DEFAULT_NODE_IO = NodeIo(
    "a node type the catalogue does not declare", 1_250_000_000, 2 * 10**9,
    "10 Gbit/s download (below the front-end NIC of any 8-GPU cloud node: errs long) and 2 GB/s read (one local "
    "NVMe SSD; a network volume is slower, EBS gp3 at its 125 MiB/s baseline: declare it in a launcher file)",
)
"""The bandwidths an estimate takes where the node type or its volume is not known (a KubeRay pod, a live node, a
machine type ``NODE_IO`` lacks), and why; the output names it."""


def ebs_volume_read(volume: dict) -> tuple[int | None, str]:
    """Read (and write) bandwidth of an EBS volume as a launcher file's ``BlockDeviceMappings[].Ebs`` declares it:
    its ``Throughput`` (MiB/s) when set, else its ``VolumeType``'s (``EBS_VOLUME_READ``); None for a type not there."""
    kind = str(volume.get("VolumeType", "gp3"))
    throughput = volume.get("Throughput")
    if isinstance(throughput, int) and not isinstance(throughput, bool):
        return throughput * _MiB, f"EBS {kind} Throughput: {throughput:,} MiB/s (cluster file)"
    if kind not in EBS_VOLUME_READ:
        return None, f"EBS {kind}: no declared throughput"
    rate = EBS_VOLUME_READ[kind][0]
    return rate, f"EBS {kind} at {rate // _MiB:,} MiB/s (hardware.EBS_VOLUME_READ; the cluster file sets no Throughput)"


_NODE_IO = {_key(io.instance): io for io in NODE_IO}


def lookup_node_io(instance: str | None) -> NodeIo | None:
    """The declared checkpoint bandwidths of a machine type, or None when the catalogue has none."""
    return _NODE_IO.get(_key(str(instance))) if instance else None
