"""Text, not JSON, on the console of the Serve processes that import Ray Serve LLM.

Importing ``ray.serve.llm`` replaces the root logger's handlers of the process with one using Ray's
``JSONFormatter`` (``ray.llm._internal.serve.observability.logging.setup``), whatever the Serve config's
``logging_config`` says: that config only reaches Serve's own ``ray.serve`` logger. So our lines (preflight,
replica check, health) and every library logging through the root logger came out as JSON documents.
:func:`follow_serve_log_encoding` keeps that handler and its Ray/Serve context filters but gives it Serve's
text layout, unless Serve's default encoding is JSON (``RAY_SERVE_LOG_ENCODING=JSON`` on the nodes), for
clusters that ship logs to a JSON pipeline.

A rejected client request (unknown model, negative ``max_tokens``, a prompt that is too long) is the client's
mistake, not the server's: Ray Serve LLM logs each with its full traceback. :class:`ClientErrorLine` makes that one
line (status, route, reason); server errors (5xx) keep their traceback.
"""

from __future__ import annotations

import logging
import os
import traceback

TEXT_FORMAT = "%(levelname)s %(asctime)s %(name)s -- %(message)s"
"""The layout of Serve's own text lines (``INFO 2026-11-30 14:25:26,204 serve 8307 -- ...``), with the logger's name."""


def serve_log_encoding(environ: dict[str, str] | None = None) -> str:
    """Serve's default log encoding: ``RAY_SERVE_LOG_ENCODING`` (TEXT when unset), as ``LoggingConfig`` reads it."""
    return (os.environ if environ is None else environ).get("RAY_SERVE_LOG_ENCODING", "TEXT").upper()


def before_serve_llm_import(environ: dict[str, str] | None = None) -> int:
    """Run Ray Serve LLM's root-logger setup now, then :func:`follow_serve_log_encoding`, so the lines logged while
    ``ray.serve.llm`` imports vLLM are text too. The setup module is internal to Ray (2.60) and imports no vLLM;
    if a later Ray moves it, nothing happens here and the call after the import still converts the handler."""
    try:
        import ray.llm._internal.serve.observability  # noqa: F401  (sets the JSON handler on the root logger)
    except ImportError:
        return 0
    return follow_serve_log_encoding(environ)


def follow_serve_log_encoding(environ: dict[str, str] | None = None) -> int:
    """Give the root logger's JSON handlers a text formatter unless Serve's encoding is JSON.

    Also applies ``VLLM_LOGGING_LEVEL``, when set, to the ``vllm`` loggers: in these processes vLLM's import-time
    lines reach the console through the root logger, which vLLM's own logging setup never sees.

    Returns how many handlers changed. Call it after ``ray.serve.llm`` has been imported."""
    env = os.environ if environ is None else environ
    vllm_level = env.get("VLLM_LOGGING_LEVEL", "").upper()
    if vllm_level in logging._nameToLevel:
        logging.getLogger("vllm").setLevel(vllm_level)
    install_client_error_lines()
    if serve_log_encoding(environ) == "JSON":
        return 0
    changed = 0
    for handler in logging.getLogger().handlers:
        formatter = handler.formatter
        if formatter is not None and type(formatter).__name__ == "JSONFormatter":
            handler.setFormatter(logging.Formatter(TEXT_FORMAT))
            changed += 1
    return changed


CLIENT_ERROR_LOGGER = "ray.serve.ray.llm._internal.serve.utils.server_utils"
"""Where Ray Serve LLM 2.60 logs every failed request (``server_utils._FatalEngineErrorLogHandler.log``: a warning with
``exc_info`` for a status below 500, the status in ``ray_serve_extra_fields``). Its module logger comes from
``observability.logging.get_logger``, which puts ``ray.serve.`` before the module's name."""
REASON_CHARS = 300


class ClientErrorLine(logging.Filter):
    """Turns the traceback Ray Serve LLM logs for a 4xx request into ``client error: STATUS ROUTE: REASON``."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = (getattr(record, "ray_serve_extra_fields", None) or {}).get("status_code")
        if record.exc_info and isinstance(status, int) and 400 <= status < 500:
            record.msg, record.args = "client error: %s %s: %s", (status, _current_route(), client_error_reason(record.exc_info[1]))
            record.exc_info = record.exc_text = None
        return True


def client_error_reason(exc: BaseException | None) -> str:
    """What the client got wrong, on one line: the HTTP error's detail or message, else the exception's last line
    (a ``RayTaskError`` from the LLM replica carries the remote traceback above it)."""
    for attribute in ("detail", "message"):
        text = getattr(exc, attribute, None)
        if isinstance(text, str) and text:
            break
    else:
        lines = traceback.format_exception_only(type(exc), exc)[-1].strip().splitlines() if exc is not None else []
        text = next((line for line in reversed(lines) if line and not line.startswith(" ")), type(exc).__name__)
    text = " ".join(text.split())
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def _current_route() -> str:
    """The request's route from Serve's request context; ``?`` outside a request."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().route or "?"
    except Exception:  # no Ray, or another Ray's internals: the line still says status and reason
        return "?"


def install_client_error_lines() -> bool:
    """Put :class:`ClientErrorLine` on Ray Serve LLM's request-error logger, once; True when it was added now."""
    logger = logging.getLogger(CLIENT_ERROR_LOGGER)
    if any(isinstance(f, ClientErrorLine) for f in logger.filters):
        return False
    logger.addFilter(ClientErrorLine())
    return True
