"""The optional API key: where it is read from, what the config refuses, and the dev app served with one.

The middleware and the key loader are checked in-process (Starlette's test client over a small FastAPI app);
then the dev app (deploy/dev.yaml) is served through Ray Serve with ``args.security.api_key_file`` and asked
over real HTTP by the stock ``openai`` client.
"""

from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest

from conftest import REPO_ROOT, http_json
from kimi_k3_serve.config.args import load_args
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.config.serve_config import load_serve_app

DEV = load_serve_app(REPO_ROOT / "deploy" / "dev.yaml")
MODEL = DEV.args.model.id
KEY = "kk3-test-key-7f3a9c1e5b2d4f6a8c0e"
MINIMAL = {"model": {"id": "m", "source": "org/m"}, "limits": {"max_model_len": 16}}


# --- the key loader ---------------------------------------------------------------------------------------------


def test_key_precedence_file_then_file_env_then_env(tmp_path):
    from kimi_k3_serve.serving.ingress import load_api_key

    args_file, env_file = tmp_path / "args.key", tmp_path / "env.key"
    args_file.write_text("from-args-file\n")
    env_file.write_text("from-env-file")
    environ = {"KIMI_K3_SERVE_API_KEY_FILE": str(env_file), "KIMI_K3_SERVE_API_KEY": "from-env"}
    assert load_api_key(str(args_file), environ) == ("from-args-file", f"file {args_file}")
    assert load_api_key(None, environ) == ("from-env-file", f"file {env_file}")
    assert load_api_key(None, {"KIMI_K3_SERVE_API_KEY": "from-env"}) == ("from-env", "$KIMI_K3_SERVE_API_KEY")
    assert load_api_key(None, {}) == (None, "none")


@pytest.mark.parametrize("content", ["", "  \n", "two words", "caf\u00e9"])
def test_bad_key_file_names_the_field_and_never_echoes_the_content(tmp_path, content):
    from kimi_k3_serve.serving.ingress import load_api_key

    path = tmp_path / "key"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_api_key(str(path), {})
    assert info.value.field == "args.security.api_key_file"
    if content.strip():
        assert content.strip() not in str(info.value)


def test_unreadable_key_file_is_a_config_error(tmp_path):
    from kimi_k3_serve.serving.ingress import load_api_key

    with pytest.raises(ConfigError, match="args.security.api_key_file.*readable file"):
        load_api_key(str(tmp_path / "missing.key"), {})
    with pytest.raises(ConfigError, match=r"\$KIMI_K3_SERVE_API_KEY_FILE"):
        load_api_key(None, {"KIMI_K3_SERVE_API_KEY_FILE": str(tmp_path)})  # a folder


# --- the config refuses literal keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"security": {"api_key": KEY}}, "args.security.api_key"),
        ({"security": {"token": KEY}}, "args.security.token"),
        ({"security": {"whatever": KEY}}, "args.security.whatever"),
        ({"engine_kwargs": {"api_key": KEY}}, "args.engine_kwargs.api_key"),
        ({"runtime_env": {"env_vars": {"KIMI_K3_SERVE_API_KEY": KEY}}}, "args.runtime_env.env_vars.KIMI_K3_SERVE_API_KEY"),
        ({"runtime_env": {"env_vars": {"VLLM_API_KEY": KEY}}}, "args.runtime_env.env_vars.VLLM_API_KEY"),
    ],
)
def test_a_literal_key_in_the_config_is_refused_without_echoing_it(extra, field):
    with pytest.raises(ConfigError) as info:
        load_args({**MINIMAL, **extra})
    assert info.value.field == field
    assert KEY not in str(info.value)
    assert "<redacted>" in str(info.value)


def test_required_key_with_none_configured_stops_the_ingress(tmp_path):
    from kimi_k3_serve.serving.ingress import API_KEY_ENV, ingress_api_key

    with pytest.raises(ConfigError) as info:
        ingress_api_key(None, True, environ={})
    assert info.value.field == "args.security.require_api_key"
    message = str(info.value)
    assert "no API key found by the ingress replica" in message and "\n" not in message
    assert all(place in message for place in ("args.security.api_key_file", "$KIMI_K3_SERVE_API_KEY_FILE",
                                               "$KIMI_K3_SERVE_API_KEY (")), message
    assert ingress_api_key(None, False, environ={}) == (None, "none")  # not required: the routes stay open
    assert ingress_api_key(None, True, environ={API_KEY_ENV: KEY}) == (KEY, f"${API_KEY_ENV}")


def test_security_section_accepts_a_key_file_and_the_requirement():
    args = load_args({**MINIMAL, "security": {"api_key_file": "/run/secrets/kk3", "require_api_key": True}})
    assert args.security.api_key_file == "/run/secrets/kk3"
    assert args.security.require_api_key is True
    assert load_args(MINIMAL).security.api_key_file is None


# --- the middleware, in-process ----------------------------------------------------------------------------------


@pytest.fixture
def guarded_client():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kimi_k3_serve.serving.ingress import ApiKeyMiddleware, _digest

    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"data": []}

    @app.post("/v1/chat/completions")
    def chat():
        return {"ok": True}

    @app.get("/health")
    def health():
        return {}

    @app.get("/v1/models/{model:path}")  # as Ray Serve LLM's ingress: it also answers /v1/models/<id>/health
    def model_card(model: str):
        return {"id": model}

    @app.post("/tokenize")
    def tokenize():
        return {"tokens": []}

    app.add_middleware(ApiKeyMiddleware, key_digest=_digest(KEY))
    return TestClient(app)


def _is_openai_401(response) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key" and error["message"]


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer wrong"},
     {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"}, {"X-Api-Key": KEY}],
)
def test_missing_or_wrong_key_is_401_in_openai_format(guarded_client, headers):
    _is_openai_401(guarded_client.get("/v1/models", headers=headers))
    _is_openai_401(guarded_client.post("/v1/chat/completions", json={}, headers=headers))


def test_right_key_passes_and_health_stays_open(guarded_client):
    assert guarded_client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert guarded_client.get("/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200
    assert guarded_client.get("/health").status_code == 200
    assert guarded_client.options("/v1/models").status_code != 401  # CORS preflight carries no credentials


@pytest.mark.parametrize(
    "path",
    ["/v1/models/m/health", "/v1/models/m", "/v1/health", "/health/", "//health", "/x/health", "/tokenize", "/docs",
     "/openapi.json", "/-/healthz/x", "/-/routes/"],
)
def test_every_path_but_the_listed_open_ones_needs_the_key(guarded_client, path):
    """No suffix or prefix match: /v1/models/<id>/health is a model route and gets a 401 like the rest."""
    response = guarded_client.post(path, json={}) if path == "/tokenize" else guarded_client.get(path)
    _is_openai_401(response)


def test_the_open_paths_are_an_exact_list():
    from kimi_k3_serve.serving.ingress import OPEN_PATHS

    assert OPEN_PATHS == {"/health", "/-/healthz", "/-/routes"}


def test_wrong_key_is_not_echoed(guarded_client):
    response = guarded_client.get("/v1/models", headers={"Authorization": "Bearer sk-guess-123456"})
    assert "sk-guess-123456" not in response.text


# --- the dev app served with a key file -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secrets") / "api.key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def keyed_url(deploy_app, key_file) -> str:
    args = {**DEV.raw_args, "security": {"api_key_file": str(key_file), "require_api_key": True}}
    return deploy_app(args, "dev-keyed")


@pytest.mark.e2e
@pytest.mark.ray
def test_served_app_requires_the_key_on_v1_and_keeps_health_open(keyed_url):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).encode()
    for path, payload in (("/v1/models", None), (f"/v1/models/{MODEL}/health", None), ("/v1/chat/completions", body),
                          ("/v1/completions", body)):
        status, answer = http_json(f"{keyed_url}{path}", payload)
        assert status == 401, (path, status, answer)
        assert answer["error"]["code"] == "invalid_api_key"

    request = urllib.request.Request(f"{keyed_url}/v1/models", headers={"Authorization": "Bearer wrong-key"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 401

    for path in ("/-/healthz", "/-/routes"):
        with urllib.request.urlopen(f"{keyed_url}{path}", timeout=30) as response:
            assert response.status == 200, path
    # README "Security": /health is open too. Serve LLM's ingress has no such route: not found, but never a 401.
    status, answer = http_json(f"{keyed_url}/health")
    assert status != 401 and status < 500, (status, answer)

    good = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=KEY, timeout=120, max_retries=0)
    start = time.perf_counter()
    result = good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8)
    print(f"\n[chat with the right key in {time.perf_counter() - start:.2f} s]")
    assert result.choices[0].message.content
    assert [m.id for m in good.models.list().data] == [MODEL]
    streamed = list(good.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True))
    assert any(c.choices and c.choices[0].finish_reason for c in streamed)

    bad = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key="wrong-key", timeout=60, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.status_code == 401


@pytest.mark.e2e
@pytest.mark.ray
def test_the_key_never_reaches_serve_config_or_logs(keyed_url, key_file, ray_head):
    """The key lives in a file only: not in what Serve stores (its checkpoints in the GCS) and shows (``serve
    status``'s details), not in any Ray log of the session. Each search is shown to see what it should: the key
    file's path is in Serve's checkpoint, and the ingress replica's "API key: required" line is in the logs."""
    from pathlib import Path

    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list
    from ray.serve._private.storage.kv_store import SERVE_INTERNAL_KV_NAMESPACE
    from ray.serve.context import _get_global_client

    stored = b"".join(_internal_kv_get(k, namespace=SERVE_INTERNAL_KV_NAMESPACE) or b""
                      for k in _internal_kv_list(b"", namespace=SERVE_INTERNAL_KV_NAMESPACE))
    assert str(key_file).encode() in stored, "the search does not see the ingress's init arguments"
    assert KEY.encode() not in stored
    assert KEY not in json.dumps(_get_global_client().get_serve_details(), default=str)

    hits, announced = [], False
    for path in Path(ray_head.temp_dir).rglob("*"):
        if path.is_file() and path.stat().st_size < 50 * 2**20:
            try:
                text = path.read_text(errors="ignore")
            except OSError:
                continue
            announced = announced or f"API key: required (from file {key_file})" in text
            if KEY in text:
                hits.append(str(path))
    assert announced, "the ingress replica's log was not found among the session logs"
    assert not hits, f"the API key appears in {hits}"


@pytest.mark.e2e
@pytest.mark.ray
def test_a_key_in_a_deployed_serve_config_is_refused(ray_head):
    """A Serve config (``serve deploy`` / ``serve run CONFIG``) that carries the key itself is refused by the build
    Serve's controller runs for it, and the refusal names the field, not the key."""
    import ray
    from ray.serve._private.application_state import build_serve_application
    from ray.serve.schema import LoggingConfig

    args = {**DEV.raw_args, "runtime_env": {"env_vars": {"KIMI_K3_SERVE_API_KEY": KEY}}}
    build = build_serve_application.options(max_retries=0).remote(
        "kimi_k3_serve.app:build_app", "v1", "dev-literal-key", args, LoggingConfig(), None, {}, {}, {})
    with pytest.raises(ray.exceptions.RayTaskError) as info:  # what Serve shows as the app's DEPLOY_FAILED message
        ray.get(build, timeout=300)
    error = str(info.value)
    assert "ConfigError" in error and "args.runtime_env.env_vars.KIMI_K3_SERVE_API_KEY" in error, error[-2000:]
    assert KEY not in error
