"""The checkpoint as the plan sees it: files mapped to pipeline stages and nodes, the listing read from a real local
folder, from a bucket URI through Ray Serve LLM's storage (its ``PyArrowFileSystem`` builds the file system; the walk
runs on ``pyarrow.fs.LocalFileSystem``, as no S3 server runs here), and from the hub through ``huggingface_hub``
against a local HTTP server that speaks the two endpoints it uses (``/api/models/{id}/revision/{rev}?blobs=1`` and
``/{id}/resolve/{rev}/{file}``); bad input is one line and exit 2; the numbers for deploy/config.yaml.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from pathlib import Path

import pytest
import yaml

from conftest import make_tiny_models
from kimi_k3_serve import cli
from kimi_k3_serve.checkpoint import local_copy
from kimi_k3_serve.checkpoint.listing import filesystem_of, listing_from_fs, read_listing
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.checkpoint import (CheckpointFile, CheckpointListing, NodeBandwidth, NodeLoad, disk_verdict,
                                               node_index, plan_checkpoint, replica_node_stages, synthetic_listing, tensor_stages)
from kimi_k3_serve.planning.layout import Layout

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, tiny_models) -> Path:
    return make_tiny_models.write_layer_shards(tiny_models.target, tmp_path_factory.mktemp("ck") / "tiny-sharded")


# ---- pure ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, stages", [
    ("model.layers.0.self_attn.q_proj.weight", {0}),
    ("model.layers.48.mlp.experts.3.w1.weight", {0}),
    ("model.layers.49.input_layernorm.weight", {1}),
    ("language_model.model.layers.92.self_attn.kv_a_proj.weight", {1}),
    ("model.embed_tokens.weight", {0}),
    ("vision_tower.blocks.3.attn.qkv.weight", {0}),
    ("lm_head.weight", {1}),
    ("model.norm.weight", {1}),
    ("model.layers.93.eh_proj.weight", {0, 1}),  # past the decoder (MTP): every stage, never too little
    ("some_buffer_we_do_not_know", {0, 1}),
])
def test_tensor_names_go_to_the_stage_that_builds_them(name, stages):
    assert tensor_stages(name, [(0, 49), (49, 93)]) == frozenset(stages)


def test_nodes_of_a_replica_follow_vllm_rank_order():
    assert replica_node_stages(Layout(tp=8, pp=2), 8) == (frozenset({0}), frozenset({1}))
    assert replica_node_stages(Layout(tp=4, pp=2), 8) == (frozenset({0, 1}),)  # one node holds both stages
    assert replica_node_stages(Layout(tp=8, pp=2), 4) == ({0}, {0}, {1}, {1})  # NVL72 trays of 4: a stage on 2 nodes
    assert replica_node_stages(Layout(tp=2, pp=2), 4) == (frozenset({0, 1}),)  # CPU: the mp executor's one node


def test_the_tiny_shards_split_by_stage_and_the_node_index_names_only_its_files(shards):
    listing = read_listing(str(shards))  # a real folder
    assert listing.has_index and len([f for f in listing.files if f.is_weights]) == 6
    plan = plan_checkpoint(listing, None, Layout(tp=1, pp=2), num_layers=4, ranks_per_node=1)
    first, last = plan.nodes
    assert first.weight_files == tuple(f"model-0000{i}-of-00006.safetensors" for i in (1, 2, 3))
    assert last.weight_files == tuple(f"model-0000{i}-of-00006.safetensors" for i in (4, 5, 6))
    assert {f.name for f in first.files} - set(first.weight_files) >= {"config.json", "tokenizer.json"}
    assert first.bytes + last.bytes < 2 * plan.whole_bytes
    index = node_index(last.files)
    assert set(index["weight_map"].values()) == set(last.weight_files) and "lm_head.weight" in index["weight_map"]


def test_a_shard_straddling_two_stages_goes_to_both():
    files = (CheckpointFile("a.safetensors", 10, tensors=("model.layers.0.x", "model.layers.1.x")),
             CheckpointFile("b.safetensors", 10, tensors=("model.layers.2.x", "lm_head.weight")),
             CheckpointFile("config.json", 1), CheckpointFile("pytorch_model.bin", 99))
    plan = plan_checkpoint(CheckpointListing("x", files, True), None, Layout(pp=2), num_layers=3, ranks_per_node=1)
    assert plan.stage_ranges == ((0, 2), (2, 3))
    assert [n.weight_files for n in plan.nodes] == [("a.safetensors",), ("b.safetensors",)]
    files2 = files[:1] + (CheckpointFile("a2.safetensors", 5, tensors=("model.layers.1.y", "model.layers.2.y")),)
    plan2 = plan_checkpoint(CheckpointListing("x", files2, True), None, Layout(pp=2), num_layers=3, ranks_per_node=1)
    assert [n.weight_files for n in plan2.nodes] == [("a.safetensors", "a2.safetensors"), ("a2.safetensors",)]
    assert all("pytorch_model.bin" not in [f.name for f in n.files] for n in plan.nodes)  # other formats never


def test_disk_verdict_and_time_estimate():
    verdict = disk_verdict("n1", "/mnt/x", need_bytes=10 * 2**30, present_bytes=4 * 2**30, free_bytes=5 * 2**30)
    assert not verdict.fits and verdict.refusal() == "node n1: download folder /mnt/x needs 6.00 GiB more, has 5.00 GiB free"
    assert disk_verdict("n1", "/mnt/x", need_bytes=10, free_bytes=None).fits
    times = NodeLoad("n1", 10**12, False, NodeBandwidth(10**9, 2 * 10**9, "test"))
    assert (times.download_s, times.read_s, times.start_s) == (1000.0, 500.0, 1500.0)
    slow_disk = NodeLoad("n1", 10**12, False, NodeBandwidth(10**10, 10**9, "test"))
    assert (slow_disk.download_s, slow_disk.read_s) == (1000.0, 1000.0)  # the download writes onto that disk
    assert NodeLoad("n1", 10**12, True, NodeBandwidth(10**10, 10**9, "test")).start_s == 1000.0  # prefetched: read only


def test_kimi_k3_per_stage_copy_against_every_node_reading_everything():
    """deploy/config.yaml's TP8 x PP2 (49/44) on 8-GPU nodes, with an index shaped as the published one (96 shards
    of the inventory's exact per-layer bytes): each node needs about half, the pair about the whole checkpoint once."""
    from kimi_k3_serve.config.args_adapter import layout_of, planner_inputs
    from kimi_k3_serve.config.serve_config import load_serve_app

    args = load_serve_app(str(REPO / "deploy" / "config.yaml")).args
    model, engine, _ = planner_inputs(args)
    target = synthetic_listing(model, source="moonshotai/Kimi-K3", shard_count=96)
    draft = synthetic_listing(engine.speculative.draft, source="Inferact/Kimi-K3-DSpark")
    plan = plan_checkpoint(target, draft, layout_of(args), num_layers=model.num_layers, ranks_per_node=8)
    assert len([f for f in target.files if f.is_weights]) == 96
    assert target.total_bytes == model.checkpoint_bytes == 1_560_860_587_136  # 262 KB off the index's total_size
    first, last = plan.nodes
    print(f"\nKimi-K3 per node: stage 0 {first.bytes:,} B ({len(first.weight_files)} shards), stage 1 {last.bytes:,} B "
          f"({len(last.weight_files)} shards, draft {last.draft_bytes:,} B); whole per node {plan.whole_bytes:,} B; "
          f"per replica {plan.total_bytes:,} B against {plan.whole_total_bytes:,} B")
    assert first.draft_bytes == 0 and last.draft_bytes == engine.speculative.draft.checkpoint_bytes
    assert 0.5 * plan.whole_bytes < first.bytes < 0.56 * plan.whole_bytes
    assert 0.44 * plan.whole_bytes < last.bytes < 0.5 * plan.whole_bytes
    shared = set(first.weight_files) & set(last.weight_files)
    assert len(shared) == 1  # the shard that straddles layers 48 | 49 goes to both nodes
    assert plan.total_bytes < 0.51 * plan.whole_total_bytes
    # README.md quotes these numbers for deploy/config.yaml: they are this plan's.
    saved = 1 - plan.total_bytes / plan.whole_total_bytes
    quoted = (f"{first.bytes / 1e9:,.1f} GB on stage 0's node and {(last.bytes + last.draft_bytes) / 1e9:,.1f} GB "
              f"(with the draft) on stage 1's, {plan.total_bytes / 1e9:,.1f} GB per replica instead of "
              f"{plan.whole_total_bytes / 1e9:,.1f} GB ({100 * saved:.1f}% less)")
    assert quoted in " ".join((REPO / "README.md").read_text().split()), quoted


# ---- the listing's sources ---------------------------------------------------------------------------------------


def test_a_bucket_uri_opens_through_ray_serve_llm_storage_and_the_walk_is_pyarrow(shards):
    import pyarrow.fs as pa_fs

    fs, root = filesystem_of("s3://my-bucket/kimi-k3/", field="args.model.source")
    assert type(fs).__name__ == "S3FileSystem" and root == "my-bucket/kimi-k3"
    fs, root = filesystem_of("gs://my-bucket/kimi-k3", field="args.model.source")
    assert type(fs).__name__ == "GcsFileSystem" and root == "my-bucket/kimi-k3"
    # The same walk a bucket gets, on pyarrow's local file system under a sub-tree (as a bucket prefix).
    sub = pa_fs.SubTreeFileSystem(str(shards.parent), pa_fs.LocalFileSystem())
    listing = listing_from_fs(sub, shards.name, source="s3://b/tiny-sharded", field="args.model.source")
    assert listing == read_listing(str(shards)).__class__(listing.source, read_listing(str(shards)).files, True)


@pytest.mark.parametrize("make, field_text", [
    (lambda d: "http://example.com/model", "expected a local folder, a hub id"),
    (lambda d: str(d / "nope"), "a checkpoint folder that exists (it is not there)"),
    (lambda d: str(_write(d, {"a.safetensors": b"x", "b.safetensors": b"y"})), "beside its 2 safetensors files"),
    (lambda d: str(_write(d, {"a.safetensors": b"x", "model.safetensors.index.json": b"{not json"})), "valid JSON"),
    (lambda d: str(_write(d, {"a.safetensors": b"x", "model.safetensors.index.json": b'{"weight_map": {}}'})),
     "non-empty `weight_map`"),
    (lambda d: str(_write(d, {"a.safetensors": b"x", "model.safetensors.index.json":
                              b'{"weight_map": {"t": "b.safetensors"}}'})), "has no such file"),
    (lambda d: str(_write(d, {"a.safetensors": b"x", "model.safetensors.index.json":
                              b'{"weight_map": {"t": "../a.safetensors"}}'})), "a relative *.safetensors file name"),
])
def test_bad_sources_are_one_line_naming_the_field(tmp_path, make, field_text):
    with pytest.raises(ConfigError) as error:
        read_listing(make(tmp_path), field="args.model.source")
    assert field_text in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith("args.model.source")


def _write(folder: Path, files: dict[str, bytes]) -> Path:
    folder = folder / "ck"
    folder.mkdir(exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_check_refuses_a_bad_index_with_exit_2(tmp_path, capsys):
    source = _write(tmp_path, {"config.json": (REPO / "tests/fixtures/configs/llama-3.1-8b.json").read_bytes(),
                               "a.safetensors": b"x", "model.safetensors.index.json": b"[1, 2"})
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"applications": [{"name": "x", "route_prefix": "/",
                                                        "import_path": "kimi_k3_serve.app:build_app", "args": {
        "model": {"id": "m", "source": str(source)}, "accelerator": {"kind": "gpu", "type": "H200"},
        "parallel": {"tensor_parallel_size": 8}, "limits": {"max_model_len": 8192, "max_num_seqs": 16}}}]}))
    code = cli.main(["check", "--config", str(config), "--cluster", str(REPO / "cluster_configs/aws-h200-p5en.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: args.model.source (model.safetensors.index.json): got") and "valid JSON" in err[0]


# ---- the hub, through huggingface_hub against a local server -----------------------------------------------------

COMMIT = "a" * 40


class _Hub(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    repo = "org/tiny"
    calls: list[str] = []

    def log_message(self, *args):  # quiet
        pass

    def _send(self, body: bytes, content_type: str, extra: dict[str, str] | None = None, head: bool = False):
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _route(self, head: bool):
        path = self.path.split("?")[0]
        self.calls.append(f"{self.command} {self.path}")
        if path.startswith(f"/api/models/{self.repo}"):
            siblings = []
            for name, data in sorted(self.files.items()):
                entry = {"rfilename": name, "size": len(data), "blobId": hashlib.sha1(data).hexdigest()}
                if name.endswith(".safetensors"):
                    entry["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
                siblings.append(entry)
            body = json.dumps({"id": self.repo, "modelId": self.repo, "sha": COMMIT, "siblings": siblings}).encode()
            return self._send(body, "application/json", head=head)
        prefix = f"/{self.repo}/resolve/"
        if path.startswith(prefix):
            name = path[len(prefix):].split("/", 1)[1]
            if name in self.files:
                data = self.files[name]
                etag = hashlib.sha256(data).hexdigest() if name.endswith(".safetensors") else hashlib.sha1(data).hexdigest()
                return self._send(data, "application/octet-stream",
                                  {"ETag": f'"{etag}"', "X-Repo-Commit": COMMIT}, head=head)
        self.send_response(404)
        self.send_header("X-Error-Code", "EntryNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        self._route(False)

    def do_HEAD(self):
        self._route(True)


@pytest.fixture
def hub(shards, tmp_path, monkeypatch):
    _Hub.files = {p.name: p.read_bytes() for p in shards.iterdir() if p.is_file()}
    _Hub.calls = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_the_hub_listing_reads_sizes_and_lfs_sha256_and_only_the_index(hub, shards):
    listing = read_listing("org/tiny", endpoint=hub)
    local = read_listing(str(shards))
    assert [(f.name, f.size_bytes, f.tensors) for f in listing.files] == [(f.name, f.size_bytes, f.tensors) for f in local.files]
    weights = [f for f in listing.files if f.is_weights]
    assert all(f.sha256 == hashlib.sha256((shards / f.name).read_bytes()).hexdigest() for f in weights)
    downloads = [c for c in _Hub.calls if c.startswith("GET") and "/resolve/" in c]
    assert len(downloads) == 1 and downloads[0].endswith("/model.safetensors.index.json")  # no weight was fetched


def test_a_hub_download_is_checked_against_its_sha256(hub, shards, tmp_path):
    listing = read_listing("org/tiny", endpoint=hub)
    shard = next(f for f in listing.files if f.name == "model-00002-of-00006.safetensors")
    entry = {"name": shard.name, "size": shard.size_bytes, "sha256": shard.sha256, "tensors": list(shard.tensors)}
    assert local_copy.fetch_file("org/tiny", entry, tmp_path / "dl", endpoint=hub) == "size+sha256+index"
    assert (tmp_path / "dl" / shard.name).read_bytes() == (shards / shard.name).read_bytes()
    bad = {**entry, "sha256": "0" * 64}
    (tmp_path / "dl" / shard.name).unlink()
    with pytest.raises(local_copy.FetchError, match="SHA-256 .* the hub's LFS metadata says 0000"):
        local_copy.fetch_file("org/tiny", bad, tmp_path / "dl2", endpoint=hub)
    assert not (tmp_path / "dl2" / shard.name).exists()  # a file that did not check out is removed


def test_check_prints_per_node_bytes_disk_and_time_and_refuses_a_small_volume(tmp_path, capsys):
    cluster = (REPO / "cluster_configs/aws-h200-p5en.yaml").read_text()
    code = cli.main(["check", "--config", str(REPO / "deploy/config.yaml"), "--cluster",
                     str(REPO / "cluster_configs/aws-h200-p5en.yaml"), "--json"])
    document = json.loads(capsys.readouterr().out)
    assert code == 0
    nodes = document["checkpoint"]["nodes"]
    assert [n["stages"] for n in nodes] == [[0], [1]] and nodes[0]["free_bytes"] == 3000 * 2**30
    # the launcher file's gp3 volume, provisioned to 1,000 MiB/s; p5en's network from the catalogue
    assert nodes[0]["disk_read_bytes_per_s"] == 1000 * 2**20 and nodes[0]["network_bytes_per_s"] == 12_500_000_000
    assert nodes[0]["load_s"] == pytest.approx(nodes[0]["bytes"] / (1000 * 2**20)) == nodes[0]["download_s"]
    startup = document["checkpoint"]["startup"]  # the budgets from the same per-node estimates
    assert startup["load_s"] == pytest.approx(nodes[0]["start_s"]) and startup["node_type"] == "p5en.48xlarge"
    assert startup["engine_start_timeout_s"] == int(startup["configured_timeout_s"])  # what deploy/config.yaml carries
    assert any(line.startswith("Start-up budget (kimi_k3_serve.planning.startup)") for line in document["checks"])
    small = tmp_path / "small.yaml"
    small.write_text(cluster.replace("VolumeSize: 3000", "VolumeSize: 1000"))
    code = cli.main(["check", "--config", str(REPO / "deploy/config.yaml"), "--cluster", str(small)])
    out = capsys.readouterr().out.splitlines()
    refusals = [line for line in out if line.startswith("does not fit:")]
    assert code == 1 and len(refusals) == 2  # both nodes of the replica, one line each
    assert refusals[0] == ("does not fit: node 1 of 2 [gpu_8xh200]: download folder the Hugging Face cache (free: the "
                           "whole EBS gp3 1,000 GiB volume) needs 1,458.55 GiB more, has 1,000.00 GiB free")


def test_check_budgets_follow_download_dir_and_name_the_default_on_a_kuberay_file(tmp_path, capsys):
    """The same per-node estimate in check's lines and its budgets: with download_dir the budget reads the node's
    prefetched stage files only; a KubeRay file names no instance type, so the default is taken and said."""
    from kimi_k3_serve.planning.hardware import DEFAULT_NODE_IO

    config = (REPO / "deploy/config.yaml").read_text()
    assert "        # download_dir: /mnt/nvme/kimi-k3\n" in config
    local = tmp_path / "config.yaml"
    local.write_text(config.replace("        # download_dir: /mnt/nvme/kimi-k3\n", "        download_dir: /mnt/nvme/kimi-k3\n"))
    for path, per_copy in ((REPO / "deploy/config.yaml", False), (local, True)):
        code = cli.main(["check", "--config", str(path), "--cluster", str(REPO / "cluster_configs/kuberay-h200.yaml"),
                         "--json"])
        document = json.loads(capsys.readouterr().out)
        assert code == 0
        section = document["checkpoint"]
        nodes, startup = section["nodes"], section["startup"]
        assert all(n["prefetched"] is per_copy and n["bandwidth_defaulted"] for n in nodes)
        assert (nodes[0]["network_bytes_per_s"], nodes[0]["disk_read_bytes_per_s"]) == (
            DEFAULT_NODE_IO.network_bytes_per_s, DEFAULT_NODE_IO.disk_read_bytes_per_s)
        slowest = max(nodes, key=lambda n: n["start_s"])
        assert startup["load_s"] == pytest.approx(slowest["start_s"])
        expected = slowest["load_s"] if per_copy else slowest["download_s"] + slowest["load_s"]
        assert startup["load_s"] == pytest.approx(expected)
        if per_copy:
            assert slowest["bytes"] < 0.56 * section["replica_bytes_whole"] / 2  # its stage's files, not all
        checks = "\n".join(document["checks"])
        assert "default (the cluster file names no instance type)" in checks
        assert "The default (hardware.DEFAULT_NODE_IO), where the node type or its volume is not known" in checks


def test_the_replica_loads_its_own_nodes_download_dir_not_the_build_nodes(tmp_path, monkeypatch, tiny_models):
    """``build_app`` expands ``download_dir`` where the app is built; the replica re-expands it on its own node
    (``replica_callback.load_from_this_nodes_copy``), so vLLM loads the copy the replica check read. Here the
    "nodes" are two values of the same variable, on Ray Serve LLM's real ``LLMConfig`` and its cached engine config."""
    from kimi_k3_serve.app import llm_config_of
    from kimi_k3_serve.checks.replica_callback import load_from_this_nodes_copy
    from kimi_k3_serve.config.args import load_args

    for node in ("build", "replica"):
        (tmp_path / node / "model").mkdir(parents=True)
        (tmp_path / node / "model" / "config.json").write_text((tiny_models.target / "config.json").read_text())
    args = load_args({"model": {"id": "tiny-llama", "source": str(tiny_models.target), "download_dir": "$KK3_NODE_DIR"},
                      "accelerator": {"kind": "cpu"}, "limits": {"max_model_len": 512, "max_num_seqs": 4}})
    monkeypatch.setenv("KK3_NODE_DIR", str(tmp_path / "build"))
    llm_config = llm_config_of(args)
    assert llm_config.get_engine_config().actual_hf_model_id == str(tmp_path / "build" / "model")
    monkeypatch.setenv("KK3_NODE_DIR", str(tmp_path / "replica"))
    line = load_from_this_nodes_copy(llm_config, args)
    assert line == f"vLLM loads {tmp_path / 'replica' / 'model'} (this node's args.model.download_dir)"
    assert llm_config.model_loading_config.model_source == str(tmp_path / "replica" / "model")
    assert llm_config.get_engine_config().get_initialization_kwargs()["model"] == str(tmp_path / "replica" / "model")
    monkeypatch.setenv("KK3_NODE_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="run prefetch first"):
        load_from_this_nodes_copy(llm_config, args)
