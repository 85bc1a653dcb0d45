"""Bad requests against the served dev app: each gets an OpenAI-style error with a 4xx status, and a normal
request succeeds right after every one of them. A client that goes away mid-stream leaves nothing running.

One dev app (deploy/dev.yaml: TP=2 + EAGLE3, max_model_len 1024) serves the whole module.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from urllib.parse import urlparse

import openai
import pytest

from conftest import REPO_ROOT, http_json
from kimi_k3_serve.config.serve_config import load_serve_app

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

DEV = load_serve_app(REPO_ROOT / "deploy" / "dev.yaml")
MODEL = DEV.args.model.id
MAX_MODEL_LEN = DEV.args.limits.max_model_len
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def dev_url(deploy_app) -> str:
    return deploy_app(DEV.raw_args, "dev-bad-requests")


@pytest.fixture(scope="module")
def client(dev_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{dev_url}/v1", api_key="none", timeout=120, max_retries=0)


def _serves_normally(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4)
    assert result.choices[0].message.content is not None and result.usage.completion_tokens > 0


def _post(url: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    return http_json(url, body, timeout=120, content_type=content_type)


LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 400  # well over 1024 tokens

BAD_REQUESTS = {
    "invalid-json": ("chat/completions", b'{"model": "tiny-llama", "messages": ['),
    "json-array-body": ("chat/completions", b"[1, 2, 3]"),
    "empty-body": ("chat/completions", b""),
    "messages-a-string": ("chat/completions", {**CHAT, "messages": "Hi"}),
    "messages-missing": ("chat/completions", {"model": MODEL, "max_tokens": 4}),
    "max-tokens-text": ("chat/completions", {**CHAT, "max_tokens": "ten"}),
    "max-tokens-negative": ("chat/completions", {**CHAT, "max_tokens": -1}),
    "temperature-text": ("chat/completions", {**CHAT, "temperature": "hot"}),
    "temperature-negative": ("chat/completions", {**CHAT, "temperature": -1}),
    "unknown-model": ("chat/completions", {**CHAT, "model": "no-such-model"}),
    "model-not-a-string": ("chat/completions", {**CHAT, "model": 42}),
    "max-tokens-beyond-context": ("chat/completions", {**CHAT, "max_tokens": MAX_MODEL_LEN * 10}),
    "prompt-longer-than-context": ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONG_PROMPT}]}),
    "completion-prompt-too-long": ("completions", {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4}),
    "completion-prompt-a-dict": ("completions", {"model": MODEL, "prompt": {"a": 1}, "max_tokens": 4}),
    "n-huge": ("chat/completions", {**CHAT, "n": 100_000}),
    "n-zero": ("chat/completions", {**CHAT, "n": 0}),
    "logprobs-huge": ("completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "logprobs": 10_000}),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_gets_an_openai_4xx_and_the_server_keeps_serving(name, dev_url, client):
    path, payload = BAD_REQUESTS[name]
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    start = time.perf_counter()
    status, answer = _post(f"{dev_url}/v1/{path}", body)
    took = time.perf_counter() - start
    assert 400 <= status < 500, (status, answer)
    error = answer.get("error")
    assert isinstance(error, dict), answer
    assert isinstance(error.get("message"), str) and error["message"], answer
    assert error.get("type"), answer
    print(f"\n  {name}: {status} {error['type']} in {took:.2f} s: {error['message'][:140]}")
    _serves_normally(client)


def test_n_is_bounded_by_max_num_seqs(dev_url, client):
    """The ingress refuses more choices than one engine batch (args.limits.max_num_seqs, 8 in deploy/dev.yaml).
    vLLM itself refuses only n > 16384 (VLLM_MAX_N_SEQUENCES), so 9 and 16384 are refused by the bound alone."""
    bound = DEV.args.limits.max_num_seqs
    assert bound == 8
    sampled = {**CHAT, "temperature": 1.0, "max_tokens": 2}  # vLLM wants n = 1 with greedy sampling
    for n in (bound + 1, 16384):
        status, answer = _post(f"{dev_url}/v1/chat/completions", json.dumps({**sampled, "n": n}).encode())
        assert status == 400, (n, status, answer)
        assert f"n = {n} is more choices than one request may ask for here: at most {bound}" in answer["error"]["message"]
    status, answer = _post(f"{dev_url}/v1/chat/completions", json.dumps({**sampled, "n": bound}).encode())
    assert status == 200, (status, answer)
    assert len(answer["choices"]) == bound
    _serves_normally(client)


def test_body_that_is_not_json_is_a_400_not_a_500(dev_url, client):
    """A JSON body sent as ``text/plain`` reaches validation as bytes; Ray Serve LLM's handler answered 500."""
    status, answer = _post(f"{dev_url}/v1/chat/completions", json.dumps(CHAT).encode(), content_type="text/plain")
    assert status == 400, (status, answer)
    assert answer["error"]["code"] == "invalid_parameter" and answer["error"]["message"]
    _serves_normally(client)


def test_stock_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT["messages"], max_tokens=4)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4)
    assert info.value.status_code == 400
    _serves_normally(client)


def _running_requests(metrics_port: int) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    values = [float(m.group(1)) for m in re.finditer(r"^ray_vllm_num_requests_running(?:\{[^}]*\})? ([0-9.eE+-]+)$",
                                                     text, flags=re.MULTILINE)]
    return sum(values) if values else None


def test_client_that_disconnects_mid_stream_leaves_nothing_running(dev_url, client, ray_head):
    """Read the first chunks of long streams, then drop the connections; the engine must abort the requests
    (vLLM's ``num_requests_running`` back to 0) and keep answering."""
    target = urlparse(dev_url)
    body = json.dumps({**CHAT, "max_tokens": 900, "stream": True, "ignore_eos": True}).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {target.hostname}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    sockets = []
    for _ in range(3):
        conn = socket.create_connection((target.hostname, target.port), timeout=120)
        conn.sendall(request)
        received = b""
        while b"data:" not in received:  # the stream has started: tokens are being generated
            chunk = conn.recv(4096)
            assert chunk, received
            received += chunk
        sockets.append(conn)
    deadline = time.monotonic() + 60
    before = None
    while time.monotonic() < deadline:  # the engine reports them running: there is something to abort
        before = _running_requests(ray_head.metrics_port)
        if before:
            break
        time.sleep(1)
    assert before and before >= 1, f"the streams never showed as running ({before})"
    dropped = time.perf_counter()
    for conn in sockets:
        conn.close()

    deadline = time.monotonic() + 120
    running = None
    while time.monotonic() < deadline:
        running = _running_requests(ray_head.metrics_port)
        if running == 0:
            break
        time.sleep(1)
    print(f"\n[3 streams of 900 tokens dropped while {before:g} ran; engine running {running} request(s) "
          f"{time.perf_counter() - dropped:.1f} s later]")
    assert running == 0, f"the engine still runs {running} request(s) of clients that left"
    _serves_normally(client)
