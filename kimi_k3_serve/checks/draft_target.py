"""Does the target take an EAGLE3-family draft? Asked of vLLM itself, before any weight loads.

vLLM 0.32 wires an ``eagle3`` or ``dspark`` draft to its target through the target's auxiliary hidden
states, which only a model class that declares ``SupportsEagle3`` provides
(``v1/worker/gpu_model_runner.py`` ``_setup_eagle3_aux_hidden_state_outputs`` raises otherwise -- after the
weights have loaded). Which class that is depends on the checkpoint and the platform: on CUDA (and CPU)
``vllm.models.kimi_k3`` exports ``nvidia/model.py::KimiLinearForCausalLM``, which declares it; on ROCm it
exports ``amd/linear.py::KimiLinearForCausalLM``, which does not.

Two steps:

- ``gather_target_class`` (imports vLLM): the target's ``config.json`` ``architectures`` -> the class vLLM's
  model registry resolves on this platform (``ModelRegistry.resolve_model_cls``, the registry's public
  resolver) -> ``supports_eagle3(cls)``. A multimodal ``KimiK3ForConditionalGeneration`` builds its decoder
  as a registered ``KimiLinearForCausalLM`` (``nvidia/model.py`` and ``amd/model.py``:
  ``init_vllm_registered_model(..., architectures=["KimiLinearForCausalLM"])``) and hands the aux-hidden-state
  calls to it, so both classes must declare the interface. vLLM missing, or a config it cannot be asked
  about, gives ``supports=None`` and a reason, never an exception.
- ``decide_draft_target`` (pure): None, or one line naming ``args.speculative.method``, the architecture,
  the class and what is allowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

EAGLE3_FAMILY = ("eagle3", "dspark")
"""``args.speculative.method`` values whose draft reads the target's auxiliary hidden states."""

LANGUAGE_MODEL_OF = {"KimiK3ForConditionalGeneration": "KimiLinearForCausalLM"}
"""Multimodal architecture -> the registered architecture vLLM builds its language model with."""

FIELD = "args.speculative.method"


@dataclass(frozen=True)
class TargetClass:
    """What vLLM resolves the target to: the architecture config.json names, whether the class(es) declare
    ``SupportsEagle3`` (None: not asked -- ``reason`` says why) and a one-line ``reason`` naming the class."""

    architecture: str | None
    supports: bool | None
    reason: str


def decide_draft_target(method: str | None, architecture: str | None, supports: bool | None, reason: str) -> str | None:
    """None when the draft may run on the target (or it could not be asked: ``supports`` None); otherwise
    the one-line refusal."""
    if method is None or method not in EAGLE3_FAMILY or supports is None or supports:
        return None
    return (f"{FIELD} {method!r} needs a target model class that declares vLLM's SupportsEagle3, but architecture "
            f"{architecture} resolves to {reason}, which does not; allowed: a target whose vLLM class declares "
            f"SupportsEagle3 (e.g. LlamaForCausalLM, KimiLinearForCausalLM on CUDA), or no args.speculative")


def _hub_config(source: str) -> str | None:
    """config.json of a Hugging Face repo id ``owner/name``: from the local cache, else that one file fetched
    (the replica downloads the whole checkpoint right after this check anyway). None when neither works."""
    from kimi_k3_serve.config.args import source_kind

    if source_kind(source) != "remote" or source.count("/") != 1:
        return None
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        cached = try_to_load_from_cache(source, "config.json")
        if isinstance(cached, str):
            return cached
        return hf_hub_download(source, "config.json", etag_timeout=10)
    except Exception:  # no huggingface_hub, no network, no such repo
        return None


def read_architectures(source: str) -> tuple[list[str] | None, str]:
    """config.json's ``architectures`` (or ``text_config.architectures``) of a local folder or a Hugging Face
    repo id; (None, why) when there is none."""
    path = Path(source).expanduser() / "config.json"
    if not path.is_file():
        fetched = _hub_config(source)
        if fetched is None:
            return None, f"no config.json at {source} (not a local folder, nor a Hugging Face repo we could read)"
        path = Path(fetched)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return None, f"cannot read {path}: {exc}"
    archs = config.get("architectures") or (config.get("text_config") or {}).get("architectures")
    if not archs or not isinstance(archs, list):
        return None, f"{path} names no architectures"
    return [str(a) for a in archs], str(path)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def gather_target_class(source: str) -> TargetClass:
    """Resolve the target of ``source`` (a local folder or a cached hub id) through vLLM's registry on this
    process's platform and ask ``supports_eagle3`` of the class(es) vLLM will build."""
    archs, where = read_architectures(source)
    if archs is None:
        return TargetClass(None, None, f"not checked: {where}")
    try:
        from vllm import __version__ as vllm_version
        from vllm.model_executor.models.interfaces import supports_eagle3
        from vllm.model_executor.models.registry import ModelRegistry
        from vllm.platforms import current_platform
    except Exception as exc:  # the build-time machine may not have vLLM
        return TargetClass(archs[0], None, f"not checked: vLLM cannot be imported here ({type(exc).__name__}: {exc})")
    platform = f"vLLM {vllm_version} on {getattr(current_platform, 'device_name', '?')}"
    if not any(a in ModelRegistry.get_supported_archs() for a in archs):
        return TargetClass(archs[0], None, f"not checked: {archs} not in vLLM's model registry ({platform}); "
                                           "vLLM would try its Transformers backend")
    # resolve_model_cls reads only these three fields of the ModelConfig while an architecture is registered.
    model_config = SimpleNamespace(model_impl="auto", convert_type="none", runner_type="generate")
    try:
        cls, arch = ModelRegistry.resolve_model_cls(archs, model_config=model_config)
        classes = [cls]
        inner_arch = LANGUAGE_MODEL_OF.get(arch)
        if inner_arch is not None:
            inner, _ = ModelRegistry.resolve_model_cls([inner_arch], model_config=model_config)
            classes.append(inner)
    except Exception as exc:
        return TargetClass(archs[0], None, f"not checked: vLLM could not load the class of {archs} "
                                           f"({type(exc).__name__}: {exc})")
    lacking = [c for c in classes if not supports_eagle3(c)]
    if len(classes) == 1:
        described = _class_name(classes[0])
    else:
        described = f"{_class_name(classes[0])} with language model {_class_name(classes[1])}"
    if lacking and len(classes) > 1:
        described += f" ({', '.join(_class_name(c) for c in lacking)} lacks it)"
    return TargetClass(arch, not lacking, f"{described} ({platform})")
