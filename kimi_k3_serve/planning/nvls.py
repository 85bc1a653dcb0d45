"""NCCL's NVLS buffers: the device memory NVLink SHARP takes on each GPU of a tensor-parallel group.

Computed from NCCL 2.30.7's code, not measured (the lent H200 hosts have no NVLink multicast and run with
``NCCL_NVLS_ENABLE=0``). ``src/transport/nvls.cc`` ``ncclNvlsBufferSetup`` gives every GPU of a communicator with NVLS
support ``nvlsChannels x 2 x NCCL_STEPS x NCCL_NVLS_CHUNKSIZE x nHeads`` bytes of its own memory, bound to the
multicast object (``nvlsAllocateMem``: ``cuMemCreate`` of that size, rounded to the allocation granularity):
- ``nvlsChannels``: 16 on SM90, 24 on SM100 within one node, 32 on SM100 across nodes (``ncclNvlsTuning``);
- ``NCCL_STEPS`` 8 (``src/include/device.h``); ``NCCL_NVLS_CHUNKSIZE`` 128 KiB unless the environment sets it;
- ``nHeads``: the communicator's GPUs, all in one NVLink domain for a TP group (8 at TP8 on an HGX node).

So 256 MiB per GPU at TP8 on an H200 node. Older NCCLs took more: 2.20 gave each channel and head 4 MiB of buffer and
2 MiB of credits (2.25 GiB per GPU in a published 8 x H200 log, with 24 channels), 2.21 and 2.22 1 MiB and 2 MiB
(768 MiB at 16 channels); since 2.23 the credits are apart and tiny. NCCL sets the buffers up lazily (``NCCL_RUNTIME_CONNECT``, on by
default), at the first collective it runs with the NVLS algorithm. In vLLM that is the profile's all-reduce of
``max_num_batched_tokens x hidden``, too large for the custom and symmetric-memory all-reduce, on PyNccl's TP
communicator (``cuda_communicator.py`` ``all_reduce``): one communicator, inside the memory budget. NVLS needs
NVLink multicast (NVSwitch: Hopper and Blackwell HGX and NVL72) and two GPUs or more; ``NCCL_NVLS_ENABLE=0`` in the
engine's environment turns it off. Pure.
"""

from __future__ import annotations

from typing import Mapping

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.units import KiB, MiB, round_up

NCCL_STEPS = 8
DEFAULT_CHUNK_BYTES = 128 * KiB
ALLOCATION_GRANULARITY = 2 * MiB
ENV_FIELD = "args.runtime_env.env_vars"


def nvls_channels(compute_capability: tuple[int, int], spans_nodes: bool) -> int:
    if compute_capability < (10, 0):
        return 16
    return 32 if spans_nodes else 24


def check_nvls_env(env: Mapping[str, str] | None) -> None:
    """ConfigError naming the variable when the engine's environment sets NVLS to something NCCL would misread."""
    setting = str((env or {}).get("NCCL_NVLS_ENABLE", "")).strip()
    if setting not in ("", "0", "1", "2"):
        raise ConfigError(f"{ENV_FIELD}.NCCL_NVLS_ENABLE", setting, "0 (off), 1 (on) or 2 (NCCL's default: where "
                                                                    "the GPUs support multicast)")
    chunk = str((env or {}).get("NCCL_NVLS_CHUNKSIZE", "")).strip()
    if chunk and not (chunk.isdigit() and int(chunk) > 0):
        raise ConfigError(f"{ENV_FIELD}.NCCL_NVLS_CHUNKSIZE", chunk, "a positive whole number of bytes")


def nvls_enabled(tp: int, compute_capability: tuple[int, int], env: Mapping[str, str] | None) -> bool:
    """Whether NCCL gives the TP group NVLS buffers: two GPUs or more of Hopper or later (every such GPU of the
    catalogue sits on NVSwitch; an H100 PCIe pair would get none, and the plan would be 0.06 GiB cautious), unless
    the engine's environment sets ``NCCL_NVLS_ENABLE=0``."""
    check_nvls_env(env)
    return tp >= 2 and compute_capability >= (9, 0) and str((env or {}).get("NCCL_NVLS_ENABLE", "")).strip() != "0"


def nvls_buffer_bytes(tp: int, compute_capability: tuple[int, int], env: Mapping[str, str] | None,
                      spans_nodes: bool = False) -> int:
    """Bytes of NVLS buffers on each GPU of a TP group of ``tp`` GPUs (0 where NVLS is off or unsupported)."""
    if not nvls_enabled(tp, compute_capability, env):
        return 0
    chunk = int(str((env or {}).get("NCCL_NVLS_CHUNKSIZE", "")).strip() or DEFAULT_CHUNK_BYTES)
    per_gpu = nvls_channels(compute_capability, spans_nodes) * 2 * NCCL_STEPS * chunk * tp
    return round_up(per_gpu, ALLOCATION_GRANULARITY)


def nvls_basis(nbytes: int, tp: int, compute_capability: tuple[int, int], spans_nodes: bool = False) -> str:
    """One line for the report: what the plan assumes about NVLS (``nbytes`` from ``nvls_buffer_bytes``), and why."""
    if nbytes:
        return (f"NCCL NVLS buffers: {nbytes / MiB:,.0f} MiB per GPU of each TP{tp} group, counted inside the budget "
                f"({nvls_channels(compute_capability, spans_nodes)} channels x 2 x {NCCL_STEPS} steps x chunk x {tp} "
                f"GPUs, computed from NCCL 2.30's nvls.cc, not measured); NCCL_NVLS_ENABLE=0 in {ENV_FIELD} turns "
                "NVLS and this term off")
    if tp >= 2 and compute_capability >= (9, 0):
        return f"NCCL NVLS: off (NCCL_NVLS_ENABLE=0 in {ENV_FIELD}): no NVLS buffers counted"
    return ""
