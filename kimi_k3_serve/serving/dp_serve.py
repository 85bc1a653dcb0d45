"""Serving a DP x TP (x EP) layout through Ray Serve LLM 2.60's data-parallel builder.

``ray.serve.llm.build_dp_deployment`` (``ray/llm/_internal/serve/serving_patterns/data_parallel/builder.py``) deploys
``DPServer`` (``dp_server.py``): one Serve replica per DP rank, each holding one vLLM engine core of TP x PP
workers, gang-scheduled ``data_parallel_size`` replicas at a time into one placement group (PACK, restarted as a
whole when any rank fails). ``DPServer.get_deployment_options`` multiplies ``num_replicas`` / the autoscaling
bounds by DP (a configured replica is a DP group) and drops the per-replica placement strategy; ``DPServer``'s
constructor reads its rank from the gang context, publishes or fetches rank 0's address, sets
``data_parallel_rank`` / ``data_parallel_address`` / ``data_parallel_rpc_port`` in the engine arguments and this
rank's slice of the gang's bundles in ``VLLM_RAY_BUNDLE_INDICES``.

Here ``DPServer`` is that class with this package's replica behaviour mixed in (``kimi_k3_serve.serving.server.LLMServer``:
the hang-aware health check, first-token-first stream batching, the KV prediction check); ``build_dp_app`` is
``build_dp_openai_app`` with our ingress: the DP deployment comes from ``build_dp_deployment`` itself.
The replica-start check of every DP rank is ``kimi_k3_serve.checks.dp_replica``.
"""

from __future__ import annotations

import logging
from typing import Any

from kimi_k3_serve.serving.console import before_serve_llm_import

before_serve_llm_import()

from ray.serve.llm.deployment import DPServer as _ServeDPServer

from kimi_k3_serve.serving.server import LLMServer

logger = logging.getLogger(__name__)


class DPServer(LLMServer, _ServeDPServer):
    """Ray Serve LLM's ``DPServer`` (gang context, DP master info, engine DP arguments, bundle slice) with this
    package's ``LLMServer`` behaviour. Keeps the class name, so the deployment is ``DPServer:<model id>``.

    Method order: ``LLMServer``'s overrides (``start``, ``check_health``, ``_batch_output_stream``) call ``super()``,
    which reaches ``DPServer``'s and then Ray Serve LLM's ``LLMServer``; ``__init__`` and
    ``get_deployment_options`` are ``DPServer``'s."""


def dp_deployment_options(llm_config: Any) -> dict[str, Any]:
    """Ray Serve LLM's own options for the DP deployment: ``num_replicas`` (or autoscaling bounds) times DP, the
    gang scheduling config, one replica's TP x PP placement-group bundles."""
    return DPServer.get_deployment_options(llm_config)


def build_dp_app(llm_config: Any, *, ingress_cls: type, ingress_extra_kwargs: dict[str, Any],
                 ingress_deployment_config: dict[str, Any]):
    """``build_dp_openai_app``'s application with our ingress class and ``DPServer`` subclass: the LLM deployment
    is ``build_dp_deployment(llm_config, deployment_cls=DPServer)``; the ingress is bound as ``build_dp_openai_app``
    binds it, except that its options are merged the way ``build_openai_app`` merges them
    (``maybe_apply_llm_deployment_config_defaults``: a configured ``num_replicas`` replaces the default autoscaling;
    ``build_dp_openai_app``'s plain deep merge keeps both, which Serve refuses)."""
    from ray import serve
    from ray.llm._internal.common.dict_utils import maybe_apply_llm_deployment_config_defaults
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.ingress import make_fastapi_ingress
    from ray.serve.llm import build_dp_deployment

    dp_deployment = build_dp_deployment(llm_config, deployment_cls=DPServer)
    options = maybe_apply_llm_deployment_config_defaults(ingress_cls.get_deployment_options([llm_config]),
                                                         ingress_deployment_config)
    model_id = llm_config.model_id
    return serve.deployment(make_fastapi_ingress(ingress_cls), **options).bind(
        llm_deployments={model_id: dp_deployment},
        model_cards={model_id: to_model_metadata(model_id, llm_config)},
        lora_paths={},
        **ingress_extra_kwargs,
    )
