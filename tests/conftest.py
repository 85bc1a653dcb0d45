"""Shared fixtures: the tiny local models, a local Ray head of our own, and Serve applications on it.

The Ray head runs inside the test process (``ray.init``) with its own temp dir and ports, so it never touches
another Ray cluster on the machine, and is shut down when the module that asked for it ends.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
RAY_LOGICAL_CPUS = 8
APP_READY_TIMEOUT_S = 600


def load_script(name: str):
    """``scripts/<name>.py`` as a module (the scripts are not a package). Registered in ``sys.modules`` first:
    dataclasses look their module up while a class is made."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


make_tiny_models = load_script("make_tiny_models")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_models() -> "make_tiny_models.TinyModels":
    """The tiny target and draft in the model cache (made once, reused by later runs)."""
    cache = make_tiny_models.default_cache_dir()
    os.environ[make_tiny_models.MODEL_CACHE_ENV] = str(cache)  # `cache:NAME` sources resolve here
    start = time.perf_counter()
    models = make_tiny_models.ensure_tiny_models(cache)
    print(f"\n[tiny models ready in {time.perf_counter() - start:.2f} s at {cache}]")
    return models


@dataclass
class RayHead:
    temp_dir: str
    metrics_port: int
    http_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@pytest.fixture(scope="module")
def ray_head(tiny_models) -> Iterator[RayHead]:
    """A local Ray head with more logical CPUs than cores (placement groups reserve logical CPUs) and Serve
    listening on a free port of 127.0.0.1. Engine metrics reach Prometheus on ``metrics_port`` every second."""
    import ray
    from ray import serve

    if ray.is_initialized():
        pytest.fail("a Ray instance is already initialised in this process")
    # A short path: Ray's Unix sockets live under it and must stay below the OS length limit.
    temp_dir = tempfile.mkdtemp(prefix="kk3-ray-")
    head = RayHead(temp_dir=temp_dir, metrics_port=free_port(), http_port=free_port())
    start = time.perf_counter()
    ray.init(
        num_cpus=RAY_LOGICAL_CPUS,
        include_dashboard=False,
        _temp_dir=temp_dir,
        _metrics_export_port=head.metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
        log_to_driver=False,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": head.http_port}, proxy_location="HeadOnly")
    print(f"\n[Ray head + Serve up in {time.perf_counter() - start:.1f} s, HTTP {head.base_url}]")
    try:
        yield head
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


def wait_for_app(name: str, timeout_s: float = APP_READY_TIMEOUT_S) -> float:
    """Block until Serve reports application ``name`` RUNNING; fail with Serve's own message otherwise."""
    from ray import serve

    start = time.perf_counter()
    last = ""
    while time.perf_counter() - start < timeout_s:
        app = serve.status().applications.get(name)
        if app is not None:
            status = str(app.status.value if hasattr(app.status, "value") else app.status)
            if status == "RUNNING":
                return time.perf_counter() - start
            if status in ("DEPLOY_FAILED", "UNHEALTHY"):
                details = {d: (s.status, s.message) for d, s in app.deployments.items()}
                pytest.fail(f"application {name} is {status}: {app.message} {details}")
            last = f"{status} {app.message}"
        time.sleep(2)
    pytest.fail(f"application {name} not RUNNING after {timeout_s:.0f} s (last: {last})")


@pytest.fixture(scope="module")
def deploy_app(ray_head: RayHead) -> Iterator[Callable[[dict[str, Any], str], str]]:
    """``deploy(args, name) -> base URL``: build with ``kimi_k3_serve.app.build_app`` and run it under Serve;
    every application deployed this way is deleted when the module ends."""
    from ray import serve
    from ray.serve.api import RunTarget

    from kimi_k3_serve.app import build_app

    names: list[str] = []

    def deploy(args: dict[str, Any], name: str) -> str:
        app = build_app(args)
        start = time.perf_counter()
        serve.run_many([RunTarget(target=app, name=name, route_prefix="/")], wait_for_applications_running=False)
        names.append(name)
        took = wait_for_app(name)
        print(f"\n[application {name} RUNNING {took:.1f} s after submit ({time.perf_counter() - start:.1f} s total)]")
        return ray_head.base_url

    yield deploy
    for name in names:
        try:
            serve.delete(name)
        except Exception as exc:  # teardown must go on to shut Ray down
            print(f"could not delete application {name}: {exc}")


def http_json(
    url: str, body: bytes | None = None, *, timeout: float = 60, content_type: str = "application/json"
) -> tuple[int, dict[str, Any]]:
    """POST ``body`` (or GET) and return (status, parsed JSON), including for 4xx/5xx answers."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        payload = exc.read()
        try:
            return exc.code, json.loads(payload or b"{}")
        except ValueError:
            return exc.code, {"raw": payload.decode(errors="replace")}
