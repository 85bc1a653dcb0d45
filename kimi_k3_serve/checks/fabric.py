"""The fabric check's judgement: bus bandwidth as nccl-tests defines it, which network NCCL says it uses, and
whether that is far below what the node type's interconnect should carry.

The measuring runs in the replica check's communication test (``checks.replica``, one rank per stage node, over
NCCL on GPUs or gloo on CPU); this module is its pure part, so it is tested on real NCCL log lines and numbers.

Definitions (nccl-tests ``doc/PERFORMANCE.md``): ``algbw = bytes / seconds``; all-reduce ``busbw = algbw x 2(n-1)/n``
(each rank sends and receives 2(n-1)/n of the buffer; with n = 2 busbw = algbw); send/recv ``busbw = algbw``. The
bus bandwidth is what compares with the hardware's line rate. Between two nodes with one rank each, the line rate
is one GPU's rail (``Interconnect.bytes_per_s_per_gpu``), not the node's total.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.hardware import Interconnect
from kimi_k3_serve.units import GB, MiB

DEFAULT_MEASURE_BYTES = 256 * MiB
"""Message size of the timed collectives: large enough that latency is a small part of the time on a 50 GB/s rail."""
DEFAULT_MEASURE_BYTES_CPU = 16 * MiB
"""On CPU (gloo between raylets of a dev machine) the measurement shows the path works; a smaller message keeps it short."""
WARMUP_ITERATIONS = 2
TIMED_ITERATIONS = 5
WARN_FRACTION = 0.25
"""A bus bandwidth below a quarter of the line rate is called far below (NCCL over a working EFA / IB rail reaches
well over half; over TCP sockets a few GB/s, under a tenth)."""


@dataclass(frozen=True)
class Measurement:
    op: str
    """``all_reduce`` or ``send_recv``."""
    nbytes: int
    seconds: float
    """Mean seconds per operation over the timed iterations."""
    world: int

    @property
    def algbw(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else float("inf")

    @property
    def busbw(self) -> float:
        if self.op == "all_reduce":
            return self.algbw * 2 * (self.world - 1) / self.world
        return self.algbw

    def describe(self) -> str:
        return f"{self.op.replace('_', '/')} busbw {rate(self.busbw)} (algbw {rate(self.algbw)})"


def rate(bytes_per_s: float) -> str:
    """A bandwidth in GB/s to three significant figures (a socket fallback reads 0.0123 GB/s, not 0.00)."""
    return f"{bytes_per_s / GB:,.2f} GB/s" if bytes_per_s >= GB else f"{bytes_per_s / GB:.3g} GB/s"


def measurement(op: str, nbytes: int, seconds: float, world: int) -> Measurement:
    if op not in ("all_reduce", "send_recv"):
        raise ConfigError("fabric.op", op, "expected all_reduce or send_recv")
    if not isinstance(world, int) or world < 2:
        raise ConfigError("fabric.world", world, "expected at least 2 ranks")
    if not isinstance(nbytes, int) or nbytes <= 0 or not seconds >= 0:
        raise ConfigError("fabric.nbytes", nbytes, "expected bytes > 0 and seconds >= 0")
    return Measurement(op, nbytes, float(seconds), world)


# NCCL_DEBUG=INFO lines that name the network (formats as NCCL 2.2x and aws-ofi-nccl print them, e.g. in
# NVIDIA/nccl#1053, #952, #1597 and aws/aws-ofi-nccl#24):
#   "NCCL INFO Using network Socket" | "... Using network IB" | "... Using network Libfabric" (older: "AWS Libfabric")
#   "NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>"   "NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ..."
#   "NCCL INFO NET/OFI Selected Provider is efa (found 16 nics)"
#   "NCCL INFO Channel 03/0 : 15[7] -> 6[6] [send] via NET/Socket/3"   "... via NET/AWS Libfabric/0"
# Not a choice: "NET/IB : No device found." (NCCL then falls back to sockets), "NET/Plugin: Failed to find ...".
_USING_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")
_NET_LINE = re.compile(r"NCCL INFO NET/(?:(Socket|IB|gIB) : Using |(OFI) Selected [Pp]rovider )")
_CHANNEL_VIA = re.compile(r"NCCL INFO (?:Channel|Ring) .* via (NET/[^/]+|P2P|SHM|NVLS|COLLNET)")


def _name_of(network: str) -> str:
    lowered = network.lower()
    if lowered.startswith("socket"):
        return "socket"
    if "gib" in lowered:
        return "gib"
    if "libfabric" in lowered or "ofi" in lowered:
        return "ofi"
    if lowered.startswith("ib"):
        return "ib"
    return lowered


def nccl_transport(log_lines: Iterable[str]) -> str | None:
    """The network NCCL says it uses between the nodes: ``socket``, ``ib``, ``ofi``, ``gib``, ``nvlink`` (every
    channel over P2P/NVLS, no network: one NVLink domain), or None when the lines do not say (NCCL_DEBUG below INFO).
    A "Using network" line wins; then the NET/ lines; then the channels' transports."""
    lines = list(log_lines)
    for line in lines:
        match = _USING_NETWORK.search(line)
        if match:
            return _name_of(match.group(1))
    for line in lines:
        match = _NET_LINE.search(line)
        if match:
            return _name_of(match.group(1) or match.group(2))
    via = {m.group(1) for line in lines if (m := _CHANNEL_VIA.search(line))}
    nets = {v for v in via if v.startswith("NET/")}
    if nets:
        return _name_of(sorted(nets)[0].removeprefix("NET/"))
    if via and via <= {"P2P", "NVLS"}:
        return "nvlink"
    return None


@dataclass(frozen=True)
class FabricVerdict:
    refused: bool
    warnings: tuple[str, ...]
    line: str


def judge_fabric(measurements: Iterable[Measurement], *, transport: str | None, expected: Interconnect | None,
                 node_type: str, min_fabric_fraction: float | None = None,
                 warn_fraction: float = WARN_FRACTION) -> FabricVerdict:
    """Compare the measured bus bandwidths with ``expected`` (one GPU's rail of ``node_type``). Warn below
    ``warn_fraction`` of it or when NCCL uses sockets where the node type has a fabric; refuse (``refused``) for
    either when ``min_fabric_fraction`` is set and the bandwidth is below that fraction, or NCCL uses sockets."""
    found = tuple(measurements)
    if min_fabric_fraction is not None and not 0 < min_fabric_fraction <= 1:
        raise ConfigError("args.fabric.min_fabric_fraction", min_fabric_fraction, "expected a fraction in (0, 1]")
    parts = [m.describe() for m in found]
    line = "fabric: " + ", ".join(parts) + (f" over {transport}" if transport else "")
    if expected is None or not found:
        return FabricVerdict(False, (), line + (" (no expected bandwidth for this node type)" if found else ""))
    slowest = min(m.busbw for m in found)
    fraction = slowest / expected.bytes_per_s_per_gpu
    line += f"; {fraction:.0%} of {node_type}'s {expected.name} at {expected.bytes_per_s_per_gpu / GB:,.1f} GB/s per GPU"
    problems = []
    on_sockets = transport == "socket" and expected.transport != "socket"
    if on_sockets:
        problems.append(f"NCCL is using TCP sockets (NET/Socket), not {expected.name}")
    threshold = min_fabric_fraction if min_fabric_fraction is not None else warn_fraction
    if fraction < threshold:
        problems.append(f"the bus bandwidth {rate(slowest)} is {fraction:.0%} of the "
                        f"{expected.bytes_per_s_per_gpu / GB:,.1f} GB/s one GPU's {expected.name} rail carries "
                        f"(below {threshold:.0%})")
    if not problems:
        return FabricVerdict(False, (), line)
    message = (f"fabric between the stage nodes ({node_type}): " + "; ".join(problems) + ". Check: "
               + "; ".join(expected.settings) + f" ({expected.source})")
    refused = min_fabric_fraction is not None
    if refused:
        message += f". Refused: args.fabric.min_fabric_fraction is {min_fabric_fraction:g}"
    return FabricVerdict(refused, (message,), line)
