"""The OpenAI ingress: Ray Serve LLM's ``OpenAiIngress`` with OpenAI-style errors for unknown models and an
optional API key.

Ray Serve LLM 2.60 raises FastAPI's ``HTTPException`` when a request names a model it does not serve. FastAPI
answers that itself with ``{"detail": ...}`` before Serve LLM's error middleware can turn it into OpenAI's
``{"error": {"message", "type", "code"}}``, so OpenAI clients see a body they cannot parse. Raising Serve LLM's
own ``OpenAIHTTPException`` instead lets that middleware format it like every other error.

The API key (OpenAI's ``Authorization: Bearer <key>``) is read inside the ingress replica, from
``args.security.api_key_file``, else the file named by ``$KIMI_K3_SERVE_API_KEY_FILE``, else
``$KIMI_K3_SERVE_API_KEY`` -- never from the Serve config itself, so it is not stored in Serve's checkpoints or
shown by ``serve status``. Ray Serve LLM has no authentication of its own, so an ASGI middleware is put in
front of its FastAPI app when the replica wraps it. Serve's own health routes (``/-/healthz``, ``/-/routes``)
are answered by the proxy and never reach it; ``/health`` stays open as well. These are the only open paths, matched
exactly: ``/v1/models/{model:path}`` answers ``/v1/models/<id>/health`` too, so a suffix match opened a model route.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional

from kimi_k3_serve.serving.console import before_serve_llm_import, follow_serve_log_encoding

before_serve_llm_import()  # text, not JSON, for what the imports below log (kimi_k3_serve.serving.console)

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
from ray.serve.llm.ingress import OpenAiIngress
from starlette.responses import JSONResponse

from kimi_k3_serve.errors import ConfigError

logger = logging.getLogger(__name__)
follow_serve_log_encoding()  # importing ray.serve.llm just set this process's root logger to JSON

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError"}

API_KEY_ENV = "KIMI_K3_SERVE_API_KEY"
API_KEY_FILE_ENV = "KIMI_K3_SERVE_API_KEY_FILE"
OPEN_PATHS = frozenset({"/health", "/-/healthz", "/-/routes"})
"""Every path the ingress answers without the key, matched exactly (no prefix, no suffix, no trailing slash)."""
CHOICES_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
"""The routes whose body may ask for ``n`` choices (direct streaming: checked by ``ChoicesBoundMiddleware``)."""


def too_many_choices(n: Any, max_choices: int | None) -> str | None:
    """The 400's message when ``n`` asks for more choices than one request may (the engine's batch), else None.
    vLLM accepts any n >= 1 and fans one request out into n sequences: n = 100000 would occupy the engine for
    hours while every other client waits."""
    if max_choices is None or not isinstance(n, int) or isinstance(n, bool) or n <= max_choices:
        return None
    return (f"n = {n} is more choices than one request may ask for here: at most {max_choices} "
            "(the engine's batch, args.limits.max_num_seqs)")


def _openai_error(exc: HTTPException) -> OpenAIHTTPException:
    return OpenAIHTTPException(
        status_code=exc.status_code,
        message=str(exc.detail),
        type=_ERROR_TYPES.get(exc.status_code, "InvalidRequestError"),
    )


def _checked_key(text: str, field: str, where: str) -> str:
    key = text.strip()
    if not key or any(not ("!" <= ch <= "~") for ch in key):
        # The value itself is never echoed: it is (or is close to) a secret.
        raise ConfigError(field, where, "a non-empty key of printable ASCII characters without spaces")
    return key


def load_api_key(api_key_file: str | None, environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """``(key, where it came from)``; ``(None, "none")`` when no key is configured. The key is never logged."""
    environ = os.environ if environ is None else environ
    for field, path in (("args.security.api_key_file", api_key_file), (f"${API_KEY_FILE_ENV}", environ.get(API_KEY_FILE_ENV))):
        if path:
            try:
                text = Path(path).expanduser().read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                reason = getattr(exc, "strerror", None) or type(exc).__name__
                raise ConfigError(field, path, f"a readable file holding the API key ({reason})") from None
            return _checked_key(text, field, f"the contents of {path}"), f"file {path}"
    if environ.get(API_KEY_ENV) is not None:
        return _checked_key(environ[API_KEY_ENV], f"${API_KEY_ENV}", "its value"), f"${API_KEY_ENV}"
    return None, "none"


def ingress_api_key(api_key_file: str | None, require_api_key: bool,
                    environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """The key the ingress replica enforces (``load_api_key``); with ``require_api_key`` and no key anywhere, a
    ``ConfigError`` that stops the replica before it serves one open route."""
    key, where = load_api_key(api_key_file, environ)
    if key is None and require_api_key:
        raise ConfigError(
            "args.security.require_api_key",
            True,
            f"no API key found by the ingress replica; expected one in the file named by args.security.api_key_file, "
            f"in the file named by ${API_KEY_FILE_ENV}, or in ${API_KEY_ENV} (the environment of the Ray nodes)",
        )
    return key, where


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode("latin-1") if isinstance(key, str) else key).digest()


async def _validation_error(request: Any, exc: RequestValidationError) -> JSONResponse:
    """A request body that does not validate: 400 in OpenAI's format. Ray Serve LLM's own handler puts the raw
    input into ``param``; a body that is not JSON (``Content-Type: text/plain``) is bytes there, which cannot be
    serialised, and the client got a 500. OpenAI's ``param`` is the parameter's name, which is what goes here."""
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "Invalid request", "loc": ("body",), "type": "invalid_request_error"}
    if not isinstance(first, dict):  # vLLM's own app raises it with plain strings (e.g. a text/plain body)
        first = {"msg": str(first), "loc": ("body",), "type": "invalid_request_error"}
    loc = tuple(first.get("loc") or ("body",))
    param = ".".join(str(part) for part in loc[1:]) or None
    body = {"error": {"message": f"Invalid request format: {first.get('msg')} at {loc}",
                      "type": str(first.get("type") or "invalid_request_error"), "param": param,
                      "code": "invalid_parameter"}}
    return JSONResponse(status_code=400, content=body)


def _unauthorized(message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    return JSONResponse(status_code=401, content=body, headers={"WWW-Authenticate": "Bearer"})


class ApiKeyMiddleware:
    """Pure ASGI (streams and client disconnects pass through untouched): every HTTP route but the health ones
    needs ``Authorization: Bearer <key>``. Digests are compared in constant time."""

    def __init__(self, app: Any, *, key_digest: bytes) -> None:
        self.app = app
        self._digest = key_digest

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS" or self._is_open(scope):
            await self.app(scope, receive, send)
            return
        presented = None
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and token.strip():
                    presented = token.strip()
                break
        if presented is None:
            response = _unauthorized("Missing API key: send it as the header `Authorization: Bearer <key>`.")
        elif not hmac.compare_digest(_digest(presented), self._digest):
            response = _unauthorized("Incorrect API key provided.")
        else:
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        await response(scope, receive, send)

    @staticmethod
    def _is_open(scope: dict) -> bool:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        return path in OPEN_PATHS


class ChoicesBoundMiddleware:
    """Pure ASGI, for vLLM's own app in the LLM replica (direct streaming, where no ingress replica parses the
    request): a POST to ``CHOICES_PATHS`` whose JSON body asks for more than ``max_choices`` choices gets the
    ingress path's 400 in OpenAI's format. The body is read once and handed on unchanged; later ``receive`` calls
    (a client that disconnects mid-stream) reach the server as before. A body that is not a JSON object is left
    to vLLM's own validation."""

    def __init__(self, app: Any, *, max_choices: int) -> None:
        self.app = app
        self._max_choices = max_choices

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in CHOICES_PATHS:
            await self.app(scope, receive, send)
            return
        received, chunks = [], []
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        if received and received[-1]["type"] == "http.request":  # the whole body: one message downstream
            received = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        try:
            body = json.loads(b"".join(chunks)) if chunks else None
        except (ValueError, UnicodeDecodeError):
            body = None
        message = too_many_choices(body.get("n") if isinstance(body, dict) else None, self._max_choices)
        if message is not None:
            error = {"error": {"message": message, "type": "BadRequestError", "param": "n", "code": 400}}
            await JSONResponse(status_code=400, content=error)(scope, receive, send)
            return

        async def replay() -> dict:
            return received.pop(0) if received else await receive()

        await self.app(scope, replay, send)


class OpenAiErrorsIngress(OpenAiIngress):
    """``OpenAiIngress`` whose model lookups fail with OpenAI-style error bodies, with an optional API key and a
    bound on the choices (``n``) one request may ask for."""

    def __init__(self, *args: Any, api_key_file: str | None = None, require_api_key: bool = False,
                 max_choices: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._max_choices = max_choices
        key, where = ingress_api_key(api_key_file, require_api_key)
        self._api_key_digest = _digest(key) if key is not None else None
        logger.info("API key: %s", f"required (from {where})" if key is not None else "not configured, routes open")

    def _set_asgi_app(self, app: Any) -> None:
        # Serve's ingress wrapper hands the FastAPI app over here, before its lifespan starts: the only point
        # where a middleware can still be added to an app that Ray Serve LLM builds itself.
        if self._api_key_digest is not None:
            app.add_middleware(ApiKeyMiddleware, key_digest=self._api_key_digest)
        app.add_exception_handler(RequestValidationError, _validation_error)  # replaces Ray Serve LLM's
        super()._set_asgi_app(app)

    async def _process_llm_request(self, body: Any, call_method: str, raw_request: Any = None) -> Any:
        message = too_many_choices(getattr(body, "n", None), self._max_choices)
        if message is not None:
            raise OpenAIHTTPException(status_code=400, message=message, type="BadRequestError")
        return await super()._process_llm_request(body, call_method, raw_request)

    async def _get_model_id(self, model: Optional[str]) -> str:
        try:
            return await super()._get_model_id(model)
        except HTTPException as exc:
            raise _openai_error(exc) from None

    def _get_configured_serve_handle(self, model_id: str) -> Any:
        try:
            return super()._get_configured_serve_handle(model_id)
        except HTTPException as exc:
            raise _openai_error(exc) from None
