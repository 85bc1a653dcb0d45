"""Accept a Serve config without importing Ray, when Ray's own schema is sure to accept it too.

Importing ``ray.serve.schema`` costs about 0.8 s (it pulls in Ray's core worker and all of ``ray.serve``), more
than the whole capacity check. Most deploy files use only a small part of ``ServeDeploySchema``: applications
with ``name``, ``route_prefix``, ``import_path`` and ``args``, and plain ``http_options``. For those, a snapshot
of that part of Ray's JSON schema (``data/serve_deploy_schema.json``, generated from
``ServeDeploySchema.model_json_schema()``) plus Ray's six validators on those fields decide acceptance.
``logging_config`` is covered (encoding, log level, access log) because the dev configs set it.

This is a shortcut for *accepting* only. A document that uses any other field, fails the snapshot, or was
written for another Ray version goes to Ray's ``ServeDeploySchema``, so every rejection (and its message) is
Ray's own. Tests keep the shortcut honest: the snapshot must equal what the installed Ray generates, the
validators Ray attaches to these models must be the ones mirrored or ones that cannot fire on the fast fields,
and on generated documents the shortcut must never accept what Ray rejects.

    python -m kimi_k3_serve.config.serve_schema   # rewrite the snapshot from the installed Ray
"""

from __future__ import annotations

import json
import logging
import math
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

SNAPSHOT_PATH = Path(__file__).resolve().parents[1] / "data" / "serve_deploy_schema.json"

FAST_FIELDS: dict[str, tuple[str, ...]] = {
    "ServeDeploySchema": ("applications", "http_options", "proxy_location", "target_capacity", "logging_config"),
    "ServeApplicationSchema": ("name", "route_prefix", "import_path", "args", "logging_config"),
    "HTTPOptionsSchema": ("host", "port", "root_path", "request_timeout_s", "keep_alive_timeout_s"),
    "LoggingConfig": ("encoding", "log_level", "enable_access_log"),
}
"""The fields the shortcut knows completely; any other key sends the document to Ray's schema (``host`` and
``port`` inside an application, for instance, which Ray rejects with its own message)."""

DEFAULT_APP_NAME = "default"
DEFAULT_ROUTE_PREFIX = "/"
"""``ServeApplicationSchema`` defaults that Ray's uniqueness validators see for an omitted name or prefix."""


def reduce_schema(full: dict[str, Any]) -> dict[str, Any]:
    """The part of ``ServeDeploySchema``'s JSON schema covering ``FAST_FIELDS``, with every other key forbidden
    and documentation (titles, descriptions, defaults) dropped. Deterministic, so the snapshot can be compared."""
    definitions = full.get("$defs", {})

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: strip(value) for key, value in sorted(node.items())
                    if key not in ("title", "description", "default", "examples")}
        if isinstance(node, list):
            return [strip(value) for value in node]
        return node

    def restricted(schema: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
        properties = schema.get("properties", {})
        missing = [name for name in fields if name not in properties]
        if missing:
            raise ValueError(f"Ray's schema no longer has the fields {missing}")
        return {
            "type": "object",
            "properties": {name: strip(properties[name]) for name in fields},
            "required": [name for name in schema.get("required", []) if name in fields],
            "additionalProperties": False,
        }

    reduced = restricted(full, FAST_FIELDS["ServeDeploySchema"])
    used: dict[str, Any] = {}
    pending = _refs(reduced)
    while pending:
        name = pending.pop()
        if name in used:
            continue
        if name in FAST_FIELDS:
            used[name] = restricted(definitions[name], FAST_FIELDS[name])
        else:
            used[name] = strip(definitions[name])
        pending |= _refs(used[name])
    reduced["$defs"] = dict(sorted(used.items()))
    return reduced


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = set()
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            found.add(ref.removeprefix("#/$defs/"))
        for value in node.values():
            found |= _refs(value)
        return found
    if isinstance(node, list):
        return set().union(*(_refs(value) for value in node)) if node else set()
    return set()


def snapshot_from_ray() -> dict[str, Any]:
    """What the snapshot file should hold for the installed Ray (imports Ray)."""
    from ray.serve.schema import ServeDeploySchema

    return {
        "ray_version": metadata.version("ray"),
        "generated_from": "ray.serve.schema.ServeDeploySchema.model_json_schema(mode='validation')",
        "schema": reduce_schema(ServeDeploySchema.model_json_schema(mode="validation")),
    }


@cache
def _snapshot_validator() -> Any | None:
    """A JSON Schema validator for the snapshot, or None when there is none for the installed Ray version."""
    try:
        snapshot = json.loads(SNAPSHOT_PATH.read_text())
    except (OSError, ValueError):
        return None
    if snapshot.get("ray_version") != _installed_ray_version():
        return None
    import jsonschema

    return jsonschema.Draft202012Validator(snapshot["schema"])


def _installed_ray_version() -> str | None:
    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:
        return None


def accepts_without_ray(document: Any) -> bool:
    """True only when Ray's ``ServeDeploySchema`` is sure to accept ``document`` too; False means "ask Ray"."""
    validator = _snapshot_validator()
    if validator is None or not isinstance(document, dict) or not _finite_outside_args(document):
        return False
    if not validator.is_valid(document):
        return False
    applications = document["applications"]
    logging_configs = [document.get("logging_config")] + [app.get("logging_config") for app in applications]
    return (_import_paths_valid(applications) and _names_and_routes_valid(applications)
            and all(_logging_config_valid(config) for config in logging_configs if config is not None))


def _finite_outside_args(node: Any, *, in_args: bool = False) -> bool:
    """Pydantic rejects NaN against ``ge``/``le`` bounds where JSON Schema accepts it, and a whole float of 2^63 or
    more for an int field (``int_parsing_size``) where JSON Schema calls it an integer; leave those to Ray.
    ``args`` belongs to the application's builder and is validated there."""
    if isinstance(node, float) and not in_args:
        return math.isfinite(node) and abs(node) < 2**63
    if isinstance(node, dict):
        return all(_finite_outside_args(value, in_args=in_args or key == "args") for key, value in node.items())
    if isinstance(node, list):
        return all(_finite_outside_args(value, in_args=in_args) for value in node)
    return True


def _import_paths_valid(applications: list[dict[str, Any]]) -> bool:
    """``ServeApplicationSchema.import_path_format_valid``: ``module:attr`` with one colon not at either end,
    or ``module.attr`` with a dot not at either end."""
    for app in applications:
        path = app["import_path"]
        if ":" in path:
            if path.count(":") > 1 or path.startswith(":") or path.endswith(":"):
                return False
        elif "." not in path or path.startswith(".") or path.endswith("."):
            return False
    return True


def _names_and_routes_valid(applications: list[dict[str, Any]]) -> bool:
    """``ServeDeploySchema.application_names_unique``, ``application_names_nonempty`` and
    ``application_routes_unique`` (a null prefix is exempt; an omitted one is ``/``)."""
    names = [app.get("name", DEFAULT_APP_NAME) for app in applications]
    if any(name == "" for name in names) or len(set(names)) != len(names):
        return False
    routes = [app.get("route_prefix", DEFAULT_ROUTE_PREFIX) for app in applications]
    routes = [route for route in routes if route is not None]
    return len(set(routes)) == len(routes)


LOG_ENCODINGS = ("TEXT", "JSON")
"""``ray.serve.schema.EncodingType``."""


def _logging_config_valid(config: dict[str, Any]) -> bool:
    """``LoggingConfig.valid_encoding_format`` and ``valid_log_level``: the encoding is TEXT or JSON; the level is a
    name or number the ``logging`` module knows (pydantic takes an integral float such as 20.0 as the int 20)."""
    if "encoding" in config and config["encoding"] not in LOG_ENCODINGS:
        return False
    level = config.get("log_level", "INFO")
    if isinstance(level, bool):
        return False
    if isinstance(level, (int, float)):
        return float(level).is_integer() and int(level) in logging._levelToName
    return level in logging._nameToLevel


def main() -> int:
    snapshot = snapshot_from_ray()
    SNAPSHOT_PATH.parent.mkdir(exist_ok=True)
    SNAPSHOT_PATH.write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT_PATH} (Ray {snapshot['ray_version']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
