"""The LLM replica: Ray Serve LLM's ``LLMServer`` with a health check that notices a hung engine
(``kimi_k3_serve.serving.health``), stream batching that never delays the first token (``kimi_k3_serve.serving.streaming``),
and, once the engine is up, the KV cache the replica check predicted against the one vLLM made
(``kimi_k3_serve.checks.kv_prediction``).

Under Ray Serve LLM's direct streaming (``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1`` on the Ray nodes) this replica is
the ingress: HAProxy forwards the client's HTTP to vLLM's own app in it, and no ingress replica of ours is in the
path. What our ingress guarantees is then put on that app, in ``__serve_build_asgi_app__`` (Ray Serve LLM's hook
that builds it): the API key (``ApiKeyMiddleware``, the same exact open paths) and the bound on ``n``
(``ChoicesBoundMiddleware``), read from ``experimental_configs[GUARDS_KEY]`` (``kimi_k3_serve.app`` puts the key
file's path there, never the key). Errors are vLLM's own OpenAI-style ones (its exception handlers), with our
handler for a body that does not validate. The key is loaded before the engine starts, so a required key that is
missing stops the replica at once.
"""

from __future__ import annotations

import logging
import time
from typing import Any, AsyncGenerator, List, TypeVar

from kimi_k3_serve.serving.console import before_serve_llm_import, follow_serve_log_encoding

before_serve_llm_import()  # text, not JSON, for what the imports below log (kimi_k3_serve.serving.console)

from ray.serve.llm import LLMServer as _ServeLLMServer

from kimi_k3_serve.serving.health import (
    UNHEALTHY_THRESHOLD,
    EngineNotProgressingError,
    probe_engine,
    probe_timeout_s,
    slow_probe_message,
)
from kimi_k3_serve.checks.kv_prediction import report_kv_cache_prediction
from kimi_k3_serve.serving.streaming import FirstChunkNowBatcher

GUARDS_KEY = "kimi_k3_serve_guards"
"""``LLMConfig.experimental_configs`` key of what vLLM's own app must enforce under direct streaming:
``{"api_key_file", "require_api_key", "max_choices"}`` (the ingress replica's ``ingress_extra_kwargs``)."""

logger = logging.getLogger(__name__)
follow_serve_log_encoding()  # importing ray.serve.llm just set this process's root logger to JSON

T = TypeVar("T")


class LLMServer(_ServeLLMServer):
    """Keeps Ray Serve LLM's class name, so the deployment keeps its name ``LLMServer:<model id>``."""

    _key_digest: bytes | None = None
    _guards_loaded = False

    async def start(self) -> None:
        self._load_guards()  # a required key that is missing: stop before the engine loads
        await super().start()
        self._compare_kv_cache()

    def _load_guards(self) -> dict[str, Any] | None:
        """The direct-streaming guards of this replica's config, with the API key's digest loaded; None when the
        config has none (the ingress path, where our ingress replica enforces them)."""
        guards = self._llm_config.experimental_configs.get(GUARDS_KEY)
        if guards is None or self._guards_loaded:
            return guards
        from kimi_k3_serve.serving.ingress import _digest, ingress_api_key

        key, where = ingress_api_key(guards.get("api_key_file"), bool(guards.get("require_api_key")))
        self._key_digest = _digest(key) if key is not None else None
        self._guards_loaded = True
        logger.info("API key (direct streaming, on vLLM's app): %s",
                    f"required (from {where})" if key is not None else "not configured, routes open")
        return guards

    async def __serve_build_asgi_app__(self):
        from ray.llm._internal.serve.core.server.llm_server import _add_middleware_to_built_app
        from fastapi.exceptions import RequestValidationError

        from kimi_k3_serve.serving.ingress import ApiKeyMiddleware, ChoicesBoundMiddleware, _validation_error

        app = await super().__serve_build_asgi_app__()  # vLLM's app, with Ray Serve LLM's LoRA and model routes
        guards = self._load_guards()
        if guards is None:
            return app
        app.add_exception_handler(RequestValidationError, _validation_error)  # a text/plain body: 400, not 500
        if guards.get("max_choices") is not None:
            _add_middleware_to_built_app(app, ChoicesBoundMiddleware, max_choices=int(guards["max_choices"]))
        if self._key_digest is not None:  # added last: the outermost, so nothing runs before the key is checked
            _add_middleware_to_built_app(app, ApiKeyMiddleware, key_digest=self._key_digest)
        return app

    def _compare_kv_cache(self) -> None:
        """The replica check's KV prediction (``ReplicaPreflight.result.report``: the callback instance Ray
        Serve LLM keeps per process on the LLMConfig, which ran in this replica before the engine) against
        what vLLM made. Never raises."""
        try:
            callback = self._llm_config.get_or_create_callback()
            result = getattr(callback, "result", None)
            engine_client = getattr(self.engine, "_engine_client", None)
            if engine_client is None:
                logger.warning("KV cache: plan vs vLLM not compared: the engine has no client")
                return
            report_kv_cache_prediction(getattr(result, "report", None), engine_client,
                                       self._llm_config.model_id)
        except Exception as exc:  # bookkeeping must never fail the replica
            logger.warning("KV cache: plan vs vLLM not compared: %s: %s", type(exc).__name__, exc)

    _probes_done = 0
    _slow_probes_in_a_row = 0
    _busy_since: float | None = None
    """When the first of the current run of slow probes started (monotonic)."""

    async def check_health(self) -> None:
        await super().check_health()  # a dead engine: vLLM's own errored flag
        engine_client = getattr(self.engine, "_engine_client", None)
        if engine_client is None:  # still starting
            return
        startup, self._probes_done = self._probes_done == 0, self._probes_done + 1
        timeout_s = probe_timeout_s(self._llm_config.deployment_config)
        started = time.monotonic()
        try:
            await probe_engine(engine_client, timeout_s)
        except EngineNotProgressingError:
            self._busy_since = self._busy_since or started
            busy_s = time.monotonic() - self._busy_since
            if startup:  # failing Serve's start-up probe fails the start, with a traceback: a busy engine is not hung
                logger.warning(slow_probe_message(0, busy_s, timeout_s, startup=True))
                return
            self._slow_probes_in_a_row += 1
            message = slow_probe_message(self._slow_probes_in_a_row, busy_s, timeout_s)
            (logger.error if self._slow_probes_in_a_row >= UNHEALTHY_THRESHOLD else logger.warning)(message)
            raise EngineNotProgressingError(message) from None  # Serve counts it; the restart is Serve's, at 3
        self._slow_probes_in_a_row, self._busy_since = 0, None

    def _batch_output_stream(self, generator: AsyncGenerator[T, None]) -> AsyncGenerator[List[T], None]:
        return FirstChunkNowBatcher(generator, interval_ms=self._get_batch_interval_ms()).stream()
