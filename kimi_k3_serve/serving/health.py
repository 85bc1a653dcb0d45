"""A health check that notices a vLLM engine that stopped making progress, not only one that died.

Ray Serve LLM's ``LLMServer.check_health`` asks vLLM's ``AsyncLLM.check_health``, which only reads the
``errored`` flag set when the EngineCore process exits. An engine that hangs -- an EngineCore or worker
process stopped, a collective that never returns -- keeps that flag clear and the replica keeps taking
requests that never finish. So the check also sends the engine core a utility request (``is_sleeping``, a
no-op it answers between two engine steps) and fails when no answer comes within the probe timeout.

An idle engine answers at once even when a worker is stuck, since it has no step to run: only an engine
that has work and does not move is called hung. The probe timeout is half of the deployment's
``health_check_timeout_s`` (``args.deployment``), so the probe fails with its own message before Serve's
timeout fires. Serve restarts a replica after ``REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD`` (3) failures in a
row, so a hang is acted on within about ``3 x (health_check_period_s + health_check_timeout_s / 2)``.

What the console says (:func:`slow_probe_message`): a slow probe is one warning saying how long the engine has been
busy; only the failure that makes Serve restart the replica (the third in a row) says so. The replica's first probe,
which Serve runs as part of starting it, never fails on a slow answer: a failure there is a failed start with a
traceback, and an engine that just loaded is busy, not hung (vLLM's own errored flag is still checked).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

PROBE_SHARE_OF_HEALTH_TIMEOUT = 0.5
DEFAULT_HEALTH_CHECK_TIMEOUT_S = 30.0  # Ray Serve's default
UNHEALTHY_THRESHOLD = 3  # ray.serve._private.constants.REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD


class EngineNotProgressingError(RuntimeError):
    """The engine holds work but did not answer a no-op request in time."""


def probe_timeout_s(deployment_config: dict[str, Any]) -> float:
    return PROBE_SHARE_OF_HEALTH_TIMEOUT * float(
        deployment_config.get("health_check_timeout_s") or DEFAULT_HEALTH_CHECK_TIMEOUT_S
    )


def hang_detection_bound_s(health_check_period_s: float, health_check_timeout_s: float) -> float:
    """Longest time from a hang to Serve marking the replica unhealthy (before the controller's own slack)."""
    return UNHEALTHY_THRESHOLD * (health_check_period_s + PROBE_SHARE_OF_HEALTH_TIMEOUT * health_check_timeout_s)


async def probe_engine(engine_client: Any, timeout_s: float) -> float:
    """Seconds the engine core took to answer a no-op utility request; raises when it does not in time."""
    start = time.perf_counter()
    try:
        await asyncio.wait_for(engine_client.is_sleeping(), timeout=timeout_s)
    except asyncio.TimeoutError:
        raise EngineNotProgressingError(f"the vLLM engine core did not answer a no-op request within {timeout_s:.1f} s") from None
    return time.perf_counter() - start


def slow_probe_message(failures_in_a_row: int, busy_s: float, timeout_s: float, *, startup: bool = False) -> str:
    """One line for a probe that got no answer within ``timeout_s``; the engine has been busy for ``busy_s``."""
    head = f"health: the vLLM engine has been busy for {busy_s:.0f} s (no answer to a no-op request within {timeout_s:.1f} s)"
    if startup:
        return f"{head}; the replica's first probe, at start: not counted as a failure"
    if failures_in_a_row < UNHEALTHY_THRESHOLD:
        return f"{head}; health check failure {failures_in_a_row} of {UNHEALTHY_THRESHOLD} in a row before Serve restarts the replica"
    return (f"{head}: it is hung (a stopped EngineCore or worker process, or a stuck collective); health check failure "
            f"{failures_in_a_row} in a row: Serve restarts the replica")
