"""A Ray cluster of several raylets on this host, each with its own GPUs: the shape of a multi-node deployment (a
pipeline stage per node, NCCL between nodes) rehearsed on one machine with Ray's own ``ray.cluster_utils.Cluster``.

Each raylet's ``CUDA_VISIBLE_DEVICES`` names its GPUs, so Ray gives its tasks those GPUs of the host (a task on the
second raylet of ``[["0"], ["1"]]`` sees GPU 1) and a STRICT_SPREAD placement group spans the raylets as it would
span machines. The GPU tests serve through it and the PP layout benchmark's Serve side runs on it.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Sequence


def raylets_per_gpu_group(gpu_groups: Sequence[Sequence[str]], *, num_cpus: int = 8, temp_dir: str | None = None,
                          object_store_memory: int | None = None, head_num_cpus: int | None = None):
    """``Cluster`` with one raylet per entry of ``gpu_groups`` (the head first), raylet i declaring
    ``len(gpu_groups[i])`` GPUs and seeing ``CUDA_VISIBLE_DEVICES=",".join(gpu_groups[i])``. ``temp_dir``: the head's
    (default a new one; keep it short, Ray's socket paths must fit 107 bytes). ``head_num_cpus`` (default
    ``num_cpus``): 0 keeps every task that asks for a CPU off the head. Waits until every raylet is up."""
    from ray.cluster_utils import Cluster

    os.makedirs(os.path.join(tempfile.gettempdir(), "ray"), exist_ok=True)  # Ray records the address there whatever temp_dir is

    def node(gpus: Sequence[str]) -> dict[str, Any]:
        # Every raylet on 127.0.0.1: this is one machine, and nothing else should reach it (with Ray's loopback
        # mode, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, set before Ray is imported; the bench script sets it).
        args: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": len(gpus), "node_ip_address": "127.0.0.1",
                                "env_vars": {"CUDA_VISIBLE_DEVICES": ",".join(gpus), "RAY_USAGE_STATS_ENABLED": "0"}}
        if object_store_memory is not None:
            args["object_store_memory"] = object_store_memory
        return args

    head, *others = gpu_groups
    head_args = {**node(head), "include_dashboard": False, "temp_dir": temp_dir or tempfile.mkdtemp(prefix="kk3-ray-")}
    if head_num_cpus is not None:
        head_args["num_cpus"] = head_num_cpus
    cluster = Cluster(initialize_head=True, head_node_args=head_args)
    for gpus in others:
        cluster.add_node(**node(gpus))
    cluster.wait_for_nodes()
    return cluster
