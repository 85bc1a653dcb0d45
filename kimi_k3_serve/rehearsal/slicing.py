"""A Kimi-K3 slice of N layers that keeps every layer kind, so that one or two GPUs can rehearse the architecture.

The slice is the text backbone (``KimiLinearForCausalLM``, what a text-only endpoint serves) cut to its first N
layers: layer 0 dense, layers 1.. MoE with MXFP4 experts, KDA and gated MLA layers in the model's own 3:1 pattern
(MLA at 1-based layers 4, 8, ...). Widths, experts, vocabulary and quantization are the full model's, so every
per-layer number measured on the slice is the full model's per-layer number. The DSpark draft is sliced with it:
its target layers must exist in the slice. Pure: dicts in, dicts out; ``write_slice`` writes config.json files.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Mapping

from kimi_k3_serve.errors import ConfigError

SLICE_ARCHITECTURE = "KimiLinearForCausalLM"
DRAFT_TARGET_LAYERS = 5


def min_slice_layers(text_config: Mapping[str, Any]) -> int:
    """The fewest leading layers that hold every layer kind: the first MLA layer (1-based) and a MoE layer."""
    lac = text_config["linear_attn_config"]
    first_mla = min(int(i) for i in lac["full_attn_layers"])
    first_moe = int(text_config.get("first_k_dense_replace", 0)) + 1
    return max(first_mla, first_moe, 2)


def slice_text_config(config: Mapping[str, Any], num_layers: int, *, field: str = "--layers") -> dict[str, Any]:
    """The config.json of the first ``num_layers`` layers of a Kimi-K3 (multimodal or text-only) config."""
    text = config.get("text_config", config)
    total = int(text["num_hidden_layers"])
    low = min_slice_layers(text)
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not low <= num_layers <= total:
        raise ConfigError(field, num_layers,
                          f"a slice keeps every layer kind (dense, MoE, KDA, MLA) from {low} layers up to the model's {total}")
    out = copy.deepcopy(dict(text))
    out["architectures"] = [SLICE_ARCHITECTURE]
    out["num_hidden_layers"] = num_layers
    lac = out["linear_attn_config"]
    lac["full_attn_layers"] = [int(i) for i in lac["full_attn_layers"] if int(i) <= num_layers]
    lac["kda_layers"] = [int(i) for i in lac["kda_layers"] if int(i) <= num_layers]
    return with_top_level_settings(out, text, config)


def with_top_level_settings(out: dict[str, Any], text: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """``out`` (a text config cut from ``config``) with the quantization and dtype a multimodal config keeps at its
    top level."""
    quant = text.get("quantization_config") or config.get("quantization_config")
    if quant is not None:
        out["quantization_config"] = copy.deepcopy(quant)
    if "torch_dtype" not in out and "torch_dtype" in config:
        out["torch_dtype"] = config["torch_dtype"]
    return out


def slice_draft_config(draft: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """A draft config whose target layers exist in a slice of ``num_layers`` layers.

    DSpark taps ``num_target_layers`` target layers (its input projection is ``target_hidden x num_target_layers``
    wide); in a slice they are spread evenly over its layers, at most one per layer. EAGLE3 drafts name theirs in
    ``eagle_aux_hidden_state_layer_ids`` (top level or in ``eagle_config``), which get the same treatment. Other drafts are returned unchanged."""
    out = copy.deepcopy(dict(draft))
    if "target_layer_ids" in out:
        want = min(int(out.get("num_target_layers") or len(out["target_layer_ids"])), num_layers)
        ids = spread(num_layers, want)
        out["target_layer_ids"] = ids
        out["num_target_layers"] = len(ids)
    if out.get("eagle_aux_hidden_state_layer_ids"):
        out["eagle_aux_hidden_state_layer_ids"] = spread(num_layers, min(len(out["eagle_aux_hidden_state_layer_ids"]), num_layers))
    aux = (out.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux:
        out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = spread(num_layers, min(len(aux), num_layers))
    return out


def spread(num_layers: int, count: int) -> list[int]:
    """``count`` distinct layer indices spread evenly over ``range(num_layers)``, the last layer included."""
    if count <= 1:
        return [num_layers - 1]
    return sorted({round(i * (num_layers - 1) / (count - 1)) for i in range(count)})


def write_slice(config: Mapping[str, Any], num_layers: int, out_dir: Path,
                draft: Mapping[str, Any] | None = None) -> tuple[Path, Path | None]:
    """Write ``out_dir/target/config.json`` (and ``out_dir/draft/config.json``); returns the two folders."""
    target_dir = Path(out_dir) / "target"
    target_dir.mkdir(parents=True, exist_ok=True)
    (target_dir / "config.json").write_text(json.dumps(slice_text_config(config, num_layers), indent=1))
    draft_dir = None
    if draft is not None:
        draft_dir = Path(out_dir) / "draft"
        draft_dir.mkdir(parents=True, exist_ok=True)
        (draft_dir / "config.json").write_text(json.dumps(slice_draft_config(draft, num_layers), indent=1))
    return target_dir, draft_dir
