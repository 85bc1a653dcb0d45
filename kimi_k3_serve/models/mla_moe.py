"""MLA mixture-of-experts decoders: ``DeepseekV2ForCausalLM`` and ``DeepseekV3ForCausalLM`` (the class the
Kimi-K2 family uses). The MLA latent projections are replicated on every TP rank (vLLM fuses q_a and
kv_a into one ``disable_tp`` MergedColumnParallelLinear), q_b/kv_b/o are TP-sharded, and after loading vLLM
keeps ``W_UK_T``/``W_UV`` copies of ``kv_b_proj`` in the activation dtype (dequantized for fp8 checkpoints).
The checkpoint's MTP layers (``num_nextn_predict_layers``) are only loaded with MTP speculation and are not
part of the target inventory."""

from __future__ import annotations

from typing import Any, Mapping

from kimi_k3_serve.models.common import ConfigReader, gated_mlp, norm
from kimi_k3_serve.models.gqa_dense import finish
from kimi_k3_serve.models.inventory import (
    REPLICATED,
    TP_DIM0,
    TP_DIM1,
    ActivationWidths,
    LayerInventory,
    MlaKv,
    ModelInventory,
    TensorSpec,
)
from kimi_k3_serve.models.kimi_k3 import absorbed_mla_copies
from kimi_k3_serve.models.quant import model_dtype_of, parse_quantization

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def build(config: Mapping[str, Any], architecture: str, *, name: str, source: str | None) -> ModelInventory:
    r = ConfigReader(config, source)
    dtype = model_dtype_of(config, source=source)
    q = parse_quantization(config, dtype, source=source)
    hidden = r.require("hidden_size")
    heads = r.require("num_attention_heads")
    num_layers = r.require("num_hidden_layers")
    q_lora = r.optional_count("q_lora_rank")
    kv_lora = r.require("kv_lora_rank")
    rope = r.require("qk_rope_head_dim")
    nope = r.require("qk_nope_head_dim")
    v_dim = r.require("v_head_dim")
    experts = r.count("n_routed_experts", 0, minimum=0) or 0
    shared = r.count("n_shared_experts", 0, minimum=0) or 0
    moe_inter = r.count("moe_intermediate_size", 0, minimum=0)
    first_dense = r.count("first_k_dense_replace", 0, minimum=0)
    freq = r.count("moe_layer_freq", 1)
    noaux = r.get("topk_method") == "noaux_tc"
    layers = []
    for i in range(num_layers):
        p = f"model.layers.{i}.self_attn"
        t: list[TensorSpec] = []
        if q_lora:
            t += q.linear(f"{p}.q_a_proj", q_lora, hidden, REPLICATED, "attention")
            t.append(norm(f"{p}.q_a_layernorm", q_lora, dtype, "attention"))
            t += q.linear(f"{p}.q_b_proj", heads * (nope + rope), q_lora, TP_DIM0, "attention")
        else:
            t += q.linear(f"{p}.q_proj", heads * (nope + rope), hidden, TP_DIM0, "attention")
        t += q.linear(f"{p}.kv_a_proj_with_mqa", kv_lora + rope, hidden, REPLICATED, "attention")
        t.append(norm(f"{p}.kv_a_layernorm", kv_lora, dtype, "attention"))
        t += q.linear(f"{p}.kv_b_proj", heads * (nope + v_dim), kv_lora, TP_DIM0, "attention")
        t += q.linear(f"{p}.o_proj", hidden, heads * v_dim, TP_DIM1, "attention")
        t.append(absorbed_mla_copies(p, heads, nope, v_dim, kv_lora, dtype))
        m = f"model.layers.{i}.mlp"
        is_moe = experts > 0 and i >= first_dense and i % freq == 0
        if is_moe:
            t.append(TensorSpec(f"{m}.gate.weight", (experts, hidden), dtype, REPLICATED, "router_and_latent"))
            if noaux:
                t.append(TensorSpec(f"{m}.gate.e_score_correction_bias", (experts,), "float32", REPLICATED, "router_and_latent"))
            if shared:
                t += gated_mlp(q, f"{m}.shared_experts", hidden, moe_inter * shared, "shared_experts")
            t += q.experts(f"{m}.experts", experts, moe_inter, hidden)
        else:
            t += gated_mlp(q, m, hidden, r.require("intermediate_size"), "dense_mlp")
        t += [norm(f"model.layers.{i}.input_layernorm", hidden, dtype), norm(f"model.layers.{i}.post_attention_layernorm", hidden, dtype)]
        layers.append(LayerInventory(i, "mla", "moe" if is_moe else "dense", tuple(t), MlaKv(kv_lora, rope)))
    widths = ActivationWidths(hidden, max(r.count("intermediate_size", 0, minimum=0), moe_inter * shared), heads, nope + rope,
                              moe_intermediate_size=moe_inter, moe_hidden_size=hidden, num_experts=experts,
                              experts_per_token=r.count("num_experts_per_tok", 0, minimum=0))
    return finish(config, r, architecture, "mla_moe", dtype, q.describe(), layers, name=name, source=source, widths=widths)
