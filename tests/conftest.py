"""Shared fixtures: the tiny local models, a local Ray head of our own, and Serve applications on it.

The Ray head runs inside the test process (``ray.init``) with its own temp dir and ports, so it never touches
another Ray cluster on the machine, and is shut down when the module that asked for it ends.

Every Ray the tests start stays on this machine. Before anything imports Ray, this file sets, for this process
and every process it starts (raylets, ``ray start``, ``serve run``):
- ``RAY_USAGE_STATS_ENABLED=0``: nothing is reported to Ray's usage server;
- ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's loopback mode (its default on macOS and Windows). On Linux Ray
  turns ``127.0.0.1`` given as a node address into the machine's outward address
  (``services.resolve_ip_for_localhost``), so ``_node_ip_address="127.0.0.1"`` alone does not keep it local;
  in this mode the node address is 127.0.0.1 and the GCS, raylets, agents, workers and dashboard bind to it;
- no ``RAY_ADDRESS``: no test joins a cluster it did not start.
``assert_ray_stays_on_this_machine`` checks the result on the live Ray: each fixture that starts one calls it,
and before every test that runs with Ray connected it runs again. A head without auth (the autoscaling test
turns token auth off) is then reachable from nowhere but this machine.
"""

from __future__ import annotations

import os

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.pop("RAY_ADDRESS", None)

import importlib.util  # noqa: E402
import ipaddress  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator  # noqa: E402

import pytest  # noqa: E402

from kimi_k3_serve.serving.ports import LOOPBACK, free_loopback_port, free_loopback_ports  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
RAY_LOGICAL_CPUS = 8
APP_READY_TIMEOUT_S = 600


def load_script(name: str, folder: str = "scripts"):
    """``scripts/<name>.py`` (or ``<folder>/<name>.py``) as a module (the scripts are not a package). Registered in
    ``sys.modules`` first: dataclasses look their module up while a class is made."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


make_tiny_models = load_script("make_tiny_models")


def comment_prose(yaml_text: str) -> str:
    """A YAML file's text with each comment's ``#`` line breaks joined: a sentence over several lines reads whole."""
    return re.sub(r"\n\s*#\s*", " ", yaml_text)


def last_logged_int(pattern: str, text: str) -> int | None:
    """The last integer a vLLM log gives for ``pattern`` (one group), e.g. a setting of the config it printed."""
    found = re.findall(pattern, text)
    return int(found[-1]) if found else None


def run_with_rehearsal_plugin(code: str, folder: Path) -> str:
    """``code`` run by this Python with the rehearsal's vLLM plugin installed in ``folder`` and on its path, and every
    plugin vLLM finds allowed, as an engine process would have it; returns what it printed (it must exit 0)."""
    from kimi_k3_serve.rehearsal import graph_samples

    path = os.pathsep.join(p for p in (str(graph_samples.install(folder)), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("VLLM_PLUGINS", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def free_port() -> int:
    return free_loopback_port()


def free_ports(count: int) -> list[int]:
    """Ports for listeners that start together: all different."""
    return free_loopback_ports(count)


def stop_process_group(proc: subprocess.Popen, sig: int, timeout_s: float = 90) -> None:
    """Send ``sig`` to the process group of ``proc`` (started with ``start_new_session=True``: ``ray start``,
    ``serve run``) and wait for it; SIGKILL the group if it has not exited after ``timeout_s``."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def http_status(url: str) -> int:
    """HTTP status of a GET on ``url``; 0 when there is no answer (nothing listening yet, an error status, a
    timeout), for polling a server that is starting."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except Exception:
        return 0


# --- Ray stays on this machine ------------------------------------------------------------------------------------


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    mapped = getattr(address, "ipv4_mapped", None)  # "::ffff:127.0.0.1", as Ray's gRPC servers report it
    return (mapped or address).is_loopback


def _ray_processes(session_dir: str, gcs_address: str) -> tuple[list, list]:
    """This Ray's own processes: (the ones whose command line names its session dir or its GCS address: GCS,
    raylets, dashboard, monitors, the Ray client server; the workers and agents the raylets start, ``ray::...``).
    What a worker starts in turn (vLLM's engine processes) is not Ray's and is in neither list."""
    import psutil

    names_this_ray = re.compile(rf"{re.escape(session_dir)}|{re.escape(gcs_address)}(?!\d)")
    services, workers = {}, {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if names_this_ray.search(" ".join(proc.info["cmdline"] or ())):
                services[proc.pid] = proc
                for child in proc.children():
                    cmdline = " ".join(child.cmdline())
                    if cmdline.startswith("ray::") or "default_worker.py" in cmdline:
                        workers[child.pid] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return list(services.values()), [p for pid, p in workers.items() if pid not in services]


SERVE_REPLICA = "ray::ServeReplica:"
"""The one listener not on loopback that is allowed, once per Serve replica: Ray Serve 2.60 starts each replica's
inter-deployment gRPC server on ``[::]:0``, hard-coded (``ray/serve/_private/replica.py``, ``_on_initialized``),
with no setting to bind it elsewhere. Anything else a replica listens on beyond loopback fails the check."""


def assert_ray_stays_on_this_machine() -> None:
    """The Ray this process is connected to is this machine's alone: usage stats off (here and in every Ray
    process), the GCS, every live raylet and the dashboard on 127.0.0.1, and no Ray process listening on an
    address another machine can reach (but for ``SERVE_REPLICA``)."""
    import psutil
    import ray
    from ray._common.usage import usage_lib
    from ray._private import ray_constants

    assert not ray_constants.ENABLE_RAY_CLUSTER, "Ray is not in its loopback mode (imported before conftest?)"
    assert not usage_lib.usage_stats_enabled(), "Ray usage stats are on"
    gcs = ray.get_runtime_context().gcs_address
    assert gcs.rsplit(":", 1)[0] == LOOPBACK, f"the GCS is at {gcs}"
    nodes = {n["NodeID"][:8]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert nodes and set(nodes.values()) == {LOOPBACK}, f"raylets at {nodes}"
    node = ray._private.worker.global_worker.node
    if node.webui_url:
        assert node.webui_url.rsplit(":", 1)[0] == LOOPBACK, f"the dashboard is at {node.webui_url}"
    services, workers = _ray_processes(node.get_session_dir_path(), gcs)
    assert services, f"no process of the Ray session {node.get_session_dir_path()} found"
    exposed, stats_on = [], []
    for proc in [psutil.Process(), *services, *workers]:  # this driver too: its core worker listens
        try:
            name = " ".join(proc.cmdline())[:80].rstrip()
            wide = [c.laddr for c in proc.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN and not _is_loopback(c.laddr.ip)]
            if name.startswith(SERVE_REPLICA) and len(wide) == 1 and wide[0].ip == "::":
                wide = []  # Serve's own inter-deployment server: see SERVE_REPLICA
            exposed.extend(f"{a.ip}:{a.port} ({proc.pid} {name})" for a in wide)
            # The services (the dashboard's usage reporter among them) run with the env they were started with.
            if proc in services and proc.environ().get("RAY_USAGE_STATS_ENABLED") != "0":
                stats_on.append(f"{proc.pid} {name}")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    assert not exposed, f"Ray listens beyond this machine: {exposed}"
    assert not stats_on, f"Ray processes without RAY_USAGE_STATS_ENABLED=0: {stats_on}"


@pytest.fixture(scope="session", autouse=True)
def ray_stays_on_this_machine() -> None:
    """Set above, before any test module imports Ray; asserted here, and again in ``pytest_runtest_call``."""
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and "RAY_ADDRESS" not in os.environ
    if "ray._private.ray_constants" in sys.modules:
        assert not sys.modules["ray._private.ray_constants"].ENABLE_RAY_CLUSTER, "Ray is not in its loopback mode"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Before each test that runs with Ray connected (whichever fixture started it), Ray is still local only."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        assert_ray_stays_on_this_machine()
    yield


# --- The test process ends without Python's own teardown ---------------------------------------------------------

_session_exit_status: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    _session_exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """End the process with pytest's exit status once the report is written, running the atexit handlers but not
    the interpreter's teardown. This process starts and stops an in-process Ray head once per module, and that
    teardown can then crash in Ray's native threads (ray-project/ray#31145): CI saw "950 passed", then a
    segmentation fault and exit code 139. Nothing the run reports can change after this point."""
    if not _session_exit_status:  # no session ran (a usage error): pytest exits as it does
        return
    import atexit

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_session_exit_status[-1])


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
    metrics_port, http_port = free_ports(2)
    head = RayHead(temp_dir=temp_dir, metrics_port=metrics_port, http_port=http_port)
    start = time.perf_counter()
    for attempt in (1, 2):
        try:
            ray.init(
                num_cpus=RAY_LOGICAL_CPUS,
                include_dashboard=False,
                _node_ip_address=LOOPBACK,
                _temp_dir=temp_dir,
                _metrics_export_port=head.metrics_port,
                _system_config={"metrics_report_interval_ms": 1000},
                log_to_driver=False,
            )
            break
        except Exception as exc:  # Ray waits 30 s for its raylet; a loaded 2-core machine can take longer, once
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
            print(f"\n[Ray head did not start in Ray's 30 s ({exc}); trying once more]")
            ray.shutdown()
    serve.start(http_options={"host": LOOPBACK, "port": head.http_port}, proxy_location="HeadOnly")
    print(f"\n[Ray head + Serve up in {time.perf_counter() - start:.1f} s, HTTP {head.base_url}]")
    try:
        assert_ray_stays_on_this_machine()
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
