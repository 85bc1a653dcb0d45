"""``kimi-k3-serve prefetch`` on a real local Ray cluster of two worker nodes (``ray.cluster_utils.Cluster``): the tiny
Llama written as layer shards with an index, split TP1 x PP2 over two nodes of one fake GPU each, every node with
a download folder of its own (``$KIMI_K3_SERVE_TEST_DOWNLOADS`` set in each raylet's environment, which the node's
tasks inherit; the config's ``download_dir`` is that variable). Shown: each node fetched only its stage's shards,
a resumed run fetches nothing twice, a truncated shard is fetched again, and a node whose disk is too small is
refused in one line before any node downloads (a real small file system: the test mounts a 512 KiB tmpfs at that node's download folder).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from conftest import make_tiny_models  # noqa: E402
from kimi_k3_serve import cli  # noqa: E402
from kimi_k3_serve.checkpoint import local_copy  # noqa: E402

DOWNLOADS_ENV = "KIMI_K3_SERVE_TEST_DOWNLOADS"


def config_file(tmp: Path, source: Path, *, name: str = "prefetch.yaml") -> Path:
    args = {
        "model": {"id": "tiny-llama", "source": str(source), "download_dir": f"${DOWNLOADS_ENV}"},
        "accelerator": {"kind": "gpu", "type": "H200"},
        "parallel": {"tensor_parallel_size": 1, "pipeline_parallel_size": 2},
        "limits": {"max_model_len": 512, "max_num_seqs": 4},
    }
    document = {"applications": [{"name": "tiny", "route_prefix": "/", "import_path": "kimi_k3_serve.app:build_app",
                                  "args": args}]}
    path = tmp / name
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, tiny_models):
    work = tmp_path_factory.mktemp("prefetch")
    shards = make_tiny_models.write_layer_shards(tiny_models.target, work / "tiny-llama-sharded")
    folders = [work / "node-a", work / "node-b", work / "head"]
    started = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "env_vars": {DOWNLOADS_ENV: str(folders[2])}})
    nodes = [cluster.add_node(num_cpus=1, num_gpus=1, resources={"accelerator_type:H200": 1},
                              env_vars={DOWNLOADS_ENV: str(folder)}) for folder in folders[:2]]
    cluster.wait_for_nodes()
    print(f"\n[3-raylet Ray cluster up in {time.perf_counter() - started:.1f} s]")
    try:
        yield {"address": cluster.address, "shards": shards, "folders": folders, "ids": [n.node_id for n in nodes],
               "work": work}
    finally:
        cluster.shutdown()


def _prefetch(config: Path, address: str, capsys, *extra: str) -> tuple[int, dict, str]:
    code = cli.main(["prefetch", "--config", str(config), "--address", address, "--json", *extra])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def _weights(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "model").glob("*.safetensors")) if (folder / "model").exists() else []


def test_each_node_fetches_only_its_stage_and_a_rerun_resumes(two_nodes, capsys):
    config = config_file(two_nodes["work"], two_nodes["shards"])
    code, document, err = _prefetch(config, two_nodes["address"], capsys)
    assert code == 0, err
    node_a, node_b, head = two_nodes["folders"]
    by_node = {n["node_id"]: n for n in document["nodes"]}
    # Sorted by node id, the first worker node takes stage 0 and the second stage 1 (prefetch.assign_nodes).
    first, second = sorted(two_nodes["ids"])
    folder_of = dict(zip(two_nodes["ids"], (node_a, node_b)))
    stage0 = ["model-00001-of-00006.safetensors", "model-00002-of-00006.safetensors", "model-00003-of-00006.safetensors"]
    stage1 = ["model-00004-of-00006.safetensors", "model-00005-of-00006.safetensors", "model-00006-of-00006.safetensors"]
    assert by_node[first]["stages"] == [0] and _weights(folder_of[first]) == stage0
    assert by_node[second]["stages"] == [1] and _weights(folder_of[second]) == stage1
    assert _weights(head) == [] and (head / "model" / "config.json").is_file()  # configs on every node
    for folder in (node_a, node_b, head):
        assert (folder / "model" / "tokenizer.json").is_file()
    # Each node's index names only the tensors it holds, so vLLM (which refuses an index naming an absent file) loads it.
    index = json.loads((folder_of[second] / "model" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(stage1)
    assert "lm_head.weight" in index["weight_map"] and "model.embed_tokens.weight" not in index["weight_map"]
    # The bytes are the source's bytes.
    for name in stage1:
        assert (folder_of[second] / "model" / name).read_bytes() == (two_nodes["shards"] / name).read_bytes()
    whole = document["whole_checkpoint_bytes_per_node"]
    assert all(n["bytes"] < whole for n in document["nodes"])
    assert "prefetch: node" in err and "GB/s" in err  # the per-node progress lines went to stderr with --json

    # Resumable: a second run fetches nothing; a truncated shard (an interrupted copy) is fetched again, alone.
    code, document, err = _prefetch(config, two_nodes["address"], capsys)
    assert code == 0 and all(r["fetched_bytes"] == 0 for r in document["results"]), document["results"]
    victim = folder_of[first] / "model" / stage0[1]
    size = victim.stat().st_size
    os.replace(victim, victim.with_name(victim.name + local_copy.PART_SUFFIX))
    with open(victim.with_name(victim.name + local_copy.PART_SUFFIX), "r+b") as handle:
        handle.truncate(size // 3)
    code, document, err = _prefetch(config, two_nodes["address"], capsys)
    assert code == 0, err
    fetched = {r["node_id"]: r["fetched_bytes"] for r in document["results"]}
    assert fetched[first] == size - size // 3 and fetched[second] == 0
    assert victim.read_bytes() == (two_nodes["shards"] / stage0[1]).read_bytes()


@pytest.fixture
def small_disk(two_nodes):
    """A 512 KiB tmpfs mounted where the first node's download folder will be: a real file system that is too
    small for a stage of the tiny model (about 0.68 MiB); skipped where the sandbox cannot mount."""
    first = sorted(two_nodes["ids"])[0]
    folder = dict(zip(two_nodes["ids"], two_nodes["folders"][:2]))[first] / "small"
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield first, folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_a_node_short_of_disk_is_refused_before_any_download(two_nodes, small_disk, capsys, tmp_path):
    first, folder = small_disk
    config = config_file(tmp_path, two_nodes["shards"])
    config.write_text(config.read_text().replace(f"${DOWNLOADS_ENV}", f"${DOWNLOADS_ENV}/small"))
    code, document, err = _prefetch(config, two_nodes["address"], capsys)
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith("does not fit:")]
    assert len(lines) == 1, err  # only the node on the small disk, once
    assert lines[0].startswith(f"does not fit: node {first}: download folder {folder} needs 0.6")  # MiB
    assert "has 0.50 MiB free" in lines[0] and lines[0].endswith("nothing was downloaded")
    refused = [n for n in document["nodes"] if not n["fits"]]
    assert [n["node_id"] for n in refused] == [first] and refused[0]["free_bytes"] == 512 * 1024
    assert list(folder.iterdir()) == []  # nothing written on the small disk
    for other in two_nodes["folders"]:
        assert not (other / "small" / "model").exists()  # nor on any other node


def test_the_replica_check_puts_each_stage_where_its_files_are_and_refuses_a_missing_shard(two_nodes, capsys):
    """After prefetch, the replica check (on a placement group reserved as Ray Serve LLM asks for it) puts the last
    stage on the node that holds its shards, and refuses in one line, before vLLM starts, once a shard is gone."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from kimi_k3_serve.checks.replica import ReplicaCheckError, check_replica
    from kimi_k3_serve.commands.check import serve_llm_bundles
    from kimi_k3_serve.config.args import load_args

    config = config_file(two_nodes["work"], two_nodes["shards"])
    assert _prefetch(config, two_nodes["address"], capsys)[0] == 0
    args = load_args(yaml.safe_load(config.read_text())["applications"][0]["args"])
    first, second = sorted(two_nodes["ids"])
    ray.init(address=two_nodes["address"], logging_level="ERROR", log_to_driver=False)
    try:
        bundles, strategy = serve_llm_bundles(args)
        pg = placement_group(bundles, strategy=strategy)
        ray.get(pg.ready(), timeout=60)
        try:
            result = check_replica(args, pg, comm_backend="gloo", comm_timeout_s=60)
            copy_line = next(line for line in result.lines if line.startswith("local copy:"))
            assert f"stage 0 on {first}" in copy_line and f"stage 1 on {second}" in copy_line, result.lines
            folder = dict(zip(two_nodes["ids"], two_nodes["folders"][:2]))[second] / "model"
            shard = folder / "model-00005-of-00006.safetensors"
            kept = shard.read_bytes()
            shard.unlink()
            try:
                with pytest.raises(ReplicaCheckError) as refused:
                    check_replica(args, pg, comm_backend="gloo", comm_timeout_s=60)
            finally:
                shard.write_bytes(kept)
            message = str(refused.value)
            assert "\n" not in message
            assert message.startswith(f"replica refused before vLLM starts: stage 1 runs on node {second}")
            assert "lacks 1 of its files (model-00005-of-00006.safetensors)" in message
        finally:
            remove_placement_group(pg)
    finally:
        ray.shutdown()
