"""The replica-start check on a real local multi-raylet Ray cluster (``ray.cluster_utils.Cluster``, two nodes of
four fake H200 GPUs each). The GPUs' NVML readings come through the live inventory's own reader seam
(``$KIMI_K3_SERVE_NVML_READINGS``, a recorded H200 reading replayed per node), so the check reads "NVML" in
the very Ray tasks it runs on a GPU cluster. The placement group is reserved by Ray exactly as Ray Serve LLM
asks for it, and the check runs through the hook Serve calls (``callback_config`` -> ``on_before_node_init``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group  # noqa: E402

from kimi_k3_serve.config.args import load_args  # noqa: E402
from kimi_k3_serve.commands.check import serve_llm_bundles  # noqa: E402
from kimi_k3_serve.cluster.live import RECORDED_READINGS_ENV  # noqa: E402
from kimi_k3_serve.units import GiB  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
H200_READING = json.loads((FIXTURES / "nvml" / "h200-2026-11-29.json").read_text())["nvml_before_cuda_init"]
GPUS_PER_NODE = 4
H200_NODE = {"num_cpus": 2, "num_gpus": GPUS_PER_NODE, "resources": {"accelerator_type:H200": 1}}


def node_reading(free_bytes: list[int]) -> dict:
    """A node's NVML reading: the recorded H200 device, once per GPU, with the given free memory."""
    device = H200_READING["devices"][0]
    devices = []
    for index, free in enumerate(free_bytes):
        d = copy.deepcopy(device)
        d["index"], d["uuid"] = index, f"{device['uuid'][:-2]}{index:02d}"
        d["memory_v2"]["free"] = free
        d["memory_v2"]["used"] = d["memory_v2"]["total"] - d["memory_v2"]["reserved"] - free
        devices.append(d)
    return {**H200_READING, "devices": devices}


def full_free() -> int:
    v2 = H200_READING["devices"][0]["memory_v2"]
    return v2["total"] - v2["reserved"]


def serve_args(model_dir: Path) -> dict:
    return {
        "model": {"id": "llama-8b", "source": str(model_dir)},
        "accelerator": {"kind": "gpu", "type": "H200"},
        "parallel": {"tensor_parallel_size": GPUS_PER_NODE, "pipeline_parallel_size": 2},
        "limits": {"max_model_len": 8192, "max_num_seqs": 16, "gpu_memory_utilization": 0.9},
    }


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("replica")
    readings = workdir / "nvml-readings.json"
    readings.write_text("{}")
    model_dir = workdir / "llama-8b"
    model_dir.mkdir()
    shutil.copy(FIXTURES / "configs" / "llama-3.1-8b.json", model_dir / "config.json")
    previous = os.environ.get(RECORDED_READINGS_ENV)
    os.environ[RECORDED_READINGS_ENV] = str(readings)  # inherited by the raylets and their workers
    started = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = [cluster.add_node(**H200_NODE), cluster.add_node(**H200_NODE)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    print(f"\n[3-raylet Ray cluster up in {time.perf_counter() - started:.1f} s]")
    ids = [node.node_id for node in nodes]

    def set_free(free_by_node: dict[str, list[int]]) -> None:
        readings.write_text(json.dumps({node: node_reading(free) for node, free in free_by_node.items()}))

    try:
        yield {"address": cluster.address, "ids": ids, "set_free": set_free, "model_dir": model_dir, "workdir": workdir}
    finally:
        ray.shutdown()
        cluster.shutdown()
        if previous is None:
            os.environ.pop(RECORDED_READINGS_ENV, None)
        else:
            os.environ[RECORDED_READINGS_ENV] = previous


@pytest.fixture
def reserved(gpu_cluster):
    """The placement group Ray Serve LLM asks for one replica of the config, reserved by Ray."""
    args = load_args(serve_args(gpu_cluster["model_dir"]))
    bundles, strategy = serve_llm_bundles(args)
    pg = placement_group(bundles, strategy=strategy)
    ray.get(pg.ready(), timeout=60)
    os.environ.pop("VLLM_RAY_BUNDLE_INDICES", None)
    try:
        yield pg
    finally:
        remove_placement_group(pg)
        os.environ.pop("VLLM_RAY_BUNDLE_INDICES", None)
        wait_for_free_gpus()


def wait_for_free_gpus(timeout_s: float = 30.0) -> None:
    """Ray returns a removed placement group's resources asynchronously."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0) < 2 * GPUS_PER_NODE and time.monotonic() < deadline:
        time.sleep(0.2)


def callback(pg, model_dir: Path):
    """The hook object exactly as Ray Serve LLM builds it from ``LLMConfig.callback_config``."""
    from ray.serve.llm import LLMConfig

    from kimi_k3_serve.checks.replica_callback import ReplicaPreflight

    raw = serve_args(model_dir)
    llm_config = LLMConfig(model_loading_config={"model_id": "llama-8b", "model_source": str(model_dir)},
                           accelerator_type="H200",
                           callback_config={"callback_class": ReplicaPreflight,
                                            "callback_kwargs": {"args": raw, "comm_backend": "gloo"}})
    config = llm_config.callback_config
    return config.callback_class(llm_config=llm_config, raise_error_on_callback=config.raise_error_on_callback,
                                 ctx_kwargs={"placement_group": pg, "runtime_env": {"env_vars": {}}},
                                 **config.callback_kwargs)


def test_live_check_cli_against_the_cluster(gpu_cluster):
    a, b = gpu_cluster["ids"]
    gpu_cluster["set_free"]({a: [full_free()] * GPUS_PER_NODE, b: [full_free()] * GPUS_PER_NODE})
    config = gpu_cluster["workdir"] / "serve.yaml"
    config.write_text(json.dumps({"applications": [{"name": "llm", "import_path": "kimi_k3_serve.app:build_app",
                                                     "args": serve_args(gpu_cluster["model_dir"])}]}))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "capacity_check.py"), "--config", str(config),
                           "--address", gpu_cluster["address"], "--json"], capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - started
    print(f"\n[live check, cold process: {seconds:.2f} s to verdict (exit {done.returncode})]")
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(done.stdout)
    report = data["report"]
    assert data["fits"] is True and report["world_size"] == 8 and report["gpu"] == "H200"
    assert {r["node"] for r in report["ranks"]} == {a, b}  # the GPUs NVML (the seam) reported, node by node
    assert all(r["free_bytes"] == full_free() for r in report["ranks"])


def test_bundle_order_applied_and_stages_talk(gpu_cluster, reserved):
    a, b = gpu_cluster["ids"]
    # b's GPUs are 1 GiB fuller than a's: the last stage (lm_head, sampler) belongs on a.
    gpu_cluster["set_free"]({a: [full_free()] * GPUS_PER_NODE, b: [full_free() - GiB] * GPUS_PER_NODE})
    hook = callback(reserved, gpu_cluster["model_dir"])
    started = time.perf_counter()
    asyncio.run(hook.run_callback("on_before_node_init"))
    print(f"\n[replica-start check passed in {time.perf_counter() - started:.2f} s]")
    order = [int(i) for i in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
    assert hook.ctx.runtime_env["env_vars"]["VLLM_RAY_BUNDLE_INDICES"] == os.environ["VLLM_RAY_BUNDLE_INDICES"]
    table = {int(k): v for k, v in placement_group_table(reserved)["bundles_to_node_id"].items()}
    assert sorted(order) == list(range(8))
    stage0 = {table[i] for i in order[:GPUS_PER_NODE]}
    stage1 = {table[i] for i in order[GPUS_PER_NODE:]}
    assert stage1 == {a} and stage0 == {b}  # each TP group on one node; the last stage on the roomier node
    lines = hook.result.lines
    assert any(line.startswith("GPU memory on the reserved GPUs: fits") for line in lines)
    assert any("gloo all-reduce and stage-to-stage send/recv across 2 nodes" in line for line in lines), lines
    assert hook.result.report.fits and {r.node for r in hook.result.report.rows} == {a, b}


def test_every_rank_of_a_replica_talks_across_its_two_nodes(gpu_cluster, reserved):
    """The smoke test with a process per GPU, not per stage (the 8-rank run of a TP4 x PP2 replica on 2 x 4 GPUs): one
    all-reduce over the 8 and a send/recv chain through them, over gloo, and its line names ranks and nodes."""
    from kimi_k3_serve.checks.replica import comm_smoke_test

    table = {int(k): v for k, v in placement_group_table(reserved)["bundles_to_node_id"].items()}
    bundles = sorted(table, key=lambda i: (table[i], i))  # node by node, as the stages are
    line = comm_smoke_test(reserved, bundles, [table[i][:8] for i in bundles], backend="gloo", timeout_s=120)
    assert "gloo all-reduce and stage-to-stage send/recv across 8 ranks on 2 nodes" in line, line


def test_replica_whose_gpu_lost_memory_is_refused_before_engine_start(gpu_cluster):
    from kimi_k3_serve.checks.preflight import check_before_deploy

    a, b = gpu_cluster["ids"]
    gpu_cluster["set_free"]({a: [full_free()] * GPUS_PER_NODE, b: [full_free()] * GPUS_PER_NODE})
    args = load_args(serve_args(gpu_cluster["model_dir"]))
    bundles, strategy = serve_llm_bundles(args)
    # At build time the cluster has room (the live inventory reads the same seam) ...
    built = check_before_deploy(args, bundles, strategy)
    assert built.report is not None and built.report.fits
    pg = placement_group(bundles, strategy=strategy)
    ray.get(pg.ready(), timeout=60)
    os.environ.pop("VLLM_RAY_BUNDLE_INDICES", None)
    try:
        # ... then another process takes 100 GiB of one of b's GPUs before the replica starts.
        lost = [full_free()] * GPUS_PER_NODE
        lost[2] = full_free() - 100 * GiB
        gpu_cluster["set_free"]({a: [full_free()] * GPUS_PER_NODE, b: lost})
        hook = callback(pg, gpu_cluster["model_dir"])
        started = time.perf_counter()
        with pytest.raises(Exception) as refused:
            asyncio.run(hook.run_callback("on_before_node_init"))
        print(f"\n[replica refused in {time.perf_counter() - started:.2f} s]")
        message = str(refused.value)
        assert "replica refused before loading llama-8b" in message
        assert "SHORT" in message and b in message  # the per-GPU table names the node that is short
        assert "VLLM_RAY_BUNDLE_INDICES" not in os.environ  # the engine was never told to start
        report = refused.value.__cause__.report
        short = [row for row in report.rows if not row.fits]
        assert [(row.node, row.gpu_index) for row in short] == [(b, 2)]
        budget = math.ceil(full_free() * 0.9)  # gpu_memory_utilization x the CUDA-visible total
        assert short[0].shortfall_bytes == budget - lost[2]
    finally:
        remove_placement_group(pg)
        os.environ.pop("VLLM_RAY_BUNDLE_INDICES", None)
        wait_for_free_gpus()


def test_target_that_cannot_take_the_draft_is_refused_before_anything_else(tmp_path):
    """Mixtral's vLLM class does not declare SupportsEagle3: the hook refuses in its first step, asking the
    installed vLLM's registry, before it reads the placement group (here a bare object nothing may touch)."""
    from ray.serve.llm import LLMConfig

    from kimi_k3_serve.checks.replica import ReplicaCheckError
    from kimi_k3_serve.checks.replica_callback import ReplicaPreflight

    model_dir = tmp_path / "mixtral"
    model_dir.mkdir()
    shutil.copy(FIXTURES / "configs" / "mixtral-8x7b.json", model_dir / "config.json")
    raw = {**serve_args(model_dir), "model": {"id": "mixtral", "source": str(model_dir)},
           "speculative": {"method": "eagle3", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}}
    llm_config = LLMConfig(model_loading_config={"model_id": "mixtral", "model_source": str(model_dir)},
                           accelerator_type="H200",
                           callback_config={"callback_class": ReplicaPreflight, "callback_kwargs": {"args": raw}})
    hook = ReplicaPreflight(llm_config=llm_config, raise_error_on_callback=True,
                            ctx_kwargs={"placement_group": object(), "runtime_env": {"env_vars": {}}}, args=raw)
    started = time.perf_counter()
    with pytest.raises(Exception) as refused:
        asyncio.run(hook.run_callback("on_before_node_init"))
    print(f"\n[refused in {time.perf_counter() - started:.2f} s: {refused.value}]")
    error = refused.value if isinstance(refused.value, ReplicaCheckError) else refused.value.__cause__
    assert isinstance(error, ReplicaCheckError), repr(refused.value)
    message = str(error)
    assert "\n" not in message
    assert message.startswith("args.speculative.method 'eagle3' needs a target model class that declares vLLM's "
                              "SupportsEagle3, but architecture MixtralForCausalLM resolves to "
                              "vllm.model_executor.models.mixtral.MixtralForCausalLM")
    assert hook.result is None and "VLLM_RAY_BUNDLE_INDICES" not in os.environ
