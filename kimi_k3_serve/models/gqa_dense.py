"""Dense GQA decoders: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM`` (q/k/v biases),
``Qwen3ForCausalLM`` (q/k RMS norms). vLLM merges q/k/v and gate/up into one parallel linear each; the
bytes are the same as the separate checkpoint tensors."""

from __future__ import annotations

from typing import Any, Mapping

from kimi_k3_serve.models.common import ConfigReader, embedding, gated_mlp, gqa_attention, norm
from kimi_k3_serve.models.inventory import VOCAB, ActivationWidths, GqaKv, LayerInventory, ModelInventory, TensorSpec
from kimi_k3_serve.models.quant import model_dtype_of, parse_quantization

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def attention_shape(r: ConfigReader) -> tuple[int, int, int, int]:
    """(hidden, heads, kv_heads, head_dim) with Llama-family defaults."""
    hidden = r.require("hidden_size")
    heads = r.require("num_attention_heads")
    kv_heads = r.count("num_key_value_heads", heads)
    head_dim = r.count("head_dim", hidden // heads)
    return hidden, heads, kv_heads, head_dim


def reject_sliding_window(r: ConfigReader, architecture: str) -> None:
    """Sliding-window layers change the KV arithmetic (window + in-flight tokens); not modelled."""
    window = r.get("sliding_window")
    used = r.get("use_sliding_window", architecture in ("MistralForCausalLM",))
    if window and used:
        r.reject("sliding_window", window, "sliding-window attention is not modelled; expected null or use_sliding_window: false")


def build(config: Mapping[str, Any], architecture: str, *, name: str, source: str | None) -> ModelInventory:
    r = ConfigReader(config, source)
    dtype = model_dtype_of(config, source=source)
    q = parse_quantization(config, dtype, source=source)
    hidden, heads, kv_heads, head_dim = attention_shape(r)
    inter = r.require("intermediate_size")
    vocab = r.require("vocab_size")
    num_layers = r.require("num_hidden_layers")
    reject_sliding_window(r, architecture)
    bias = architecture == "Qwen2ForCausalLM" or bool(r.get("attention_bias", False))
    qk_norm = architecture == "Qwen3ForCausalLM"
    layers = []
    for i in range(num_layers):
        p = f"model.layers.{i}"
        tensors = gqa_attention(q, f"{p}.self_attn", hidden, heads, kv_heads, head_dim, bias=bias, qk_norm=qk_norm)
        tensors += gated_mlp(q, f"{p}.mlp", hidden, inter, "dense_mlp")
        tensors += [norm(f"{p}.input_layernorm", hidden, dtype), norm(f"{p}.post_attention_layernorm", hidden, dtype)]
        layers.append(LayerInventory(i, "gqa", "dense", tuple(tensors), GqaKv(kv_heads, head_dim, head_dim)))
    return finish(config, r, architecture, "gqa_dense", dtype, q.describe(), layers, name=name, source=source,
                  widths=ActivationWidths(hidden, inter, heads, head_dim))


def finish(config: Mapping[str, Any], r: ConfigReader, architecture: str, family: str, dtype: str, quantization: str,
           layers: list[LayerInventory], *, name: str, source: str | None, widths: ActivationWidths,
           expert_min: int = 0) -> ModelInventory:
    """Embedding, final norm and lm_head (tied or not) around the decoder layers."""
    hidden = r.require("hidden_size")
    vocab = r.require("vocab_size")
    tied = bool(r.get("tie_word_embeddings", False))
    return ModelInventory(
        name=name, architecture=architecture, family=family, dtype=dtype, hidden_size=hidden, vocab_size=vocab,
        layers=tuple(layers),
        embedding=(embedding("model.embed_tokens", vocab, hidden, dtype),),
        head=(TensorSpec("lm_head.weight", (vocab, hidden), dtype, VOCAB, "lm_head"), norm("model.norm", hidden, dtype)),
        widths=widths, quantization=quantization, max_position_embeddings=r.count("max_position_embeddings", 0, minimum=0),
        num_attention_heads=widths.num_attention_heads, num_kv_heads=r.get("num_key_value_heads", widths.num_attention_heads),
        tie_word_embeddings=tied, expert_min_intermediate_per_rank=expert_min,
        tp_divisors=(("num_attention_heads", widths.num_attention_heads),), source=source or name,
    )
