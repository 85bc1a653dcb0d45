"""Small builders shared by the family modules: reading required config fields and making the tensors every
decoder has (norms, embeddings, lm_head, GQA attention, gated MLPs)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from kimi_k3_serve.errors import UnsupportedModelError
from kimi_k3_serve.models.inventory import REPLICATED, TP_DIM0, TP_DIM1, VOCAB, TensorSpec
from kimi_k3_serve.models.quant import QuantScheme


class ConfigReader:
    """Reads fields of one (text) config and names the missing or unsupported one in its error."""

    def __init__(self, config: Mapping[str, Any], source: str | None, prefix: str = "") -> None:
        self.config = config
        self.source = source
        self.prefix = prefix

    def field(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def require(self, key: str, kind: type = int) -> Any:
        value = self.config.get(key)
        if value is None:
            raise UnsupportedModelError(self.field(key), None, f"required by the {self.config.get('model_type', '?')} memory model",
                                        source=self.source)
        if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise UnsupportedModelError(self.field(key), value, "expected a non-negative integer", source=self.source)
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
