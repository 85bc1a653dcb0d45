"""``serve run deploy/dev.yaml``, Ray's own CLI as a user runs it (``make serve``'s last step), answers a request.

A Ray head of this test's own (``ray start --head`` bound to 127.0.0.1 only, usage stats off), then
``serve run`` on the shipped dev config -- its HTTP port moved to a free one, nothing else changed -- and a chat
completion through the stock ``openai`` client. Ctrl-C stops ``serve run``, as a user stops it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import pytest
import yaml

from conftest import (
    LOOPBACK, RAY_LOGICAL_CPUS, REPO_ROOT, assert_ray_stays_on_this_machine, free_port, http_status, stop_process_group,
    wait_for_app,
)

pytestmark = [pytest.mark.e2e, pytest.mark.ray]
READY_TIMEOUT_S = 900


@pytest.fixture
def ray_cli_head(tiny_models):
    """``ray start --head --block`` of this test's own; yields (address, environment for Ray's CLIs, temp dir)."""
    temp_dir = tempfile.mkdtemp(prefix="kk3-cli-")
    port = free_port()
    # No token auth: this process joins the head too, and Ray reads its auth settings once per process, so a
    # head with a token fails here after any earlier test's Ray. Bound to loopback, it is not reachable from outside.
    # Said outright: with RAY_AUTH_MODE unset, Ray 2.60 turns token auth on wherever ~/.ray/auth_token exists.
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "RAY_AUTH_MODE": "disabled"}
    log = open(Path(temp_dir) / "ray-head.log", "w")
    head = subprocess.Popen(
        [sys.executable, "-c", "from ray.scripts.scripts import main; main()", "start", "--head", "--block",
         "--port", str(port), "--node-ip-address", LOOPBACK, "--num-cpus", str(RAY_LOGICAL_CPUS), "--temp-dir", temp_dir,
         "--include-dashboard", "false", "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        started = time.monotonic()
        while "Ray runtime started" not in (Path(temp_dir) / "ray-head.log").read_text(errors="replace"):
            assert head.poll() is None, (Path(temp_dir) / "ray-head.log").read_text()[-3000:]
            assert time.monotonic() - started < 120, "the Ray head did not start in 120 s"
            time.sleep(1)
        yield f"{LOOPBACK}:{port}", env, temp_dir
    finally:
        stop_process_group(head, signal.SIGTERM)  # `ray start --block` stops its own processes on SIGTERM
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_serve_run_dev_yaml_answers_a_chat_request(ray_cli_head, tmp_path):
    import ray

    address, env, temp_dir = ray_cli_head
    document = yaml.safe_load((REPO_ROOT / "deploy" / "dev.yaml").read_text())
    http_port = free_port()
    document["http_options"]["port"] = http_port  # the shipped file, on a port no other test uses
    config = tmp_path / "dev.yaml"
    config.write_text(yaml.safe_dump(document, sort_keys=False))
    base = f"http://{LOOPBACK}:{http_port}"
    model = document["applications"][0]["args"]["model"]["id"]

    log_path = tmp_path / "serve-run.log"
    started = time.monotonic()
    ray.init(address=address, log_to_driver=False)  # to follow Serve's own status of the application
    with open(log_path, "w") as log:
        serve = subprocess.Popen([sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run", str(config)],
                                 stdout=log, stderr=subprocess.STDOUT, env={**env, "RAY_ADDRESS": address},
                                 cwd=REPO_ROOT, start_new_session=True)
        try:
            while http_status(f"{base}/-/routes") != 200:  # serve run has started Serve and is deploying
                assert serve.poll() is None, f"serve run exited with {serve.returncode}: {log_path.read_text()[-3000:]}"
                assert time.monotonic() - started < READY_TIMEOUT_S, log_path.read_text()[-3000:]
                time.sleep(3)
            wait_for_app(document["applications"][0]["name"], READY_TIMEOUT_S)
            print(f"\n[serve run deploy/dev.yaml RUNNING after {time.monotonic() - started:.0f} s]")
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, max_retries=0)
            assert [m.id for m in client.models.list().data] == [model]
            chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                                  max_tokens=8)
            assert chat.choices[0].message.content and chat.usage.completion_tokens >= 1
            assert_ray_stays_on_this_machine()
        finally:
            ray.shutdown()
            stop_process_group(serve, signal.SIGINT)  # Ctrl-C: serve run deletes its applications and exits
