"""Secrets never travel in a config file.

A Serve config is stored by Serve (its checkpoints in the GCS), shown by ``serve status`` and the dashboard, and
copied verbatim into a KubeRay RayService (``serveConfigV2``). So a field whose *name* says it holds a secret
(``HF_TOKEN``, ``hf_token``, ``*_key``, ``*_token``, ``*_secret``, ``*password``), anywhere in the document
(``args``, ``args.engine_kwargs``, ``args.runtime_env.env_vars``, Serve's own ``runtime_env``), is refused before
anything else reads the file, and so is a value shaped like a token (``kimi_k3_serve.tokens``) in a field of any
name: the error names the field and never carries its value, and no later error (Ray's or pydantic's, which quote
their input) can see it either.
"""

from __future__ import annotations

from typing import Any, Mapping

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.tokens import NotShown, looks_like_token

SECRET_NAMES = frozenset({"key", "token", "secret", "password", "passwd", "apikey"})
SECRET_SUFFIXES = ("_key", "_token", "_secret", "_password", "_passwd", "-key", "-token", "-secret", "-password")
NOT_SECRET = frozenset({("security", "require_api_key")})
"""Schema fields whose name matches but that hold no secret: (parent key, key)."""

SECRET_REFUSED = (
    "expected no secret in a config file (Serve stores the config and `serve status` shows it): set it in "
    "the environment of the Ray nodes (on KubeRay from a Kubernetes Secret); the API key goes in a file named by "
    "args.security.api_key_file, or $KIMI_K3_SERVE_API_KEY_FILE / $KIMI_K3_SERVE_API_KEY on the nodes"
)


def is_secret_name(name: object) -> bool:
    """Whether a field or environment variable name says it holds a secret (case-insensitive)."""
    lowered = str(name).lower()
    return lowered in SECRET_NAMES or lowered.endswith(SECRET_SUFFIXES)


def secret_field(data: Any, root: str) -> str | None:
    """The dotted path of the first field in ``data`` (mappings and lists, any depth) whose name says it holds a secret
    or whose text is shaped like a token, or None."""
    stack: list[tuple[str, str | None, Any]] = [(root, None, data)]
    while stack:
        path, parent, node = stack.pop(0)
        if isinstance(node, Mapping):
            for key, value in node.items():
                child = f"{path}.{key}"
                if (is_secret_name(key) and (parent, str(key)) not in NOT_SECRET) or looks_like_token(str(key)):
                    return child
                stack.append((child, str(key), value))
        elif isinstance(node, (list, tuple)):
            stack.extend((f"{path}[{i}]", parent, value) for i, value in enumerate(node))
        elif isinstance(node, str) and looks_like_token(node):
            return path
    return None


def refuse_secrets(data: Any, root: str, *, source: str | None = None) -> None:
    """A ``ConfigError`` naming the first secret-named field (its value shown as ``<redacted>``)."""
    field = secret_field(data, root)
    if field is not None:
        raise ConfigError(field, NotShown(), SECRET_REFUSED, source=source)
