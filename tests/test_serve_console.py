"""What ``make serve`` shows: text logs from the Serve processes, and the readiness waiter's answer.

- ``kimi_k3_serve.serving.console``: importing our replica modules (which import Ray Serve LLM, which puts a JSON
  formatter on the root logger) leaves the root logger writing text, unless Serve's encoding is JSON. Checked in
  a fresh interpreter, with the real Ray Serve LLM import.
- ``scripts/wait_ready.py``: with nothing listening it says what it waited for and exits 1; the curl example
  names the model. (The ready line itself is checked by hand with ``make serve``: see the README.)
"""

from __future__ import annotations

import json
import logging
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


# --- one line per client error; health probes that say what is true ------------------------------------------------


def _request_error_record(exc: Exception, status: int) -> logging.LogRecord:
    """The record Ray Serve LLM 2.60 makes for a failed request (server_utils._FatalEngineErrorLogHandler.log)."""
    from kimi_k3_serve.serving.console import CLIENT_ERROR_LOGGER

    logger = logging.getLogger(CLIENT_ERROR_LOGGER)
    try:
        raise exc
    except Exception:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 0, "Encountered failure while handling request %s",
                                 ("req-1",), sys.exc_info(), extra={"ray_serve_extra_fields": {"status_code": status}})


def test_ray_serve_llms_own_request_error_log_is_one_line_for_a_client_error(capsys):
    """Through Ray Serve LLM's own code: the logger its failed-request handler writes to is the one the filter is on,
    and what reaches its handlers for a 404 is one line, for a 500 the traceback."""
    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
    from ray.llm._internal.serve.utils import server_utils

    from kimi_k3_serve.serving.console import CLIENT_ERROR_LOGGER, TEXT_FORMAT, install_client_error_lines

    assert server_utils.logger.name == CLIENT_ERROR_LOGGER
    install_client_error_lines()
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(logging.Formatter(TEXT_FORMAT).format(record))

    keep = Keep()
    server_utils.logger.addHandler(keep)
    try:
        server_utils._FatalEngineErrorLogHandler().log(
            OpenAIHTTPException(status_code=404, message="model 'nope' is not served", type="NotFoundError"), "req-1", 404)
        try:
            raise RuntimeError("engine died")
        except RuntimeError as exc:
            server_utils._FatalEngineErrorLogHandler().log(exc, "req-2", 500)
    finally:
        server_utils.logger.removeHandler(keep)
    assert len(seen) == 2
    assert len(seen[0].splitlines()) == 1 and seen[0].endswith("client error: 404 ?: model 'nope' is not served"), seen[0]
    assert "Traceback" in seen[1]


def test_a_client_error_is_one_line_with_status_route_and_reason():
    from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException

    from kimi_k3_serve.serving.console import ClientErrorLine, TEXT_FORMAT, install_client_error_lines

    install_client_error_lines()
    assert not install_client_error_lines()  # once
    record = _request_error_record(OpenAIHTTPException(status_code=404, message="model 'nope' is not served",
                                                       type="NotFoundError"), 404)
    assert ClientErrorLine().filter(record)
    line = logging.Formatter(TEXT_FORMAT).format(record)
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert line.endswith("client error: 404 ?: model 'nope' is not served"), line  # ?: outside a Serve request


def test_a_client_error_from_the_llm_replica_keeps_only_its_last_line():
    from kimi_k3_serve.serving.console import ClientErrorLine, TEXT_FORMAT

    remote = ValueError("ray::LLMServer.chat() (pid=1)\n  File \"x.py\", line 1, in chat\n    raise\n"
                        "ValueError: This model's maximum context length is 1024 tokens")
    record = _request_error_record(remote, 400)
    ClientErrorLine().filter(record)
    line = logging.Formatter(TEXT_FORMAT).format(record)
    assert line.endswith("client error: 400 ?: ValueError: This model's maximum context length is 1024 tokens"), line


def test_a_server_error_keeps_its_traceback():
    from kimi_k3_serve.serving.console import ClientErrorLine, TEXT_FORMAT

    record = _request_error_record(RuntimeError("engine died"), 500)
    ClientErrorLine().filter(record)
    assert "Traceback" in logging.Formatter(TEXT_FORMAT).format(record)


def test_only_the_failure_serve_restarts_on_says_it_will():
    from kimi_k3_serve.serving.health import UNHEALTHY_THRESHOLD, slow_probe_message

    first = slow_probe_message(1, 12.4, 10.0)
    assert first.startswith("health: the vLLM engine has been busy for 12 s (no answer to a no-op request within 10.0 s)")
    assert "1 of 3 in a row" in first and "hung" not in first and "Serve restarts the replica" in first
    for failures in range(1, UNHEALTHY_THRESHOLD):
        assert "hung" not in slow_probe_message(failures, 5, 10.0) and ": Serve restarts" not in slow_probe_message(failures, 5, 10.0)
    last = slow_probe_message(UNHEALTHY_THRESHOLD, 35, 10.0)
    assert "it is hung" in last and last.endswith(f"failure {UNHEALTHY_THRESHOLD} in a row: Serve restarts the replica")
    startup = slow_probe_message(0, 11, 10.0, startup=True)
    assert "hung" not in startup and "restart" not in startup and "not counted as a failure" in startup
