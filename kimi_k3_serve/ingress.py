"""The OpenAI ingress: Ray Serve LLM's ``OpenAiIngress`` with OpenAI-style errors for unknown models.

Ray Serve LLM 2.60 raises FastAPI's ``HTTPException`` when a request names a model it does not serve. FastAPI
answers that itself with ``{"detail": ...}`` before Serve LLM's error middleware can turn it into OpenAI's
``{"error": {"message", "type", "code"}}``, so OpenAI clients see a body they cannot parse. Raising Serve LLM's
own ``OpenAIHTTPException`` instead lets that middleware format it like every other error.
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import HTTPException
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
from ray.serve.llm.ingress import OpenAiIngress

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError"}


def _openai_error(exc: HTTPException) -> OpenAIHTTPException:
    return OpenAIHTTPException(
        status_code=exc.status_code,
        message=str(exc.detail),
        type=_ERROR_TYPES.get(exc.status_code, "InvalidRequestError"),
    )


class OpenAiErrorsIngress(OpenAiIngress):
    """``OpenAiIngress`` whose model lookups fail with OpenAI-style error bodies."""

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
