"""Small builders shared by the family modules: reading required config fields and making the tensors every
decoder has (norms, embeddings, lm_head, GQA attention, gated MLPs)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from kimi_k3_serve.errors import UnsupportedModelError
from kimi_k3_serve.models.inventory import REPLICATED, TP_DIM0, TP_DIM1, VOCAB, TensorSpec
from kimi_k3_serve.models.quant import QuantScheme


MAX_SIZE = 2**31 - 1
"""Any size or count in a config.json: far above every real model's, low enough that the byte sums stay exact."""
MAX_OF_FIELD = {"num_hidden_layers": 1024, "vt_num_hidden_layers": 1024}
"""Counts the inventory loops over, one tensor list per layer: the largest real models have about 128 layers."""


class ConfigReader:
    """Reads fields of one (text) config and names the missing or unsupported one in its error."""

    def __init__(self, config: Mapping[str, Any], source: str | None, prefix: str = "") -> None:
        self.config = config
        self.source = source
        self.prefix = prefix

    def field(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def require(self, key: str, kind: type = int, *, minimum: int = 1) -> Any:
        """A field that must be there; an int one at least ``minimum`` (sizes and counts: a zero one would be
        divided by, or make a model of no tensors)."""
        value = self.config.get(key)
        if value is None:
            raise UnsupportedModelError(self.field(key), None, f"required by the {self.config.get('model_type', '?')} memory model",
                                        source=self.source)
        if kind is int:
            return self._checked_int(key, value, minimum)
        if not isinstance(value, kind):
            raise UnsupportedModelError(self.field(key), value, f"expected a {kind.__name__}", source=self.source)
        return value

    def count(self, key: str, default: int, *, minimum: int = 1) -> int:
        """An optional integer field (``default`` when absent), at least ``minimum``."""
        value = self.config.get(key)
        return default if value is None else self._checked_int(key, value, minimum)

    def optional_count(self, key: str, *, minimum: int = 1) -> int | None:
        """An optional integer field whose absence means something (``q_lora_rank: null``: no q LoRA): None."""
        value = self.config.get(key)
        return None if value is None else self._checked_int(key, value, minimum)

    def _checked_int(self, key: str, value: Any, minimum: int) -> int:
        maximum = MAX_OF_FIELD.get(key, MAX_SIZE)
        if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
            raise UnsupportedModelError(self.field(key), value, f"expected an integer from {minimum} to {maximum:,}",
                                        source=self.source)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key)
        return default if value is None else value

    def reject(self, key: str, value: Any, allowed: str) -> None:
        raise UnsupportedModelError(self.field(key), value, allowed, source=self.source)


def norm(name: str, size: int, dtype: str, category: str = "norms") -> TensorSpec:
    return TensorSpec(f"{name}.weight", (size,), dtype, REPLICATED, category)


def embedding(name: str, vocab: int, hidden: int, dtype: str, category: str = "embedding") -> TensorSpec:
    return TensorSpec(f"{name}.weight", (vocab, hidden), dtype, VOCAB, category)


def gqa_attention(
    q: QuantScheme, prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int, *, bias: bool = False, qk_norm: bool = False, input_size: int | None = None, category: str = "attention",
) -> list[TensorSpec]:
    """q/k/v (vLLM QKVParallelLinear, KV heads replicated when TP > kv_heads) and o_proj (RowParallel).

    The per-rank KV-head replication (``max(1, kv_heads // tp)`` heads, i.e. ``cdiv`` rows) is expressed
    by the ``parts``: a part that TP cannot split below one head keeps one head per rank.
    """
    cols = input_size or hidden
    out = q.linear(f"{prefix}.q_proj", heads * head_dim, cols, TP_DIM0, category)
    out += _kv_proj(q, f"{prefix}.k_proj", kv_heads, head_dim, cols, category)
    out += _kv_proj(q, f"{prefix}.v_proj", kv_heads, head_dim, cols, category)
    out += q.linear(f"{prefix}.o_proj", hidden, heads * head_dim, TP_DIM1, category)
    if bias:
        out += [
            TensorSpec(f"{prefix}.q_proj.bias", (heads * head_dim,), q.model_dtype, TP_DIM0, category),
            TensorSpec(f"{prefix}.k_proj.bias", (kv_heads * head_dim,), q.model_dtype, TP_DIM0, category, kv_heads=kv_heads),
            TensorSpec(f"{prefix}.v_proj.bias", (kv_heads * head_dim,), q.model_dtype, TP_DIM0, category, kv_heads=kv_heads),
        ]
    if qk_norm:
        out += [norm(f"{prefix}.q_norm", head_dim, q.model_dtype), norm(f"{prefix}.k_norm", head_dim, q.model_dtype)]
    return out


def _kv_proj(q: QuantScheme, module: str, kv_heads: int, head_dim: int, cols: int, category: str) -> list[TensorSpec]:
    """A k or v projection: QKVParallelLinear keeps ``max(1, kv_heads // tp)`` whole heads per rank."""
    specs = q.linear(module, kv_heads * head_dim, cols, TP_DIM0, category)
    return [replace(s, kv_heads=kv_heads) if s.sharding == TP_DIM0 and s.shape[0] % kv_heads == 0 else s for s in specs]


def gated_mlp(
    q: QuantScheme, prefix: str, hidden: int, intermediate: int, category: str, *, replicated_under_sp: bool = False,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), merged: bool = False,
) -> list[TensorSpec]:
    """SwiGLU-style MLP: MergedColumnParallel gate/up and RowParallel down."""
    gate, up, down = names
    if merged:
        out = q.linear(f"{prefix}.gate_up_proj", 2 * intermediate, hidden, TP_DIM0, category,
                       parts=((intermediate, True), (intermediate, True)), replicated_under_sp=replicated_under_sp)
    else:
        out = q.linear(f"{prefix}.{gate}", intermediate, hidden, TP_DIM0, category, replicated_under_sp=replicated_under_sp)
        out += q.linear(f"{prefix}.{up}", intermediate, hidden, TP_DIM0, category, replicated_under_sp=replicated_under_sp)
    out += q.linear(f"{prefix}.{down}", hidden, intermediate, TP_DIM1, category, replicated_under_sp=replicated_under_sp)
    return out
