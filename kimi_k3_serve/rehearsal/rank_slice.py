"""One TP rank of one pipeline stage of a Kimi-K3 deployment, as a TP1 model that one GPU can rehearse.

A rank slice keeps the stage's depth and its order of layer kinds, and gives every tensor the shape it has on one
TP rank, so vLLM allocates on one GPU what that rank allocates at full scale:
- the stage's layers ``[start, end)``, renumbered from 0, each keeping its kind (KDA or MLA, dense or MoE);
- a ``1/tp`` share of the attention heads (KDA and MLA) and of every TP-split MLP width (the dense MLP, the shared
  experts, and each routed expert's intermediate rows, padded to vLLM's 256-row minimum per rank);
- the whole MLA latent cache and every replicated tensor (q/kv latent projections, router, latent MoE projections);
- all of the experts: grouped top-k routing needs ``topk <= topk_group * E / n_group``, so their number stays;
- the draft, narrowed the same way, when the stage is the last one.

What a TP1 model cannot be made to hold the way a TP rank does is listed by ``rank_only_terms``: the vocabulary
tables (a rank holds ``1/tp`` of the embedding and lm_head, and only stage 0 / the last stage hold them), and the
memory that communication takes. Pure: dicts in, dicts out.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.rehearsal.slicing import SLICE_ARCHITECTURE, slice_draft_config, with_top_level_settings

MIN_MOE_INTERMEDIATE_PER_RANK = 256
"""vLLM 0.32 KimiMoE ``min_moe_intermediate_per_partition``: each rank's expert rows are padded up to this under TP."""


@dataclass(frozen=True)
class RankOf:
    """Which rank is sliced: stage ``stage`` (layers ``start..end-1``) of ``num_stages``, at TP ``tp``."""

    stage: int
    num_stages: int
    start: int
    end: int
    tp: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def describe(self) -> str:
        return (f"stage {self.stage} of {self.num_stages} (layers {self.start}-{self.end - 1}, {self.end - self.start} "
                f"layers) at TP{self.tp}: one rank's shapes on one GPU")

    def describe_stage(self) -> str:
        return (f"stage {self.stage} of {self.num_stages} (layers {self.start}-{self.end - 1}, {self.end - self.start} "
                f"layers) at TP{self.tp}: the whole stage, as a model of its own, on {self.tp} GPUs")


def _share(config: Mapping[str, Any], key: str, tp: int, field: str) -> int:
    value = int(config[key])
    if value % tp:
        raise ConfigError(field, value, f"a multiple of tensor_parallel_size {tp}: a rank slice holds 1/{tp} of it")
    return value // tp


def rank_text_config(config: Mapping[str, Any], rank: RankOf) -> dict[str, Any]:
    """The TP1 config.json of one rank of ``rank``'s stage, from a Kimi-K3 (multimodal or text-only) config."""
    text = config.get("text_config", config)
    tp = rank.tp
    total = int(text["num_hidden_layers"])
    if not 0 <= rank.start < rank.end <= total:
        raise ConfigError("--rank-of", rank.stage, f"a stage within the model's {total} layers")
    if int(text.get("moe_layer_freq", 1)) != 1:
        raise ConfigError("moe_layer_freq", text.get("moe_layer_freq"), "1: a rank slice renumbers the stage's layers")
    out = copy.deepcopy(dict(text))
    out["architectures"] = [SLICE_ARCHITECTURE]
    out["num_hidden_layers"] = rank.end - rank.start
    # 1-based layer lists, shifted to the slice's numbering: each layer keeps its kind.
    lac = out["linear_attn_config"]
    for key in ("full_attn_layers", "kda_layers"):
        lac[key] = [int(i) - rank.start for i in lac[key] if rank.start < int(i) <= rank.end]
    lac["num_heads"] = _share(lac, "num_heads", tp, "linear_attn_config.num_heads")
    if lac.get("num_k_heads"):
        lac["num_k_heads"] = _share(lac, "num_k_heads", tp, "linear_attn_config.num_k_heads")
    out["first_k_dense_replace"] = max(0, int(text.get("first_k_dense_replace", 0)) - rank.start)
    out["num_attention_heads"] = _share(text, "num_attention_heads", tp, "num_attention_heads")
    out["num_key_value_heads"] = max(1, int(text.get("num_key_value_heads", text["num_attention_heads"])) // tp)
    out["intermediate_size"] = _share(text, "intermediate_size", tp, "intermediate_size")
    if text.get("num_experts"):
        per_rank = _share(text, "moe_intermediate_size", tp, "moe_intermediate_size")
        out["moe_intermediate_size"] = max(per_rank, MIN_MOE_INTERMEDIATE_PER_RANK) if tp > 1 else per_rank
    return with_top_level_settings(out, text, config)


def rank_draft_config(draft: Mapping[str, Any], rank: RankOf) -> dict[str, Any]:
    """The draft of the last stage at one rank's shapes: its heads and MLP rows split ``tp`` ways (vLLM builds the
    draft with the target's TP), its target layers spread over the slice's layers."""
    out = slice_draft_config(draft, rank.end - rank.start)
    tp = rank.tp
    out["num_attention_heads"] = _share(draft, "num_attention_heads", tp, "speculative draft num_attention_heads")
    out["num_key_value_heads"] = max(1, int(draft.get("num_key_value_heads", draft["num_attention_heads"])) // tp)
    if "head_dim" not in draft and "kv_lora_rank" not in draft:  # GQA drafts derive head_dim from the full width
        out["head_dim"] = int(draft["hidden_size"]) // int(draft["num_attention_heads"])
    out["intermediate_size"] = _share(draft, "intermediate_size", tp, "speculative draft intermediate_size")
    return out


@dataclass(frozen=True)
class RankOnlyTerm:
    """Memory that differs between the real rank and its slice: what it is, bytes on the real rank minus bytes on the
    slice (``None`` where not counted), whether that number is exact, and where it comes from."""

    name: str
    delta_bytes: int | None
    exact: bool
    source: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "delta_bytes": self.delta_bytes, "exact": self.exact, "source": self.source}


def rank_only_terms(real: Any, sliced: Any, *, outside_real: int, outside_sliced: int,
                    whole_stage: bool = False) -> tuple[RankOnlyTerm, ...]:
    """What the real rank holds beside what its rehearsed model's rank holds, term by term (``real``, ``sliced``:
    the plan's ``RankMemory`` of the real layout's rank and of the rank slice at TP1, or with ``whole_stage`` of the
    stage as a model of its own at the layout's TP). Weights are exact (the inventory's sharding); the rest are the
    plan's own estimates of both, with the source of the difference."""
    terms: list[RankOnlyTerm] = []
    held = "its own 1/TP share of it" if whole_stage else "all of it"
    model = "the stage model" if whole_stage else "the slice"
    cats = sorted(set(real.weights_by_category) | set(sliced.weights_by_category))
    for cat in cats:
        delta = real.weights_by_category.get(cat, 0) - sliced.weights_by_category.get(cat, 0)
        if delta:
            why = {"embedding": f"a rank holds 1/TP of the embedding, on stage 0 only; {model} holds {held}",
                   "lm_head": f"a rank holds 1/TP of the lm_head, on the last stage only; {model} holds {held}",
                   "norms": f"the final norms are on the last stage only; {model} holds them"}
            terms.append(RankOnlyTerm(f"weights:{cat}", delta, True, why.get(cat, "the inventory's sharding rules")))
    if real.draft_bytes != sliced.draft_bytes:
        terms.append(RankOnlyTerm("draft", real.draft_bytes - sliced.draft_bytes, True,
                                  "under PP the last stage builds its own 1/TP share of the target embedding for the draft"))
    for name, attr, source in (
            ("activation", "activation_bytes", "the plan's profile peak (the sampler runs on the last stage only; a "
                                               "later stage's forward holds every AttnRes block from layer 0, where "
                                               "the model, numbered from 0, holds its own; a stage before the draft's "
                                               "holds the hidden states it captures for it: from vLLM's code)"),
            ("non_torch", "non_torch_bytes", "the plan's post-snapshot non-torch memory: TP>2 custom all-reduce buffers "
                                             "(2.1 GiB, llm-d on H100; not measured on an H200 at TP8) and NCCL's NVLS "
                                             "buffers where the config leaves NVLS on (planning/nvls.py, computed from "
                                             "NCCL's code; the lent hosts run with NCCL_NVLS_ENABLE=0)"),
            ("cuda_graphs", "cuda_graph_bytes",
             "the plan's CUDA-graph estimate of the real stage against the stage model's: every stage of the engine "
             "captures the sizes the draft's tokens per sequence set (max_num_seqs x (k+1) x 2), the stage model without "
             "the draft fewer" if whole_stage else
             "the plan's CUDA-graph estimate at the real TP (all-reduce nodes inside the graphs are not seen by a TP1 "
             "slice; FlashInfer's fused all-reduce keeps a zero residual per MoE layer, made in the estimate's eager "
             "warmups: planning/fused_allreduce.py, computed from vLLM's code)"),
            ("workspaces", "workspace_bytes", "profiled workspaces, with the pipeline receive buffer of a stage after "
                                              "the first and its slots for the draft's hidden states captured before "
                                              "it (exact, from vLLM's make_empty_intermediate_tensors)")):
        delta = getattr(real, attr) - getattr(sliced, attr)
        if delta:
            terms.append(RankOnlyTerm(name, delta, False, source))
    if real.after_kv_bytes != sliced.after_kv_bytes:
        terms.append(RankOnlyTerm("after_kv", real.after_kv_bytes - sliced.after_kv_bytes, False,
                                  "the plan's memory allocated after vLLM sizes the KV cache, which takes headroom, "
                                  "not KV pool (with enforce_eager at TP > 1, FlashInfer's fused all-reduce "
                                  "residuals)"))
    if outside_real != outside_sliced:
        terms.append(RankOnlyTerm("outside_budget", outside_real - outside_sliced, False,
                                  "NCCL communicators before vLLM's memory snapshot (about 1 GiB): they take headroom, "
                                  "not KV pool"))
    return tuple(terms)


OUTSIDE_THE_POOL = ("after_kv", "outside_budget")
"""Rank-only terms that take headroom, not KV pool."""


def real_rank_kv_bytes(measured_slice_kv: int, terms: tuple[RankOnlyTerm, ...]) -> int:
    """The real rank's KV pool as vLLM's slice measurement implies it: the slice's pool less what the real rank holds
    more inside the budget (terms outside the budget and uncounted ones left out)."""
    return measured_slice_kv - sum(t.delta_bytes for t in terms if t.delta_bytes and t.name not in OUTSIDE_THE_POOL)
