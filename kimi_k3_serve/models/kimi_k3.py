"""Kimi-K3 (``KimiK3ForConditionalGeneration``) and its text-only class (``KimiLinearForCausalLM``): KDA and
gated MLA attention, a dense first layer, latent MoE with MXFP4 experts, Block Attention Residuals, untied
embeddings, and (multimodal class only) the MoonViT-3D vision tower.

Tensor shapes and sharding follow vLLM 0.32 ``vllm/models/kimi_k3/nvidia/{model,kda,mla}.py``:
- KDA ``in_proj_qkvgfab`` merges q/k/v/g (TP-split), f_a (replicated) and b (TP-split) and pads each rank's
  rows to a multiple of 16 (kda.py ``in_proj_padding``); conv1d weights are fp32 on the GPU (kda.py
  ``params_dtype=torch.float32``) plus an fp32 width-major copy for fused decode;
- MLA ``fused_qkv_a_g_proj`` keeps the q/kv latent projections replicated and splits the gate; after
  loading vLLM splits ``kv_b_proj`` into ``W_UK_T``/``W_UV`` (mla.py ``process_weights_after_loading``): views of
  a bf16 ``kv_b_proj``, a dequantized copy only when ``kv_b_proj`` is quantized;
- the router gate and the latent ``routed_expert_{down,up}_proj`` are ReplicatedLinear;
- experts are FusedMoE weights, padded to 256 intermediate rows per rank under TP without EP (model.py
  ``min_moe_intermediate_per_partition``).
"""

from __future__ import annotations

from typing import Any, Mapping

from kimi_k3_serve.models.common import ConfigReader, embedding, gated_mlp, norm
from kimi_k3_serve.models.inventory import (
    REPLICATED,
    TP_DIM0,
    TP_DIM1,
    VOCAB,
    ActivationWidths,
    KdaState,
    LayerInventory,
    MlaKv,
    MlaProjections,
    ModelInventory,
    TensorSpec,
)
from kimi_k3_serve.models.quant import QuantScheme, model_dtype_of, parse_quantization

ARCHITECTURES = ("KimiK3ForConditionalGeneration", "KimiLinearForCausalLM")

# The keys of linear_attn_config the KDA memory model reads; any other key is an unknown field.
_LINEAR_ATTN_KEYS = {
    "full_attn_layers", "kda_layers", "num_heads", "head_dim", "short_conv_kernel_size", "use_full_rank_gate",
    "gate_lower_bound", "num_k_heads", "head_k_dim",
}
# vLLM 0.32 KimiMoE: min_moe_intermediate_per_partition (getattr default 256).
_MIN_MOE_INTERMEDIATE_PER_RANK = 256
# KDA in_proj rows per rank are padded to this multiple (kda.py: alignment 16 unless FP8_PB_WO ModelOpt).
_KDA_IN_PROJ_ALIGN = 16


def build(config: Mapping[str, Any], architecture: str, *, name: str, source: str | None) -> ModelInventory:
    multimodal = architecture == "KimiK3ForConditionalGeneration"
    text = config.get("text_config") if multimodal else config
    if multimodal and not isinstance(text, Mapping):
        raise ConfigReader(config, source).reject("text_config", text, "KimiK3ForConditionalGeneration needs a text_config object")
    assert isinstance(text, Mapping)
    r = ConfigReader(text, source, prefix="text_config." if multimodal else "")
    dtype = model_dtype_of(text if ("torch_dtype" in text or "dtype" in text) else config, source=source)
    quant_source = text if text.get("quantization_config") else config
    q = parse_quantization(quant_source, dtype, source=source)

    hidden = r.require("hidden_size")
    vocab = r.require("vocab_size")
    num_layers = r.require("num_hidden_layers")
    heads = r.require("num_attention_heads")
    if r.count("num_nextn_predict_layers", 0, minimum=0):
        r.reject("num_nextn_predict_layers", r.get("num_nextn_predict_layers"), "MTP layers are not modelled; expected 0")
    if r.get("tie_word_embeddings", False):
        r.reject("tie_word_embeddings", True, "Kimi-K3 has untied embeddings; expected false")
    lac = r.require("linear_attn_config", dict)
    unknown = sorted(set(lac) - _LINEAR_ATTN_KEYS)
    if unknown:
        r.reject(f"linear_attn_config.{unknown[0]}", lac[unknown[0]], f"known keys: {', '.join(sorted(_LINEAR_ATTN_KEYS))}")
    if not lac.get("use_full_rank_gate", False):
        r.reject("linear_attn_config.use_full_rank_gate", lac.get("use_full_rank_gate"),
                 "only the Kimi-K3 full-rank-gate KDA is modelled (KimiK3DeltaAttention)")
    kda_layers = {int(i) for i in lac.get("kda_layers") or ()}
    full_layers = {int(i) for i in lac.get("full_attn_layers") or ()}
    if kda_layers & full_layers or len(kda_layers | full_layers) != num_layers:
        r.reject("linear_attn_config.kda_layers", sorted(kda_layers), f"kda_layers and full_attn_layers must partition 1..{num_layers}")
    lac_reader = ConfigReader(lac, source, prefix=r.field("linear_attn_config."))
    kda = KdaState(
        num_heads=lac_reader.require("num_heads"), head_dim=lac_reader.require("head_dim"),
        conv_kernel_size=lac_reader.require("short_conv_kernel_size"),
        num_k_heads=lac.get("num_k_heads"), head_k_dim=lac.get("head_k_dim"),
    )
    mla = MlaKv(kv_lora_rank=r.require("kv_lora_rank"), qk_rope_head_dim=r.require("qk_rope_head_dim"))
    if not r.get("mla_use_nope", False):
        r.reject("mla_use_nope", r.get("mla_use_nope"), "vLLM's Kimi-K3 MLA is NoPE-only (asserts mla_use_nope)")

    first_dense = r.count("first_k_dense_replace", 0, minimum=0)
    freq = r.count("moe_layer_freq", 1)
    num_experts = r.count("num_experts", 0, minimum=0) or 0
    attn_res = r.get("attn_res_block_size") is not None

    layers = []
    for i in range(num_layers):
        prefix = f"model.layers.{i}"
        is_kda = (i + 1) in kda_layers
        tensors: list[TensorSpec] = [norm(f"{prefix}.input_layernorm", hidden, dtype), norm(f"{prefix}.post_attention_layernorm", hidden, dtype)]
        if attn_res:
            tensors += [
                norm(f"{prefix}.self_attention_res_norm", hidden, dtype),
                norm(f"{prefix}.mlp_res_norm", hidden, dtype),
                TensorSpec(f"{prefix}.self_attention_res_proj.weight", (1, hidden), dtype, REPLICATED, "norms"),
                TensorSpec(f"{prefix}.mlp_res_proj.weight", (1, hidden), dtype, REPLICATED, "norms"),
            ]
        tensors += _kda_tensors(q, f"{prefix}.self_attn", hidden, kda) if is_kda else _mla_tensors(q, f"{prefix}.self_attn", hidden, heads, r)
        is_moe = bool(num_experts) and i >= first_dense and i % freq == 0
        if is_moe:
            tensors += _moe_tensors(q, f"{prefix}.block_sparse_moe", hidden, r)
        else:
            tensors += gated_mlp(q, f"{prefix}.mlp", hidden, r.require("intermediate_size"), "dense_mlp",
                                 replicated_under_sp=True, merged=True)
        layers.append(LayerInventory(i, "kda" if is_kda else "mla", "moe" if is_moe else "dense", tuple(tensors), kda if is_kda else mla))

    head = [
        TensorSpec("lm_head.weight", (vocab, hidden), dtype, VOCAB, "lm_head"),
        norm("model.norm", hidden, dtype),
    ]
    if attn_res:
        head += [norm("model.output_attn_res_norm", hidden, dtype),
                 TensorSpec("model.output_attn_res_proj.weight", (1, hidden), dtype, REPLICATED, "norms")]
    vision = _vision_tensors(config.get("vision_config") or {}, hidden, dtype, source) if multimodal else []
    moe_inter = r.count("moe_intermediate_size", 0, minimum=0)
    return ModelInventory(
        name=name,
        architecture=architecture,
        family="kimi_k3",
        dtype=dtype,
        hidden_size=hidden,
        vocab_size=vocab,
        layers=tuple(layers),
        embedding=(embedding("model.embed_tokens", vocab, hidden, dtype),),
        head=tuple(head),
        widths=ActivationWidths(
            hidden_size=hidden,
            intermediate_size=max(r.count("intermediate_size", 0, minimum=0), moe_inter * r.count("num_shared_experts", 0, minimum=0)),
            num_attention_heads=heads,
            head_dim=kda.head_dim,
            moe_intermediate_size=moe_inter,
            moe_hidden_size=r.count("routed_expert_hidden_size", 0, minimum=0) or hidden,
            num_experts=num_experts,
            experts_per_token=r.count("num_experts_per_token", 0, minimum=0),
        ),
        quantization=q.describe(),
        max_position_embeddings=r.count("max_position_embeddings", 0, minimum=0),
        num_attention_heads=heads,
        num_kv_heads=r.get("num_key_value_heads", heads),
        vision=tuple(vision),
        expert_min_intermediate_per_rank=_MIN_MOE_INTERMEDIATE_PER_RANK if num_experts else 0,
        attn_res_block_size=int(r.get("attn_res_block_size") or 0),
        tp_divisors=(("num_attention_heads", heads), ("linear_attn_config.num_heads", kda.num_heads)),
        source=source or name,
        mla=MlaProjections(
            q_lora_rank=r.optional_count("q_lora_rank") or 0, kv_lora_rank=mla.kv_lora_rank,
            qk_nope_head_dim=r.require("qk_nope_head_dim"), qk_rope_head_dim=mla.qk_rope_head_dim,
            v_head_dim=r.require("v_head_dim"), output_gate=bool(r.get("mla_use_output_gate", False)),
        ),
    )


def _kda_tensors(q: QuantScheme, prefix: str, hidden: int, kda: KdaState) -> list[TensorSpec]:
    proj = kda.num_heads * kda.head_dim
    dtype = q.model_dtype
    return [
        *q.linear(f"{prefix}.in_proj_qkvgfab", 4 * proj + kda.head_dim + kda.num_heads, hidden, TP_DIM0, "linear_attention",
                  parts=((4 * proj, True), (kda.head_dim, False), (kda.num_heads, True)), local_align=_KDA_IN_PROJ_ALIGN),
        *q.linear(f"{prefix}.f_b_proj", proj, kda.head_dim, TP_DIM0, "linear_attention"),
        TensorSpec(f"{prefix}.dt_bias", (proj,), "float32", TP_DIM0, "linear_attention"),
        TensorSpec(f"{prefix}.A_log", (kda.num_heads,), "float32", TP_DIM0, "linear_attention"),
        TensorSpec(f"{prefix}.conv1d.weight", (kda.conv_dim, kda.conv_kernel_size), "float32", TP_DIM0, "linear_attention"),
        # fp32 width-major copy for the fused decode kernels (SM90/SM10x/SM12x), built after loading.
        TensorSpec(f"{prefix}.decode_conv1d_weight", (kda.conv_dim, kda.conv_kernel_size), "float32", TP_DIM0,
                   "runtime_copies", in_checkpoint=False),
        norm(f"{prefix}.o_norm", kda.head_dim, dtype, "linear_attention"),
        TensorSpec(f"{prefix}.decode_norm_weight", (kda.head_dim,), "float32", REPLICATED, "runtime_copies", in_checkpoint=False),
        *q.linear(f"{prefix}.o_proj", hidden, proj, TP_DIM1, "linear_attention"),
    ]


def _mla_tensors(q: QuantScheme, prefix: str, hidden: int, heads: int, r: ConfigReader) -> list[TensorSpec]:
    dtype = q.model_dtype
    q_lora = r.optional_count("q_lora_rank")
    kv_lora = r.require("kv_lora_rank")
    rope = r.require("qk_rope_head_dim")
    nope = r.require("qk_nope_head_dim")
    v_dim = r.require("v_head_dim")
    gate = bool(r.get("mla_use_output_gate", False))
    out: list[TensorSpec] = []
    if q_lora:
        parts = [(q_lora, False), (kv_lora + rope, False)] + ([(heads * v_dim, True)] if gate else [])
        out += q.linear(f"{prefix}.fused_qkv_a_g_proj", sum(p for p, _ in parts), hidden, TP_DIM0, "attention", parts=tuple(parts))
        out.append(norm(f"{prefix}.q_a_layernorm", q_lora, dtype, "attention"))
        out += q.linear(f"{prefix}.q_b_proj", heads * (nope + rope), q_lora, TP_DIM0, "attention")
    else:
        out += q.linear(f"{prefix}.q_proj", heads * (nope + rope), hidden, TP_DIM0, "attention")
        out += q.linear(f"{prefix}.kv_a_proj_with_mqa", kv_lora + rope, hidden, REPLICATED, "attention")
        if gate:
            out += q.linear(f"{prefix}.g_proj", heads * v_dim, hidden, TP_DIM0, "attention")
    out.append(norm(f"{prefix}.kv_a_layernorm", kv_lora, dtype, "attention"))
    out += q.linear(f"{prefix}.kv_b_proj", heads * (nope + v_dim), kv_lora, TP_DIM0, "attention")
    out += q.linear(f"{prefix}.o_proj", hidden, heads * v_dim, TP_DIM1, "attention")
    out += kimi_mla_absorbed(q, prefix, heads, nope, v_dim, kv_lora)
    return out


def kimi_mla_absorbed(q: QuantScheme, prefix: str, heads: int, nope: int, v_dim: int, kv_lora: int) -> list[TensorSpec]:
    """What ``W_UK_T``/``W_UV`` add in vLLM 0.32's Kimi-K3 MLA (models/kimi_k3/nvidia/mla.py
    ``process_weights_after_loading``): ``split_kv_b_proj`` returns views of ``kv_b_proj.weight.to(act_dtype)`` and
    ``replace_parameter`` wraps them without a copy, so an unquantized ``kv_b_proj`` costs nothing more; a quantized
    one is dequantized into a new tensor."""
    if not q.quantizes(f"{prefix}.kv_b_proj"):
        return []
    return [absorbed_mla_copies(prefix, heads, nope, v_dim, kv_lora, q.model_dtype)]


def absorbed_mla_copies(prefix: str, heads: int, nope: int, v_dim: int, kv_lora: int, dtype: str) -> TensorSpec:
    """``W_UK_T`` + ``W_UV``: the decode-time split of ``kv_b_proj`` vLLM keeps beside it, in the model dtype."""
    return TensorSpec(f"{prefix}.W_UK_T+W_UV", (heads * (nope + v_dim), kv_lora), dtype, TP_DIM0, "runtime_copies",
                      in_checkpoint=False)


def _moe_tensors(q: QuantScheme, prefix: str, hidden: int, r: ConfigReader) -> list[TensorSpec]:
    dtype = q.model_dtype
    experts = r.require("num_experts")
    inter = r.require("moe_intermediate_size")
    latent = r.optional_count("routed_expert_hidden_size")
    moe_hidden = latent or hidden
    out = [
        TensorSpec(f"{prefix}.gate.weight", (experts, hidden), dtype, REPLICATED, "router_and_latent"),
        TensorSpec(f"{prefix}.gate.e_score_correction_bias", (experts,), "float32", REPLICATED, "router_and_latent"),
    ]
    shared = r.count("num_shared_experts", 0, minimum=0)
    if shared:
        out += gated_mlp(q, f"{prefix}.shared_experts", hidden, inter * shared, "shared_experts",
                         replicated_under_sp=True, merged=True)
    if latent:
        out += q.linear(f"{prefix}.routed_expert_down_proj", latent, hidden, REPLICATED, "router_and_latent")
        out += q.linear(f"{prefix}.routed_expert_up_proj", hidden, latent, REPLICATED, "router_and_latent")
        if r.get("latent_moe_use_norm", False):
            out.append(norm(f"{prefix}.routed_expert_norm", latent, dtype, "router_and_latent"))
    out += q.experts(f"{prefix}.experts", experts, inter, moe_hidden)
    return out


def _vision_tensors(v: Mapping[str, Any], text_hidden: int, dtype: str, source: str | None) -> list[TensorSpec]:
    """MoonViT-3D + patch-merger projector (vLLM kimi_k25_vit.py); replicated (the ViT runs data-parallel)."""
    r = ConfigReader(v, source, prefix="vision_config.")
    hidden = r.count("vt_hidden_size", 1024)
    inter = r.count("vt_intermediate_size", 4096)
    layers = r.count("vt_num_hidden_layers", 27)
    qkv = r.count("qkv_hidden_size", 1536)
    patch = r.count("patch_size", 14)
    ph, pw = r.count("init_pos_emb_height", 64), r.count("init_pos_emb_width", 64)
    kernel = r.get("merge_kernel_size", [2, 2])
    if not (isinstance(kernel, list) and len(kernel) == 2
            and all(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 64 for k in kernel)):
        r.reject("merge_kernel_size", kernel, "expected two integers from 1 to 64, e.g. [2, 2]")
    mh, mw = kernel
    merged = hidden * mh * mw

    def t(name: str, *shape: int) -> TensorSpec:
        return TensorSpec(name, tuple(shape), dtype, REPLICATED, "vision")

    out = [t("vision_tower.patch_embed.proj.weight", hidden, 3 * patch * patch), t("vision_tower.patch_embed.proj.bias", hidden),
           t("vision_tower.patch_embed.pos_emb.weight", ph * pw, hidden)]
    per_block = [
        ("norm0.weight", (hidden,)), ("norm1.weight", (hidden,)),
        ("wqkv.weight", (3 * qkv, hidden)), ("wo.weight", (hidden, qkv)),
        ("mlp.fc0.weight", (inter, hidden)), ("mlp.fc0.bias", (inter,)),
        ("mlp.fc1.weight", (hidden, inter)), ("mlp.fc1.bias", (hidden,)),
    ]
    for suffix, shape in per_block:
        out.append(TensorSpec(f"vision_tower.encoder.blocks.*.{suffix}", shape, dtype, REPLICATED, "vision", count=layers))
    out += [t("vision_tower.encoder.final_layernorm.weight", hidden),
            t("mm_projector.pre_norm.weight", hidden),
            t("mm_projector.proj.0.weight", merged, merged), t("mm_projector.proj.0.bias", merged),
            t("mm_projector.proj.2.weight", text_hidden, merged), t("mm_projector.proj.2.bias", text_hidden)]
    return out
