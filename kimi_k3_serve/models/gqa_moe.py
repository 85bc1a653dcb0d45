"""GQA mixture-of-experts decoders: ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM``. The router is
replicated; experts are FusedMoE weights (EP: whole experts per rank; TP: the intermediate dim split)."""

from __future__ import annotations

from typing import Any, Mapping

from kimi_k3_serve.models.common import ConfigReader, gated_mlp, gqa_attention, norm
from kimi_k3_serve.models.gqa_dense import attention_shape, finish, reject_sliding_window
from kimi_k3_serve.models.inventory import REPLICATED, ActivationWidths, GqaKv, LayerInventory, ModelInventory, TensorSpec
from kimi_k3_serve.models.quant import model_dtype_of, parse_quantization

ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


def build(config: Mapping[str, Any], architecture: str, *, name: str, source: str | None) -> ModelInventory:
    r = ConfigReader(config, source)
    dtype = model_dtype_of(config, source=source)
    q = parse_quantization(config, dtype, source=source)
    hidden, heads, kv_heads, head_dim = attention_shape(r)
    num_layers = r.require("num_hidden_layers")
    reject_sliding_window(r, architecture)
    mixtral = architecture == "MixtralForCausalLM"
    if mixtral:
        experts, top_k, moe_inter = r.require("num_local_experts"), r.require("num_experts_per_tok"), r.require("intermediate_size")
        dense_inter, sparse_step, mlp_only = 0, 1, set()
    else:
        experts, top_k, moe_inter = r.require("num_experts"), r.require("num_experts_per_tok"), r.require("moe_intermediate_size")
        dense_inter = r.count("intermediate_size", 0, minimum=0)
        sparse_step = r.count("decoder_sparse_step", 1)
        mlp_only = set(r.get("mlp_only_layers", []))
    moe_prefix = "block_sparse_moe" if mixtral else "mlp"
    layers = []
    for i in range(num_layers):
        p = f"model.layers.{i}"
        tensors = gqa_attention(q, f"{p}.self_attn", hidden, heads, kv_heads, head_dim, qk_norm=not mixtral)
        is_moe = i not in mlp_only and experts > 0 and (i + 1) % sparse_step == 0
        if is_moe:
            tensors.append(TensorSpec(f"{p}.{moe_prefix}.gate.weight", (experts, hidden), dtype, REPLICATED, "router_and_latent"))
            tensors += q.experts(f"{p}.{moe_prefix}.experts", experts, moe_inter, hidden)
        else:
            tensors += gated_mlp(q, f"{p}.mlp", hidden, dense_inter, "dense_mlp")
        tensors += [norm(f"{p}.input_layernorm", hidden, dtype), norm(f"{p}.post_attention_layernorm", hidden, dtype)]
        layers.append(LayerInventory(i, "gqa", "moe" if is_moe else "dense", tuple(tensors), GqaKv(kv_heads, head_dim, head_dim)))
    widths = ActivationWidths(hidden, dense_inter, heads, head_dim, moe_intermediate_size=moe_inter, moe_hidden_size=hidden,
                              num_experts=experts, experts_per_token=top_k)
    return finish(config, r, architecture, "gqa_moe", dtype, q.describe(), layers, name=name, source=source, widths=widths)
