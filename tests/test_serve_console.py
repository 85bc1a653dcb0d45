"""What ``make serve`` shows: text logs from the Serve processes, and the readiness waiter's answer.

- ``kimi_k3_serve.serving.console``: importing our replica modules (which import Ray Serve LLM, which puts a JSON
  formatter on the root logger) leaves the root logger writing text, unless Serve's encoding is JSON. Checked in
  a fresh interpreter, with the real Ray Serve LLM import.
- ``scripts/wait_ready.py``: with nothing listening it says what it waited for and exits 1; the curl example
  names the model. (The ready line itself is checked by hand with ``make serve``: see the README.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

PROBE = """
import logging, sys
import kimi_k3_serve.serving.ingress  # imports ray.serve.llm (root logger -> JSON), then our console fix
print(sorted({type(h.formatter).__name__ for h in logging.getLogger().handlers}), flush=True)
logging.getLogger("kimi_k3_serve.probe").warning("hello from the probe")
"""


def _probe(encoding: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_SERVE_LOG_ENCODING"}
    if encoding:
        env["RAY_SERVE_LOG_ENCODING"] = encoding
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env,
                          cwd=REPO_ROOT)


def test_serve_processes_log_text_by_default():
    done = _probe(None)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['Formatter']"
    line = [line for line in done.stderr.splitlines() if "hello from the probe" in line][-1]
    assert line.startswith("WARNING ") and line.endswith("kimi_k3_serve.probe -- hello from the probe")
    # What the imports logged is text too: no JSON document on stderr at all.
    assert not [line for line in done.stderr.splitlines() if line.lstrip().startswith('{"asctime"')]


def test_vllm_logging_level_reaches_the_lines_vllm_logs_on_import():
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("RAY_SERVE_LOG_ENCODING", None)
    quiet = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, env=env,
                           cwd=REPO_ROOT)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    vllm_lines = [line for line in quiet.stderr.splitlines() if " vllm." in line]
    assert vllm_lines and all(line.startswith(("WARNING ", "ERROR ")) for line in vllm_lines), vllm_lines


def test_serve_processes_keep_json_when_serve_is_asked_for_json():
    done = _probe("JSON")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['JSONFormatter']"
    line = [line for line in done.stderr.splitlines() if "hello from the probe" in line][-1]
    assert json.loads(line)["message"] == "hello from the probe"


def test_wait_ready_gives_up_with_the_stage_it_reached():
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "wait_ready.py"), "--url", "http://127.0.0.1:9",
                           "--timeout-s", "2", "--every-s", "1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert lines[0].startswith("starting: waiting for Serve's HTTP proxy (")
    assert lines[-1].startswith("not ready: http://127.0.0.1:9 did not serve a request within 2 s")


def test_curl_example_names_the_model():
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    try:
        import wait_ready
    finally:
        sys.path.pop(0)
    example = wait_ready.curl_example("http://127.0.0.1:8000", "tiny-llama")
    payload = example.split("-d '", 1)[1].rstrip("'")
    assert json.loads(payload)["model"] == "tiny-llama"
    assert example.startswith("  curl http://127.0.0.1:8000/v1/chat/completions ")
