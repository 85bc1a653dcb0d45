"""The pure cluster-file renderer and the ``kimi-k3-serve render`` command."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from kimi_k3_serve import __version__
from kimi_k3_serve.cli import main
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.clusterfiles.render import (
    FORMATS,
    PLATFORM_OF_FORMAT,
    ClusterFileRequest,
    ReplicaScaling,
    ReplicaShape,
    bundle_custom_resources,
    even_bundles_per_node,
    find_offering,
    render,
)
from kimi_k3_serve.units import GiB

REPO = Path(__file__).resolve().parents[1]
SERVE_TEXT = "applications:\n  - name: demo\n    # a comment kept verbatim\n\n    import_path: kimi_k3_serve.app:build_app\n"


def _shape(gpu: str = "H200", world: int = 16, per_node: int = 8, cpus: int = 192) -> ReplicaShape:
    layout = even_bundles_per_node(world, per_node)
    return ReplicaShape(
        gpu=gpu,
        accelerator_type=gpu,
        gpus_per_node=per_node,
        nodes_per_replica=len(layout),
        bundles_per_node=layout,
        bundle_resources=((f"accelerator_type:{gpu}", 0.001),),
        cpus_per_node=cpus,
        memory_bytes_per_node=2048 * GiB,
    )


def _request(fmt: str, shape: ReplicaShape | None = None, scaling=ReplicaScaling(1, 2), **overrides) -> ClusterFileRequest:
    shape = shape or _shape()
    offering = find_offering(PLATFORM_OF_FORMAT.get(fmt, "aws"), shape.gpu)
    fields = dict(
        format=fmt, shape=shape, scaling=scaling, offering=offering, cluster_name="demo",
        deploy_config="deploy/demo.yaml", serve_config_text=SERVE_TEXT,
    )
    fields.update(overrides)
    return ClusterFileRequest(**fields)


def _ray_service(text: str) -> dict:
    """A rendered KubeRay file's RayService (its first document; the NetworkPolicy follows)."""
    documents = list(yaml.safe_load_all(text))
    assert [d["kind"] for d in documents] == ["RayService", "NetworkPolicy"]
    return documents[0]


def _worker_type(document: dict) -> dict:
    types = document["available_node_types"]
    workers = [v for k, v in types.items() if k not in ("head", "ray.head.default")]
    assert len(workers) == 1
    return workers[0]


@pytest.mark.parametrize(
    "world, per_node, expected",
    [(16, 8, (8, 8)), (12, 8, (8, 4)), (8, 4, (4, 4)), (8, 8, (8,)), (3, 8, (3,)), (32, 8, (8, 8, 8, 8))],
)
def test_bundles_fill_whole_nodes_first(world, per_node, expected):
    assert even_bundles_per_node(world, per_node) == expected


def test_declared_custom_resources_cover_the_busiest_node():
    shape = _shape()
    assert shape.declared_custom_resources() == {"accelerator_type:H200": 1}  # 8 x 0.001 fits in 1
    heavy = ReplicaShape("H200", "H200", 8, 2, (8, 8), (("accelerator_type:H200", 0.001), ("nic", 0.5)), 192, 0)
    assert heavy.declared_custom_resources() == {"accelerator_type:H200": 1, "nic": 4}
    assert heavy.ray_resources() == {"CPU": 192, "GPU": 8, "accelerator_type:H200": 1, "nic": 4}


def test_bundle_custom_resources_ignores_ray_standard_resources():
    bundles = [{"GPU": 1, "CPU": 1, "accelerator_type:H200": 0.001}, {"GPU": 1, "accelerator_type:H200": 0.001, "memory": 5}]
    assert bundle_custom_resources(bundles) == (("accelerator_type:H200", 0.001),)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(nodes_per_replica=2, bundles_per_node=(8,)), "replica_shape.bundles_per_node"),
        (dict(nodes_per_replica=1, bundles_per_node=(9,)), "replica_shape.bundles_per_node"),
        (dict(nodes_per_replica=0, bundles_per_node=()), "replica_shape.nodes_per_replica"),
        (dict(nodes_per_replica=1, bundles_per_node=(8,), bundle_resources=(("GPU", 1.0),)), "replica_shape.bundle_resources"),
    ],
)
def test_bad_replica_shape_names_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        ReplicaShape(gpu="H200", accelerator_type="H200", gpus_per_node=8, **kwargs)
    assert info.value.field == field


def test_worker_counts_are_replicas_times_nodes_per_replica():
    scaling = ReplicaScaling(min_replicas=1, max_replicas=3)
    shape = _shape(world=16, per_node=8)
    assert (scaling.min_workers(shape), scaling.max_workers(shape)) == (2, 6)
    with pytest.raises(ConfigError, match="max_replicas"):
        ReplicaScaling(min_replicas=3, max_replicas=2)
    with pytest.raises(ConfigError, match="min_replicas"):
        ReplicaScaling(min_replicas=-1, max_replicas=2)


@pytest.mark.parametrize("fmt", ["launcher-aws", "launcher-gcp", "fake"])
@pytest.mark.parametrize("world, per_node, gpu", [(16, 8, "H200"), (32, 8, "H200"), (16, 8, "B200")])
def test_launcher_node_type_follows_the_shape(fmt, world, per_node, gpu):
    shape = _shape(gpu=gpu, world=world, per_node=per_node, cpus=find_offering(PLATFORM_OF_FORMAT[fmt], gpu).cpus)
    scaling = ReplicaScaling(min_replicas=1, max_replicas=3)
    document = yaml.safe_load(render(_request(fmt, shape, scaling)))
    worker = _worker_type(document)
    nodes = world // per_node
    assert worker["max_workers"] == 3 * nodes
    assert document["max_workers"] == 3 * nodes
    # Production files keep min_replicas' nodes warm; the local fake cluster starts empty.
    assert worker["min_workers"] == (0 if fmt == "fake" else nodes)
    assert worker["resources"]["GPU"] == per_node
    assert worker["resources"][f"accelerator_type:{gpu}"] == 1
    assert all(isinstance(v, int) for v in worker["resources"].values()), "the launcher schema wants integers"


def test_idle_timeout_reaches_both_launcher_keys():
    document = yaml.safe_load(render(_request("launcher-aws", idle_timeout_s=900)))
    assert document["idle_timeout_minutes"] == 15
    assert _worker_type(document)["idle_timeout_s"] == 900


def test_kuberay_embeds_the_deploy_config_verbatim_and_declares_the_custom_resource():
    document = _ray_service(render(_request("kuberay")))
    assert document["kind"] == "RayService"
    assert document["spec"]["serveConfigV2"] == SERVE_TEXT
    cluster = document["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    (group,) = cluster["workerGroupSpecs"]
    assert (group["minReplicas"], group["maxReplicas"]) == (2, 4)
    assert group["resources"] == {"accelerator_type:H200": "1"}
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "8"


@pytest.mark.parametrize("gpu, world, per_node, cpus, image, lock", [
    ("H200", 16, 8, 180, "kimi-k3-serve:0.1.0-gpu", "deploy/requirements-gpu.lock"),
    ("GB300", 8, 4, 128, "kimi-k3-serve:0.1.0-gpu-arm64", "deploy/requirements-gpu-arm64.lock"),
])
def test_kuberay_pods_run_the_image_deploy_dockerfile_builds(gpu, world, per_node, cpus, image, lock):
    text = render(_request("kuberay", _shape(gpu=gpu, world=world, per_node=per_node, cpus=cpus)))
    cluster = _ray_service(text)["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert head["image"] == worker["image"] == image
    assert "REPLACE-ME" not in text
    assert lock in text  # the comment names the lock the image was built from
    assert (REPO / lock).is_file()
    assert image.startswith(f"kimi-k3-serve:{__version__}-gpu")


@pytest.mark.parametrize("fmt", ["launcher-aws", "launcher-gcp"])
@pytest.mark.parametrize("gpu, lock", [("H200", "deploy/requirements-gpu.lock"), ("B200", "deploy/requirements-gpu.lock")])
def test_launcher_setup_installs_the_lock_then_the_package_without_dependencies(fmt, gpu, lock):
    shape = _shape(gpu=gpu, cpus=find_offering(PLATFORM_OF_FORMAT[fmt], gpu).cpus)
    text = render(_request(fmt, shape))
    setup = yaml.safe_load(text)["setup_commands"]
    installs = [command for command in setup if " pip install " in command]
    assert len(installs) == 2
    assert installs[0].endswith(f"-r ~/kimi-k3-serve/{lock}")
    assert "--no-deps -e ~/kimi-k3-serve" in installs[1]
    assert (REPO / lock).is_file()
    # ray start (head and workers) runs in the venv the lock went into.
    assert any("activate' >> ~/.bashrc" in command for command in setup)
    setup_block = text[text.index("setup_commands:"):text.index("head_start_ray_commands:")]
    assert "EDIT" not in setup_block


def test_kuberay_joins_trays_of_one_nvlink_domain_only_where_the_domain_spans_nodes():
    tray = _shape(gpu="GB300", world=8, per_node=4, cpus=128)
    spec = _ray_service(render(_request("kuberay", tray)))["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert spec["resourceClaims"][0]["name"] == "nvlink-domain"
    assert spec["containers"][0]["resources"]["claims"] == [{"name": "nvlink-domain"}]
    hgx = _ray_service(render(_request("kuberay")))["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert "resourceClaims" not in hgx


def test_request_refuses_mismatches():
    with pytest.raises(ConfigError, match="GPUs per node"):
        _request("kuberay", offering=find_offering("kubernetes", "GB300"))
    with pytest.raises(ConfigError, match="is a kubernetes node, not launcher-aws"):
        _request("launcher-aws", offering=find_offering("kubernetes", "H200"))
    with pytest.raises(ConfigError, match="serveConfigV2"):
        _request("kuberay", serve_config_text="")
    with pytest.raises(ConfigError) as info:
        _request("ansible")
    assert info.value.field == "format"
    with pytest.raises(ConfigError) as info:
        _request("kuberay", cluster_name="Kimi_K3")
    assert info.value.field == "cluster_name"


def test_find_offering_lists_what_exists():
    assert find_offering("aws", "H200").name == "p5en.48xlarge"
    assert find_offering("gcp", "H200").name == "a3-ultragpu-8g"
    assert find_offering("kubernetes", "GB300").gpus == 4
    with pytest.raises(ConfigError, match="p5en.48xlarge"):
        find_offering("aws", "H200", "p9.huge")
    with pytest.raises(ConfigError, match="no gcp node type"):
        find_offering("gcp", "RTX-3090")


def test_cloud_offerings_agree_with_the_hardware_catalogue():
    from kimi_k3_serve.planning.hardware import lookup_gpu, lookup_instance
    from kimi_k3_serve.clusterfiles.render import OFFERINGS

    for offering in OFFERINGS:
        lookup_gpu(offering.gpu)
        if offering.platform in ("aws", "gcp"):
            instance = lookup_instance(offering.name)
            assert instance is not None, offering.name
            assert (instance.gpu, instance.gpus) == (offering.gpu, offering.gpus)


def test_header_names_the_command_that_wrote_the_file():
    text = render(_request("launcher-aws", extra_options=("--cluster-name", "demo")))
    assert "# Written by `kimi-k3-serve render --config deploy/demo.yaml --format launcher-aws --cluster-name demo`" in text


def test_render_writes_every_format_repeatedly():
    """Every format renders 50 times over; the time per file is printed, not timed (a timed bound fails on a busy CI
    runner)."""
    start = time.perf_counter()
    for fmt in FORMATS:
        for _ in range(50):
            render(_request(fmt))
    elapsed = (time.perf_counter() - start) / (50 * len(FORMATS))
    print(f"\nrender: {elapsed * 1e3:.3f} ms per file")


# --- the command -----------------------------------------------------------------------------------------------


def test_cli_writes_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    out = tmp_path / "aws.yaml"
    assert main(["render", "--config", str(REPO / "deploy/config.yaml"), "--format", "launcher-aws", "--output", str(out)]) == 0
    text = out.read_text()
    assert "--config deploy/config.yaml " in text, "a config below the working directory is named relatively"
    assert str(REPO) not in text
    assert _worker_type(yaml.safe_load(text))["node_config"]["InstanceType"] == "p5en.48xlarge"


def test_cli_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert main(["render", "--config", str(tmp_path / "missing.yaml"), "--format", "fake"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["render", "--config", "deploy/config.yaml", "--format", "launcher-gcp", "--instance-type", "p5en.48xlarge"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "instance_type" in err and "a3-ultragpu-8g" in err
    with pytest.raises(SystemExit) as info:
        main(["render", "--config", "deploy/config.yaml", "--format", "terraform"])
    assert info.value.code == 2


def test_cli_refuses_a_cpu_deploy_config(tmp_path):
    config = tmp_path / "cpu.yaml"
    config.write_text(
        "applications:\n"
        "  - name: dev\n"
        "    import_path: kimi_k3_serve.app:build_app\n"
        "    args:\n"
        "      model: {id: tiny, source: org/tiny}\n"
        "      accelerator: {kind: cpu}\n"
        "      limits: {max_model_len: 256}\n"
    )
    assert main(["render", "--config", str(config), "--format", "fake"]) == 2


def test_cli_refuses_a_layout_the_planner_rejects(tmp_path, capsys):
    """No cluster file for a replica that cannot load: Kimi-K3 at TP8 on one 8 x H200 node needs ~205 GB a GPU."""
    config = tmp_path / "tp8.yaml"
    text = (REPO / "deploy" / "config.yaml").read_text()
    text = text.replace("pipeline_parallel_size: 2", "pipeline_parallel_size: 1").replace("layer_partition: [49, 44]", "")
    config.write_text(text)
    out = tmp_path / "never.yaml"
    assert main(["render", "--config", str(config), "--format", "launcher-aws", "--output", str(out)]) == 1
    assert "does not fit" in capsys.readouterr().err
    assert not out.exists()


def test_render_core_imports_no_ray_vllm_or_torch():
    import subprocess
    import sys

    code = ("import sys, kimi_k3_serve.clusterfiles.render, kimi_k3_serve.commands.render; "
            "print(sorted(m for m in ('ray', 'vllm', 'torch', 'yaml') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


# --- Ray's control plane, closed ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["launcher-aws", "launcher-gcp"])
def test_launcher_cluster_runs_with_token_auth_and_a_loopback_dashboard(fmt):
    document = yaml.safe_load(render(_request(fmt)))
    (head_start,) = [c for c in document["head_start_ray_commands"] if "ray start" in c]
    (worker_start,) = [c for c in document["worker_start_ray_commands"] if "ray start" in c]
    assert "RAY_AUTH_MODE=token ray start --head" in head_start and "RAY_AUTH_MODE=token ray start" in worker_start
    assert "--dashboard-host=127.0.0.1" in head_start and "0.0.0.0" not in render(_request(fmt))
    # Every node gets the operator's token file; the file names its path only.
    assert document["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert "export RAY_AUTH_MODE=token" in " ".join(document["setup_commands"])  # ray exec / serve deploy clients


def test_kuberay_cluster_runs_with_token_auth_and_a_network_policy():
    text = render(_request("kuberay"))
    service, policy = yaml.safe_load_all(text)
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}
    assert "RAY_AUTH_TOKEN" not in text  # KubeRay sets it in every pod from the Secret it makes
    labels = [cluster["headGroupSpec"]["template"]["metadata"]["labels"],
              *(group["template"]["metadata"]["labels"] for group in cluster["workerGroupSpecs"])]
    spec = policy["spec"]
    assert all(spec["podSelector"]["matchLabels"].items() <= pod.items() for pod in labels), "the policy misses pods"
    assert spec["policyTypes"] == ["Ingress"]
    own, operator, clients = spec["ingress"]
    # Every rule names who it admits (a rule without `from`, or with an empty selector, admits every pod).
    for rule in spec["ingress"]:
        assert rule["from"] and all(peer and all(peer.values()) for peer in rule["from"]), rule
    assert own == {"from": [{"podSelector": spec["podSelector"]}]}
    assert operator["from"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}
    assert operator["ports"] == [{"port": 8265, "protocol": "TCP"}]  # the dashboard, nothing else of Ray
    assert clients["ports"] == [{"port": 8000, "protocol": "TCP"}]


@pytest.mark.parametrize("file_name, name", [
    ("config.yaml", "kimi-k3"),
    ("config-b200.yaml", "kimi-k3-b200"),
    ("My_Config.yaml", "kimi-k3-my-config"),  # was refused as a cluster name the user never wrote
    ("x" * 80 + ".yaml", "kimi-k3-" + "x" * 42),
])
def test_the_default_cluster_name_is_a_legal_one(file_name, name):
    from kimi_k3_serve.commands.render import default_cluster_name

    assert default_cluster_name(Path(file_name)) == name
