"""Faults on the served CPU dev app: the engine killed mid-stream, the engine hung, a node's raylet killed.

Each test prints its timings. Health checks run every 2 s with a 20 s timeout here, so the engine probe of
``kimi_k3_serve.serving.health`` gives up after 10 s and Serve acts after 3 failures in a row: a hang is noticed within
``hang_detection_bound_s(2, 20)`` = 36 s, plus the controller's own slack.

The first two tests share one single-node Ray head; the raylet test builds a three-node
``ray.cluster_utils.Cluster`` of its own afterwards (one Ray instance per process at a time).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx
import openai
import psutil
import pytest

from conftest import (
    LOOPBACK,
    RAY_LOGICAL_CPUS,
    REPO_ROOT,
    assert_ray_stays_on_this_machine,
    free_port,
    load_script,
    wait_for_app,
)
from kimi_k3_serve.serving.health import hang_detection_bound_s
from kimi_k3_serve.config.serve_config import load_serve_app

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.slow]

DEV = load_serve_app(REPO_ROOT / "deploy" / "dev.yaml")
MODEL = DEV.args.model.id
HEALTH = {"health_check_period_s": 2, "health_check_timeout_s": 20, "graceful_shutdown_timeout_s": 2}
STREAM_END_BOUND_S = 120.0
RECOVERY_BOUND_S = 600.0


replica_processes = load_script("soak").replica_processes


def _args(**overrides: dict) -> dict:
    """deploy/dev.yaml with fast health checks, as the smallest replica (one CPU worker, no draft): the faults
    are of the engine process, and a small replica starts faster and fits beside other work on the machine."""
    raw = {**DEV.raw_args, "deployment": {**DEV.raw_args.get("deployment", {}), **HEALTH}}
    overrides = {"parallel": {"tensor_parallel_size": 1}, "speculative": None, **overrides}
    for section, values in overrides.items():
        raw[section] = values if values is None else {**raw.get(section, {}), **values}
    return {k: v for k, v in raw.items() if v is not None}


def _engine_core(app: str) -> psutil.Process:
    cores = [p for p in replica_processes(app) if "EngineCore" in " ".join(p.cmdline())]
    assert len(cores) == 1, [" ".join(p.cmdline()) for p in replica_processes(app)]
    return cores[0]


def _replica_actor_pid(app: str, excluding: int | None = None) -> int | None:
    """The app's replica actor process; ``excluding`` skips an old one that may not have exited yet."""
    for process in replica_processes(app):
        if process.pid != excluding and "ServeReplica:" in " ".join(process.cmdline()):
            return process.pid
    return None


@dataclass
class Stream:
    started: threading.Event = field(default_factory=threading.Event)
    """Set on the first token, or when the stream ended without one (``produced_a_token`` says which)."""
    produced_a_token: bool = False
    outcome: str = ""
    ended_at: float | None = None
    unexpected: BaseException | None = None
    """An exception a cut stream does not raise: a bug in the test or the client, never a fault's effect."""


STREAM_CUT_ERRORS = (openai.APIError, httpx.HTTPError)
"""What a stream cut by a fault raises: the server's error status, or the connection or body cut short (openai wraps
most of httpx's, but a body cut mid-stream surfaces as httpx's own RemoteProtocolError/ReadError)."""


def _stream(client: openai.OpenAI, record: Stream) -> None:
    """A long streamed request; records how it ended (``finished:<reason>``, ``cut`` or ``error:<type>``), and any
    other exception as ``unexpected`` for ``_assert_streams_ended`` to fail on."""
    finish = None
    try:
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=800,
            stream=True, extra_body={"ignore_eos": True},
        )
        for chunk in response:
            if chunk.choices and chunk.choices[0].delta.content:
                record.produced_a_token = True
                record.started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        record.outcome = f"finished:{finish}" if finish else "cut"
    except STREAM_CUT_ERRORS as exc:
        record.outcome = f"error:{type(exc).__name__}"
    except Exception as exc:
        record.outcome, record.unexpected = f"unexpected:{type(exc).__name__}", exc
    finally:
        record.ended_at = time.perf_counter()
        record.started.set()


def test_stream_helper_tells_a_cut_stream_from_a_bug():
    """No Ray needed: a refused connection is a cut stream; a client that is not one is a bug, and fails the check."""
    refused = Stream()
    _stream(openai.OpenAI(base_url=f"http://{LOOPBACK}:{free_port()}/v1", api_key="x", max_retries=0), refused)
    assert refused.outcome == "error:APIConnectionError" and refused.unexpected is None and not refused.produced_a_token
    broken = Stream()
    _stream(object(), broken)  # type: ignore[arg-type]  # AttributeError: what a changed client API would raise
    assert broken.outcome == "unexpected:AttributeError"
    with pytest.raises(AssertionError, match="what a cut stream does not"):
        _assert_streams_ended([refused, broken], [], time.perf_counter(), "a test of the helper")


def _start_streams(client: openai.OpenAI, count: int) -> tuple[list[Stream], list[threading.Thread]]:
    records = [Stream() for _ in range(count)]
    threads = [threading.Thread(target=_stream, args=(client, r), daemon=True) for r in records]
    for thread in threads:
        thread.start()
    for record in records:
        assert record.started.wait(180), "a stream never produced a token"
        assert record.produced_a_token, f"a stream ended before its first token: {record.outcome}"
    return records, threads


def _wait_until_serving(client: openai.OpenAI, since: float) -> float:
    """Seconds from ``since`` until a normal request succeeds again."""
    deadline = since + RECOVERY_BOUND_S
    last = ""
    while time.perf_counter() < deadline:
        try:
            result = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4, timeout=30
            )
            if result.usage.completion_tokens > 0:
                return time.perf_counter() - since
        except Exception as exc:
            last = f"{type(exc).__name__}: {str(exc)[:120]}"
        time.sleep(2)
    pytest.fail(f"not serving {RECOVERY_BOUND_S:.0f} s after the fault (last: {last})")


def _assert_streams_ended(records: list[Stream], threads: list[threading.Thread], since: float, what: str) -> None:
    for thread in threads:
        thread.join(timeout=max(0.0, since + STREAM_END_BOUND_S - time.perf_counter()))
    assert not any(t.is_alive() for t in threads), f"a stream still hangs {STREAM_END_BOUND_S:.0f} s after {what}"
    unexpected = [r.unexpected for r in records if r.unexpected is not None]
    assert not unexpected, f"a stream raised what a cut stream does not: {unexpected[0]!r}"
    ends = [r.ended_at - since for r in records]
    print(f"\n[{what}: in-flight streams ended {', '.join(f'{e:.1f} s' for e in ends)} after; "
          f"outcomes {[r.outcome for r in records]}]")
    assert not any(r.outcome == "finished:length" for r in records), "a stream ran to completion through the fault"


def _kill_leftovers(pids: list[int]) -> None:
    """Processes this test stopped or orphaned: resume (so they can exit) and then kill what is left."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            continue
    gone, alive = psutil.wait_procs([p for p in map(_process, pids) if p is not None], timeout=10)
    for process in alive:
        process.kill()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


# --- one node: engine killed, engine hung ---------------------------------------------------------------------------


class TestEngineFaults:
    APP = "dev-faults"

    @pytest.fixture(scope="class")
    def served(self) -> Iterator[openai.OpenAI]:
        import ray
        from ray import serve
        from ray.serve.api import RunTarget

        from kimi_k3_serve.app import build_app

        temp_dir = tempfile.mkdtemp(prefix="kk3-fault-")
        port = free_port()
        ray.init(num_cpus=RAY_LOGICAL_CPUS, include_dashboard=False, _node_ip_address=LOOPBACK, _temp_dir=temp_dir,
                 log_to_driver=False)
        try:
            serve.start(http_options={"host": LOOPBACK, "port": port}, proxy_location="HeadOnly")
            assert_ray_stays_on_this_machine()
            serve.run_many([RunTarget(target=build_app(_args()), name=self.APP, route_prefix="/")],
                           wait_for_applications_running=False)
            print(f"\n[{self.APP} RUNNING after {wait_for_app(self.APP):.1f} s]")
            yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
                shutil.rmtree(temp_dir, ignore_errors=True)

    def test_engine_killed_mid_stream_ends_streams_and_the_replica_is_replaced(self, served):
        old_actor = _replica_actor_pid(self.APP)
        core = _engine_core(self.APP)
        records, threads = _start_streams(served, 3)
        killed_at = time.perf_counter()
        core.send_signal(signal.SIGKILL)
        _assert_streams_ended(records, threads, killed_at, "EngineCore SIGKILL")
        recovered = _wait_until_serving(served, killed_at)
        new_actor = _replica_actor_pid(self.APP)
        print(f"\n[EngineCore killed: serving again {recovered:.1f} s later; replica actor {old_actor} -> {new_actor}]")
        assert new_actor is not None and new_actor != old_actor, "Serve did not replace the replica"
        assert not _alive(core.pid), "the killed EngineCore is still there"

    def test_hung_engine_is_noticed_by_the_health_check_and_replaced(self, served):
        old_actor = _replica_actor_pid(self.APP)
        core = _engine_core(self.APP)
        stopped = [core.pid] + [child.pid for child in core.children(recursive=True)]
        records, threads = _start_streams(served, 2)
        stopped_at = time.perf_counter()
        core.send_signal(signal.SIGSTOP)  # alive, errored flag clear, no progress
        try:
            bound = hang_detection_bound_s(HEALTH["health_check_period_s"], HEALTH["health_check_timeout_s"])
            deadline = stopped_at + bound + 60  # the controller's reconcile loop and the replica's teardown
            while _alive(old_actor):
                assert time.perf_counter() < deadline, f"hung engine not acted on within {bound + 60:.0f} s"
                time.sleep(0.5)
            detected = time.perf_counter() - stopped_at
            _assert_streams_ended(records, threads, stopped_at, "EngineCore SIGSTOP")
            recovered = _wait_until_serving(served, stopped_at)
        finally:
            _kill_leftovers(stopped)
        print(f"\n[EngineCore stopped: old replica gone {detected:.1f} s later (bound {bound:.0f} s + slack), "
              f"serving again after {recovered:.1f} s]")
        assert _replica_actor_pid(self.APP) not in (None, old_actor)


# --- three nodes: the raylet of the replica's node killed -------------------------------------------------------------


class TestNodeLoss:
    APP = "dev-node-loss"

    @pytest.fixture(scope="class")
    def cluster(self) -> Iterator[Any]:
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        temp_dir = tempfile.mkdtemp(prefix="kk3-nodes-")
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 0, "gcs_server_port": free_port(), "temp_dir": temp_dir,
                            "include_dashboard": False, "node_ip_address": LOOPBACK},
        )
        workers = [cluster.add_node(num_cpus=4, node_ip_address=LOOPBACK) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": LOOPBACK, "port": port}, proxy_location="HeadOnly")
        cluster.http_port = port
        cluster.gpu_workers = workers
        try:
            assert_ray_stays_on_this_machine()
            yield cluster
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
                cluster.shutdown()
                shutil.rmtree(temp_dir, ignore_errors=True)

    def test_replica_comes_back_on_the_other_node_when_its_raylet_dies(self, cluster):
        from ray import serve
        from ray.serve.api import RunTarget

        from kimi_k3_serve.app import build_app

        args = _args()  # the smallest replica fits either worker node
        serve.run_many([RunTarget(target=build_app(args), name=self.APP, route_prefix="/")],
                       wait_for_applications_running=False)
        print(f"\n[{self.APP} RUNNING after {wait_for_app(self.APP):.1f} s]")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="none", timeout=120,
                               max_retries=0)
        assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4).usage.completion_tokens > 0

        old_actor = _replica_actor_pid(self.APP)
        raylet_of = {node.all_processes["raylet"][0].process.pid: node for node in cluster.gpu_workers}
        parent = psutil.Process(old_actor).parent()
        assert parent is not None and parent.pid in raylet_of, "the replica is not on a worker node"
        doomed = raylet_of[parent.pid]
        orphans = [p.pid for p in replica_processes(self.APP)]
        killed_at = time.perf_counter()
        cluster.remove_node(doomed, allow_graceful=False)
        try:
            recovered = _wait_until_serving(client, killed_at)
        finally:
            _kill_leftovers([pid for pid in orphans if pid != old_actor])
        # The old replica, orphaned by its raylet, can outlive it for a moment, and can even answer the first request
        # after the fault before Serve has started its successor: wait (within the recovery bound) for the new one.
        new_actor = _replica_actor_pid(self.APP, excluding=old_actor)
        while new_actor is None and time.perf_counter() < killed_at + RECOVERY_BOUND_S:
            time.sleep(2)
            new_actor = _replica_actor_pid(self.APP, excluding=old_actor)
        assert new_actor is not None, f"no new replica actor process {RECOVERY_BOUND_S:.0f} s after the fault"
        assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4).usage.completion_tokens > 0
        (survivor,) = [node for node in cluster.gpu_workers if node is not doomed]
        new_parent = psutil.Process(new_actor).parent()
        print(f"\n[raylet of node {doomed.node_id[:8]} killed: serving again {recovered:.1f} s later, "
              f"replica now under raylet {new_parent.pid}]")
        assert new_parent.pid == survivor.all_processes["raylet"][0].process.pid
