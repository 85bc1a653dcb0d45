"""The LLM replica: Ray Serve LLM's ``LLMServer`` with a health check that notices a hung engine
(``kimi_k3_serve.serving.health``), stream batching that never delays the first token (``kimi_k3_serve.serving.streaming``),
and, once the engine is up, the KV cache the replica check predicted against the one vLLM made
(``kimi_k3_serve.checks.kv_prediction``).
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

logger = logging.getLogger(__name__)
follow_serve_log_encoding()  # importing ray.serve.llm just set this process's root logger to JSON

T = TypeVar("T")


class LLMServer(_ServeLLMServer):
    """Keeps Ray Serve LLM's class name, so the deployment keeps its name ``LLMServer:<model id>``."""

    async def start(self) -> None:
        await super().start()
        self._compare_kv_cache()

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
