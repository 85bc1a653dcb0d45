"""Model inventories from ``config.json``: ``load_model(source)``.

``source`` is a name in ``SHIPPED`` (configs shipped with the package, so planning works
offline), a path to a ``config.json``, or a checkpoint folder holding one. An architecture or config field
the inventory does not know is an UnsupportedModelError naming it, never a guess.
"""

from __future__ import annotations

from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping

from kimi_k3_serve.errors import ConfigError, UnsupportedModelError
from kimi_k3_serve.inputs import load_json, read_text_file
from kimi_k3_serve.models import drafts, gqa_dense, gqa_moe, kimi_k3, mla_moe
from kimi_k3_serve.models.inventory import ModelInventory

SHIPPED = {"kimi-k3": "kimi-k3.json", "kimi-k3-dspark": "kimi-k3-dspark.json", "kimi-k3-eagle3": "kimi-k3-eagle3.json",
           "kimi-k3-eagle3-mla": "kimi-k3-eagle3-mla.json"}
"""``kimi-k3-eagle3`` (LlamaForCausalLMEagle3, GQA) and ``kimi-k3-eagle3-mla`` (Eagle3DeepseekV2ForCausalLM, MLA) are
EAGLE3 drafts of Kimi-K3's width for dummy-weight rehearsals; only the MLA one can share Kimi-K3's KV pool in vLLM 0.32."""

_BUILDERS: dict[str, Callable[..., ModelInventory]] = {
    arch: module.build
    for module in (kimi_k3, gqa_dense, gqa_moe, mla_moe, drafts)
    for arch in module.ARCHITECTURES
}

SUPPORTED_ARCHITECTURES = tuple(sorted(_BUILDERS))

_CACHE: dict[tuple[str, float], ModelInventory] = {}


def read_config(source: str | Path) -> tuple[dict[str, Any], str, str]:
    """(config dict, display name, source description) for a shipped name, a config.json or a folder."""
    text = str(source)
    if text in SHIPPED:
        raw = resources.files("kimi_k3_serve.models").joinpath("data", SHIPPED[text]).read_text()
        return _parse(raw, text), text, f"package data {SHIPPED[text]}"
    path = _config_path(text)
    if path is None:
        raise ConfigError("model", text, f"expected {' or '.join(SHIPPED)}, a config.json path, or a checkpoint folder with config.json")
    name = path.parent.name if path.name == "config.json" else path.stem
    text = read_text_file(path, "model", what="a model config.json")
    return _parse(text, str(path)), name, str(path)


def _config_path(text: str) -> Path | None:
    """The config.json a path names (itself, or the one in the folder it names), or None where there is none; a name
    the OS refuses to look up (too long, an unreadable folder on the way) is none either."""
    try:
        path = Path(text).expanduser()
        if path.is_dir():
            path = path / "config.json"
        return path if path.is_file() else None
    except (OSError, RuntimeError):  # RuntimeError: expanduser of ~user with no such user
        return None


def _parse(raw: str, where: str) -> dict[str, Any]:
    config = load_json(raw, "model", where)
    if not isinstance(config, dict):
        raise ConfigError("model", where, "expected a config.json holding a JSON object")
    return config


def architecture_of(config: Mapping[str, Any], *, source: str | None = None) -> str:
    archs = config.get("architectures")
    if not archs and isinstance(config.get("text_config"), Mapping):
        archs = config["text_config"].get("architectures")
    if not archs or not isinstance(archs, list):
        raise UnsupportedModelError("architectures", archs, "config.json must name its architecture", source=source)
    arch = archs[0]
    if not isinstance(arch, str) or arch not in _BUILDERS:  # [[]] as an architecture was a TypeError (the fuzz)
        raise UnsupportedModelError("architectures", arch, f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}", source=source)
    return arch


def inventory_from_config(config: Mapping[str, Any], *, name: str = "model", source: str | None = None) -> ModelInventory:
    arch = architecture_of(config, source=source)
    try:
        inventory = _BUILDERS[arch](config, arch, name=name, source=source)
        return replace(inventory, max_model_len_limit=_max_model_len_limit(config, inventory.max_position_embeddings))
    except ConfigError:
        raise
    except (TypeError, ValueError, AttributeError) as exc:
        # A list or mapping field of the wrong type (kda_layers: 5) that the builder does not check one by one:
        # still the config's fault, so one line, not a traceback.
        raise UnsupportedModelError("model", source or name, f"expected a {arch} config.json with fields of the usual "
                                    f"types ({type(exc).__name__}: {str(exc)[:100]})") from None


# RoPE types whose max_position_embeddings vLLM 0.32 takes as already scaled (config/model.py _get_and_verify_max_len).
_ROPE_TYPES_NOT_SCALING_THE_LENGTH = ("default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def _max_model_len_limit(config: Mapping[str, Any], positions: int) -> int:
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else config
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    factor = 1.0
    if isinstance(rope, Mapping) and "gemma3" not in str(text.get("model_type", "")):
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        given = rope.get("factor")
        if rope_type not in _ROPE_TYPES_NOT_SCALING_THE_LENGTH and isinstance(given, (int, float)) and given > 0:
            factor = float(given)
    return int(positions * factor)


def load_model(source: str | Path) -> ModelInventory:
    """The inventory of a shipped model name, a ``config.json`` or a checkpoint folder (cached per file)."""
    text = str(source)
    stamp = 0.0
    if text not in SHIPPED:
        target = _config_path(text)
        try:
            stamp = target.stat().st_mtime if target is not None else 0.0
        except OSError:  # gone since: read_config says so
            stamp = 0.0
    key = (text, stamp)
    cached = _CACHE.get(key)
    if cached is None:
        config, name, where = read_config(source)
        cached = inventory_from_config(config, name=name, source=where)
        _CACHE[key] = cached
    return cached


__all__ = ["ModelInventory", "SUPPORTED_ARCHITECTURES", "inventory_from_config", "load_model", "read_config"]
