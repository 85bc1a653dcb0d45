"""Model inventories from config.json: golden numbers derived from the configs, families, quantization,
and clear errors for what is not modelled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_k3_serve.errors import ConfigError, UnsupportedModelError
from kimi_k3_serve.models import inventory_from_config, load_model, read_config
from kimi_k3_serve.models.inventory import EXPERT, TensorSpec
from kimi_k3_serve.models.quant import QuantScheme, parse_quantization

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
CHECKPOINT_BYTES = 1_560_860_324_864  # the released index's total_size (kimi-k3-facts.md 0, S10)


def test_kimi_k3_parameter_count_and_checkpoint_bytes() -> None:
    m = load_model("kimi-k3")
    assert round(m.total_params / 1e9, 2) == 2779.93
    assert abs(m.checkpoint_bytes / CHECKPOINT_BYTES - 1) < 1e-4
    print(f"\nKimi-K3: {m.total_params:,} params, {m.checkpoint_bytes:,} B vs index {CHECKPOINT_BYTES:,} B "
          f"({(m.checkpoint_bytes / CHECKPOINT_BYTES - 1) * 100:+.5f} %)")


def test_kimi_k3_layer_layout() -> None:
    m = load_model("kimi-k3")
    assert (m.count_layers("kda"), m.count_layers("mla"), m.num_layers) == (69, 24, 93)
    mla = [layer.index for layer in m.layers if layer.attention == "mla"]
    assert mla == [3 + 4 * k for k in range(23)] + [92]  # 1-based 4, 8, ..., 92 and 93
    assert m.layers[0].mlp == "dense" and all(layer.mlp == "moe" for layer in m.layers[1:])

    def params(layer, prefix: str) -> int:
        return sum(t.elements for t in layer.tensors if t.in_checkpoint and ".self_attn." in t.name and t.name.startswith(prefix))

    # Facts sheet 1.8: 443.7 M per KDA layer, 232.2 M per MLA layer (attention parameters).
    assert round(params(m.layers[0], "model.layers.0.") / 1e6, 1) == 443.7
    assert round(params(m.layers[3], "model.layers.3.") / 1e6, 1) == 232.2
    vision = sum(t.elements for t in m.vision)
    assert vision / 1e9 == pytest.approx(0.447, rel=0.005)  # "about 0.447 B" (facts 1.6); tower reconstructed


def test_kimi_k3_experts_are_mxfp4_everything_else_bf16() -> None:
    m = load_model("kimi-k3")
    experts = [t for layer in m.layers for t in layer.tensors if t.sharding == EXPERT]
    weights = [t for t in experts if t.name.endswith(("w13_weight", "w2_weight"))]
    scales = [t for t in experts if t.name.endswith("_scale")]
    assert {t.dtype for t in weights} == {"fp4_e2m1"} and {t.dtype for t in scales} == {"float8_e8m0"}
    bytes_per_param = sum(t.nbytes for t in experts) / sum(t.elements for t in weights)
    assert bytes_per_param == pytest.approx(0.53125)  # 0.5 B + one E8M0 byte per 32
    others = [t for layer in m.layers for t in layer.tensors if t.sharding != EXPERT and t.in_checkpoint]
    assert {t.dtype for t in others} <= {"bfloat16", "float32"}


def test_text_only_class_from_text_config_matches_multimodal_text_part() -> None:
    raw, _, _ = read_config("kimi-k3")
    text = dict(raw["text_config"], architectures=["KimiLinearForCausalLM"], quantization_config=raw["quantization_config"])
    text_only = inventory_from_config(text, name="k3-text")
    full = load_model("kimi-k3")
    assert text_only.architecture == "KimiLinearForCausalLM" and not text_only.vision
    assert text_only.total_params == full.total_params - sum(t.elements for t in full.vision)


def test_checkpoint_folder_and_config_path(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text((FIXTURES / "llama-3.1-8b.json").read_text())
    by_folder = load_model(tmp_path / "ckpt")
    by_file = load_model(FIXTURES / "llama-3.1-8b.json")
    assert by_folder.total_params == by_file.total_params
    assert by_folder.name == "ckpt"


@pytest.mark.parametrize("fixture,expected_b,rel", [
    ("deepseek-v3.json", 671.0, 0.002),   # 671 B without the MTP module
    ("mixtral-8x7b.json", 46.7, 0.002),
    ("qwen3-30b-a3b.json", 30.5, 0.002),
    ("llama-3.1-8b.json", 8.03, 0.001),
    ("qwen2-7b.json", 7.62, 0.001),
])
def test_family_parameter_counts_match_published(fixture: str, expected_b: float, rel: float) -> None:
    m = load_model(FIXTURES / fixture)
    assert m.total_params / 1e9 == pytest.approx(expected_b, rel=rel)


def test_deepseek_v3_fp8_block_scales_and_absorbed_copies() -> None:
    m = load_model(FIXTURES / "deepseek-v3.json")
    layer = m.layers[5]
    names = {t.name.rsplit(".", 1)[-1] for t in layer.tensors}
    assert "weight_scale_inv" in names and "w13_weight_scale_inv" in names
    kv_b = next(t for t in layer.tensors if t.name.endswith("kv_b_proj.weight"))
    copies = next(t for t in layer.tensors if t.category == "runtime_copies")
    assert kv_b.dtype == "float8_e4m3" and copies.dtype == "bfloat16" and copies.elements == kv_b.elements
    assert m.layers[0].mlp == "dense" and m.layers[3].mlp == "moe"


def test_dspark_draft_shares_target_embedding_and_head() -> None:
    d = load_model("kimi-k3-dspark")
    assert d.architecture == "K3DSparkModel" and d.draft is not None
    assert d.draft.shares_target_embedding and d.draft.shares_target_lm_head
    assert not d.embedding and not d.head and d.count_layers("mla") == 5
    assert d.draft.num_speculative_tokens_default == 7 and d.draft.target_layer_ids == (2, 23, 47, 71, 89)
    assert 2.4e9 < d.total_params < 2.8e9


def test_eagle3_draft_reads_two_hidden_widths() -> None:
    d = load_model(FIXTURES / "tiny-eagle3.json")
    q = next(t for t in d.layers[0].tensors if t.name.endswith("q_proj.weight"))
    assert q.shape == (128, 256)  # the first layer's attention reads embedding + fused features
    assert d.draft is not None and d.draft.method == "eagle3" and not d.draft.shares_target_lm_head


def _mla_eagle3_bytes_per_rank(c: dict, tp: int) -> int:
    """One rank's bytes of an ``Eagle3DeepseekV2ForCausalLM`` (bf16), counted from vLLM 0.32's layer structure:
    ``DeepseekV2Eagle3DecoderLayer`` = ``DeepseekV2MLAAttention`` (fused q/kv latent ReplicatedLinear-like
    ``disable_tp``, column-parallel ``q_b_proj`` / ``kv_b_proj``, row-parallel ``o_proj``; ``W_UK_T`` / ``W_UV``
    are views of the unquantized ``kv_b_proj``, ``mla_attention.py`` ``split_kv_b_proj``) + ``DeepseekV2MLP`` (merged gate/up column, down row) + three
    RMSNorms; then a replicated ``fc``, the final norm, a vocab-parallel ``lm_head`` (rows padded to 64) and the
    attention's RoPE cos/sin table (``get_rope`` in the default dtype: ``max_position_embeddings x qk_rope_head_dim``)."""
    h, heads, inter = c["hidden_size"], c["num_attention_heads"], c["intermediate_size"]
    q_lora, kv_lora, rope = c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v = c["qk_nope_head_dim"], c["v_head_dim"]
    aux = len(c["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    local_heads = heads // tp
    elements = 0
    for i in range(c["num_hidden_layers"]):
        first_in = 2 * h if i == 0 else h
        elements += (q_lora + kv_lora + rope) * first_in + q_lora + kv_lora   # fused_qkv_a_proj, q_a / kv_a norms
        elements += local_heads * (nope + rope) * q_lora                     # q_b_proj
        elements += local_heads * (nope + v) * kv_lora                       # kv_b_proj (W_UK_T / W_UV: views of it)
        elements += h * local_heads * v                                      # o_proj
        elements += 3 * (inter // tp) * h                                    # gate_up_proj + down_proj
        elements += 3 * h                                                    # input / post_attention / hidden norms
    elements += h * c.get("target_hidden_size", h) * aux + h                 # fc, final norm
    padded_vocab = -(-c["draft_vocab_size"] // 64) * 64
    elements += -(-padded_vocab // tp) * h                                   # lm_head
    elements += c["max_position_embeddings"] * rope                          # rotary_emb.cos_sin_cache, whole
    return elements * 2


@pytest.mark.parametrize("tp", [1, 2])
def test_mla_eagle3_draft_bytes_per_rank_from_vllm_layer_structure(tp: int) -> None:
    from kimi_k3_serve.rehearsal.slicing import slice_draft_config

    config = read_config("kimi-k3-eagle3-mla")[0]
    for c in (config, slice_draft_config(config, 8)):
        d = inventory_from_config(c, name="d")
        got = sum(sum(x.values()) for x in d.layer_bytes(tp, tp, False)) + sum(d.group_bytes("draft_extra", tp, tp, False).values())
        assert got == _mla_eagle3_bytes_per_rank(c, tp)
        print(f"\nMLA EAGLE3 draft ({c['eagle_config']['eagle_aux_hidden_state_layer_ids']}) TP{tp}: {got / 2**30:.3f} GiB per rank")


def test_mla_eagle3_draft_is_an_mla_eagle3_on_the_target_page() -> None:
    d = load_model("kimi-k3-eagle3-mla")
    k3 = load_model("kimi-k3")
    assert d.architecture == "Eagle3DeepseekV2ForCausalLM" and d.family == "eagle3" and d.draft is not None
    assert d.draft.method == "eagle3" and d.draft.shares_target_embedding and not d.draft.shares_target_lm_head
    assert not d.embedding and d.count_layers("mla") == d.num_layers == 1 and all(x.mlp == "dense" for x in d.layers)
    target_mla = next(x.kv for x in k3.layers if x.attention == "mla")
    assert d.layers[0].kv == target_mla  # one latent page size: the draft can share the target's KV pool
    a = next(t for t in d.layers[0].tensors if t.name.endswith("fused_qkv_a_proj.weight"))
    assert a.shape == (1536 + 512 + 64, 2 * 7168) and a.sharding == "replicated"
    # The V3 name is an alias of the same vLLM class.
    v3 = inventory_from_config({**read_config("kimi-k3-eagle3-mla")[0], "architectures": ["Eagle3DeepseekV3ForCausalLM"]})
    assert v3.layer_bytes(2, 2, False) == d.layer_bytes(2, 2, False)


@pytest.mark.parametrize("field,value,says", [
    ("hidden_act", "gelu", "silu"),
    ("index_topk", 2048, "indexer"),
])
def test_mla_eagle3_refuses_what_vllm_would_not_build_as_modelled(field: str, value, says: str) -> None:
    config = {**read_config("kimi-k3-eagle3-mla")[0], field: value}
    with pytest.raises(UnsupportedModelError, match=says) as err:
        inventory_from_config(config)
    assert field in str(err.value)


def test_mla_eagle3_needs_q_lora_rank_given() -> None:
    config = {k: v for k, v in read_config("kimi-k3-eagle3-mla")[0].items() if k != "q_lora_rank"}
    with pytest.raises(UnsupportedModelError, match="q_lora_rank"):
        inventory_from_config(config)
    # null is a q_proj without the LoRA: q_proj TP-split over the first layer's 2 * hidden inputs.
    d = inventory_from_config({**config, "q_lora_rank": None})
    q = next(t for t in d.layers[0].tensors if t.name.endswith("self_attn.q_proj.weight"))
    assert q.shape == (96 * 192, 2 * 7168) and q.sharding == "tp_dim0"


def test_kv_heads_replicate_when_tp_exceeds_them() -> None:
    m = load_model(FIXTURES / "qwen3-30b-a3b.json")  # 4 KV heads, head_dim 128
    k = next(t for t in m.layers[0].tensors if t.name.endswith("k_proj.weight"))
    assert k.local_elements(tp=4, ep_size=4, ep=False) == 128 * 2048
    assert k.local_elements(tp=8, ep_size=8, ep=False) == 128 * 2048  # one head per rank, replicated


@pytest.mark.parametrize("method,fmt,bytes_per_weight", [
    ("ct_mxfp4", {"format": "mxfp4-pack-quantized"}, 0.5 + 1 / 32),
    ("ct_nvfp4", {"format": "nvfp4-pack-quantized"}, 0.5 + 1 / 16),
    ("ct_int4", {"format": "pack-quantized", "group_size": 128}, 0.5 + 2 / 128),
])
def test_compressed_tensors_formats(method: str, fmt: dict, bytes_per_weight: float) -> None:
    weights = {"num_bits": 4, "type": "int" if method == "ct_int4" else "float", "group_size": fmt.get("group_size", 32)}
    config = {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt["format"], "ignore": ["lm_head"],
                                      "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}}
    q = parse_quantization(config, "bfloat16")
    assert q.method == method
    tensors = q.linear("model.layers.0.mlp.down_proj", 4096, 4096, "tp_dim1", "dense_mlp")
    per_weight = sum(t.nbytes for t in tensors if not t.name.endswith("global_scale")) / (4096 * 4096)
    assert per_weight == pytest.approx(bytes_per_weight)
    assert not q.quantizes("lm_head")


def test_fp8_per_tensor_and_ignored_modules() -> None:
    q = parse_quantization({"quantization_config": {"quant_method": "fp8", "ignored_layers": ["mlp.gate"]}}, "bfloat16")
    t = q.linear("model.layers.1.self_attn.o_proj", 1024, 1024, "tp_dim1", "attention")
    assert [x.dtype for x in t] == ["float8_e4m3", "float32"] and t[1].elements == 1
    assert q.quantizes("model.layers.1.self_attn.o_proj") and not q.quantizes("model.layers.1.mlp.gate")


def test_expert_padding_trap_under_tp16_without_ep() -> None:
    m = load_model("kimi-k3")
    w13 = next(t for t in m.layers[5].tensors if t.name.endswith("w13_weight"))
    per_rank_tp16 = m._local_bytes(w13, 16, 16, False, False)
    per_rank_tp8 = m._local_bytes(w13, 8, 8, False, False)
    # 3072 / 16 = 192 rows < 256: vLLM pads to 256 per rank, so TP16 costs 256/192 of the even share.
    assert per_rank_tp16 * 192 == per_rank_tp8 // 2 * 256
    assert m._local_bytes(w13, 16, 16, True, False) * 16 == w13.nbytes  # EP: whole experts, no padding


# -- errors ------------------------------------------------------------------------------------------

def test_unknown_architecture_is_named() -> None:
    with pytest.raises(UnsupportedModelError, match="architectures: got 'GPT2LMHeadModel'"):
        inventory_from_config({"architectures": ["GPT2LMHeadModel"]})


def test_unknown_linear_attention_field_is_named() -> None:
    raw, _, _ = read_config("kimi-k3")
    raw = json.loads(json.dumps(raw))
    raw["text_config"]["linear_attn_config"]["mystery_width"] = 3
    with pytest.raises(UnsupportedModelError, match=r"text_config\.linear_attn_config\.mystery_width"):
        inventory_from_config(raw)


def test_unknown_quantization_format_is_named() -> None:
    cfg = json.loads((FIXTURES / "llama-3.1-8b.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "marlin-24",
                                  "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4}}}}
    with pytest.raises(UnsupportedModelError, match="quantization_config.format: got 'marlin-24'"):
        inventory_from_config(cfg)
    cfg["quantization_config"] = {"quant_method": "awq"}
    with pytest.raises(UnsupportedModelError, match="quant_method: got 'awq'"):
        inventory_from_config(cfg)


def test_missing_field_and_sliding_window_are_refused() -> None:
    cfg = json.loads((FIXTURES / "llama-3.1-8b.json").read_text())
    del cfg["num_hidden_layers"]
    with pytest.raises(UnsupportedModelError, match="num_hidden_layers: got None"):
        inventory_from_config(cfg)
    cfg = json.loads((FIXTURES / "qwen2-7b.json").read_text())
    cfg["use_sliding_window"] = True
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        inventory_from_config(cfg)


def test_bad_model_source_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model: got 'no-such-model'"):
        load_model("no-such-model")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="expected valid JSON"):
        load_model(tmp_path)


def test_tensor_spec_rejects_unknown_sharding() -> None:
    with pytest.raises(ValueError, match="unknown sharding"):
        TensorSpec("x", (1,), "bfloat16", "diagonal", "norms")
    assert QuantScheme("none", "bfloat16").describe() == "bfloat16"


def test_an_architecture_that_is_not_a_name_is_refused_by_field():
    """Found by the config.json fuzz (tests/test_fuzz_config.py): ``"architectures": [[]]`` was a TypeError."""
    from kimi_k3_serve.errors import UnsupportedModelError
    from kimi_k3_serve.models import architecture_of

    for bad in ([[]], [{}], [7]):
        with pytest.raises(UnsupportedModelError, match="architectures"):
            architecture_of({"architectures": bad})
