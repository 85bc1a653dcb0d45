"""The one adapter from a validated deploy config (``ServeArgs``) to the planner's inputs and to vLLM's.

- ``planner_inputs``: (model inventory, ``EngineSettings``, ``Pins``) with the deploy config's own layout pinned,
  so the build-time check, ``check``, ``render`` and the rehearsal plan exactly what will run;
- ``vllm_engine_args_of``: the engine arguments and environment ``build_app`` deploys, through the one
  translation (``kimi_k3_serve.planning.vllm_args``) the plan shows.
"""

from __future__ import annotations

from kimi_k3_serve.config.args import ServeArgs, with_resolved_sources
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.layout import EngineSettings, Layout, SpeculativeSettings
from kimi_k3_serve.models.inventory import ModelInventory
from kimi_k3_serve.planning.vllm_args import VllmEngineArgs, vllm_engine_args

# Hub ids of the checkpoints whose config.json ships with the package, so a deploy config that names the hub
# id is planned offline. Any other source must be a local folder (or config.json) the planner can read.
SHIPPED_MODEL_IDS = {"moonshotai/Kimi-K3": "kimi-k3", "Inferact/Kimi-K3-DSpark": "kimi-k3-dspark"}

PIN_FIELDS = {
    "tp": "args.parallel.tensor_parallel_size",
    "pp": "args.parallel.pipeline_parallel_size",
    "layout.pp": "args.parallel.pipeline_parallel_size",
    "ep": "args.parallel.enable_expert_parallel",
    "dp": "args.parallel.data_parallel_size",
    "layer_partition": "args.parallel.layer_partition",
    "layout.layer_partition": "args.parallel.layer_partition",
}
"""Planner pin and layout field -> the args field a deploy config sets it with."""


def model_inventory(source: str, *, field: str) -> ModelInventory:
    """The inventory of a (resolved) model source: a shipped hub id, a local checkpoint folder or config.json."""
    from kimi_k3_serve.models import load_model

    shipped = SHIPPED_MODEL_IDS.get(source)
    try:
        return load_model(shipped or source)
    except ConfigError as exc:
        raise ConfigError(
            field, source, f"{', '.join(SHIPPED_MODEL_IDS)} or a local checkpoint folder / config.json ({exc.allowed})"
        ) from None


def layout_of(args: ServeArgs) -> Layout:
    """The engine layout a deploy config sets; no ``layer_partition`` is vLLM's default split."""
    parallel = args.parallel
    partition = tuple(parallel.layer_partition) if parallel.layer_partition is not None else None
    return Layout(tp=parallel.tensor_parallel_size, pp=parallel.pipeline_parallel_size,
                  ep=parallel.enable_expert_parallel, dp=parallel.data_parallel_size, layer_partition=partition)


def engine_settings(args: ServeArgs, *, draft: ModelInventory | None = None) -> EngineSettings:
    """The deploy config's engine as the planner and the translation to vLLM see it. ``draft``: the draft's
    inventory when its memory is to be counted (the planner); the draft source is the config's either way."""
    limits, extra = args.limits, args.engine_kwargs
    speculative = None
    if args.speculative is not None:
        speculative = SpeculativeSettings(
            method=args.speculative.method,
            num_speculative_tokens=args.speculative.num_speculative_tokens,
            draft=draft,
            draft_tp=args.speculative.draft_tensor_parallel_size,
            source=args.speculative.model,
        )
    return EngineSettings(
        max_model_len=limits.max_model_len,
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        kv_cache_dtype=limits.kv_cache_dtype,
        gpu_memory_utilization=limits.gpu_memory_utilization,
        enable_prefix_caching=limits.enable_prefix_caching,
        mamba_ssm_cache_dtype=extra.get("mamba_ssm_cache_dtype", "auto"),
        speculative=speculative,
        language_model_only=bool(extra.get("language_model_only", False)),
        enforce_eager=limits.enforce_eager,
        moe_backend=str(extra.get("moe_backend", "auto")),
        fp8_prefill_query=bool((extra.get("attention_config") or {}).get("use_prefill_query_quantization", False)),
        num_redundant_experts=int((extra.get("eplb_config") or {}).get("num_redundant_experts", 0))
        if extra.get("enable_eplb") else 0,
        eplb_window_size=int((extra.get("eplb_config") or {}).get("window_size", 1000)),
        accelerator=args.accelerator.kind,
        load_format=args.model.load_format,
        extra_engine_kwargs=dict(extra),
        env_vars=dict(args.runtime_env.env_vars),
    )


def deploy_pins(args: ServeArgs, model: ModelInventory):
    """The deploy config's layout, pinned: the planner checks exactly what will run. Without a
    ``layer_partition`` vLLM splits the layers its default way, so that split is pinned too."""
    from kimi_k3_serve.planning.planner import Pins, default_partition

    layout = layout_of(args)
    partition = layout.layer_partition
    if partition is None and layout.pp > 1:
        partition = default_partition(model.num_layers, layout.pp)
    return Pins(tp=layout.tp, pp=layout.pp, ep=layout.ep, dp=layout.dp, layer_partition=partition)


def planner_inputs(args: ServeArgs):
    """(model inventory, EngineSettings, Pins) for a validated ``ServeArgs``, sources resolved: the deploy
    config's own layout, pinned, so the check is of exactly what will run."""
    from kimi_k3_serve.planning.planner import validate_length, validate_pins

    args = with_resolved_sources(args)
    model = model_inventory(args.model.source, field="args.model.source")
    draft = model_inventory(args.speculative.model, field="args.speculative.model") if args.speculative else None
    try:  # the planner names its own pins; the user wrote args.parallel.*
        pins = deploy_pins(args, model)
        validate_pins(model, pins)
    except ConfigError as exc:
        field = PIN_FIELDS.get(exc.field)
        if field is None:
            raise
        raise ConfigError(field, exc.value, exc.allowed, source=exc.source) from None
    engine = engine_settings(args, draft=draft)
    validate_length(model, engine.max_model_len, field="args.limits.max_model_len")
    return model, engine, pins


def vllm_engine_args_of(args: ServeArgs) -> VllmEngineArgs:
    """What ``build_app`` deploys for ``args`` (sources already resolved: ``args.with_resolved_sources``)."""
    try:
        architecture = model_inventory(args.model.source, field="args.model.source").architecture
    except ConfigError:  # a source only vLLM can read: its environment is vLLM's own choice
        architecture = None
    return vllm_engine_args(layout_of(args), engine_settings(args), architecture=architecture)
