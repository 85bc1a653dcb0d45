"""Speculative-decoding drafts that vLLM builds on the last pipeline stage.

- ``LlamaForCausalLMEagle3`` (vLLM ``llama_eagle3.py``): one or more Llama decoder layers whose first
  attention reads ``2 * hidden`` (embedding + fused target features), a replicated ``fc`` fusing three
  target hidden states, its own (possibly smaller) ``lm_head``; the input embedding is the target's.
- ``K3DSparkModel`` (vLLM ``models/kimi_k3/nvidia/dspark_mla.py``): dense MLA decoder layers (RoPE, no
  output gate, ``non_causal_multi_token_decode``), a replicated ``context_proj`` over the tapped target
  layers, a replicated per-layer ``context_kv_proj``, and a replicated Markov head; it shares the target's
  embedding and lm_head (``k3_dspark.py`` requires ``draft_vocab_size == vocab_size``). Its MLA layers use RoPE:
  one fp32 cos/sin table of ``max_position_embeddings`` rows, shared by every layer and whole on every rank.
- ``Eagle3DeepseekV2ForCausalLM`` (vLLM ``deepseek_eagle3.py``; ``Eagle3DeepseekV3ForCausalLM`` is the same class):
  causal DeepSeek-V2 MLA decoder layers (``DeepseekV2MLAAttention``, RoPE, no gate) with a dense
  ``DeepseekV2MLP`` (never MoE), the first layer's latent projections reading ``2 * hidden``, a ``hidden_norm``
  in every layer, a replicated ``fc`` over the tapped target layers and its own ``lm_head``; the input
  embedding is the target's. Its MLA cache is the target's page when ``kv_lora_rank + qk_rope_head_dim`` match.
"""

from __future__ import annotations

from typing import Any, Mapping

from kimi_k3_serve.models.common import ConfigReader, gated_mlp, gqa_attention, norm
from kimi_k3_serve.models.inventory import (
    REPLICATED,
    TP_DIM0,
    TP_DIM1,
    VOCAB,
    ActivationWidths,
    DraftInfo,
    GenericMlaDims,
    GqaKv,
    LayerInventory,
    MlaKv,
    ModelInventory,
    TensorSpec,
)
from kimi_k3_serve.models.kimi_k3 import kimi_mla_absorbed
from kimi_k3_serve.models.quant import QuantScheme, model_dtype_of, parse_quantization

ARCHITECTURES = ("LlamaForCausalLMEagle3", "K3DSparkModel", "Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")


def build(config: Mapping[str, Any], architecture: str, *, name: str, source: str | None) -> ModelInventory:
    if architecture == "K3DSparkModel":
        return _dspark(config, name=name, source=source)
    if architecture in ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM"):
        return _eagle3_mla(config, architecture, name=name, source=source)
    return _eagle3(config, name=name, source=source)


def _eagle3(config: Mapping[str, Any], *, name: str, source: str | None) -> ModelInventory:
    r = ConfigReader(config, source)
    dtype = model_dtype_of(config, source=source)
    q = parse_quantization(config, dtype, source=source)
    hidden = r.require("hidden_size")
    heads = r.require("num_attention_heads")
    kv_heads = r.count("num_key_value_heads", heads)
    head_dim = r.count("head_dim", hidden // heads)
    inter = r.require("intermediate_size")
    vocab = r.require("vocab_size")
    draft_vocab = r.count("draft_vocab_size", 0, minimum=0) or vocab
    target_hidden = r.count("target_hidden_size", 0, minimum=0) or hidden
    num_layers = r.count("num_hidden_layers", 1)
    layers = []
    for i in range(num_layers):
        prefix = "midlayer" if num_layers == 1 else f"layers.{i}"
        tensors = gqa_attention(q, f"{prefix}.self_attn", hidden, heads, kv_heads, head_dim,
                                input_size=2 * hidden if i == 0 else hidden, category="draft")
        tensors += gated_mlp(q, f"{prefix}.mlp", hidden, inter, "draft")
        tensors += [norm(f"{prefix}.input_layernorm", hidden, dtype, "draft"), norm(f"{prefix}.post_attention_layernorm", hidden, dtype, "draft")]
        if i == 0:
            tensors.append(norm(f"{prefix}.hidden_norm", hidden, dtype, "draft"))
        layers.append(LayerInventory(i, "gqa", "dense", tuple(tensors), GqaKv(kv_heads, head_dim, head_dim)))
    extra = [
        TensorSpec("fc.weight", (hidden, 3 * target_hidden), dtype, REPLICATED, "draft"),
        norm("norm", hidden, dtype, "draft"),
        TensorSpec("lm_head.weight", (draft_vocab, hidden), dtype, VOCAB, "draft_lm_head"),
    ]
    if draft_vocab != vocab:
        extra += [TensorSpec("d2t", (draft_vocab,), "int64", REPLICATED, "draft"),
                  TensorSpec("t2d", (vocab,), "uint8", REPLICATED, "draft")]
    return ModelInventory(
        name=name, architecture="LlamaForCausalLMEagle3", family="eagle3", dtype=dtype, hidden_size=hidden, vocab_size=vocab,
        layers=tuple(layers), embedding=(), head=(),
        widths=ActivationWidths(hidden, inter, heads, head_dim),
        quantization=q.describe(), max_position_embeddings=r.count("max_position_embeddings", 0, minimum=0),
        num_attention_heads=heads, num_kv_heads=kv_heads, draft_extra=tuple(extra),
        draft=DraftInfo("eagle3", shares_target_embedding=True, shares_target_lm_head=False),
        tp_divisors=(("num_attention_heads", heads),), source=source or name,
    )


def _dspark_rope_table(r: ConfigReader, rope_dim: int) -> TensorSpec:
    """The RoPE cos/sin table of the DSpark MLA layers, built while the draft loads: vLLM 0.32 models/kimi_k3/nvidia/
    mla.py asks ``get_rope(qk_rope_head_dim, max_position_embeddings, dtype=torch.float32)``, which caches one instance
    for all layers (rotary_embedding/__init__.py ``_ROPE_DICT``); its ``cos_sin_cache`` is ``[max_position, rope_dim]``
    fp32 (base.py), ``x factor`` rows under deepseek_yarn (deepseek_scaling_rope.py). Not TP-split. vLLM raises a draft's
    max_position_embeddings to the target's max_model_len when smaller (config/speculative.py); not modelled here."""
    rows = r.require("max_position_embeddings")
    scaling = r.get("rope_scaling") or r.get("rope_parameters") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        rows = int(rows * float(scaling.get("factor", 1.0)))
    return TensorSpec("rotary_emb.cos_sin_cache", (rows, rope_dim), "float32", REPLICATED, "runtime_copies", in_checkpoint=False)


def _eagle3_mla_rope_table(r: ConfigReader, rope_dim: int, dtype: str) -> TensorSpec:
    """The MLA EAGLE3's RoPE cos/sin table, built while the draft loads (so inside "Model loading took"):
    ``DeepseekV2MLAAttention`` (vLLM 0.32 deepseek_v2.py) asks ``get_rope(qk_rope_head_dim, max_position_embeddings,
    rope_parameters, is_neox_style=False)`` without a dtype, so the table takes torch's default dtype while the model
    is built, the model's (rotary_embedding/__init__.py; base.py ``cache.to(dtype)``): ``[max_position, rope_dim]``,
    ``x factor`` rows under a scaled rope (deepseek_scaling_rope.py). Not TP-split; Kimi-K3's own MLA (NoPE) has no
    table to share it with. 128 MiB at Kimi-K3's 1,048,576 positions."""
    rows = r.require("max_position_embeddings")
    scaling = r.get("rope_scaling") or r.get("rope_parameters") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        rows = int(rows * float(scaling.get("factor", 1.0)))
    return TensorSpec("rotary_emb.cos_sin_cache", (rows, rope_dim), dtype, REPLICATED, "runtime_copies", in_checkpoint=False)


def _mla_draft_layer(q: QuantScheme, p: str, hidden: int, cols: int, heads: int, q_lora: int | None, kv_lora: int,
                     rope: int, nope: int, v_dim: int, inter: int) -> list[TensorSpec]:
    """One dense MLA decoder layer of a draft (DSpark's, the MLA EAGLE3's), reading ``cols`` wide inputs: the q and
    kv latent projections stay whole on every rank (``DeepSeekV2FusedQkvAProjLinear``, ``disable_tp``), the heads
    and the SwiGLU MLP are TP-split, and ``W_UK_T``/``W_UV`` are views of an unquantized ``kv_b_proj`` (Kimi-K3's
    mla.py and layers/attention/mla_attention.py split it alike: ``kimi_mla_absorbed``)."""
    dtype = q.model_dtype
    if q_lora:
        tensors = [*q.linear(f"{p}.self_attn.fused_qkv_a_proj", q_lora + kv_lora + rope, cols, REPLICATED, "draft"),
                   norm(f"{p}.self_attn.q_a_layernorm", q_lora, dtype, "draft"),
                   *q.linear(f"{p}.self_attn.q_b_proj", heads * (nope + rope), q_lora, TP_DIM0, "draft")]
    else:
        tensors = [*q.linear(f"{p}.self_attn.kv_a_proj_with_mqa", kv_lora + rope, cols, REPLICATED, "draft"),
                   *q.linear(f"{p}.self_attn.q_proj", heads * (nope + rope), cols, TP_DIM0, "draft")]
    return tensors + [
        norm(f"{p}.self_attn.kv_a_layernorm", kv_lora, dtype, "draft"),
        *q.linear(f"{p}.self_attn.kv_b_proj", heads * (nope + v_dim), kv_lora, TP_DIM0, "draft"),
        *q.linear(f"{p}.self_attn.o_proj", hidden, heads * v_dim, TP_DIM1, "draft"),
        *kimi_mla_absorbed(q, f"{p}.self_attn", heads, nope, v_dim, kv_lora),
        *gated_mlp(q, f"{p}.mlp", hidden, inter, "draft", merged=True),
        norm(f"{p}.input_layernorm", hidden, dtype, "draft"),
        norm(f"{p}.post_attention_layernorm", hidden, dtype, "draft"),
    ]


def _dspark(config: Mapping[str, Any], *, name: str, source: str | None) -> ModelInventory:
    r = ConfigReader(config, source)
    dtype = model_dtype_of(config, source=source)
    q = parse_quantization(config, dtype, source=source)
    hidden = r.require("hidden_size")
    heads = r.require("num_attention_heads")
    inter = r.require("intermediate_size")
    vocab = r.require("vocab_size")
    q_lora = r.optional_count("q_lora_rank")
    if not q_lora:
        r.reject("q_lora_rank", q_lora, "MLA DSpark requires q_lora_rank (vLLM k3_dspark.py)")
    draft_vocab = r.count("draft_vocab_size", 0, minimum=0) or vocab
    if draft_vocab != vocab:
        r.reject("draft_vocab_size", draft_vocab, f"MLA DSpark shares the target lm_head: must equal vocab_size {vocab}")
    for flag in ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm"):
        if r.get(flag, False):
            r.reject(flag, True, "MLA DSpark does not support it (vLLM k3_dspark.py)")
    target_ids = tuple(int(i) for i in r.require("target_layer_ids", list))
    if r.get("num_target_layers") != len(target_ids):
        r.reject("num_target_layers", r.get("num_target_layers"), f"must equal len(target_layer_ids) = {len(target_ids)}")
    kv_lora = r.require("kv_lora_rank")
    rope = r.require("qk_rope_head_dim")
    nope = r.require("qk_nope_head_dim")
    v_dim = r.require("v_head_dim")
    num_layers = r.require("num_hidden_layers")
    layers = []
    for i in range(num_layers):
        tensors = _mla_draft_layer(q, f"layers.{i}", hidden, hidden, heads, q_lora, kv_lora, rope, nope, v_dim, inter)
        layers.append(LayerInventory(i, "mla", "dense", tuple(tensors), MlaKv(kv_lora, rope)))
    target_hidden = r.count("target_hidden_size", 0, minimum=0) or hidden
    markov = r.require("markov_rank")
    extra = [
        TensorSpec("context_proj.weight", (hidden, target_hidden * len(target_ids)), dtype, REPLICATED, "draft"),
        norm("context_norm", hidden, dtype, "draft"),
        TensorSpec("context_kv_proj.weight", ((kv_lora + rope) * num_layers, hidden), dtype, REPLICATED, "draft"),
        norm("final_norm", hidden, dtype, "draft"),
        TensorSpec("markov_head.markov_w1.weight", (vocab, markov), dtype, REPLICATED, "draft"),
        TensorSpec("markov_head.markov_w2.weight", (draft_vocab, markov), dtype, REPLICATED, "draft"),
        _dspark_rope_table(r, rope),
    ]
    if r.get("enable_confidence_head", False):
        width = hidden + (markov if r.get("confidence_head_with_markov", False) else 0)
        extra += [TensorSpec("confidence_head.weight", (1, width), dtype, REPLICATED, "draft"),
                  TensorSpec("confidence_head.bias", (1,), dtype, REPLICATED, "draft")]
    block = r.optional_count("block_size")
    return ModelInventory(
        name=name, architecture="K3DSparkModel", family="dspark", dtype=dtype, hidden_size=hidden, vocab_size=vocab,
        layers=tuple(layers), embedding=(), head=(),
        widths=ActivationWidths(hidden, inter, heads, nope + rope),
        quantization=q.describe(), max_position_embeddings=r.count("max_position_embeddings", 0, minimum=0),
        num_attention_heads=heads, num_kv_heads=heads, draft_extra=tuple(extra),
        draft=DraftInfo("dspark", shares_target_embedding=True, shares_target_lm_head=True,
                        num_speculative_tokens_default=int(block) if block else None, target_layer_ids=target_ids),
        tp_divisors=(("num_attention_heads", heads),), source=source or name,
    )


def _eagle3_mla(config: Mapping[str, Any], architecture: str, *, name: str, source: str | None) -> ModelInventory:
    """vLLM 0.32 ``deepseek_eagle3.py`` over ``deepseek_v2.py``'s ``DeepseekV2MLAAttention`` and ``DeepseekV2MLP``."""
    r = ConfigReader(config, source)
    dtype = model_dtype_of(config, source=source)
    q = parse_quantization(config, dtype, source=source)
    hidden = r.require("hidden_size")
    heads = r.require("num_attention_heads")
    inter = r.require("intermediate_size")
    vocab = r.require("vocab_size")
    draft_vocab = r.count("draft_vocab_size", 0, minimum=0) or vocab
    kv_lora = r.require("kv_lora_rank")
    rope = r.require("qk_rope_head_dim")
    nope = r.require("qk_nope_head_dim")
    v_dim = r.require("v_head_dim")
    if "q_lora_rank" not in config:
        # vLLM reads config.q_lora_rank, so an absent key takes the config class's default (1536 in DeepseekV3Config).
        r.reject("q_lora_rank", None, "must be given (an integer, or null for a q_proj without a LoRA)")
    q_lora = r.optional_count("q_lora_rank")
    if r.get("hidden_act", "silu") != "silu":
        r.reject("hidden_act", r.get("hidden_act"), "silu (DeepseekV2MLP raises on anything else)")
    if r.get("index_topk") is not None:
        r.reject("index_topk", r.get("index_topk"), "absent: the DeepSeek-V3.2 indexer of an EAGLE3 draft is not modelled")
    target_hidden = r.count("target_hidden_size", 0, minimum=0) or hidden
    # DeepseekV2Eagle3Model: num_aux_hidden_states, else len(eagle_config.eagle_aux_hidden_state_layer_ids), else 3.
    aux_ids = (r.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    num_aux = r.get("num_aux_hidden_states") or (len(aux_ids) if aux_ids else 3)
    num_layers = r.require("num_hidden_layers")
    layers = []
    for i in range(num_layers):
        cols = 2 * hidden if i == 0 else hidden  # the first layer reads [embedding; fused target features]
        # Its DeepseekV2MLP leaves is_sequence_parallel False: TP-split even when the target replicates its MLPs.
        tensors = _mla_draft_layer(q, f"layers.{i}", hidden, cols, heads, q_lora, kv_lora, rope, nope, v_dim, inter)
        tensors.append(norm(f"layers.{i}.hidden_norm", hidden, dtype, "draft"))  # built in every layer, read by the first only
        layers.append(LayerInventory(i, "mla", "dense", tuple(tensors), MlaKv(kv_lora, rope)))
    extra = [
        # ReplicatedLinear with params_dtype = the target's dtype.
        TensorSpec("fc.weight", (hidden, target_hidden * num_aux), dtype, REPLICATED, "draft"),
        norm("norm", hidden, dtype, "draft"),
        # Its own ParallelLMHead, as a checkpoint with lm_head weights keeps it (v1/worker/gpu/spec_decode/eagle/
        # utils.py load_eagle_model); dummy weights share the target's (memory._draft_bytes).
        TensorSpec("lm_head.weight", (draft_vocab, hidden), dtype, VOCAB, "draft_lm_head"),
    ]
    if r.get("fc_norm", False):
        extra.append(TensorSpec("fc_norm.*.weight", (target_hidden,), dtype, REPLICATED, "draft", count=num_aux))
    extra.append(_eagle3_mla_rope_table(r, rope, dtype))
    if draft_vocab != vocab:
        # draft_id_to_target_id only; load_weights skips t2d.
        extra.append(TensorSpec("draft_id_to_target_id", (draft_vocab,), "int64", REPLICATED, "draft"))
    return ModelInventory(
        name=name, architecture=architecture, family="eagle3", dtype=dtype, hidden_size=hidden, vocab_size=vocab,
        layers=tuple(layers), embedding=(), head=(),
        widths=ActivationWidths(hidden, inter, heads, nope + rope),
        quantization=q.describe(), max_position_embeddings=r.count("max_position_embeddings", 0, minimum=0),
        num_attention_heads=heads, num_kv_heads=heads, draft_extra=tuple(extra),
        draft=DraftInfo("eagle3", shares_target_embedding=True, shares_target_lm_head=False, num_aux_hidden_states=num_aux,
                        generic_mla=GenericMlaDims(q_lora or 0, kv_lora, nope, rope, v_dim)),
        tp_divisors=(("num_attention_heads", heads), ("intermediate_size", inter)), source=source or name,
    )
