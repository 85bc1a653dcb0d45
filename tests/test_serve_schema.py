"""The Ray-free shortcut for accepting Serve configs (``kimi_k3_serve.config.serve_schema``) against Ray's own schema.

The shortcut may only ever accept what ``ray.serve.schema.ServeDeploySchema`` accepts; everything else is left
to Ray. These tests hold it to that: the snapshot must be what the installed Ray generates, Ray's validators on
the covered models must be accounted for, and on hand-made and generated documents the shortcut never accepts
what Ray rejects.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from ray.serve.schema import HTTPOptionsSchema, LoggingConfig, ServeApplicationSchema, ServeDeploySchema

from conftest import REPO_ROOT
from kimi_k3_serve.config import serve_schema
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.config.serve_config import load_serve_app
from test_fuzz_config import mutated, yaml_values

DEPLOY_FILES = sorted((REPO_ROOT / "deploy").glob("*.yaml"))
GOOD_DOCUMENTS = [yaml.safe_load(path.read_text()) for path in DEPLOY_FILES]

MIRRORED = {
    ("ServeApplicationSchema", "import_path_format_valid"),
    ("ServeDeploySchema", "application_names_unique"),
    ("ServeDeploySchema", "application_routes_unique"),
    ("ServeDeploySchema", "application_names_nonempty"),
    ("LoggingConfig", "valid_encoding_format"),
    ("LoggingConfig", "valid_log_level"),
}
"""Ray validators the shortcut repeats."""
INERT = {
    # Their fields are not in FAST_FIELDS, so a document that sets them never takes the shortcut.
    ("ServeApplicationSchema", "convert_autoscaling_policy_to_dict"),
    ("ServeApplicationSchema", "runtime_env_contains_remote_uris"),
    ("HTTPOptionsSchema", "validate_ssl_certfile"),
    ("LoggingConfig", "valid_additional_log_standard_attrs"),
    # Fires only on an application's own host/port, or on deployments with external_scaler_enabled.
    ("ServeDeploySchema", "nested_host_and_port"),
    ("ServeApplicationSchema", "validate_external_scaler_and_autoscaling"),
}
"""Ray validators that cannot fire on a document made only of FAST_FIELDS (the reason is beside each)."""


def ray_accepts(document) -> bool:
    try:
        ServeDeploySchema.model_validate(document)
    except (ValidationError, TypeError, ValueError):
        return False
    return True


def test_snapshot_is_what_the_installed_ray_generates():
    written = json.loads(serve_schema.SNAPSHOT_PATH.read_text())
    assert written == serve_schema.snapshot_from_ray(), (
        "Ray's ServeDeploySchema changed: run `python -m kimi_k3_serve.config.serve_schema` and review the diff"
    )


def test_every_ray_validator_on_the_covered_models_is_mirrored_or_inert():
    found = set()
    for model in (ServeDeploySchema, ServeApplicationSchema, HTTPOptionsSchema, LoggingConfig):
        decorators = model.__pydantic_decorators__
        for kind in ("field_validators", "model_validators", "root_validators", "validators"):
            found |= {(model.__name__, name) for name in getattr(decorators, kind)}
    assert found == MIRRORED | INERT


def test_covered_fields_still_exist_in_ray():
    models = {m.__name__: m for m in (ServeDeploySchema, ServeApplicationSchema, HTTPOptionsSchema, LoggingConfig)}
    for model, fields in serve_schema.FAST_FIELDS.items():
        assert set(fields) <= set(models[model].model_fields), model


@pytest.mark.parametrize("path", DEPLOY_FILES, ids=lambda p: p.name)
def test_shipped_deploy_files_take_the_shortcut(path):
    document = yaml.safe_load(path.read_text())
    assert serve_schema.accepts_without_ray(document)
    assert ray_accepts(document)
    assert load_serve_app(path).serve_schema == "snapshot"


def _with_apps(*apps, **top):
    return {"applications": [{"import_path": "kimi_k3_serve.app:build_app", "args": {}, **app} for app in apps], **top}


REJECTED_BY_RAY = {
    "duplicate names": _with_apps({"name": "a", "route_prefix": "/a"}, {"name": "a", "route_prefix": "/b"}),
    "duplicate default names": _with_apps({"route_prefix": "/a"}, {"route_prefix": "/b"}),
    "empty name": _with_apps({"name": ""}),
    "duplicate routes": _with_apps({"name": "a", "route_prefix": "/x"}, {"name": "b", "route_prefix": "/x"}),
    "duplicate default routes": _with_apps({"name": "a"}, {"name": "b"}),
    "two colons": _with_apps({"import_path": "a:b:c"}),
    "unknown log encoding": _with_apps({"name": "a"}, logging_config={"encoding": "YAML"}),
    "lowercase log level": _with_apps({"name": "a"}, logging_config={"log_level": "warning"}),
    "unknown numeric log level": _with_apps({"name": "a"}, logging_config={"log_level": 25}),
    "unknown app log level": _with_apps({"name": "a", "logging_config": {"log_level": "LOUD"}}),
    "leading colon": _with_apps({"import_path": ":b"}),
    "trailing colon": _with_apps({"import_path": "a:"}),
    "no dot or colon": _with_apps({"import_path": "module"}),
    "leading dot": _with_apps({"import_path": ".module"}),
    "trailing dot": _with_apps({"import_path": "module."}),
    "host inside an application": _with_apps({"host": "0.0.0.0"}),
    "port inside an application": _with_apps({"port": 8000}),
    "NaN target capacity": _with_apps({}, target_capacity=float("nan")),
    "target capacity above 100": _with_apps({}, target_capacity=101),
    "unknown proxy location": _with_apps({}, proxy_location="Everywhere"),
    "port as text": _with_apps({}, http_options={"port": "eighty"}),
    "name not text": _with_apps({"name": 5}),
    "no import path": {"applications": [{"name": "a"}]},
    "no applications": {"http_options": {}},
    "args not a mapping": _with_apps({"args": [1, 2]}),
}


@pytest.mark.parametrize("name", REJECTED_BY_RAY)
def test_the_shortcut_leaves_what_ray_rejects_to_ray(name):
    document = REJECTED_BY_RAY[name]
    assert not ray_accepts(document), "the example must be one Ray rejects"
    assert not serve_schema.accepts_without_ray(document)


@pytest.mark.parametrize("document", [
    _with_apps({"name": "a", "route_prefix": None}, {"name": "b", "route_prefix": None}),  # null prefixes may repeat
    _with_apps({"name": "a", "import_path": "pkg.module"}),
    _with_apps({}, http_options={"host": "127.0.0.1", "port": 8000.0, "request_timeout_s": 5}, target_capacity=50),
    _with_apps({}, proxy_location="HeadOnly"),
    _with_apps({"logging_config": {"encoding": "JSON", "log_level": 10}},
               logging_config={"encoding": "TEXT", "log_level": "WARNING", "enable_access_log": False}),
], ids=["null-routes", "dotted-path", "http-options", "proxy-location", "logging-config"])
def test_the_shortcut_accepts_what_ray_accepts(document):
    assert ray_accepts(document)
    assert serve_schema.accepts_without_ray(document)


def test_a_snapshot_for_another_ray_version_is_not_used(monkeypatch):
    monkeypatch.setattr(serve_schema, "_installed_ray_version", lambda: "0.0.1")
    serve_schema._snapshot_validator.cache_clear()
    try:
        assert not serve_schema.accepts_without_ray(GOOD_DOCUMENTS[0])
    finally:
        monkeypatch.undo()
        serve_schema._snapshot_validator.cache_clear()
    assert serve_schema.accepts_without_ray(GOOD_DOCUMENTS[0])


def test_the_shortcut_does_not_decide_rejections(tmp_path):
    """A file the shortcut passes over gets Ray's verdict and Ray's message, field named."""
    path = tmp_path / "config.yaml"
    document = copy.deepcopy(GOOD_DOCUMENTS[0])
    document["applications"][0]["host"] = "0.0.0.0"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError, match="set host in the top level deploy config only"):
        load_serve_app(path)


app_values = st.fixed_dictionaries(
    {"import_path": st.sampled_from(["kimi_k3_serve.app:build_app", "a.b", "a:b:c", "x", ":x", "x.", "a.b:c"])},
    optional={
        "name": st.sampled_from(["", "llm", "llm", "default", 7, None]),
        "route_prefix": st.sampled_from(["/", "/", "/v1", None, "v1", "", 3]),
        "args": st.sampled_from([{}, {"k": float("nan")}, [], None]),
    },
)
fast_documents = st.fixed_dictionaries(
    {"applications": st.lists(app_values, max_size=3)},
    optional={
        "http_options": st.dictionaries(
            st.sampled_from(["host", "port", "root_path", "request_timeout_s", "keep_alive_timeout_s"]), yaml_values,
            max_size=3),
        "proxy_location": st.sampled_from(["EveryNode", "HeadOnly", "Disabled", "Nowhere", None, 1]),
        "target_capacity": st.one_of(st.none(), st.floats(allow_nan=True), st.integers(-5, 200), st.booleans()),
    },
)
DIFFERENTIAL = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@DIFFERENTIAL
@given(fast_documents)
@example({"applications": [], "http_options": {"port": 9.223372036854776e18}})  # pydantic: int_parsing_size
def test_never_accepts_what_ray_rejects_on_documents_of_covered_fields(document):
    if serve_schema.accepts_without_ray(document):
        assert ray_accepts(document), document


@DIFFERENTIAL
@given(mutated(GOOD_DOCUMENTS))
def test_never_accepts_what_ray_rejects_on_mutated_deploy_files(document):
    if serve_schema.accepts_without_ray(document):
        assert ray_accepts(document), document


def test_check_of_a_shipped_config_does_not_import_ray():
    code = (
        "import sys\n"
        "from kimi_k3_serve.cli import main\n"
        "code = main(['check', '--config', 'deploy/config.yaml', '--cluster', 'cluster_configs/aws-h200-p5en.yaml'])\n"
        "print('exit', code, 'ray imported:', 'ray' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().endswith("exit 0 ray imported: False"), done.stdout + done.stderr
    assert "without importing Ray" in done.stdout
