"""Weight quantization read from ``quantization_config``: what each linear weight costs in memory, scales
included, and which modules a scheme leaves unquantized.

Supported (anything else is an UnsupportedModelError, never a guess):
- no ``quantization_config``: weights in the model dtype (bf16 / fp16 / fp32);
- ``quant_method: fp8``: float8 weights with a per-tensor fp32 ``weight_scale``, or, with
  ``weight_block_size`` (DeepSeek-V3), an fp32 ``weight_scale_inv`` per block;
- ``quant_method: compressed-tensors`` with ``float-quantized`` (fp8), ``pack-quantized`` (int4, group
  scales in the model dtype, zero points when asymmetric), ``mxfp4-pack-quantized`` (e2m1 + one E8M0
  byte per 32) and ``nvfp4-pack-quantized`` (e2m1 + one fp8 scale per 16 + fp32 global scales).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from kimi_k3_serve.errors import UnsupportedModelError
from kimi_k3_serve.models.inventory import EXPERT, TP_DIM0, TensorSpec
from kimi_k3_serve.units import cdiv

MODEL_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "half": "float16"}


@dataclass(frozen=True)
class QuantScheme:
    method: str
    """``none``, ``fp8``, ``fp8_block``, ``ct_fp8``, ``ct_int4``, ``ct_mxfp4``, ``ct_nvfp4``."""
    model_dtype: str
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()
    group_size: int = 0
    block: tuple[int, int] = (0, 0)
    symmetric: bool = True
    per_channel: bool = False

    # -- which modules ----------------------------------------------------------------------------
    def quantizes(self, module: str) -> bool:
        if self.method == "none":
            return False
        if any(_matches(pattern, module) for pattern in self.ignore):
            return False
        return any(pattern == "Linear" or _matches(pattern, module) for pattern in self.targets)

    def describe(self) -> str:
        names = {
            "none": self.model_dtype,
            "fp8": "fp8 (per-tensor scales)",
            "fp8_block": f"fp8 block-scaled {self.block[0]}x{self.block[1]}",
            "ct_fp8": "compressed-tensors fp8",
            "ct_int4": f"compressed-tensors int4 (group {self.group_size})",
            "ct_mxfp4": "compressed-tensors mxfp4 (group 32, E8M0 scales)",
            "ct_nvfp4": "compressed-tensors nvfp4 (group 16, fp8 scales)",
        }
        text = names[self.method]
        if self.method != "none":
            if self.targets != ("Linear",):
                text += " on routed experts only" if all("experts" in t for t in self.targets) else " on " + ", ".join(self.targets)
            text += f"; other weights {self.model_dtype}"
        return text

    # -- tensors for one linear weight ------------------------------------------------------------
    def linear(
        self,
        module: str,
        rows: int,
        cols: int,
        sharding: str,
        category: str,
        *,
        parts: tuple[tuple[int, bool], ...] | None = None,
        local_align: int = 1,
        count: int = 1,
        replicated_under_sp: bool = False,
        quantizable: bool = True,
    ) -> list[TensorSpec]:
        """The weight of ``module`` (``rows`` outputs x ``cols`` inputs) plus any scale tensors."""
        common = dict(category=category, count=count, replicated_under_sp=replicated_under_sp, sharding=sharding)
        if not quantizable or not self.quantizes(module):
            return [
                TensorSpec(f"{module}.weight", (rows, cols), self.model_dtype, parts=parts, local_align=local_align, **common)
            ]
        weight_dtype, scale_dtype, group = self._formats()
        out = [TensorSpec(f"{module}.weight", (rows, cols), weight_dtype, parts=parts, local_align=local_align, **common)]
        if self.method == "fp8_block":
            br, bc = self.block
            scale_parts = _scaled_parts(parts, br if sharding == TP_DIM0 else bc)
            out.append(
                TensorSpec(f"{module}.weight_scale_inv", (cdiv(rows, br), cdiv(cols, bc)), "float32", parts=scale_parts, **common)
            )
        elif group:
            scale_parts = parts if sharding == TP_DIM0 else _scaled_parts(parts, group)
            out.append(TensorSpec(f"{module}.weight_scale", (rows, cdiv(cols, group)), scale_dtype, parts=scale_parts, **common))
            if self.method == "ct_int4" and not self.symmetric:
                out.append(
                    TensorSpec(f"{module}.weight_zero_point", (cdiv(rows, 8), cdiv(cols, group)), "int32",
                               parts=_scaled_parts(parts, 8) if sharding == TP_DIM0 else _scaled_parts(parts, group), **common)
                )
            if self.method == "ct_nvfp4":
                out.append(TensorSpec(f"{module}.weight_global_scale", (1,), "float32", **{**common, "sharding": "replicated"}))
        else:  # per-tensor or per-channel fp8
            shape = (rows, 1) if self.per_channel else (1,)
            scale_sharding = sharding if self.per_channel and sharding == TP_DIM0 else "replicated"
            out.append(TensorSpec(f"{module}.weight_scale", shape, "float32", **{**common, "sharding": scale_sharding},
                                  parts=parts if scale_sharding == TP_DIM0 else None))
        return out

    def experts(self, module: str, num_experts: int, intermediate: int, hidden: int, category: str = "routed_experts") -> list[TensorSpec]:
        """FusedMoE weights of one layer: merged ``w13`` [2I, H] and ``w2`` [H, I] per expert, with scales.

        Under TP without EP vLLM splits the intermediate dim; under EP it places whole experts per rank.
        """
        # vLLM matches compressed-tensors targets against the unfused expert names (gate_proj / up_proj /
        # down_proj), whatever the checkpoint calls them (Kimi-K3: w1 / w3 / w2).
        quantized = self.quantizes(f"{module}.0.gate_proj")
        wdtype, sdtype, group = self._formats() if quantized else (self.model_dtype, "", 0)
        common = dict(sharding=EXPERT, category=category, count=num_experts)
        out = [
            TensorSpec(f"{module}.w13_weight", (2 * intermediate, hidden), wdtype, expert_dim=0, inter_mult=2, **common),
            TensorSpec(f"{module}.w2_weight", (hidden, intermediate), wdtype, expert_dim=1, **common),
        ]
        if not quantized:
            return out
        if self.method == "fp8_block":
            br, bc = self.block
            out += [
                TensorSpec(f"{module}.w13_weight_scale_inv", (cdiv(2 * intermediate, br), cdiv(hidden, bc)), "float32",
                           expert_dim=0, inter_mult=2, inter_div=br, **common),
                TensorSpec(f"{module}.w2_weight_scale_inv", (cdiv(hidden, br), cdiv(intermediate, bc)), "float32",
                           expert_dim=1, inter_div=bc, **common),
            ]
        elif group:
            out += [
                TensorSpec(f"{module}.w13_weight_scale", (2 * intermediate, cdiv(hidden, group)), sdtype,
                           expert_dim=0, inter_mult=2, **common),
                TensorSpec(f"{module}.w2_weight_scale", (hidden, cdiv(intermediate, group)), sdtype,
                           expert_dim=1, inter_div=group, **common),
            ]
            if self.method == "ct_nvfp4":
                out.append(TensorSpec(f"{module}.w13_weight_global_scale", (2,), "float32", expert_dim=None, **common))
                out.append(TensorSpec(f"{module}.w2_weight_global_scale", (1,), "float32", expert_dim=None, **common))
        else:
            out.append(TensorSpec(f"{module}.w13_weight_scale", (2,), "float32", expert_dim=None, **common))
            out.append(TensorSpec(f"{module}.w2_weight_scale", (1,), "float32", expert_dim=None, **common))
        return out

    def _formats(self) -> tuple[str, str, int]:
        """(weight dtype, scale dtype, group size along the input dim; 0 = no group scales)."""
        return {
            "fp8": ("float8_e4m3", "float32", 0),
            "fp8_block": ("float8_e4m3", "float32", 0),
            "ct_fp8": ("float8_e4m3", "float32", 0),
            "ct_int4": ("int4", self.model_dtype, self.group_size),
            "ct_mxfp4": ("fp4_e2m1", "float8_e8m0", 32),
            "ct_nvfp4": ("fp4_e2m1", "float8_e4m3", 16),
        }[self.method]


def _scaled_parts(parts: tuple[tuple[int, bool], ...] | None, div: int) -> tuple[tuple[int, bool], ...] | None:
    if parts is None:
        return None
    return tuple((cdiv(size, div), split) for size, split in parts)


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    # Plain names in compressed-tensors / fp8 ignore lists are module names or suffixes.
    return module == pattern or module.endswith("." + pattern) or module.endswith(pattern)


def parse_quantization(config: Mapping[str, Any], model_dtype: str, *, source: str | None = None) -> QuantScheme:
    """The scheme of a (text) config; ``model_dtype`` is the config's ``torch_dtype`` (bf16 if absent)."""
    q = config.get("quantization_config")
    if not q:
        return QuantScheme("none", model_dtype)
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        block = q.get("weight_block_size")
        ignore = tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ())
        if block:
            if len(block) != 2:
                raise UnsupportedModelError("quantization_config.weight_block_size", block, "expected [rows, cols]", source=source)
            return QuantScheme("fp8_block", model_dtype, ignore=ignore, block=(int(block[0]), int(block[1])))
        return QuantScheme("fp8", model_dtype, ignore=ignore)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(q, model_dtype, source)
    raise UnsupportedModelError(
        "quantization_config.quant_method", method or None, "supported: fp8, compressed-tensors (or no quantization_config)",
        source=source,
    )


def _parse_compressed_tensors(q: Mapping[str, Any], model_dtype: str, source: str | None) -> QuantScheme:
    fmt = str(q.get("format", ""))
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise UnsupportedModelError(
            "quantization_config.config_groups", sorted(groups), "exactly one config group is supported", source=source
        )
    group = next(iter(groups.values()))
    weights = group.get("weights") or {}
    targets = tuple(group.get("targets") or ("Linear",))
    ignore = tuple(q.get("ignore") or ())
    num_bits = weights.get("num_bits")
    wtype = weights.get("type")
    group_size = int(weights.get("group_size") or 0)
    if fmt == "mxfp4-pack-quantized":
        if group_size not in (0, 32):
            raise UnsupportedModelError("quantization_config...group_size", group_size, "mxfp4 uses groups of 32", source=source)
        return QuantScheme("ct_mxfp4", model_dtype, targets=targets, ignore=ignore, group_size=32)
    if fmt == "nvfp4-pack-quantized":
        return QuantScheme("ct_nvfp4", model_dtype, targets=targets, ignore=ignore, group_size=16)
    if fmt == "pack-quantized":
        if num_bits != 4 or wtype not in ("int", None):
            raise UnsupportedModelError(
                "quantization_config.config_groups.weights", {"num_bits": num_bits, "type": wtype},
                "pack-quantized is supported for 4-bit int weights", source=source,
            )
        if group_size <= 0:
            raise UnsupportedModelError("quantization_config...group_size", group_size, "expected a group size > 0", source=source)
        return QuantScheme("ct_int4", model_dtype, targets=targets, ignore=ignore, group_size=group_size,
                           symmetric=bool(weights.get("symmetric", True)))
    if fmt in ("float-quantized", "naive-quantized") and num_bits == 8 and wtype == "float":
        return QuantScheme("ct_fp8", model_dtype, targets=targets, ignore=ignore,
                           per_channel=weights.get("strategy") == "channel")
    raise UnsupportedModelError(
        "quantization_config.format", fmt or None,
        "supported compressed-tensors formats: float-quantized (fp8), pack-quantized (int4), "
        "mxfp4-pack-quantized, nvfp4-pack-quantized", source=source,
    )


def model_dtype_of(config: Mapping[str, Any], *, source: str | None = None) -> str:
    raw = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    dtype = MODEL_DTYPES.get(str(raw))
    if dtype is None:
        raise UnsupportedModelError("torch_dtype", raw, f"expected one of {', '.join(sorted(MODEL_DTYPES))}", source=source)
    return dtype
