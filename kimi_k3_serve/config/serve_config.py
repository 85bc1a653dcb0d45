"""Read a Serve config file (``deploy/*.yaml``) and return our application's validated ``args``.

The file is checked against Ray Serve's own schema (``ServeDeploySchema``; for the common shape of a deploy file,
without importing Ray, see ``kimi_k3_serve.config.serve_schema``), then the application whose
``import_path`` is ``kimi_k3_serve.app:build_app`` is picked and its ``args`` validated by ``kimi_k3_serve.config.args``.
Every problem (missing file, bad YAML, wrong import path, bad args) is one ``ConfigError`` naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi_k3_serve.config.args import ServeArgs, config_error_from, dotted, load_args
from kimi_k3_serve.config.secrets import NotShown, refuse_secrets
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.inputs import is_host, load_yaml, read_text_file, refuse_token_text

APP_IMPORT_PATH = "kimi_k3_serve.app:build_app"


@dataclass(frozen=True)
class ServeApp:
    """Our application as one Serve config file declares it."""

    path: Path
    name: str
    index: int
    """Position in ``applications``."""
    args: ServeArgs
    raw_args: dict[str, Any]
    """The ``args`` mapping as written, which is what Serve passes to ``build_app``."""
    http_host: str
    http_port: int
    serve_schema: str = ""
    """What accepted the file: ``ray`` (``ServeDeploySchema``) or ``snapshot`` (``kimi_k3_serve.config.serve_schema``)."""


def read_serve_config(path: str | Path) -> dict[str, Any]:
    """The file's YAML as a mapping, checked against Ray Serve's ``ServeDeploySchema``."""
    data, _ = _read_and_validate(path)
    return data


def _read_and_validate(path: str | Path) -> tuple[dict[str, Any], str]:
    """The file's YAML mapping and what accepted it (``snapshot`` or ``ray``)."""
    source = str(path)
    text = read_text_file(path, "config", what="a Serve config YAML such as deploy/dev.yaml")
    data = load_yaml(text, "config", source)
    if not isinstance(data, dict):
        raise ConfigError("config", type(data).__name__, "expected a mapping with `applications`", source=source)
    refuse_secrets(data, "config", source=source)  # before Ray's schema, whose errors quote their input
    refuse_token_text(text, "config", source=source)  # comments and keys too: render copies the file verbatim

    from kimi_k3_serve.config.serve_schema import accepts_without_ray

    if accepts_without_ray(data):
        _check_http_options(data, source)
        return data, "snapshot"

    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(data)
    except ValidationError as exc:
        raise config_error_from(exc, root="config", source=source) from None
    _reject_unknown_keys(data, source)
    _check_http_options(data, source)
    return data, "ray"


HTTP_SECONDS = ("keep_alive_timeout_s", "request_timeout_s")


def _check_http_options(data: dict[str, Any], source: str) -> None:
    """What Serve's schema (or its snapshot) lets through but its proxy cannot use: a route prefix without its
    leading /, a host that is no address, a port outside 1-65535 (or true), a negative, infinite or non-numeric
    timeout. ``render`` and the ingress would otherwise carry them to the nodes."""
    for i, app in enumerate(data.get("applications") or []):
        prefix = app.get("route_prefix", "/") if isinstance(app, dict) else "/"
        if prefix is not None and not (isinstance(prefix, str) and re.fullmatch(r"/|(/[^/\s{}]+)+", prefix)):
            raise ConfigError(f"config.applications[{i}].route_prefix", prefix, "expected a path that starts with / "
                              "and does not end with one (e.g. /v1), without spaces or {}", source=source)
    http = data.get("http_options")
    if not isinstance(http, dict):
        return
    host = http.get("host", "127.0.0.1")
    if not (isinstance(host, str) and is_host(host)):
        raise ConfigError("config.http_options.host", host, "expected an IP address (127.0.0.1 keeps it to this host; "
                          "0.0.0.0 listens on every interface) or a host name", source=source)
    port = http.get("port", 8000)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ConfigError("config.http_options.port", port, "expected a whole number from 1 to 65535", source=source)
    for key in HTTP_SECONDS:
        seconds = http.get(key)
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not 0 <= seconds < float("inf")):
            raise ConfigError(f"config.http_options.{key}", seconds, "expected a finite number of seconds >= 0",
                              source=source)


def _reject_unknown_keys(data: dict[str, Any], source: str) -> None:
    """Serve's schema ignores keys it does not know, so a typo (``http_option:``) would silently drop a setting."""
    from ray.serve.schema import HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema

    sections = [("config", data, ServeDeploySchema)]
    if isinstance(data.get("http_options"), dict):
        sections.append(("config.http_options", data["http_options"], HTTPOptionsSchema))
    for i, app in enumerate(data.get("applications") or []):
        sections.append((f"config.applications[{i}]", app, ServeApplicationSchema))
    for where, section, schema in sections:
        for key in section:
            if key not in schema.model_fields:
                raise ConfigError(
                    f"{where}.{key}", NotShown(), f"unknown field; allowed here: {', '.join(schema.model_fields)}",
                    source=source,
                )


def load_serve_app(path: str | Path, *, app_name: str | None = None) -> ServeApp:
    """Our application in a Serve config file, with validated ``args``.

    With ``app_name``, that application (which must point at ``kimi_k3_serve.app:build_app``); otherwise the one
    application that does.
    """
    data, accepted_by = _read_and_validate(path)
    source = str(path)
    applications = data.get("applications") or []
    ours = [(i, app) for i, app in enumerate(applications) if app.get("import_path") == APP_IMPORT_PATH]
    if app_name is not None:
        named = [(i, app) for i, app in enumerate(applications) if app.get("name") == app_name]
        if not named:
            names = ", ".join(str(app.get("name")) for app in applications) or "none"
            raise ConfigError("config.applications[].name", app_name, f"no such application; the file has: {names}", source=source)
        index, app = named[0]
        if app.get("import_path") != APP_IMPORT_PATH:
            raise ConfigError(
                f"config.applications[{index}].import_path", app.get("import_path"), f"expected {APP_IMPORT_PATH}", source=source
            )
    elif len(ours) == 1:
        index, app = ours[0]
    elif not ours:
        found = ", ".join(repr(app.get("import_path")) for app in applications) or "no applications"
        raise ConfigError(
            "config.applications[].import_path", found, f"expected one application with import_path {APP_IMPORT_PATH}", source=source
        )
    else:
        names = ", ".join(str(app.get("name")) for _, app in ours)
        raise ConfigError(
            "config.applications", names, "several applications use this builder; pick one by name", source=source
        )

    raw_args = app.get("args")
    if raw_args is None:
        raise ConfigError(f"config.applications[{index}].args", None, "required: the application's args section", source=source)
    args = load_args(raw_args, source=f"{source} ({dotted('applications', (index,))})")
    http = data.get("http_options") or {}
    return ServeApp(
        path=Path(path),
        name=str(app.get("name", "default")),
        index=index,
        args=args,
        raw_args=dict(raw_args),
        http_host=str(http.get("host", "127.0.0.1")),
        http_port=int(http.get("port", 8000)),
        serve_schema=accepted_by,
    )
