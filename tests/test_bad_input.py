"""Bad input, nothing launched: a matrix of malformed deploy configs and cluster files through the CLI.

Every case starts from a good file (deploy/config.yaml; a cluster file of each format), changes one thing,
and runs ``kimi-k3-serve check`` (or ``plan``) in-process. Each must end with exit code 2 and one ``error:``
line on stderr that names the field, with no traceback; nothing is started (no Ray, no Serve). A few cases
run as real subprocesses, and a few go through ``build_app``, the path ``serve deploy`` takes.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from conftest import REPO_ROOT
from kimi_k3_serve import cli
from kimi_k3_serve.errors import ConfigError

GOOD_CONFIG = REPO_ROOT / "deploy" / "config.yaml"
DEV_CONFIG = REPO_ROOT / "deploy" / "dev.yaml"
GOOD_CLUSTERS = {
    "simple": REPO_ROOT / "tests" / "fixtures" / "check" / "h200-2x8.yaml",
    "launcher": REPO_ROOT / "cluster_configs" / "aws-h200-p5en.yaml",
    "kuberay": REPO_ROOT / "cluster_configs" / "kuberay-h200.yaml",
}


def _args(doc: dict) -> dict:
    return doc["applications"][0]["args"]


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """Set ``args.<path>`` (dotted) in a Serve config document."""

    def mutate(doc: dict) -> None:
        node = _args(doc)
        *parents, last = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value

    return mutate


def _drop(path: str) -> Callable[[dict], None]:
    def mutate(doc: dict) -> None:
        node = _args(doc)
        *parents, last = path.split(".")
        for key in parents:
            node = node[key]
        del node[last]

    return mutate


def _doc(fn: Callable[[dict], None]) -> Callable[[dict], None]:
    return fn


@dataclass(frozen=True)
class Case:
    name: str
    field: str
    """A substring of the stderr line: the field the message must name."""
    config: Callable[[dict], Any] | None = None
    cluster: Callable[[Any], Any] | None = None
    cluster_format: str = "simple"
    raw_config: str | None = None
    """Written verbatim instead of a mutated config (bad YAML and the like)."""
    raw_cluster: str | None = None
    base_config: Path = GOOD_CONFIG


def _parallel(**values):
    def mutate(doc):
        _args(doc)["parallel"].update(values)

    return mutate


def _two_builder_apps(doc):
    second = copy.deepcopy(doc["applications"][0])
    second["name"], second["route_prefix"] = "kimi-k3-b", "/b"
    doc["applications"].append(second)


def _simple(**values):
    def mutate(doc):
        doc["nodes"][0].update(values)

    return mutate


def _launcher_type(**values):
    def mutate(doc):
        doc["available_node_types"]["gpu_8xh200"].update(values)

    return mutate


def _kuberay_group(**values):
    def mutate(doc):
        doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(values)

    return mutate


CONFIG_CASES = [
    # wrong types
    Case("tp-not-an-int", "args.parallel.tensor_parallel_size", _set("parallel.tensor_parallel_size", "eight")),
    Case("pp-a-float", "args.parallel.pipeline_parallel_size", _set("parallel.pipeline_parallel_size", 1.5)),
    Case("ep-not-a-bool", "args.parallel.enable_expert_parallel", _set("parallel.enable_expert_parallel", "maybe")),
    Case("max-model-len-text", "args.limits.max_model_len", _set("limits.max_model_len", "32k")),
    Case("limits-a-list", "args.limits", _set("limits", [32768])),
    Case("engine-kwargs-a-string", "args.engine_kwargs", _set("engine_kwargs", "moe_backend=marlin")),
    Case("env-var-not-a-string", "args.runtime_env.env_vars.NCCL_DEBUG", _set("runtime_env.env_vars.NCCL_DEBUG", 1)),
    Case("nvls-enable-not-a-setting", "args.runtime_env.env_vars.NCCL_NVLS_ENABLE",
         _set("runtime_env.env_vars.NCCL_NVLS_ENABLE", "yes")),
    Case("nvls-chunk-not-bytes", "args.runtime_env.env_vars.NCCL_NVLS_CHUNKSIZE",
         _set("runtime_env.env_vars.NCCL_NVLS_CHUNKSIZE", "128K")),
    Case("args-a-list", "args", lambda d: d["applications"][0].__setitem__("args", ["model"])),
    # YAML's true is not the count 1, nor 0 false (the sections are strict)
    Case("max-model-len-true", "args.limits.max_model_len", _set("limits.max_model_len", True)),
    Case("tp-true", "args.parallel.tensor_parallel_size", _set("parallel.tensor_parallel_size", True)),
    Case("gpu-util-true", "args.limits.gpu_memory_utilization", _set("limits.gpu_memory_utilization", True)),
    Case("speculative-tokens-true", "args.speculative.num_speculative_tokens",
         _set("speculative.num_speculative_tokens", True)),
    Case("max-replicas-true", "args.autoscaling.max_replicas", _set("autoscaling.max_replicas", True)),
    Case("require-api-key-zero", "args.security.require_api_key", _set("security.require_api_key", 0)),
    Case("max-model-len-a-decimal", "args.limits.max_model_len", _set("limits.max_model_len", 4096.0)),
    Case("engine-start-timeout-text", "args.runtime_env.env_vars.RAYLLM_ENGINE_START_TIMEOUT_S",
         _set("runtime_env.env_vars.RAYLLM_ENGINE_START_TIMEOUT_S", "abc")),
    Case("engine-start-timeout-zero", "args.runtime_env.env_vars.RAYLLM_ENGINE_START_TIMEOUT_S",
         _set("runtime_env.env_vars.RAYLLM_ENGINE_START_TIMEOUT_S", "0")),
    # unknown keys
    Case("unknown-top-key", "args.replicas", _set("replicas", 2)),
    Case("typo-in-parallel", "args.parallel.tensor_paralel_size", _set("parallel.tensor_paralel_size", 8)),
    Case("typo-in-limits", "args.limits.max_model_length", _set("limits.max_model_length", 8192)),
    Case("unknown-serve-key", "config.unknown_top_level", lambda d: d.__setitem__("unknown_top_level", 1)),
    # the model
    Case("model-source-missing", "args.model.source", _drop("model.source")),
    Case("model-id-empty", "args.model.id", _set("model.id", "")),
    Case("model-section-missing", "args.model", _drop("model")),
    Case("model-folder-absent", "args.model.source", _set("model.source", "./no/such/checkpoint")),
    Case("draft-folder-absent", "args.speculative.model", _set("speculative.model", "/no/such/draft")),
    Case("draft-method-unknown", "args.speculative.method", _set("speculative.method", "medusa")),
    Case("draft-tp-illegal", "args.speculative.draft_tensor_parallel_size",
         _set("speculative.draft_tensor_parallel_size", 3)),
    # the layout
    Case("tp-zero", "args.parallel.tensor_parallel_size", _set("parallel.tensor_parallel_size", 0)),
    Case("tp-negative", "args.parallel.tensor_parallel_size", _set("parallel.tensor_parallel_size", -8)),
    Case("tp-not-dividing-heads", "args.parallel.tensor_parallel_size", _parallel(tensor_parallel_size=3)),
    Case("tp-not-dividing-heads-6", "args.parallel.tensor_parallel_size",
         _parallel(tensor_parallel_size=6, pipeline_parallel_size=1, layer_partition=None)),
    Case("pp-larger-than-layers", "args.parallel.pipeline_parallel_size",
         _parallel(pipeline_parallel_size=1000, layer_partition=None)),
    Case("partition-wrong-length", "args.parallel.layer_partition", _set("parallel.layer_partition", [93])),
    Case("partition-wrong-sum", "args.parallel.layer_partition", _set("parallel.layer_partition", [50, 50])),
    Case("partition-zero-stage", "args.parallel.layer_partition", _set("parallel.layer_partition", [93, 0])),
    Case("dp-zero", "args.parallel.data_parallel_size", _set("parallel.data_parallel_size", 0)),
    # limits
    Case("max-model-len-zero", "args.limits.max_model_len", _set("limits.max_model_len", 0)),
    Case("max-model-len-negative", "args.limits.max_model_len", _set("limits.max_model_len", -1)),
    Case("max-num-seqs-zero", "args.limits.max_num_seqs", _set("limits.max_num_seqs", 0)),
    Case("batched-tokens-zero", "args.limits.max_num_batched_tokens", _set("limits.max_num_batched_tokens", 0)),
    Case("batched-tokens-below-batch", "args.limits.max_num_batched_tokens", _set("limits.max_num_batched_tokens", 8)),
    Case("gpu-util-above-one", "args.limits.gpu_memory_utilization", _set("limits.gpu_memory_utilization", 1.5)),
    Case("gpu-util-zero", "args.limits.gpu_memory_utilization", _set("limits.gpu_memory_utilization", 0)),
    Case("kv-dtype-unknown", "args.limits.kv_cache_dtype", _set("limits.kv_cache_dtype", "fp4")),
    Case("speculative-tokens-zero", "args.speculative.num_speculative_tokens",
         _set("speculative.num_speculative_tokens", 0)),
    # accelerator
    Case("accelerator-kind-unknown", "args.accelerator.kind", _set("accelerator.kind", "tpu")),
    Case("gpu-type-unknown", "args.accelerator.type", _set("accelerator.type", "H900")),
    # scaling and deployment
    Case("min-above-max-replicas", "args.autoscaling.min_replicas", _set("autoscaling.min_replicas", 3)),
    Case("max-replicas-zero", "args.autoscaling.max_replicas", _set("autoscaling.max_replicas", 0)),
    Case("initial-replicas-outside", "args.autoscaling.initial_replicas", _set("autoscaling.initial_replicas", 5)),
    Case("target-negative", "args.autoscaling.target_ongoing_requests",
         _set("autoscaling.target_ongoing_requests", -1)),
    Case("target-above-max-ongoing", "args.autoscaling.target_ongoing_requests",
         _set("autoscaling.target_ongoing_requests", 500)),
    Case("health-period-zero", "args.deployment.health_check_period_s", _set("deployment.health_check_period_s", 0)),
    Case("max-ongoing-zero", "args.deployment.max_ongoing_requests", _set("deployment.max_ongoing_requests", 0)),
    Case("ingress-replicas-zero", "args.ingress.num_replicas", _set("ingress.num_replicas", 0)),
    # conflicting pinned choices
    Case("engine-kwargs-owned-tp", "args.engine_kwargs.tensor_parallel_size",
         _set("engine_kwargs.tensor_parallel_size", 16)),
    Case("engine-kwargs-owned-model", "args.engine_kwargs.model", _set("engine_kwargs.model", "other/model")),
    Case("cpu-with-gpu-type", "args.accelerator.type", _set("accelerator.kind", "cpu")),
    Case("cpu-pp-with-eager", "args.limits.enforce_eager",
         _doc(lambda d: _args(d)["parallel"].update(pipeline_parallel_size=2) or
              _args(d)["limits"].update(enforce_eager=True)), base_config=DEV_CONFIG),
    Case("cpu-pp-with-draft", "args.speculative",
         _doc(lambda d: _args(d)["parallel"].update(pipeline_parallel_size=2) or
              _args(d)["limits"].update(enforce_eager=False)), base_config=DEV_CONFIG),
    Case("cpu-expert-parallel", "args.parallel.enable_expert_parallel", _parallel(enable_expert_parallel=True),
         base_config=DEV_CONFIG),
    # secrets in plain text
    Case("literal-api-key", "args.security.api_key", _set("security.api_key", "sk-live-123")),
    Case("api-key-in-env", "args.runtime_env.env_vars.VLLM_API_KEY", _set("runtime_env.env_vars.VLLM_API_KEY", "x")),
    # the file around the args
    Case("no-builder-app", "import_path", lambda d: d["applications"][0].__setitem__("import_path", "x.y:z")),
    Case("args-missing", "config.applications[0].args", lambda d: d["applications"][0].pop("args")),
    Case("no-applications", "applications", lambda d: d.__setitem__("applications", [])),
    Case("two-builder-apps", "config.applications", _two_builder_apps),
    Case("http-port-text", "config.http_options.port", lambda d: d["http_options"].__setitem__("port", "http")),
    Case("http-port-negative", "config.http_options.port", lambda d: d["http_options"].__setitem__("port", -1)),
    Case("http-port-zero", "config.http_options.port", lambda d: d["http_options"].__setitem__("port", 0)),
    Case("http-port-true", "config.http_options.port", lambda d: d["http_options"].__setitem__("port", True)),
    Case("http-keep-alive-negative", "config.http_options.keep_alive_timeout_s",
         lambda d: d["http_options"].__setitem__("keep_alive_timeout_s", -1)),
    # a token pasted into a field of any name is refused by its shape, and not echoed
    Case("token-in-model-source", "args.model.source", _set("model.source", "hf_" + "a1B2c3" * 6)),
    Case("token-in-env-value", "args.runtime_env.env_vars.MY_THING",
         _set("runtime_env.env_vars.MY_THING", "ghp_" + "Zx9" * 12)),
    Case("token-in-a-comment", "line 9",
         raw_config=GOOD_CONFIG.read_text().replace("proxy_location: EveryNode", "proxy_location: EveryNode  # hf_"
                                                    + "a1B2c3" * 6)),
    # the engine kwargs the planner reads: bool("false") was true, int(1.9) was 1, and a text section a traceback
    Case("language-model-only-text", "args.engine_kwargs.language_model_only",
         _set("engine_kwargs.language_model_only", "false")),
    Case("attention-config-text", "args.engine_kwargs.attention_config", _set("engine_kwargs.attention_config", "x")),
    Case("prefill-quantization-text", "args.engine_kwargs.attention_config.use_prefill_query_quantization",
         _set("engine_kwargs.attention_config", {"use_prefill_query_quantization": "false"})),
    Case("eplb-config-text", "args.engine_kwargs.eplb_config", _set("engine_kwargs.eplb_config", "x")),
    Case("redundant-experts-decimal", "args.engine_kwargs.eplb_config.num_redundant_experts",
         _set("engine_kwargs.eplb_config", {"num_redundant_experts": 1.9})),
    Case("eplb-window-null", "args.engine_kwargs.eplb_config.window_size",
         _set("engine_kwargs.eplb_config", {"window_size": None})),
    Case("moe-backend-true", "args.engine_kwargs.moe_backend", _set("engine_kwargs.moe_backend", True)),
    Case("mamba-dtype-unknown", "args.engine_kwargs.mamba_ssm_cache_dtype",
         _set("engine_kwargs.mamba_ssm_cache_dtype", "float8")),
    Case("env-var-name-with-equals", "args.runtime_env.env_vars", _set("runtime_env.env_vars.A=B", "x")),
    Case("upscale-delay-infinite", "args.autoscaling.upscale_delay_s",
         _set("autoscaling.upscale_delay_s", float("inf"))),
    Case("health-period-nan", "args.deployment.health_check_period_s",
         _set("deployment.health_check_period_s", float("nan"))),
    Case("route-prefix-without-slash", "config.applications[0].route_prefix",
         lambda d: d["applications"][0].__setitem__("route_prefix", "v1")),
    Case("http-host-with-port", "config.http_options.host",
         lambda d: d["http_options"].__setitem__("host", "0.0.0.0:8000")),
    Case("http-host-no-address", "config.http_options.host",
         lambda d: d["http_options"].__setitem__("host", "999.1.1.1")),
    Case("duplicate-key", "max_num_seqs",
         raw_config=GOOD_CONFIG.read_text().replace("      limits:\n", "      limits:\n        max_num_seqs: 4\n")),
    Case("bad-yaml", "config", raw_config="applications:\n  - name: [unclosed\n"),
    Case("yaml-a-list", "config", raw_config="- 1\n- 2\n"),
    Case("empty-file", "config", raw_config=""),
    Case("tab-indented-yaml", "config", raw_config="applications:\n\t- name: x\n"),
]

CLUSTER_CASES = [
    Case("cluster-bad-yaml", "cluster", raw_cluster="nodes: [ {count: 2\n"),
    Case("cluster-a-list", "(top level)", raw_cluster="- gpu: H200\n"),
    Case("cluster-unknown-format", "(top level)", raw_cluster="machines: 2\n"),
    Case("cluster-empty", "(top level)", raw_cluster=""),
    Case("simple-no-nodes", "nodes", cluster=lambda d: d.__setitem__("nodes", [])),
    Case("simple-count-negative", "nodes[0].count", cluster=_simple(count=-1)),
    Case("simple-count-text", "nodes[0].count", cluster=_simple(count="two")),
    Case("simple-gpu-unknown", "nodes[0].gpu", cluster=_simple(gpu="H900")),
    Case("simple-gpus-zero", "nodes[0].gpus", cluster=_simple(gpus=0)),
    Case("simple-unknown-key", "nodes[0].gpu_type", cluster=_simple(gpu_type="H200")),
    Case("simple-free-above-total", "nodes[0].free_bytes", cluster=_simple(free_bytes=10**15)),
    Case("simple-free-wrong-length", "nodes[0].free_bytes", cluster=_simple(free_bytes=[1, 2])),
    Case("simple-node-not-a-mapping", "nodes[0]", cluster=lambda d: d.__setitem__("nodes", ["H200"])),
    Case("launcher-gpu-text", "available_node_types.gpu_8xh200.resources.GPU", cluster_format="launcher",
         cluster=lambda d: d["available_node_types"]["gpu_8xh200"]["resources"].__setitem__("GPU", "eight")),
    Case("launcher-head-type-unknown", "head_node_type", cluster_format="launcher",
         cluster=lambda d: d.__setitem__("head_node_type", "nope")),
    Case("launcher-max-below-min", "available_node_types.gpu_8xh200.max_workers", cluster_format="launcher",
         cluster=_launcher_type(max_workers=1)),
    Case("launcher-no-types", "available_node_types", cluster_format="launcher",
         cluster=lambda d: d.__setitem__("available_node_types", {})),
    Case("launcher-unknown-accelerator", "available_node_types.gpu_8xh200", cluster_format="launcher",
         cluster=lambda d: d["available_node_types"]["gpu_8xh200"].__setitem__(
             "resources", {"GPU": 8, "accelerator_type:Z9000": 1})),
    Case("kuberay-groups-not-a-list", "workerGroupSpecs", cluster_format="kuberay",
         cluster=lambda d: d["spec"]["rayClusterConfig"].__setitem__("workerGroupSpecs", {"a": 1})),
    Case("kuberay-max-below-min", "workerGroupSpecs[0].maxReplicas", cluster_format="kuberay",
         cluster=_kuberay_group(maxReplicas=1)),
    Case("kuberay-bad-resources-json", "rayStartParams.resources", cluster_format="kuberay",
         cluster=_kuberay_group(rayStartParams={"resources": "{not json"})),
    Case("kuberay-hosts-zero", "workerGroupSpecs[0].numOfHosts", cluster_format="kuberay",
         cluster=_kuberay_group(numOfHosts=0)),
    Case("launcher-block-devices-a-number", "node_config.BlockDeviceMappings", cluster_format="launcher",
         cluster=lambda d: d["available_node_types"]["gpu_8xh200"]["node_config"]
         .__setitem__("BlockDeviceMappings", 5)),
    Case("launcher-ebs-text", "BlockDeviceMappings[0].Ebs", cluster_format="launcher",
         cluster=lambda d: d["available_node_types"]["gpu_8xh200"]["node_config"]["BlockDeviceMappings"][0]
         .__setitem__("Ebs", "abc")),
    *[Case(f"launcher-volume-size-{name}", "BlockDeviceMappings[0].Ebs.VolumeSize", cluster_format="launcher",
           cluster=lambda d, size=size: d["available_node_types"]["gpu_8xh200"]["node_config"]["BlockDeviceMappings"][0]
           ["Ebs"].__setitem__("VolumeSize", size))
      for name, size in (("negative", -1), ("zero", 0), ("true", True), ("text", "abc"), ("nan", float("nan")))],
    Case("cluster-token-in-a-name", "line 2",
         raw_cluster="nodes:\n  - {name: hf_" + "a1B2c3" * 6 + ", count: 2, gpu: H200}\n"),
    Case("launcher-max-workers-below-min", "max_workers", cluster_format="launcher",
         cluster=lambda d: d.__setitem__("max_workers", 1)),
    Case("kuberay-group-null", "workerGroupSpecs[0]", cluster_format="kuberay",
         cluster=lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"].__setitem__(0, None)),
    Case("kuberay-replicas-above-max", "workerGroupSpecs[0].replicas", cluster_format="kuberay",
         cluster=_kuberay_group(replicas=5, maxReplicas=4)),
    Case("simple-gpu-a-list", "nodes[0].gpu", cluster=_simple(gpu=["H200"])),
    Case("simple-name-empty", "nodes[0].name", cluster=_simple(name="")),
    Case("simple-unknown-top-key", "zz", cluster=lambda d: d.__setitem__("zz", 1)),
    Case("launcher-cpu-true", "resources.CPU", cluster_format="launcher",
         cluster=lambda d: d["available_node_types"]["gpu_8xh200"]["resources"].__setitem__("CPU", True)),
    Case("cluster-duplicate-key", "count", raw_cluster="nodes:\n  - {count: 2, gpu: H200, count: 1}\n"),
]

# The planner checks these; it names its own pins (``tp``, ``layout.pp``, ``layer_partition``) rather than
# the deploy config's fields. The mapping belongs where the check turns args into planner pins (preflight).
# The files are named after no field: a message names its file, and a file named config.yaml would name the field
# ``config`` for any message. ``assert_clear_bad_input`` also takes the paths out before it looks for the field.
def _write_config(case: Case, tmp_path: Path) -> Path:
    path = tmp_path / "input-a.yaml"
    if case.raw_config is not None:
        path.write_text(case.raw_config)
        return path
    doc = yaml.safe_load(case.base_config.read_text())
    if case.config is not None:
        case.config(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _write_cluster(case: Case, tmp_path: Path) -> Path:
    path = tmp_path / "input-b.yaml"
    if case.raw_cluster is not None:
        path.write_text(case.raw_cluster)
        return path
    if case.cluster is None:
        return GOOD_CLUSTERS[case.cluster_format]
    doc = next(yaml.safe_load_all(GOOD_CLUSTERS[case.cluster_format].read_text()))  # KubeRay: the RayService
    case.cluster(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_clear_bad_input(code: int, out: str, err: str, field: str, *, paths: list[str] = ()) -> None:
    """Exit 2, one ``error:`` line on stderr, no traceback, and ``field`` named in the message itself: the
    ``paths`` of the files given are taken out first, so that a file or folder name cannot name it instead."""
    assert code == 2, f"exit code {code}\nstdout: {out}\nstderr: {err}"
    assert "Traceback" not in err and "Traceback" not in out
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    message = lines[0]
    for path in sorted(paths, key=len, reverse=True):
        message = message.replace(path, "<path>")
    assert field in message, f"{field!r} not named in: {message}"
    print(f"\n  {message[:200]}")


def _paths_in(err: str, tmp_path: Path) -> list[str]:
    """The good files and anything under ``tmp_path`` that a message may quote."""
    known = [str(GOOD_CONFIG), str(DEV_CONFIG), *map(str, GOOD_CLUSTERS.values())]
    return known + [word.strip("'\":;,()") for word in err.split() if str(tmp_path) in word]


def _cases():
    for case in CONFIG_CASES + CLUSTER_CASES:
        yield pytest.param(case, id=case.name)


@pytest.mark.parametrize("case", list(_cases()))
def test_check_refuses_bad_input_naming_the_field(case: Case, tmp_path, capsys):
    import ray

    config = _write_config(case, tmp_path)
    cluster = _write_cluster(case, tmp_path)
    code, out, err = run_cli(["check", "--config", str(config), "--cluster", str(cluster)], capsys)
    assert_clear_bad_input(code, out, err, case.field, paths=[str(config), str(cluster)])
    assert not ray.is_initialized()  # nothing started
    assert "a1B2c3a1B2c3" not in err and "Zx9Zx9Zx9" not in err  # the token cases' values are not echoed


def test_the_matrix_is_large_and_its_bases_are_good(capsys):
    assert len(CONFIG_CASES) + len(CLUSTER_CASES) >= 40
    for cluster in GOOD_CLUSTERS.values():  # every mutation starts from a file that passes
        code, out, err = run_cli(["check", "--config", str(GOOD_CONFIG), "--cluster", str(cluster)], capsys)
        assert code == 0, err
    code, out, err = run_cli(["check", "--config", str(DEV_CONFIG), "--cluster", str(GOOD_CLUSTERS["simple"])], capsys)
    assert code == 0, err


def test_unreadable_files_are_bad_input(tmp_path, capsys):
    folder = tmp_path / "a-folder.yaml"
    folder.mkdir()
    code, out, err = run_cli(["check", "--config", str(folder), "--cluster", str(GOOD_CLUSTERS["simple"])], capsys)
    assert_clear_bad_input(code, out, err, "config", paths=_paths_in(err, tmp_path))
    code, out, err = run_cli(["check", "--config", str(GOOD_CONFIG), "--cluster", str(folder)], capsys)
    assert_clear_bad_input(code, out, err, "cluster", paths=_paths_in(err, tmp_path))
    code, out, err = run_cli(["check", "--config", str(tmp_path / "missing.yaml"), "--cluster",
                              str(GOOD_CLUSTERS["simple"])], capsys)
    assert_clear_bad_input(code, out, err, "config", paths=_paths_in(err, tmp_path))
    if os.geteuid() != 0:  # root reads a mode-000 file anyway
        locked = tmp_path / "locked.yaml"
        locked.write_text(GOOD_CONFIG.read_text())
        locked.chmod(0)
        code, out, err = run_cli(["check", "--config", str(locked), "--cluster", str(GOOD_CLUSTERS["simple"])], capsys)
        assert_clear_bad_input(code, out, err, "config", paths=_paths_in(err, tmp_path))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x01garbage")
    code, out, err = run_cli(["check", "--config", str(binary), "--cluster", str(GOOD_CLUSTERS["simple"])], capsys)
    assert_clear_bad_input(code, out, err, "config", paths=_paths_in(err, tmp_path))


def test_app_name_that_does_not_exist(capsys, tmp_path):
    code, out, err = run_cli(["check", "--config", str(GOOD_CONFIG), "--app", "nope", "--cluster",
                              str(GOOD_CLUSTERS["simple"])], capsys)
    assert_clear_bad_input(code, out, err, "config.applications[].name", paths=_paths_in(err, tmp_path))


PLAN = ["plan", "--model", "kimi-k3", "--max-model-len", "8192"]


@pytest.mark.parametrize(
    "extra, field",
    [
        (["--gpu", "H900", "--nodes", "2"], "gpu"),
        (["--gpu", "H200", "--nodes", "0"], "nodes"),
        (["--gpu", "H200", "--nodes", "2", "--gpus-per-node", "0"], "--gpus-per-node"),
        (["--gpu", "H200"], "--gpu/--nodes"),
        (["--gpu", "H200", "--nodes", "2", "--tp", "3"], "--tp"),
        (["--gpu", "H200", "--nodes", "2", "--layer-partition", "a,b"], "--layer-partition"),
        (["--gpu", "H200", "--nodes", "2", "--speculative-method", "eagle3"], "--speculative-method/--draft"),
        (["--cluster", "/no/such/cluster.yaml"], "cluster"),
        (["--gpu", "H200", "--nodes", "2", "--kv-cache-dtype", "fp4"], "--kv-cache-dtype"),
        (["--gpu", "H200", "--nodes", "two"], "--nodes"),
        # refused before a search over 256 nodes, as `memory` refuses it
        (["--gpu", "H200", "--nodes", "2", "--speculative-method", "eagle3", "--draft", "kimi-k3-dspark"],
         "--speculative-method"),
        (["--gpu", "H200", "--nodes", "2", "--speculative-method", "dspark", "--draft", "no-such-draft"], "--draft"),
        (["--gpu", "H200", "--nodes", "2", "--tp", "16"], "--tp"),  # wider than a node's NVLink domain
        # options that mean something only with others are not silently dropped
        (["--gpu", "H200", "--nodes", "2", "--num-speculative-tokens", "4"], "--num-speculative-tokens"),
        (["--gpu", "H200", "--nodes", "2", "--draft-tp", "1"], "--draft-tp"),
        (["--gpu", "H200", "--nodes", "2", "--as-is"], "--as-is"),
    ],
    ids=["gpu-unknown", "nodes-zero", "gpus-per-node-zero", "nodes-missing", "tp-not-dividing", "partition-text",
         "draft-missing", "cluster-missing", "kv-dtype-choice", "nodes-text", "draft-of-another-method",
         "draft-absent", "tp-wider-than-nvlink", "speculative-tokens-without-draft", "draft-tp-without-draft",
         "as-is-without-cluster"],
)
def test_plan_refuses_bad_input_naming_the_field(extra, field, capsys):
    code, out, err = run_cli(PLAN + extra, capsys)
    given_paths = [arg for arg in extra if "/" in arg]
    assert_clear_bad_input(code, out, err, field, paths=given_paths)


def test_plan_refuses_a_model_file_that_does_not_exist(tmp_path, capsys):
    code, out, err = run_cli(["plan", "--model", str(tmp_path / "config.json"), "--gpu", "H200", "--nodes", "1",
                              "--max-model-len", "1024"], capsys)
    assert_clear_bad_input(code, out, err, "model", paths=_paths_in(err, tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    code, out, err = run_cli(["plan", "--model", str(tmp_path / "config.json"), "--gpu", "H200", "--nodes", "1",
                              "--max-model-len", "1024"], capsys)
    assert_clear_bad_input(code, out, err, "model", paths=_paths_in(err, tmp_path))


# --- as real processes --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tp-zero", "bad-yaml", "literal-api-key", "simple-gpu-unknown"])
def test_cli_process_exits_2_without_traceback(name, tmp_path):
    (case,) = [c for c in CONFIG_CASES + CLUSTER_CASES if c.name == name]
    config, cluster = _write_config(case, tmp_path), _write_cluster(case, tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "kimi_k3_serve.cli", "check", "--config", str(config), "--cluster", str(cluster)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert_clear_bad_input(done.returncode, done.stdout, done.stderr, case.field, paths=[str(config), str(cluster)])
    assert "sk-live-123" not in done.stderr + done.stdout


# --- the serve deploy path: build_app refuses before anything is deployed ------------------------------------------


@pytest.mark.parametrize("name", ["tp-zero", "max-model-len-negative", "typo-in-limits", "literal-api-key",
                                  "dp-zero", "model-folder-absent"])
def test_build_app_refuses_before_deploying(name):
    import ray

    (case,) = [c for c in CONFIG_CASES if c.name == name]
    doc = yaml.safe_load(GOOD_CONFIG.read_text())
    case.config(doc)
    from kimi_k3_serve.app import build_app

    with pytest.raises(ConfigError) as info:
        build_app(_args(doc))
    assert case.field in str(info.value)
    assert not ray.is_initialized()


# --- inputs that used to hang or end in a traceback: one line, exit 2, within 2 s, as real processes -------------

ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9))
HOSTILE_FILES = {
    "alias-bomb": (ALIAS_BOMB, "aliases expanded"),
    "self-referencing-anchor": ("applications: &a\n  - *a\n", "self-reference"),
    "deep-flow-nesting": ("[" * 50_000 + "]" * 50_000, "nested at most"),
    "deep-block-nesting": ("a:\n" + "".join("  " * i + "b:\n" for i in range(1, 200)), "nested at most"),
    "huge-integer": ("applications: " + "9" * 5000 + "\n", "valid YAML"),
}
HOSTILE_INPUT_SECONDS = 2.0


def run_cli_process(argv: list[str], cwd: Path) -> tuple[int, str, str, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kimi_k3_serve.cli", *argv], capture_output=True, text=True,
                          timeout=60, cwd=cwd, stdin=subprocess.DEVNULL)
    return done.returncode, done.stdout, done.stderr, time.perf_counter() - started


def assert_one_line_in_time(code: int, out: str, err: str, seconds: float, field: str, *, paths: list[str]) -> None:
    """Exit 2, exactly one stderr line, ``error: FIELD: ...`` with ``FIELD`` named outside the file paths (a path
    such as ``/tmp/.../config.yaml`` would otherwise name ``config`` for any message), and under the time bound."""
    assert code == 2, f"exit code {code}\nstdout: {out}\nstderr: {err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    message = lines[0]
    for path in paths:
        message = message.replace(path, "<path>")
    assert message.startswith(f"error: {field}: ") or f": {field}: got" in message, message
    assert "Traceback" not in err + out
    assert seconds < HOSTILE_INPUT_SECONDS + STARTUP_ALLOWANCE_S, f"{seconds:.2f} s"
    print(f"\n  {seconds:.2f} s  {message[:160]}")


STARTUP_ALLOWANCE_S = 3.0
"""The interpreter and our imports, on a loaded 2-core CI machine; the reading itself must take under 2 s."""


@pytest.mark.parametrize("name", sorted(HOSTILE_FILES))
@pytest.mark.parametrize("role", ["config", "cluster"])
def test_hostile_yaml_is_refused_quickly(name, role, tmp_path):
    text, words = HOSTILE_FILES[name]
    hostile = tmp_path / "input-a.yaml"  # names no field
    hostile.write_text(text)
    config, cluster = (hostile, GOOD_CLUSTERS["simple"]) if role == "config" else (GOOD_CONFIG, hostile)
    code, out, err, seconds = run_cli_process(["check", "--config", str(config), "--cluster", str(cluster)], tmp_path)
    assert_one_line_in_time(code, out, err, seconds, role, paths=[str(hostile)])
    assert words in err


def test_yaml_bounds_are_checked_before_the_document_is_built():
    from kimi_k3_serve.inputs import MAX_DEPTH, load_yaml

    started = time.perf_counter()
    for text, words in HOSTILE_FILES.values():
        with pytest.raises(ConfigError, match=words):
            load_yaml(text, "config", "<test>")
    assert time.perf_counter() - started < HOSTILE_INPUT_SECONDS
    # the bounds refuse nothing real: the deepest allowed nesting, and aliases that expand to a modest size
    assert load_yaml("[" * MAX_DEPTH + "]" * MAX_DEPTH, "config", "<test>") is not None
    assert load_yaml("a: &a [1, 2]\nb: [*a, *a, *a]\n", "config", "<test>")["b"] == [[1, 2]] * 3


@pytest.mark.parametrize("role", ["config", "cluster"])
def test_a_fifo_is_refused_not_waited_on(role, tmp_path):
    fifo = tmp_path / "input-a.yaml"
    os.mkfifo(fifo)
    config, cluster = (fifo, GOOD_CLUSTERS["simple"]) if role == "config" else (GOOD_CONFIG, fifo)
    code, out, err, seconds = run_cli_process(["check", "--config", str(config), "--cluster", str(cluster)], tmp_path)
    assert_one_line_in_time(code, out, err, seconds, role, paths=[str(fifo)])
    assert "not a FIFO" in err


def test_a_fifo_model_config_is_refused(tmp_path):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    os.mkfifo(folder / "config.json")
    code, out, err, seconds = run_cli_process(["plan", "--model", str(folder), "--gpu", "H200", "--nodes", "1",
                                               "--max-model-len", "1024"], tmp_path)
    assert_one_line_in_time(code, out, err, seconds, "model", paths=[str(folder)])


@pytest.mark.parametrize("content, words", [
    (bytes(range(256)) * 4, "UTF-8"),
    ("[" * 100_000 + "]" * 100_000, "nested less deeply"),
], ids=["binary", "deep-json"])
def test_unreadable_model_config_is_one_line(content, words, tmp_path):
    model = tmp_path / "checkpoint" / "config.json"
    model.parent.mkdir()
    model.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, out, err, seconds = run_cli_process(["plan", "--model", str(model.parent), "--gpu", "H200", "--nodes", "1",
                                               "--max-model-len", "1024"], tmp_path)
    assert_one_line_in_time(code, out, err, seconds, "model", paths=[str(model), str(model.parent)])
    assert words in err


def _kimi_k3_config() -> dict:
    from importlib import resources

    return json.loads(resources.files("kimi_k3_serve.models").joinpath("data", "kimi-k3.json").read_text())


@pytest.mark.parametrize("field, value", [
    ("text_config.num_attention_heads", 0),
    ("text_config.linear_attn_config.num_heads", 0),
    ("text_config.linear_attn_config.head_dim", 0),
    ("text_config.moe_layer_freq", 0),
    ("text_config.num_hidden_layers", 10**12),
    ("text_config.linear_attn_config.kda_layers", 5),
])
def test_zero_or_absurd_model_sizes_are_bad_input(field, value, tmp_path, capsys):
    config = _kimi_k3_config()
    node = config
    *parents, last = field.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    path = tmp_path / "checkpoint" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    started = time.perf_counter()
    code, out, err = run_cli(["memory", "--model", str(path), "--gpu", "H200", "--tp", "8", "--pp", "2",
                              "--max-model-len", "8192"], capsys)
    assert time.perf_counter() - started < HOSTILE_INPUT_SECONDS
    expected = "model" if field.endswith("kda_layers") else field
    assert_clear_bad_input(code, out, err, expected, paths=[str(path)])


# --- values that used to be planned as a shortfall, hang, or fail after the work: bad input, up front -------------


@pytest.mark.parametrize("argv, field, words", [
    (["plan", "--model", "kimi-k3", "--gpu", "H200", "--nodes", "1000000000", "--max-model-len", "8192"], "--nodes", "4,096"),
    (["plan", "--model", "kimi-k3", "--gpu", "H200", "--nodes", "2", "--gpus-per-node", "100000",
      "--max-model-len", "8192"], "--gpus-per-node", "72"),
    (["plan", "--model", "kimi-k3", "--gpu", "H200", "--min", "--max-nodes", "100000000", "--max-model-len", "8192"],
     "--max-nodes", "4,096"),
    (["memory", "--gpu", "H200", "--tp", "1000000000", "--max-model-len", "8192"], "--tp", "64"),
    (["memory", "--gpu", "H200", "--tp", "8", "--pp", "100000", "--max-model-len", "8192"], "--pp", "1,024"),
    (["plan", "--model", "kimi-k3", "--gpu", "H200", "--nodes", "2", "--max-model-len", "100000000000"],
     "--max-model-len", "1,048,576"),
    (["memory", "--gpu", "H200", "--tp", "8", "--pp", "2", "--max-model-len", "1048577"], "--max-model-len", "1,048,576"),
    (["plan", "--model", "kimi-k3", "--gpu", "H200", "--nodes", "2", "--max-model-len", "8192", "--speculative-method",
      "dspark", "--draft", "kimi-k3-dspark", "--num-speculative-tokens", "100000000"], "--num-speculative-tokens", "64"),
    (["memory", "--gpu", "H200", "--tp", "8", "--pp", "2", "--max-model-len", "8192", "--speculative-config",
      '{"method": "dspark", "num_speculative_tokens": 100000000}'], "--speculative-config.num_speculative_tokens", "64"),
    # 3 divides the 96 heads; vLLM refuses it because it does not divide the padded vocabulary (163,840)
    (["plan", "--model", "kimi-k3", "--gpu", "H200", "--nodes", "2", "--tp", "3", "--max-model-len", "8192"],
     "--tp", "3 does not divide vocab_size (padded to a multiple of 64) = 163,840"),
    (["memory", "--gpu", "H200", "--tp", "3", "--max-model-len", "8192"], "--tp", "3 does not divide vocab_size"),
], ids=["nodes-1e9", "gpus-per-node-huge", "max-nodes-huge", "memory-tp-1e9", "memory-pp-huge", "plan-length-beyond-positions",
        "memory-length-one-beyond", "plan-speculative-tokens-absurd", "memory-speculative-tokens-absurd", "plan-tp-3-real-reason",
        "memory-tp-3-real-reason"])
def test_counts_and_lengths_are_bounded(argv, field, words, capsys):
    started = time.perf_counter()
    code, out, err = run_cli(argv, capsys)
    assert time.perf_counter() - started < HOSTILE_INPUT_SECONDS
    assert_clear_bad_input(code, out, err, field)
    assert words in err
    assert err.startswith(f"error: {field}: got ")


def test_a_deploy_config_longer_than_the_model_is_bad_input(tmp_path, capsys):
    case = Case("length-beyond-positions", "args.limits.max_model_len", _set("limits.max_model_len", 2_000_000))
    config = _write_config(case, tmp_path)
    code, out, err = run_cli(["check", "--config", str(config), "--cluster", str(GOOD_CLUSTERS["simple"])], capsys)
    assert_clear_bad_input(code, out, err, "args.limits.max_model_len", paths=[str(config)])
    assert "1,048,576" in err


@pytest.mark.parametrize("plot, words", [
    ("no-such-folder/fit.png", "existing folder"),
    ("fit.xyz", "ending in .png"),
    (".", "ending in .png"),  # a folder: the plot used to be written beside it, as ..png
])
def test_plot_path_is_checked_before_the_check_runs(plot, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(["check", "--config", str(GOOD_CONFIG), "--cluster", str(GOOD_CLUSTERS["simple"]),
                              "--plot", plot], capsys)
    assert_clear_bad_input(code, out, err, "--plot", paths=[str(GOOD_CONFIG), str(GOOD_CLUSTERS["simple"])])
    assert words in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_work_dir_that_is_a_file_is_bad_input(tmp_path, capsys):
    a_file = tmp_path / "input-a"
    a_file.write_text("")
    for work_dir in (a_file, a_file / "below"):
        code, out, err = run_cli(["rehearse", "--config", str(GOOD_CONFIG), "--dry-run", "--work-dir", str(work_dir)],
                                 capsys)
        assert_clear_bad_input(code, out, err, "--work-dir", paths=[str(work_dir)])


@pytest.mark.parametrize("extra, code_expected", [([], 0), (["--tp", "3"], 2)], ids=["dry-run", "bad-input"])
def test_rehearse_leaves_no_temp_folder(extra, code_expected, tmp_path, capsys, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes the rehearsal's folder
    code, out, err = run_cli(["rehearse", "--config", str(GOOD_CONFIG), "--dry-run", *extra], capsys)
    assert code == code_expected, err
    assert "kimi-k3-rehearse-" in out or code_expected == 2  # the dry run did use a temp folder
    assert list(tmp_path.glob("kimi-k3-rehearse-*")) == []


# --- flags that used to end in a traceback or be silently misread: one line, exit 2 ----------------------------------

CHECK = ["check", "--config", str(GOOD_CONFIG)]
MEMORY = ["memory", "--gpu", "H200", "--tp", "8", "--pp", "2", "--max-model-len", "8192"]
DEEP_JSON = "[" * 60_000


@pytest.mark.parametrize("argv, field, words", [
    (CHECK + ["--cluster", ""], "--cluster", "non-empty"),
    (CHECK + ["--address", "127.0.0.1:²"], "--address", "port from 1 to 65535"),  # str.isdigit takes superscripts
    (CHECK + ["--address", "127.0.0.1:0"], "--address", "port from 1 to 65535"),
    (CHECK + ["--address", "a" * 64 + ":6379"], "--address", "labels of 1 to 63"),  # idna's UnicodeError
    (CHECK + ["--address", "héllo..:6379"], "--address", "ASCII"),
    (CHECK + ["--address", ""], "--address", "host:port"),
    (["prefetch", "--config", str(GOOD_CONFIG), "--address", "a..b:1"], "--address", "DNS name"),
    (["render", "--config", str(GOOD_CONFIG), "--output", ""], "--output", "non-empty"),
    (["render", "--config", str(GOOD_CONFIG), "--cluster-name", " "], "--cluster-name", "non-empty"),
    (["memory", "--gpu", "H200", "--model", "m" * 5000], "--model", "config.json"),  # ENAMETOOLONG
    (MEMORY + ["--speculative-config", DEEP_JSON], "--speculative-config", "nested less deeply"),
    (MEMORY + ["--speculative-config", '{"method": "dspark", "model": false}'], "--speculative-config.model",
     "non-empty string"),
    (MEMORY + ["--speculative-config", '{"method": "dspark", "model": ""}'], "--speculative-config.model",
     "non-empty string"),
    (MEMORY + ["--speculative-config", '{"method": "dspark", "model": "no-such-draft"}'],
     "--speculative-config.model", "config.json"),
    (MEMORY + ["--speculative-config", '{"method": "dspark", "num_speculative_tokens": true}'],
     "--speculative-config.num_speculative_tokens", "integer"),
    (MEMORY + ["--speculative-config", '{"method": "dspark", "draft_tensor_parallel_size": true}'],
     "--speculative-config.draft_tensor_parallel_size", "target's TP"),
    (["rehearse", "--config", str(GOOD_CONFIG), "--dry-run", "--engine-kwargs", DEEP_JSON], "--engine-kwargs",
     "nested less deeply"),
    (["rehearse", "--config", str(GOOD_CONFIG), "--dry-run", "--work-dir", "/proc/1"], "--work-dir", "written"),
    (["rehearse", "--config", str(GOOD_CONFIG), "--dry-run", "--model", "kimi-k3"], "--model", "only without --config"),
    (MEMORY + ["--compute-capability", "99.9"], "--compute-capability", "7.0 to 12.9"),
    (["memory", "--gpu", "H200", "--compute-capability", "10.0", "--tp", "8", "--pp", "2", "--max-model-len", "8192"],
     "--compute-capability", "the H200 is 9.0"),
], ids=["cluster-empty", "address-superscript-port", "address-port-zero", "address-label-too-long",
        "address-not-ascii", "address-empty", "prefetch-address-empty-label", "render-output-empty",
        "render-cluster-name-blank", "memory-model-name-too-long", "speculative-config-too-deep",
        "draft-model-false", "draft-model-empty", "draft-model-absent", "speculative-tokens-true", "draft-tp-true",
        "engine-kwargs-too-deep", "work-dir-unwritable", "rehearse-model-with-config", "capability-absurd",
        "capability-not-the-gpus"])
def test_flags_that_used_to_fail_late_or_be_misread(argv, field, words, capsys):
    code, out, err = run_cli(argv, capsys)
    assert_clear_bad_input(code, out, err, field, paths=[str(GOOD_CONFIG)])
    assert words in err


@pytest.mark.parametrize("make", [
    lambda tmp: (tmp / "dangling.png").symlink_to(tmp / "no-such-folder" / "x.png") or tmp / "dangling.png",
    lambda tmp: tmp / ("p" * 300 + ".png"),
], ids=["dangling-link", "name-too-long"])
def test_plot_that_cannot_be_written_is_refused_before_the_check(make, tmp_path, capsys):
    plot = make(tmp_path)
    code, out, err = run_cli(CHECK + ["--cluster", str(GOOD_CLUSTERS["launcher"]), "--plot", str(plot)], capsys)
    assert_clear_bad_input(code, out, err, "--plot", paths=[str(GOOD_CONFIG), str(GOOD_CLUSTERS["launcher"])])
    assert "verdict" not in out  # refused before the check ran
    assert not (tmp_path / "no-such-folder").exists()


def test_an_unreadable_regular_file_is_bad_input(capsys):
    """/proc/self/mem is a "regular file" whose reads fail."""
    code, out, err = run_cli(["check", "--config", "/proc/self/mem", "--cluster", str(GOOD_CLUSTERS["simple"])],
                             capsys)
    assert_clear_bad_input(code, out, err, "config", paths=["/proc/self/mem", str(GOOD_CLUSTERS["simple"])])
    assert "cannot be read" in err


# --- secrets: known by their shape too, never echoed ---------------------------------------------------------------

TOKEN = "hf_" + "Q7w8E9r0" * 4


@pytest.mark.parametrize("argv", [
    CHECK + ["--address", f"user:{TOKEN}@head:6379"],
    CHECK + ["--app", TOKEN, "--cluster", str(GOOD_CLUSTERS["simple"])],
    ["memory", "--gpu", "H200", "--model", TOKEN],
    MEMORY + ["--kv-cache-dtype", TOKEN],
    ["rehearse", "--config", str(GOOD_CONFIG), "--dry-run", "--env", f"MY_THING={TOKEN}"],
    ["rehearse", "--config", str(GOOD_CONFIG), "--dry-run", "--engine-kwargs", f'{{"tokenizer": "{TOKEN}"}}'],
], ids=["address-userinfo", "app-name", "memory-model", "argparse-choice", "rehearse-env", "rehearse-engine-kwargs"])
def test_a_token_shaped_value_is_never_echoed(argv, capsys):
    code, out, err = run_cli(argv, capsys)
    assert code == 2, err
    assert TOKEN not in out + err and TOKEN[:12] not in out + err
    assert "<redacted>" in err


def test_a_file_that_is_no_cluster_file_is_not_echoed(tmp_path, capsys):
    """A password file given by mistake: its lines are keys of one mapping, and none is printed."""
    shadow = tmp_path / "shadow"
    shadow.write_text("".join(f"user{i}:$6$salt$hash{i}value:19000:0:99999:7:::\n" for i in range(5)))
    code, out, err = run_cli(CHECK + ["--cluster", str(shadow)], capsys)
    assert_clear_bad_input(code, out, err, "(top level)", paths=[str(GOOD_CONFIG), str(shadow)])
    assert "$6$" not in err and "hash0value" not in err


@pytest.mark.parametrize("extra, flag", [
    (["--kv-cache-dtype", "int3"], "--kv-cache-dtype"),
    (["--tp", "3"], "--tp"),
    (["--max-model-len", "99999999"], "--max-model-len"),
    (["--engine-kwargs", '{"tensor_parallel_size": 3}'], "--engine-kwargs.tensor_parallel_size"),
    (["--speculative-config", '{"method": "medusa", "model": "x", "num_speculative_tokens": 1}'],
     "--speculative-config.method"),
], ids=["kv-dtype", "tp", "max-model-len", "engine-kwargs", "speculative-config"])
def test_rehearse_blames_the_flag_not_the_config_file(extra, flag, capsys):
    code, out, err = run_cli(["rehearse", "--config", str(GOOD_CONFIG), "--dry-run", *extra], capsys)
    assert_clear_bad_input(code, out, err, flag, paths=[])
    assert err.startswith(f"error: {flag}: got ")  # not "<config file>: args.<field>"


@pytest.mark.parametrize("text, masked", [
    ("hf_" + "Q7w8E9r0" * 4, "<redacted>"),
    ("sk-proj-abc123def456ghi789jkl", "<redacted>"),
    ("AKIAIOSFODNN7EXAMPLE", "<redacted>"),
    ("Authorization: Bearer abcd1234efgh5678ijkl", "Authorization: <redacted>"),
    ("https://user:pa55word@host/x", "https://user:<redacted>@host/x"),
    # prose and addresses that merely look alike are left alone: a comment in a shipped file must not be refused
    ("ask-for-the-cluster-autoscaler-to-scale", "ask-for-the-cluster-autoscaler-to-scale"),
    ("clients send Bearer authentication headers", "clients send Bearer authentication headers"),
    ("ray://head:10001", "ray://head:10001"),
    ("s3://bucket/kimi-k3/model.safetensors", "s3://bucket/kimi-k3/model.safetensors"),
])
def test_token_shapes(text, masked):
    from kimi_k3_serve.tokens import mask_tokens

    assert mask_tokens(text) == masked


def test_no_shipped_file_holds_a_token_shape():
    from kimi_k3_serve.tokens import looks_like_token

    shipped = [*REPO_ROOT.glob("deploy/*.yaml"), *REPO_ROOT.glob("cluster_configs/*.yaml")]
    assert shipped and not [path.name for path in shipped if looks_like_token(path.read_text())]
