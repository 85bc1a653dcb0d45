"""Property-based fuzz of the config readers: whatever the input, the answer is a validated value or one
``ConfigError`` -- never another exception, which would reach the user as a traceback.

Two kinds of input: arbitrary YAML-like data, and a good document with one part replaced by arbitrary data
(which reaches much deeper into the validators than random data does).
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import REPO_ROOT
from kimi_k3_serve.config.args import load_args
from kimi_k3_serve.cluster.files import load_cluster_file, parse_cluster_document
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.config.serve_config import load_serve_app

GOOD_ARGS = [
    yaml.safe_load((REPO_ROOT / "deploy" / name).read_text())["applications"][0]["args"]
    for name in ("config.yaml", "dev.yaml", "dev-pp.yaml")
]
GOOD_CLUSTERS = [
    next(yaml.safe_load_all(path.read_text()))  # KubeRay files: the RayService (the NetworkPolicy follows)
    for path in (
        REPO_ROOT / "tests" / "fixtures" / "check" / "h200-2x8.yaml",
        REPO_ROOT / "cluster_configs" / "aws-h200-p5en.yaml",
        REPO_ROOT / "cluster_configs" / "kuberay-h200.yaml",
        REPO_ROOT / "cluster_configs" / "kuberay-gb300-nvl72.yaml",
        REPO_ROOT / "tests" / "fixtures" / "clusters" / "launcher-gcp-explicit.yaml",
    )
]

# Deterministic and bounded for CI: the same examples every run (derandomize) and a fixed number of them. No deadline
# per example: how fast a bad input is refused is benchmarked, not timed here (a 2 s deadline failed the CLI fuzz on a
# busy 2-core machine, 2026-12-03).
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
FILE_FUZZ = settings(FUZZ, max_examples=150, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["H200", "cpu", "gpu", "eagle3", "auto", "8", "-1", "1e9", "cache:", "./x", "nan", "H900"]),
)
yaml_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a document (keys and list indexes), the root included."""
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _paths(value, prefix + (i,))
    return found


def _replace(document: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    result = copy.deepcopy(document)
    node = result
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return result


@st.composite
def mutated(draw, documents: list[Any]) -> Any:
    document = draw(st.sampled_from(documents))
    path = draw(st.sampled_from(_paths(document)))
    action = draw(st.sampled_from(["replace", "replace", "delete", "add-key"]))
    if action == "delete" and path:
        result = copy.deepcopy(document)
        node = result
        for part in path[:-1]:
            node = node[part]
        del node[path[-1]]
        return result
    if action == "add-key":
        node = document
        for part in path:
            node = node[part]
        if isinstance(node, dict):
            return _replace(document, path, {**node, draw(st.text(max_size=10)): draw(yaml_values)})
    return _replace(document, path, draw(yaml_values))


def _only_config_errors(call) -> None:
    try:
        call()
    except ConfigError as exc:
        assert exc.field, exc  # names a field
        str(exc)  # and renders


@FUZZ
@given(yaml_values)
def test_load_args_on_arbitrary_data(data):
    _only_config_errors(lambda: load_args(data, source="fuzz"))


@FUZZ
@given(mutated(GOOD_ARGS))
def test_load_args_on_mutated_good_args(data):
    _only_config_errors(lambda: load_args(data, source="fuzz"))


@FUZZ
@given(yaml_values)
def test_cluster_reader_on_arbitrary_data(data):
    _only_config_errors(lambda: parse_cluster_document(data, source="fuzz"))


@FUZZ
@given(mutated(GOOD_CLUSTERS))
def test_cluster_reader_on_mutated_good_files(data):
    _only_config_errors(lambda: parse_cluster_document(data, source="fuzz").at_capacity())


@FILE_FUZZ
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_file_readers_on_arbitrary_bytes(tmp_path, content):
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(content)
    _only_config_errors(lambda: load_cluster_file(str(path)))
    _only_config_errors(lambda: load_serve_app(path))


@settings(FILE_FUZZ, max_examples=100)
@given(mutated([yaml.safe_load((REPO_ROOT / "deploy" / "config.yaml").read_text())]))
def test_serve_config_reader_on_mutated_deploy_file(tmp_path, document):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(document))
    _only_config_errors(lambda: load_serve_app(path))


MODEL_CONFIGS = [json.loads(path.read_text()) for path in sorted((REPO_ROOT / "kimi_k3_serve" / "models" / "data").glob("*.json"))
                 + sorted((REPO_ROOT / "tests" / "fixtures" / "configs").glob("*.json"))]
sizes = st.one_of(st.integers(min_value=-2, max_value=4), st.sampled_from([96, 2**31, 10**12, 2**70]), st.none(),
                  st.floats(allow_nan=True), st.text(max_size=4), st.lists(st.integers(), max_size=3))


@st.composite
def mutated_model_config(draw) -> Any:
    """A shipped or fixture config.json with one field replaced: sizes (zero heads, 10^12 layers) or any value."""
    return _replace(*_pick_path(draw, draw(st.sampled_from(MODEL_CONFIGS))), draw(sizes | yaml_values))


def _pick_path(draw, document: Any) -> tuple[Any, tuple]:
    return document, draw(st.sampled_from(_paths(document)[1:]))


@FUZZ
@given(mutated_model_config())
def test_model_config_reader_on_mutated_configs(config):
    """Each example builds the inventory and estimates one layout: what ``memory`` and ``plan`` do with a config.json."""
    from kimi_k3_serve.models import inventory_from_config
    from kimi_k3_serve.planning.layout import EngineSettings, Layout, RankDevice
    from kimi_k3_serve.planning.memory import estimate_memory

    def build_and_estimate():
        model = inventory_from_config(config, name="fuzz", source="fuzz")
        estimate_memory(model, Layout(tp=1), EngineSettings(max_model_len=4096), RankDevice(150 * 2**30))

    _only_config_errors(build_and_estimate)


def test_fuzz_throughput_is_printed():
    start = time.perf_counter()
    for args in GOOD_ARGS:
        load_args(args)
    for cluster in GOOD_CLUSTERS:
        parse_cluster_document(cluster)
    print(f"\n[{len(GOOD_ARGS)} args + {len(GOOD_CLUSTERS)} cluster documents read in "
          f"{time.perf_counter() - start:.3f} s]")
