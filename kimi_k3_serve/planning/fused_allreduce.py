"""The zero residual that vLLM 0.32 keeps in every Kimi-K3 MoE layer at TP > 1 for FlashInfer's fused all-reduce.

With the MoE's TP > 1 (the layout's TP x DP; expert parallelism makes it 1, fused_moe/config.py
``FusedMoEParallelConfig.make``), shared experts, a routed output the MoE kernel leaves un-reduced and no sequence
parallelism (models/kimi_k3/nvidia/latent_moe_runner.py ``_use_fused_path``), the MoE tail all-reduces the routed
experts' latent output with FlashInfer's fused all-reduce + add + RMSNorm (``allreduce_norm_latent_out``) whenever
the batch has at most ``max_token_num`` tokens (model_executor/layers/fused_allreduce_gemma_rms_norm.py
``_can_use_flashinfer``). The kernel needs a residual input, so the layer allocates, the first time, a zeros buffer of
``max_token_num x latent`` in the model dtype and keeps it (``_get_zero_residual``). ``max_token_num`` is the fusion's
size budget for the GPU and TP degree (``FUSION_MAX_SIZE_MIB``) over one token's latent bytes, so each layer holds about
that budget.

Where vLLM's profile run (``max_num_batched_tokens`` tokens) is within ``max_token_num`` the buffers are made there.
Otherwise the first smaller batch makes them: with CUDA graphs, the eager warmup of a small PIECEWISE size inside
vLLM's CUDA-graph estimate (v1/worker/gpu/cudagraph_utils.py ``profile_cudagraph_memory`` warms up and captures every
PIECEWISE size), so the KV sizing sees them either way; with ``enforce_eager``, the first small decode, after the KV
cache is sized. Computed from vLLM's code, not measured: the one recorded run it applies to is the TP2 slice of 4
layers (2026-11-30), which profiled 0.40 GiB over the plan before the term was counted. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimi_k3_serve.models.inventory import DTYPE_BITS, ModelInventory
from kimi_k3_serve.planning.layout import Layout
from kimi_k3_serve.units import MiB

FUSION_MAX_SIZE_MIB: dict[tuple[int, int], dict[int, float]] = {
    (9, 0): {2: 64, 4: 2, 8: 0.5},
    (10, 0): {2: 64, 4: 32, 8: 1, 16: 64},
    (10, 3): {2: 64, 4: 64, 8: 4, 16: 64},
    (10, 7): {2: 64, 4: 64, 8: 2},
}
"""FlashInfer's fused all-reduce budget in MiB per device capability and TP size (vLLM 0.32
compilation/passes/fusion/allreduce_rms_fusion.py ``FI_ALLREDUCE_FUSION_MAX_SIZE_MB``); a TP size not listed does
not take the fused path."""

BASIS = ("FlashInfer fused all-reduce + RMSNorm: a zeros residual of max_token_num x the routed latent per MoE layer "
         "at the MoE's TP > 1 without expert or sequence parallelism (vLLM models/kimi_k3/nvidia/latent_moe_runner.py "
         "_get_zero_residual; max_token_num from FI_ALLREDUCE_FUSION_MAX_SIZE_MB), computed, not measured")


@dataclass(frozen=True)
class ZeroResidual:
    """The buffers of one stage's rank."""

    max_token_num: int
    bytes_per_layer: int
    layers: int

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_layer * self.layers

    def in_profile(self, max_num_batched_tokens: int) -> bool:
        """Whether vLLM's profile run, at ``max_num_batched_tokens``, makes them (else the first smaller batch does)."""
        return max_num_batched_tokens <= self.max_token_num

    def describe(self, max_num_batched_tokens: int, cuda_graphs: bool) -> str:
        when = ("made by vLLM's profile run, within max_token_num" if self.in_profile(max_num_batched_tokens) else
                "made by the eager warmup of a small PIECEWISE size in vLLM's CUDA-graph estimate" if cuda_graphs else
                "made by the first decode of at most max_token_num tokens (enforce_eager), after vLLM sizes the KV "
                "cache")
        return (f"{BASIS}: {self.layers} MoE layers x {self.bytes_per_layer / MiB:,.2f} MiB "
                f"(max_token_num {self.max_token_num:,}), {when}")


def zero_residual(model: ModelInventory, layout: Layout, start: int, end: int, sequence_parallel: bool,
                  compute_capability: tuple[int, int]) -> ZeroResidual | None:
    """The zero residuals of the MoE layers ``start..end`` on one rank, or None where vLLM takes no fused path."""
    moe_tp = 1 if layout.ep else layout.tp * layout.dp
    budget = FUSION_MAX_SIZE_MIB.get(compute_capability, {}).get(moe_tp)
    latent = model.widths.moe_hidden_size
    if moe_tp == 1 or sequence_parallel or not budget or not latent or model.family != "kimi_k3":
        return None
    layers = sum(1 for i in range(start, end) if _has_fused_tail(model, i))
    if not layers:
        return None
    token_bytes = latent * DTYPE_BITS[model.dtype] // 8
    max_token_num = int(budget * MiB) // token_bytes
    return ZeroResidual(max_token_num, max_token_num * token_bytes, layers)


def _has_fused_tail(model: ModelInventory, layer: int) -> bool:
    """A MoE layer with shared experts and a normed routed latent: the tail that calls ``allreduce_norm_latent_out``."""
    tensors = model.layers[layer].tensors
    return (any(t.category == "shared_experts" for t in tensors)
            and any(t.name.endswith("routed_expert_norm.weight") for t in tensors))
