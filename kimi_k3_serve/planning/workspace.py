"""vLLM 0.32's shared workspace, and the part of it that vLLM's KV-cache sizing does not see.

``v1/worker/workspace.py`` (``WorkspaceManager``) keeps one scratch buffer per lane. ``get_simultaneous`` grows it
to the largest request it has seen (freeing the old buffer first) and never shrinks it, so its size is the largest
of its users', not their sum. On lane 0, one rank of Kimi-K3 has three users:
- the modular MoE kernel's buffers (``modular_kernel.py _allocate_buffers``), sized by the profile run's
  ``max_num_batched_tokens``: allocated inside vLLM's memory profile, so the KV cache is sized without them;
- TRITON_MLA's split-KV decode logits (``triton_mla.py _reserve_attn_logits_workspace``) for an MLA draft that
  runs on TRITON_MLA (DSpark: its non-causal attention has no FLASHMLA kernel), reserved when the attention
  backend is built, after the profile and before the KV cache: what it adds is invisible to the KV sizing, and
  when it does not fit beside the KV cache, allocating the KV cache fails;
- FlashKDA's prefill buffers (``kda.py``: a (1, T, H, D) output, two (N, H, D, D) states and the kernel's own
  workspace), first requested in warmup, after the KV cache.

Measured on an H200 with ``VLLM_DEBUG_WORKSPACE=1`` (tests/fixtures/gpu/2026-12-01): 1,792 MB for the MoE buffers
of a TP8 rank at 8,192 tokens, 3,584 MB at 16,384; 2,432 MB at full width; TRITON_MLA's logits grew lane 0 to
18,468 MB for a 6-layer slice with DSpark at 768 sequences, and vLLM then failed to allocate its 27.82 GiB KV cache
with 27.40 GiB free. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimi_k3_serve.units import MiB

SM_COUNT = {(9, 0): 132, (10, 0): 148, (10, 3): 160, (12, 0): 188}
"""Streaming multiprocessors by compute capability (H100/H200, B200, B300/GB300, RTX PRO 6000): TRITON_MLA caps its
KV splits at twice this (``_SPLIT_OCCUPANCY_MULTIPLIER``)."""
TRITON_MLA_MIN_WORK_PER_SPLIT = 512
"""``triton_mla.py _MIN_WORK_PER_SPLIT``: tokens of context per KV split."""
WORKSPACE_ALIGN = 2 * MiB
"""The sizes vLLM logs for the workspace are whole MiB multiples (18,468.00 MB where the shapes give 18,467.8)."""


@dataclass(frozen=True)
class SharedWorkspace:
    """Lane 0 of the workspace on one rank: each user's request and what the KV sizing misses."""

    moe_bytes: int
    triton_mla_logits_bytes: int
    flashkda_bytes: int

    @property
    def before_kv_bytes(self) -> int:
        """Growth past the profile's MoE buffers before the KV cache is allocated (TRITON_MLA's reservation)."""
        return max(0, self.triton_mla_logits_bytes - self.moe_bytes)

    @property
    def after_kv_bytes(self) -> int:
        """Growth in warmup, after the KV cache (FlashKDA's buffers, where they outgrow both others)."""
        return max(0, self.flashkda_bytes - max(self.moe_bytes, self.triton_mla_logits_bytes))

    @property
    def unseen_bytes(self) -> int:
        """Everything the KV sizing does not see: it has to fit outside the budget."""
        return self.before_kv_bytes + self.after_kv_bytes

    def describe(self) -> str:
        parts = [f"MoE buffers {self.moe_bytes / MiB:,.0f} MiB (in the profile)"]
        if self.triton_mla_logits_bytes:
            parts.append(f"TRITON_MLA decode logits {self.triton_mla_logits_bytes / MiB:,.0f} MiB (before the KV cache)")
        if self.flashkda_bytes:
            parts.append(f"FlashKDA prefill {self.flashkda_bytes / MiB:,.0f} MiB (in warmup)")
        return "shared workspace, the largest of: " + ", ".join(parts)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def triton_mla_logits_bytes(max_num_seqs: int, query_len: int, local_heads: int, kv_lora_rank: int,
                            max_model_len: int, compute_capability: tuple[int, int]) -> int:
    """``_reserve_attn_logits_workspace``: fp32 ``(max_num_seqs x query_len, heads, splits, kv_lora_rank + 1)``,
    splits = ``min(next_pow2(max_model_len // 512), 2 x SMs)``. ``forward_mqa`` takes the same shape for a batch of
    that many query rows at that context (``memory._dspark_capture_lane_bytes``)."""
    sms = SM_COUNT.get(compute_capability, SM_COUNT[(9, 0)])
    splits = min(_next_power_of_2(max(1, max_model_len // TRITON_MLA_MIN_WORK_PER_SPLIT)), 2 * sms)
    raw = max_num_seqs * query_len * local_heads * splits * (kv_lora_rank + 1) * 4
    return -(-raw // WORKSPACE_ALIGN) * WORKSPACE_ALIGN


def moe_buffer_bytes(tokens: int, experts_per_token: int, local_intermediate: int, moe_hidden: int) -> int:
    """The modular MoE kernel's two bf16 buffers: ``tokens x top_k`` rows of ``max(2N, K)`` and of ``K``
    (N the rank's expert intermediate, K the experts' hidden size). Matches the measured 1,792 / 3,584 / 2,432 MB."""
    return tokens * experts_per_token * (max(2 * local_intermediate, moe_hidden) + moe_hidden) * 2
