"""Every shipped deploy config and cluster file is valid for the tool that reads it, fits per the planner, and
is exactly what ``kimi-k3-serve render`` writes.

- Serve configs: Ray Serve's ``ServeDeploySchema``, our ``args`` schema, Serve's ``DeploymentConfig`` for the
  options the app builder derives, and vLLM 0.32's engine-argument names and choices for the pass-through
  ``engine_kwargs``.
- Ray cluster launcher files: Ray's ``ray/autoscaler/ray-schema.json`` (jsonschema) and Ray's own
  ``prepare_config`` + ``validate_config``.
- KubeRay files: a field whitelist of the ``ray.io/v1`` RayService / RayCluster types (KubeRay >= 1.4, read
  from ``ray-operator/apis/ray/v1/{rayservice,raycluster}_types.go``) plus Ray's KubeRay autoscaling-config
  reader, which is what the in-tree autoscaler turns the worker groups into.
- Fit: the planner checks each deploy config's own layout on the nodes its cluster file declares.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import typing
from pathlib import Path

import pytest
import yaml

from conftest import comment_prose
from kimi_k3_serve.cli import main
from kimi_k3_serve.cluster.files import load_cluster_file
from kimi_k3_serve.config.args_adapter import planner_inputs
from kimi_k3_serve.planning.planner import plan
from kimi_k3_serve.config.serve_config import load_serve_app, read_serve_config

REPO = Path(__file__).resolve().parents[1]
DEPLOY_CONFIGS = sorted((REPO / "deploy").glob("config*.yaml"))
CLUSTER_FILES = sorted((REPO / "cluster_configs").glob("*.yaml"))
HEADER = re.compile(r"^# Written by `(kimi-k3-serve render [^`]+)`", re.MULTILINE)

EXPECTED_CLUSTER_FILES = {
    "aws-h200-p5en.yaml": ("deploy/config.yaml", "launcher-aws"),
    "gcp-h200-a3-ultra.yaml": ("deploy/config.yaml", "launcher-gcp"),
    "kuberay-h200.yaml": ("deploy/config.yaml", "kuberay"),
    "fake-h200.yaml": ("deploy/config.yaml", "fake"),
    "aws-b200-p6.yaml": ("deploy/config-b200.yaml", "launcher-aws"),
    "kuberay-gb300-nvl72.yaml": ("deploy/config-gb300-nvl72.yaml", "kuberay"),
    "aws-h200-p5en-wide-ep.yaml": ("deploy/config-wide-ep.yaml", "launcher-aws"),
    "kuberay-gb300-nvl72-wide-ep.yaml": ("deploy/config-gb300-nvl72-wide-ep.yaml", "kuberay"),
}


def _ids(paths):
    return [p.name for p in paths]


def _render_command(path: Path) -> list[str]:
    match = HEADER.search(path.read_text())
    assert match, f"{path.name} does not say which render command wrote it"
    return shlex.split(match.group(1))


def _option(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def _cluster_files_of(config: Path) -> list[Path]:
    relative = config.relative_to(REPO).as_posix()
    return [f for f in CLUSTER_FILES if _option(_render_command(f), "--config") == relative]


@pytest.fixture(scope="module")
def replica_plans():
    """The planner's verdict for each deploy config's own layout, on one replica's nodes (declared)."""
    from kimi_k3_serve.commands.render import plan_replica
    from kimi_k3_serve.planning.hardware import lookup_gpu

    plans = {}
    for config in DEPLOY_CONFIGS:
        args = load_serve_app(config).args
        plans[config.name] = plan_replica(args, gpus_per_node=lookup_gpu(args.accelerator.type).gpus_per_node)
    return plans


# --- Serve configs ----------------------------------------------------------------------------------------------


def test_the_deploy_configs_ship():
    assert {p.name for p in DEPLOY_CONFIGS} == {"config.yaml", "config-b200.yaml", "config-gb300-nvl72.yaml",
                                                "config-wide-ep.yaml", "config-gb300-nvl72-wide-ep.yaml"}


@pytest.mark.parametrize("config", DEPLOY_CONFIGS, ids=_ids(DEPLOY_CONFIGS))
def test_deploy_config_passes_serve_and_args_schemas(config):
    from ray.serve._private.config import DeploymentConfig

    from kimi_k3_serve.app import deployment_config, ingress_deployment_config

    document = read_serve_config(config)  # ServeDeploySchema
    app = load_serve_app(config)  # our args schema
    assert document["proxy_location"] == "EveryNode"
    assert app.args.accelerator.kind == "gpu"
    derived = DeploymentConfig.from_default(**deployment_config(app.args))
    assert derived.autoscaling_config.target_ongoing_requests == app.args.autoscaling.target_ongoing_requests
    assert DeploymentConfig.from_default(**ingress_deployment_config(app.args)).num_replicas == app.args.ingress.num_replicas


ALL_SERVE_CONFIGS = sorted((REPO / "deploy").glob("*.yaml"))
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@pytest.mark.parametrize("config", ALL_SERVE_CONFIGS, ids=_ids(ALL_SERVE_CONFIGS))
def test_serve_configs_are_closed_by_default(config):
    """Every GPU config requires the API key (the ingress refuses to start without one); only the dev configs are
    open, and they listen on loopback alone."""
    app = load_serve_app(config)
    if config.name.startswith("dev"):
        assert app.http_host in LOOPBACK_HOSTS, f"{config.name} is open (no key) and listens on {app.http_host}"
    else:
        assert app.args.accelerator.kind == "gpu"
        assert app.args.security.require_api_key is True, f"{config.name} serves /v1 without a key when none is found"


@pytest.mark.parametrize("config", DEPLOY_CONFIGS, ids=_ids(DEPLOY_CONFIGS))
def test_engine_kwargs_are_vllm_032_arguments(config):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    fields = {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}
    for name, value in load_serve_app(config).args.engine_kwargs.items():
        assert name in fields, f"{config.name}: {name} is not a vLLM 0.32 engine argument"
        kind = fields[name].type
        if typing.get_origin(kind) is typing.Literal:
            assert value in typing.get_args(kind), f"{config.name}: {name}={value!r} is not one of vLLM's choices"
        if name == "attention_backend":
            assert value in AttentionBackendEnum.__members__, f"{config.name}: no attention backend {value!r}"


@pytest.mark.parametrize("config", DEPLOY_CONFIGS, ids=_ids(DEPLOY_CONFIGS))
def test_deploy_config_serving_settings(config, replica_plans):
    args = load_serve_app(config).args
    verdict = replica_plans[config.name]
    concurrency = float(verdict.report.max_concurrency)
    # Limits with margin: the KV cache holds max_num_seqs requests even at max_model_len.
    assert verdict.fits and args.limits.max_num_seqs <= concurrency
    # A real autoscaling target, from the plan's concurrency (Ray Serve LLM's own default is 1e9: never scales).
    target = args.autoscaling.target_ongoing_requests
    assert target is not None and 1 <= target <= min(args.limits.max_num_seqs, concurrency)
    assert args.autoscaling.max_replicas > args.autoscaling.min_replicas >= 1
    assert args.ingress.num_replicas == args.autoscaling.max_replicas, "ingress scaled with the model"
    # A replica takes many minutes to load: slow scale-in, generous start/health/drain times.
    assert args.autoscaling.downscale_delay_s >= 600
    assert args.deployment.health_check_timeout_s >= 30
    assert args.deployment.graceful_shutdown_timeout_s >= 60
    assert int(args.runtime_env.env_vars["RAYLLM_ENGINE_START_TIMEOUT_S"]) > 3600
    # DSpark, the draft vLLM recommends for Kimi-K3; the planner charged it to the last stage.
    assert (args.speculative.method, args.speculative.model) == ("dspark", "Inferact/Kimi-K3-DSpark")
    last = max(r.pp_stage for r in verdict.report.ranks)
    assert all(r.draft_bytes > 0 for r in verdict.report.ranks if r.pp_stage == last)
    assert all(r.draft_bytes == 0 for r in verdict.report.ranks if r.pp_stage != last)


def test_gb300_layout_is_the_gemm_rs_sequence_parallel_one(replica_plans):
    verdict = replica_plans["config-gb300-nvl72.yaml"]
    assert verdict.optimisations.is_on("sequence_parallel") and verdict.optimisations.is_on("gemm_rs")
    assert len({p.node_id for p in verdict.placements}) > 1, "the TP group spans trays of one NVLink domain"
    assert len({p.nvlink_domain for p in verdict.placements}) == 1
    env = load_serve_app(REPO / "deploy/config-gb300-nvl72.yaml").args.runtime_env.env_vars
    # the plan's kernel decision needs GEMM-RS switched on, and the config does so (the plan deploys the config's env)
    assert env["VLLM_ENABLE_GEMM_RS"] == "1" == verdict.optimisations.env["VLLM_ENABLE_GEMM_RS"]
    assert verdict.env_vars["VLLM_ENABLE_GEMM_RS"] == "1"


# What a deploy config's comments claim the plan says, each with the plan's quantity it must equal. The plan moves
# whenever a constant is refitted; a number left behind would tell a user a capacity the planner no longer proves.
CLAIMS = (
    (re.compile(r"([\d.]+) requests of ([\d,]+) tokens at once at the point estimates"), "point"),
    (re.compile(r"([\d.]+) requests of ([\d,]+) tokens(?! at once at the point)"), "banded"),
    (re.compile(r"\(([\d.]+) at the point estimates"), "point"),
    (re.compile(r"below the ([\d.]+) full-length requests"), "banded"),
    (re.compile(r"([\d,]+) tokens \(planner:"), "kv_cache_tokens"),
    (re.compile(r"([\d.]+) over the (\d+) engines"), "point_all_engines"),
)


def _claims(text: str) -> list[tuple[str, str, str | None]]:
    """(kind, number as written, the max_model_len or engine count written beside it) for every claim in ``text``;
    a comment's sentence may run over several ``#`` lines."""
    prose = comment_prose(text)
    return [(kind, m.group(1), m.group(2) if m.lastindex == 2 else None)
            for pattern, kind in CLAIMS for m in pattern.finditer(prose)]


def _as_written(value: float, written: str) -> str:
    """``value`` with as many decimals (and thousands commas) as the claim was written with."""
    decimals = len(written.split(".")[1]) if "." in written else 0
    return f"{value:,.{decimals}f}" if "," in written else f"{value:.{decimals}f}"


@pytest.mark.parametrize("config", DEPLOY_CONFIGS, ids=_ids(DEPLOY_CONFIGS))
def test_deploy_config_comments_state_the_plans_numbers(config, replica_plans):
    report = replica_plans[config.name].report
    dp = replica_plans[config.name].layout.dp
    plan_says = {"point": float(report.max_concurrency), "banded": float(report.banded_max_concurrency),
                 "kv_cache_tokens": float(report.kv_cache_tokens),
                 "point_all_engines": float(report.max_concurrency) * dp}
    claims = _claims(config.read_text())
    assert any(kind == "banded" for kind, _, _ in claims), f"{config.name} does not say what its limits hold"
    for kind, written, beside in claims:
        assert written == _as_written(plan_says[kind], written), (
            f"{config.name}: the comment says {written} ({kind}), the plan {plan_says[kind]:.4f}")
        if kind in ("point", "banded") and beside is not None:
            assert int(beside.replace(",", "")) == report.engine.max_model_len, f"{config.name}: {beside} tokens"
        if kind == "point_all_engines":
            assert int(beside) == dp


# --- every deploy config fits its cluster files -----------------------------------------------------------------


@pytest.mark.parametrize("config", DEPLOY_CONFIGS, ids=_ids(DEPLOY_CONFIGS))
def test_deploy_config_fits_its_cluster_files(config):
    args = load_serve_app(config).args
    model, engine, pins = planner_inputs(args)
    files = [f for f in _cluster_files_of(config) if "fake" not in f.name]
    assert files, f"no cluster file is rendered from {config.name}"
    for cluster_file in files:
        # The nodes the file starts with hold min_replicas replicas; its maximum holds max_replicas.
        cluster = load_cluster_file(str(cluster_file))
        verdict = plan(model, engine, cluster, pins)
        assert verdict.fits, cluster_file.name
        world = args.parallel.world_size
        at_capacity = cluster.at_capacity()
        assert sum(n.gpu_count for n in at_capacity.gpu_nodes) == args.autoscaling.max_replicas * world
        print(f"\n{config.name} on {cluster_file.name}: {verdict.layout.describe()} fits, "
              f"{float(verdict.report.max_concurrency):.2f} x {args.limits.max_model_len} tokens")


# --- cluster files ----------------------------------------------------------------------------------------------


def test_expected_cluster_files_ship_and_each_names_its_source():
    assert {f.name for f in CLUSTER_FILES} == set(EXPECTED_CLUSTER_FILES)
    for cluster_file in CLUSTER_FILES:
        words = _render_command(cluster_file)
        assert (_option(words, "--config"), _option(words, "--format")) == EXPECTED_CLUSTER_FILES[cluster_file.name]


@pytest.mark.parametrize("cluster_file", CLUSTER_FILES, ids=_ids(CLUSTER_FILES))
def test_shipped_cluster_file_is_renders_output_byte_for_byte(cluster_file, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / cluster_file.name
    assert main(_render_command(cluster_file)[1:] + ["--output", str(out)]) == 0
    assert out.read_text() == cluster_file.read_text(), (
        f"{cluster_file.name} drifted from its deploy config: run the command in its header again"
    )


def _launcher_files():
    return [f for f in CLUSTER_FILES if _option(_render_command(f), "--format").startswith("launcher-")]


def _kuberay_files():
    return [f for f in CLUSTER_FILES if _option(_render_command(f), "--format") == "kuberay"]


def _ray_schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def _expected_worker(cluster_file: Path) -> tuple[int, int, dict[str, float]]:
    """(min workers, max workers, custom resources per bundle) the deploy config and its plan call for."""
    from kimi_k3_serve.commands.render import plan_replica
    from kimi_k3_serve.clusterfiles.render import bundle_custom_resources

    words = _render_command(cluster_file)
    args = load_serve_app(REPO / _option(words, "--config")).args
    document = next(yaml.safe_load_all(cluster_file.read_text()))  # a KubeRay file's RayService; its NetworkPolicy follows
    if "available_node_types" in document:
        gpus_per_node = next(t["resources"]["GPU"] for t in document["available_node_types"].values() if "GPU" in t["resources"])
    else:
        limits = document["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
        gpus_per_node = int(limits["resources"]["limits"]["nvidia.com/gpu"])
    replica = plan_replica(args, gpus_per_node=gpus_per_node)
    nodes = len({p.node_id for p in replica.placements})
    custom = dict(bundle_custom_resources(replica.placement_group_config["bundles"]))
    return args.autoscaling.min_replicas * nodes, args.autoscaling.max_replicas * nodes, custom


@pytest.mark.parametrize("cluster_file", _launcher_files(), ids=_ids(_launcher_files()))
def test_launcher_file_is_valid_for_ray_and_matches_the_plan(cluster_file):
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    document = yaml.safe_load(cluster_file.read_text())
    jsonschema.validate(document, _ray_schema())
    validate_config(prepare_config(document))  # what `ray up` does before launching anything
    (worker,) = [t for name, t in document["available_node_types"].items() if name != document["head_node_type"]]
    min_workers, max_workers, custom = _expected_worker(cluster_file)
    assert (worker["min_workers"], worker["max_workers"], document["max_workers"]) == (min_workers, max_workers, max_workers)
    for resource, per_bundle in custom.items():
        assert worker["resources"][resource] >= per_bundle * worker["resources"]["GPU"], resource


def test_fake_cluster_file_is_valid_for_ray():
    import jsonschema
    from ray.autoscaler._private.util import validate_config

    cluster_file = REPO / "cluster_configs" / "fake-h200.yaml"
    document = yaml.safe_load(cluster_file.read_text())
    jsonschema.validate(document, _ray_schema())
    validate_config(document)  # the fake provider ships no defaults file, so the file is complete on its own
    production = yaml.safe_load((REPO / "cluster_configs" / "aws-h200-p5en.yaml").read_text())
    fake_worker = document["available_node_types"]["gpu_8xh200"]["resources"]
    real_worker = production["available_node_types"]["gpu_8xh200"]["resources"]
    assert {k: v for k, v in fake_worker.items() if k not in ("CPU", "object_store_memory")} == {
        k: v for k, v in real_worker.items() if k != "CPU"
    }


# KubeRay ray.io/v1 fields (KubeRay >= 1.5.1): RayServiceSpec, RayClusterSpec, HeadGroupSpec, WorkerGroupSpec,
# AutoscalerOptions from ray-operator/apis/ray/v1/{rayservice,raycluster}_types.go; AuthOptions (``mode`` only in
# 1.5.1; ``secretName`` and ``enableK8sTokenAuth`` came in 1.6). ``None`` = any value.
# The pod template is corev1.PodTemplateSpec; only the fields these files use are listed.
# corev1.Probe (k8s.io/api/core/v1/types.go): ProbeHandler's exec plus the window fields.
_PROBE = {"exec": {"command": [str]}, "initialDelaySeconds": int, "periodSeconds": int, "timeoutSeconds": int,
          "successThreshold": int, "failureThreshold": int}
_CONTAINER = {"name": str, "image": str, "resources": {"limits": None, "requests": None, "claims": [{"name": str}]},
              "ports": [{"containerPort": int, "name": str}], "volumeMounts": [{"name": str, "mountPath": str}],
              "env": None, "livenessProbe": _PROBE}
_POD_TEMPLATE = {"metadata": None, "spec": {"containers": [_CONTAINER], "volumes": None, "tolerations": None,
                                            "nodeSelector": None, "resourceClaims": None}}
_STRING_MAP = {"*": str}
_KUBERAY_RAYSERVICE = {
    "apiVersion": str,
    "kind": str,
    "metadata": {"name": str, "namespace": str, "labels": None, "annotations": None},
    "spec": {
        "serveConfigV2": str,
        "rayClusterDeletionDelaySeconds": int,
        "excludeHeadPodFromServeSvc": bool,
        "serveService": None,
        "upgradeStrategy": {"type": ("NewCluster", "NewClusterWithIncrementalUpgrade", "None"), "clusterUpgradeOptions": None},
        "rayClusterConfig": {
            "rayVersion": str,
            "authOptions": {"mode": ("disabled", "token")},
            "enableInTreeAutoscaling": bool,
            "suspend": bool,
            "gcsFaultToleranceOptions": None,
            "headServiceAnnotations": None,
            "autoscalerOptions": {
                "version": ("v1", "v2"),
                "upscalingMode": ("Default", "Aggressive", "Conservative"),
                "idleTimeoutSeconds": int,
                "resources": None, "image": str, "imagePullPolicy": str, "env": None, "envFrom": None,
                "volumeMounts": None, "securityContext": None,
            },
            "headGroupSpec": {"rayStartParams": _STRING_MAP, "template": _POD_TEMPLATE, "serviceType": str,
                              "headService": None, "enableIngress": bool, "resources": _STRING_MAP, "labels": _STRING_MAP},
            "workerGroupSpecs": [{
                "groupName": str, "replicas": int, "minReplicas": int, "maxReplicas": int, "idleTimeoutSeconds": int,
                "numOfHosts": int, "suspend": bool, "scaleStrategy": None, "resources": _STRING_MAP,
                "labels": _STRING_MAP, "rayStartParams": _STRING_MAP, "template": _POD_TEMPLATE,
            }],
        },
    },
}
# networking.k8s.io/v1 NetworkPolicy (k8s.io/api/networking/v1/types.go): NetworkPolicySpec, NetworkPolicyIngressRule,
# NetworkPolicyPeer, NetworkPolicyPort; LabelSelector's two fields.
_LABEL_SELECTOR = {"matchLabels": _STRING_MAP, "matchExpressions": None}
_PEER = {"podSelector": _LABEL_SELECTOR, "namespaceSelector": _LABEL_SELECTOR, "ipBlock": None}
_PORT = {"port": None, "endPort": int, "protocol": ("TCP", "UDP", "SCTP")}
_NETWORK_POLICY = {
    "apiVersion": ("networking.k8s.io/v1",),
    "kind": ("NetworkPolicy",),
    "metadata": {"name": str, "namespace": str, "labels": None, "annotations": None},
    "spec": {"podSelector": _LABEL_SELECTOR, "policyTypes": [("Ingress", "Egress")],
             "ingress": [{"from": [_PEER], "ports": [_PORT]}], "egress": [{"to": [_PEER], "ports": [_PORT]}]},
}
_REQUIRED = {"spec.rayClusterConfig.headGroupSpec": ("template",),
             "spec.rayClusterConfig.workerGroupSpecs[]": ("groupName", "minReplicas", "maxReplicas", "template")}


def _check_fields(value, schema, path: str, problems: list[str]) -> None:
    if schema is None:
        return
    if isinstance(schema, tuple):
        if value not in schema:
            problems.append(f"{path}: {value!r} not one of {schema}")
    elif isinstance(schema, type):
        if not isinstance(value, schema) or (schema is int and isinstance(value, bool)):
            problems.append(f"{path}: expected {schema.__name__}, got {type(value).__name__}")
    elif isinstance(schema, list):
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list")
            return
        for i, item in enumerate(value):
            _check_fields(item, schema[0], f"{path}[{i}]", problems)
    elif isinstance(schema, dict):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping")
            return
        for key, item in value.items():
            if "*" in schema:
                _check_fields(item, schema["*"], f"{path}.{key}", problems)
            elif key not in schema:
                problems.append(f"{path}.{key}: not a field of the KubeRay CRD")
            else:
                _check_fields(item, schema[key], f"{path}.{key}".lstrip("."), problems)
        for required in _REQUIRED.get(re.sub(r"\[\d+\]", "[]", path.lstrip(".")), ()):
            if required not in value:
                problems.append(f"{path}.{required}: required")


def test_kuberay_field_check_catches_typos():
    problems: list[str] = []
    document = {"apiVersion": "ray.io/v1", "kind": "RayService", "spec": {"rayClusterConfig": {
        "workerGroupSpecs": [{"groupName": "g", "minReplica": 1, "maxReplicas": 2, "template": {}}],
        "autoscalerOptions": {"version": "v3"}}}}
    _check_fields(document, _KUBERAY_RAYSERVICE, "", problems)
    assert any("minReplica: not a field" in p for p in problems)
    assert any("minReplicas: required" in p for p in problems)
    assert any("'v3' not one of" in p for p in problems)


@pytest.mark.parametrize("cluster_file", _kuberay_files(), ids=_ids(_kuberay_files()))
def test_kuberay_file_uses_only_crd_fields_and_autoscales_from_zero(cluster_file):
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    document, policy = yaml.safe_load_all(cluster_file.read_text())
    problems: list[str] = []
    _check_fields(document, _KUBERAY_RAYSERVICE, "", problems)
    _check_fields(policy, _NETWORK_POLICY, "(NetworkPolicy)", problems)
    assert not problems, "\n".join(problems)
    assert (document["apiVersion"], document["kind"]) == ("ray.io/v1", "RayService")

    # serveConfigV2 is the deploy config itself, and valid for Serve and for our args.
    config_path = REPO / _option(_render_command(cluster_file), "--config")
    assert document["spec"]["serveConfigV2"] == config_path.read_text()

    # What the in-tree autoscaler makes of the worker group: Ray's own KubeRay reader.
    cluster_spec = document["spec"]["rayClusterConfig"]
    ray_cr = {"metadata": {"name": document["metadata"]["name"], "namespace": "default"}, "spec": cluster_spec}
    autoscaling = _derive_autoscaling_config_from_ray_cr(ray_cr)  # also runs Ray's validate_config
    (worker,) = [t for name, t in autoscaling["available_node_types"].items() if name != autoscaling["head_node_type"]]
    min_workers, max_workers, custom = _expected_worker(cluster_file)
    assert (worker["min_workers"], worker["max_workers"]) == (min_workers, max_workers)
    for resource, per_bundle in custom.items():
        assert worker["resources"].get(resource, 0) >= per_bundle * worker["resources"]["GPU"], (
            f"{resource} not declared: a pending placement group could never scale this group up"
        )
    assert autoscaling["available_node_types"][autoscaling["head_node_type"]]["resources"]["CPU"] == 0


# --- Ray's control plane, closed in every shipped cluster file -----------------------------------------------------


def test_network_policy_field_check_catches_typos():
    problems: list[str] = []
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
              "spec": {"podSelector": {"matchLabel": {}}, "ingress": [{"from": [{"podSelect": {}}]}]}}
    _check_fields(policy, _NETWORK_POLICY, "", problems)
    assert any("matchLabel: not a field" in p for p in problems) and any("podSelect: not a field" in p for p in problems)


@pytest.mark.parametrize("cluster_file", CLUSTER_FILES, ids=_ids(CLUSTER_FILES))
def test_no_shipped_cluster_file_exposes_rays_control_plane(cluster_file):
    """Launcher files: token auth on every node, the dashboard (and its Jobs API) on the head's loopback; KubeRay
    files: token auth and a NetworkPolicy over every pod; the fake-provider file runs on this machine only."""
    text = cluster_file.read_text()
    documents = list(yaml.safe_load_all(text))
    fmt = _option(_render_command(cluster_file), "--format")
    if fmt.startswith("launcher-"):
        (document,) = documents
        starts = [c for c in document["head_start_ray_commands"] + document["worker_start_ray_commands"] if "ray start" in c]
        # token auth on every start, before ray start (direct streaming's variables may sit between)
        assert len(starts) == 2 and all(re.search(r"RAY_AUTH_MODE=token (\w+=\S+ )*ray start", c) for c in starts), starts
        assert "--dashboard-host=127.0.0.1" in starts[0] and "0.0.0.0" not in text
        assert document["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    elif fmt == "kuberay":
        service, policy = documents
        cluster = service["spec"]["rayClusterConfig"]
        assert cluster["authOptions"] == {"mode": "token"}
        selector = policy["spec"]["podSelector"]["matchLabels"]
        templates = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
        assert selector and all(selector.items() <= t["metadata"]["labels"].items() for t in templates)
        assert all(rule.get("from") for rule in policy["spec"]["ingress"])
        assert "RAY_AUTH_TOKEN" not in text
    else:
        assert fmt == "fake" and "--node-ip-address=127.0.0.1" in text


# --- args.deployment.direct_streaming: every node's environment, in the rendered files -------------------------------

DIRECT_ENV = ("RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING", "RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_HAPROXY_BINARY_PATH",
              "RAY_SERVE_THROUGHPUT_OPTIMIZED")


def _direct_streaming_config(tmp_path: Path, source: str = "config.yaml") -> Path:
    """``deploy/config.yaml`` ships with direct streaming on (twelfth session): the file itself."""
    config = REPO / "deploy" / source
    assert load_serve_app(config).args.deployment.direct_streaming
    return config


@pytest.mark.parametrize("cluster_file", sorted((REPO / "cluster_configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_cluster_files_start_direct_streaming_exactly_where_their_config_asks(cluster_file):
    """The single-engine GPU configs serve through direct streaming (bare vLLM's throughput on the H200, across two
    Ray nodes); the wide-EP ones cannot yet (DP) and stay on our ingress. Each rendered file starts every node with
    the four variables when, and only when, its config sets it."""
    text = cluster_file.read_text()
    config = REPO / _option(_render_command(cluster_file), "--config")
    args = load_serve_app(config).args
    assert args.deployment.direct_streaming == (args.parallel.data_parallel_size == 1), config.name
    for name in DIRECT_ENV:
        assert (name in text) == args.deployment.direct_streaming, (cluster_file.name, name)


@pytest.mark.parametrize("fmt", ["launcher-aws", "launcher-gcp"])
def test_direct_streaming_starts_every_launcher_node_with_its_environment(tmp_path, fmt):
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    from kimi_k3_serve.commands.render import render_deploy_config

    document = yaml.safe_load(render_deploy_config(_direct_streaming_config(tmp_path), fmt))
    jsonschema.validate(document, _ray_schema())
    validate_config(prepare_config(document))
    starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in document[key] if "ray start" in c]
    assert len(starts) == 2
    for start in starts:
        assert all(f"{name}=" in start.split("ray start")[0] for name in DIRECT_ENV), start
        assert "RAY_SERVE_HAPROXY_BINARY_PATH=$HOME/kimi-k3-serve-env/bin/kimi-k3-serve-haproxy " in start
    # ... where the setup commands put the console script
    assert any("-e ~/kimi-k3-serve" in c for c in document["setup_commands"])


def test_direct_streaming_sets_every_kuberay_pods_environment(tmp_path):
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    from kimi_k3_serve.commands.render import render_deploy_config

    document, policy = yaml.safe_load_all(render_deploy_config(_direct_streaming_config(tmp_path), "kuberay"))
    problems: list[str] = []
    _check_fields(document, _KUBERAY_RAYSERVICE, "", problems)
    assert not problems, "\n".join(problems)
    cluster = document["spec"]["rayClusterConfig"]
    _derive_autoscaling_config_from_ray_cr({"metadata": {"name": "kimi-k3", "namespace": "default"}, "spec": cluster})
    pods = [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert {e["name"]: e["value"] for e in container["env"]} == {
            "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_HAPROXY_BINARY_PATH": "/opt/kimi-k3-serve/bin/kimi-k3-serve-haproxy",
            "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    # deploy/Dockerfile installs the package into that venv
    assert "python3.12 -m venv /opt/kimi-k3-serve" in (REPO / "deploy" / "Dockerfile").read_text()
    assert [p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])] == [8265, 8000]


@pytest.mark.parametrize("command", [["render", "--format", "launcher-aws"],
                                     ["check", "--cluster", str(REPO / "cluster_configs/aws-h200-p5en-wide-ep.yaml")]])
def test_direct_streaming_with_data_parallel_is_refused_in_one_line(tmp_path, capsys, command):
    from kimi_k3_serve.cli import main

    text = (REPO / "deploy" / "config-wide-ep.yaml").read_text()
    config = tmp_path / "config-wide-ep.yaml"
    config.write_text(text.replace("      deployment:\n", "      deployment:\n        direct_streaming: true\n", 1))
    assert main([command[0], "--config", str(config), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "args.deployment.direct_streaming: got True" in err and "data_parallel_size" in err
