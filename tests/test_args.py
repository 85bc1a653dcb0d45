"""The ``args`` schema of the Serve app and the Serve config reader: good configs pass, and every bad one is
one ConfigError naming the dotted field, the value and what is allowed. No Ray cluster is started here."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from kimi_k3_serve.config.args import OWNED_ENGINE_KWARGS, ServeArgs, load_args, resolve_source
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.config.serve_config import load_serve_app, read_serve_config

MINIMAL = {"model": {"id": "m", "source": "org/model"}, "limits": {"max_model_len": 4096}}

GPU = {
    "model": {"id": "kimi-k3", "source": "/models/Kimi-K3"},
    "accelerator": {"kind": "gpu", "type": "H200"},
    "parallel": {"tensor_parallel_size": 8, "pipeline_parallel_size": 2, "layer_partition": [30, 31]},
    "limits": {"max_model_len": 131072, "max_num_seqs": 64, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "fp8"},
    "speculative": {"method": "eagle3", "model": "/models/Kimi-K3-eagle3", "num_speculative_tokens": 3},
    "autoscaling": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 48, "upscale_delay_s": 60},
    "ingress": {"num_replicas": 2},
    "deployment": {"max_ongoing_requests": 128, "health_check_timeout_s": 60},
    "engine_kwargs": {"trust_remote_code": True},
    "runtime_env": {"env_vars": {"NCCL_DEBUG": "WARN"}},
}


def with_change(base: dict, dotted_path: str, value) -> dict:
    """A deep copy of ``base`` with the field at ``a.b.c`` set to ``value`` (sections created as needed)."""
    config = copy.deepcopy(base)
    *parents, leaf = dotted_path.split(".")
    node = config
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return config


def test_minimal_config_gets_scaling_defaults_that_scale():
    args = load_args(MINIMAL)
    assert args.accelerator.kind == "gpu"
    assert args.parallel.world_size == 1
    # Derived from the engine's batch (vLLM's default max_num_seqs 256), never Ray Serve LLM's 1e9.
    assert args.target_ongoing_requests == 256.0
    assert args.max_ongoing_requests == 512


def test_full_gpu_config_is_kept_as_written():
    args = load_args(GPU)
    assert args.parallel.world_size == 16
    assert args.parallel.layer_partition == [30, 31]
    assert args.accelerator.ray_accelerator_type == "H200"
    assert args.speculative is not None and args.speculative.num_speculative_tokens == 3
    assert args.target_ongoing_requests == 48.0
    assert args.max_ongoing_requests == 128
    assert args.engine_kwargs == {"trust_remote_code": True}


def test_repository_deploy_files_validate():
    dev = load_serve_app(REPO_ROOT / "deploy" / "dev.yaml")
    assert dev.args.accelerator.kind == "cpu"
    assert dev.args.parallel.tensor_parallel_size == 2
    assert dev.args.speculative.method == "eagle3" and dev.args.speculative.num_speculative_tokens == 3
    assert (dev.http_host, dev.http_port) == ("127.0.0.1", 8000)
    pp = load_serve_app(REPO_ROOT / "deploy" / "dev-pp.yaml")
    assert (pp.args.parallel.tensor_parallel_size, pp.args.parallel.pipeline_parallel_size) == (2, 2)
    assert pp.args.speculative is None and pp.args.limits.enforce_eager is False


def test_validated_args_are_immutable():
    args = load_args(MINIMAL)
    with pytest.raises(Exception):
        args.limits.max_model_len = 1  # type: ignore[misc]


BAD = [
    # (base, field to change, bad value, field named in the error, words the message must contain)
    (MINIMAL, "limits.max_model_len", 0, "args.limits.max_model_len", "greater than or equal to 1"),
    (MINIMAL, "parallel.tensor_parallel_size", 0, "args.parallel.tensor_parallel_size", "greater than or equal to 1"),
    (MINIMAL, "parallel.tensor_parallel_size", "two", "args.parallel.tensor_parallel_size", "expected a whole number"),
    (MINIMAL, "parallel.tensor_parallel_size", True, "args.parallel.tensor_parallel_size", "not true/false"),
    (MINIMAL, "limits.max_model_len", 4096.0, "args.limits.max_model_len", "expected a whole number"),
    (MINIMAL, "limits.gpu_memory_utilization", False, "args.limits.gpu_memory_utilization", "not true/false"),
    (MINIMAL, "limits.enforce_eager", 1, "args.limits.enforce_eager", "expected true or false"),
    (MINIMAL, "parallel.tensor_parallel_sise", 2, "args.parallel.tensor_parallel_sise", "allowed here: data_parallel_size"),
    (MINIMAL, "accelerator.kind", "tpu", "args.accelerator.kind", "'cpu' or 'gpu'"),
    (MINIMAL, "accelerator.type", "H201", "args.accelerator.type", "H200"),
    (MINIMAL, "limits.gpu_memory_utilization", 1.5, "args.limits.gpu_memory_utilization", "less than or equal to 1"),
    (MINIMAL, "limits.kv_cache_dtype", "int4", "args.limits.kv_cache_dtype", "fp8"),
    (MINIMAL, "autoscaling.min_replicas", 5, "args.autoscaling.min_replicas", "<= max_replicas (1)"),
    (MINIMAL, "autoscaling.target_ongoing_requests", 1e9, "args.autoscaling.target_ongoing_requests", "never scales"),
    (MINIMAL, "autoscaling.target_ongoing_requests", math.inf, "args.autoscaling.target_ongoing_requests", "finite"),
    (MINIMAL, "autoscaling.target_ongoing_requests", -1, "args.autoscaling.target_ongoing_requests", "greater than 0"),
    (GPU, "autoscaling.initial_replicas", 9, "args.autoscaling.initial_replicas", "between min_replicas (1) and max_replicas (4)"),
    (MINIMAL, "engine_kwargs.tensor_parallel_size", 2, "args.engine_kwargs.tensor_parallel_size", "args.parallel.tensor_parallel_size"),
    (MINIMAL, "engine_kwargs.speculative_config", {}, "args.engine_kwargs.speculative_config", "args.speculative"),
    (MINIMAL, "speculative", {"method": "medusa", "model": "d", "num_speculative_tokens": 2}, "args.speculative.method", "'eagle3' or 'dspark'"),
    (MINIMAL, "speculative", {"method": "eagle3", "model": "d", "num_speculative_tokens": 0}, "args.speculative.num_speculative_tokens", "greater than or equal to 1"),
    (GPU, "speculative.draft_tensor_parallel_size", 4, "args.speculative.draft_tensor_parallel_size", "1 or the target's tensor_parallel_size (8)"),
    (GPU, "parallel.layer_partition", [30, 31, 1], "args.parallel.layer_partition", "expected 2 entries"),
    (MINIMAL, "runtime_env.env_vars", {"N": 1}, "args.runtime_env.env_vars.N", "expected text"),
    (MINIMAL, "model.id", "", "args.model.id", "at least 1 character"),
    (MINIMAL, "cluster", {}, "args.cluster", "unknown field"),
    (MINIMAL, "deployment.health_check_timeout_s", 0, "args.deployment.health_check_timeout_s", "greater than 0"),
]


@pytest.mark.parametrize(("base", "path", "value", "field", "words"), BAD, ids=[f"{b[1]}={b[2]!r}" for b in BAD])
def test_bad_config_names_the_field(base, path, value, field, words):
    with pytest.raises(ConfigError) as info:
        load_args(with_change(base, path, value), source="deploy/x.yaml")
    error = info.value
    assert error.field == field
    assert words in str(error)
    assert str(error).startswith(f"deploy/x.yaml: {field}: got ")


CPU = {**MINIMAL, "accelerator": {"kind": "cpu"}}

BAD_ON_CPU = [
    ("accelerator.type", "H200", "args.accelerator.type", "only allowed with kind: gpu"),
    ("parallel.data_parallel_size", 2, "args.parallel.data_parallel_size", "must be 1 on CPU"),
    ("parallel.enable_expert_parallel", True, "args.parallel.enable_expert_parallel", "false on CPU"),
]


@pytest.mark.parametrize(("path", "value", "field", "words"), BAD_ON_CPU, ids=[b[0] for b in BAD_ON_CPU])
def test_what_cpu_cannot_do_is_refused(path, value, field, words):
    with pytest.raises(ConfigError) as info:
        load_args(with_change(CPU, path, value))
    assert info.value.field == field
    assert words in str(info.value)


def test_pipeline_parallel_on_cpu_needs_torch_compile_and_no_draft():
    pp = with_change(CPU, "parallel.pipeline_parallel_size", 2)
    with pytest.raises(ConfigError) as info:
        load_args(with_change(pp, "limits.enforce_eager", True))
    assert info.value.field == "args.limits.enforce_eager"
    draft = {"method": "eagle3", "model": "d", "num_speculative_tokens": 3}
    with pytest.raises(ConfigError) as info:
        load_args(with_change(pp, "speculative", draft))
    assert info.value.field == "args.speculative"
    assert load_args(pp).parallel.world_size == 2  # PP without a draft, compiled: accepted


def test_missing_section_and_wrong_type_of_args():
    with pytest.raises(ConfigError) as info:
        load_args({"model": {"id": "m", "source": "s"}})
    assert info.value.field == "args.limits"
    assert "required field is missing" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_args(["model"])
    assert info.value.field == "args"


def test_every_owned_engine_kwarg_points_at_an_existing_field():
    for key, target in OWNED_ENGINE_KWARGS.items():
        path = target.split(" ")[0].removeprefix("args.").split(".")
        model = ServeArgs
        for name in path:
            assert name in model.model_fields, (key, target)
            annotation = model.model_fields[name].annotation
            model = next((a for a in getattr(annotation, "__args__", (annotation,)) if hasattr(a, "model_fields")), None)
            if model is None:
                break


def test_model_sources_resolve_from_the_cache_or_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_K3_SERVE_MODEL_CACHE", str(tmp_path))
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")
    assert resolve_source("cache:tiny", field="args.model.source") == str(tmp_path / "tiny")
    assert resolve_source("org/model", field="args.model.source") == "org/model"  # a hub id passes through
    with pytest.raises(ConfigError) as info:
        resolve_source("cache:absent", field="args.model.source")
    assert info.value.field == "args.model.source" and "make models" in str(info.value)
    with pytest.raises(ConfigError) as info:
        resolve_source(str(tmp_path / "nowhere"), field="args.speculative.model")
    assert info.value.field == "args.speculative.model"


def test_build_app_refuses_bad_args_before_touching_ray():
    from kimi_k3_serve.app import build_app

    with pytest.raises(ConfigError) as info:
        build_app(with_change(CPU, "parallel.tensor_parallel_size", -2))
    assert info.value.field == "args.parallel.tensor_parallel_size"
    with pytest.raises(ConfigError) as info:
        build_app(with_change(CPU, "model.source", "cache:not-made"))
    assert info.value.field == "args.model.source"


# --- Serve config files -------------------------------------------------------------------------------------------

GOOD_FILE = """\
applications:
- name: llm
  import_path: kimi_k3_serve.app:build_app
  args:
    model: {id: m, source: org/model}
    limits: {max_model_len: 2048}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return path


def test_serve_file_good(tmp_path):
    app = load_serve_app(write(tmp_path, GOOD_FILE))
    assert app.name == "llm" and app.args.limits.max_model_len == 2048
    assert read_serve_config(write(tmp_path, GOOD_FILE))["applications"][0]["name"] == "llm"


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ("applications: [\n", "config", "valid YAML (not at line 2"),
        ("- just a list\n", "config", "expected a mapping"),
        (GOOD_FILE.replace("kimi_k3_serve.app:build_app", "ray.serve.llm:build_openai_app"),
         "config.applications[].import_path", "kimi_k3_serve.app:build_app"),
        ("http_options: {port: many}\n" + GOOD_FILE, "config.http_options.port", "valid integer"),
        (GOOD_FILE.replace("max_model_len: 2048", "max_model_len: -5"), "args.limits.max_model_len", "greater than or equal to 1"),
        (GOOD_FILE.replace("  args:\n    model: {id: m, source: org/model}\n    limits: {max_model_len: 2048}\n", ""),
         "config.applications[0].args", "required"),
    ],
    ids=["bad-yaml", "not-a-mapping", "wrong-import-path", "bad-http-port", "bad-args", "no-args"],
)
def test_serve_file_bad(tmp_path, text, field, words):
    with pytest.raises(ConfigError) as info:
        load_serve_app(write(tmp_path, text))
    assert info.value.field == field
    assert words in str(info.value)


def test_serve_file_missing_and_app_name(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_serve_app(tmp_path / "absent.yaml")
    assert info.value.field == "config" and "no such file" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_serve_app(write(tmp_path, GOOD_FILE), app_name="other")
    assert info.value.field == "config.applications[].name" and "llm" in str(info.value)


# --- secrets are refused by name and never echoed ---------------------------------------------------------------

SECRET = "hf_s3cr3t-Value-9c2e7d"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ("api_key", "args.api_key"),
        ("engine_kwargs.hf_token", "args.engine_kwargs.hf_token"),
        ("engine_kwargs.hf_overrides.auth_token", "args.engine_kwargs.hf_overrides.auth_token"),
        ("runtime_env.env_vars.HF_TOKEN", "args.runtime_env.env_vars.HF_TOKEN"),
        ("runtime_env.env_vars.AWS_SECRET_ACCESS_KEY", "args.runtime_env.env_vars.AWS_SECRET_ACCESS_KEY"),
        ("runtime_env.env_vars.S3_CLIENT_SECRET", "args.runtime_env.env_vars.S3_CLIENT_SECRET"),
        ("model.password", "args.model.password"),
        ("limits.db_password", "args.limits.db_password"),
    ],
)
def test_a_secret_in_any_field_is_refused_by_name_without_its_value(change, field):
    with pytest.raises(ConfigError) as info:
        load_args(with_change(GPU, change, SECRET))
    assert info.value.field == field
    assert SECRET not in str(info.value) and "<redacted>" in str(info.value)
    assert "input_value" not in str(info.value)


def test_secret_names_spare_the_fields_that_hold_none():
    args = load_args(with_change(GPU, "security.require_api_key", True))
    assert args.security.require_api_key is True
    ok = with_change(GPU, "runtime_env.env_vars.KIMI_K3_SERVE_API_KEY_FILE", "/run/secrets/kk3")
    assert load_args(ok).runtime_env.env_vars["KIMI_K3_SERVE_API_KEY_FILE"] == "/run/secrets/kk3"


def test_an_unknown_field_never_echoes_its_value():
    """pydantic's own message carries ``input_value=...``; ours names the field and what is allowed only."""
    with pytest.raises(ConfigError) as info:
        load_args({**MINIMAL, "credentials": SECRET})
    assert info.value.field == "args.credentials" and "unknown field" in str(info.value)
    assert SECRET not in str(info.value) and "input_value" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        # Serve's own runtime_env (Ray's schema reads this file, not the snapshot).
        (GOOD_FILE + f"  runtime_env: {{env_vars: {{HF_TOKEN: {SECRET}}}}}\n", "config.applications[0].runtime_env.env_vars.HF_TOKEN"),
        (GOOD_FILE.replace("limits: {max_model_len: 2048}", f"limits: {{max_model_len: 2048}}\n    api_key: {SECRET}"),
         "config.applications[0].args.api_key"),
        (f"http_options: {{ssl_keyfile_password: {SECRET}}}\n" + GOOD_FILE, "config.http_options.ssl_keyfile_password"),
        (f"unknown_top: {SECRET}\n" + GOOD_FILE, "config.unknown_top"),
    ],
    ids=["serve-runtime-env", "args-api-key", "http-options", "unknown-top-level"],
)
def test_a_secret_in_a_serve_file_is_refused_and_never_echoed(tmp_path, text, field):
    with pytest.raises(ConfigError) as info:
        load_serve_app(write(tmp_path, text))
    assert info.value.field == field
    assert SECRET not in str(info.value) and "input_value" not in str(info.value)


@pytest.mark.parametrize("command", ["check", "render"])
def test_cli_refuses_a_secret_with_one_line_and_prints_or_writes_nothing_of_it(tmp_path, command, capsys):
    from kimi_k3_serve.cli import main

    text = (REPO_ROOT / "deploy" / "config.yaml").read_text().replace(
        "NCCL_DEBUG: WARN", f"NCCL_DEBUG: WARN\n          HF_TOKEN: {SECRET}")
    config = tmp_path / "with-token.yaml"
    config.write_text(text)
    out = tmp_path / "cluster.yaml"
    argv = {"check": ["check", "--config", str(config), "--cluster", str(REPO_ROOT / "cluster_configs/aws-h200-p5en.yaml")],
            "render": ["render", "--config", str(config), "--format", "kuberay", "--output", str(out)]}[command]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("error: ") and "args.runtime_env.env_vars.HF_TOKEN: got <redacted>;" in captured.err
    assert SECRET not in captured.err and not out.exists()
