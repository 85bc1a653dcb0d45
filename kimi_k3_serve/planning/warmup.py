"""vLLM 0.32's kernel-warmup forward, the first one to run Kimi-K3's MLA with a KV cache, and what that MLA holds.

``gpu_worker.compile_or_warm_up_model`` -> ``kernel_warmup`` -> ``flashinfer_autotune`` runs
``_dummy_run(max_num_batched_tokens, is_profile=True)`` once the KV cache exists and before any CUDA graph is
captured (model_executor/warmup/kernel_warmup.py ``_run_flashinfer_autotune_dummy_runs``). Unlike the profile run
(``skip_attn=True``: no attention metadata, so the MLA zeroes its output), this forward builds the metadata, and
FlashMLA's builder (``reorder_batch_threshold`` 128, uniform query lengths) sends requests of up to 128 tokens down
the decode path (v1/attention/backends/utils.py ``split_decodes_and_prefills``). That path holds, at FlashMLA's
call (models/kimi_k3/nvidia/mla.py ``_attention``): the absorbed query ``ql_nope`` (heads x kv_lora), the
concatenated ``mqa_q`` (heads x (kv_lora + rope)), FlashMLA's output (heads x kv_lora) and log-sum-exp, and its
split-KV accumulators in fp32 (FlashMLA ``dense_decode_fwd``: ``(batch + num_sm_parts)`` rows of each request's
``query_len x heads`` x kv_lora). At 8,192 tokens over 256 requests, 96 heads: 3.86 GiB that vLLM's profile never
saw; round 25's H100 run at the plan's proposed utilization ran out of memory allocating ``mqa_q`` (864 MiB).
Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimi_k3_serve.models.inventory import MlaProjections
from kimi_k3_serve.planning.workspace import SM_COUNT

FLASHMLA_DECODE_THRESHOLD = 128
"""``FlashMLAMetadataBuilder.reorder_batch_threshold``: a request of at most this many tokens is a decode."""
FLASHMLA_QUERY_TILE = 64
"""FlashMLA's query rows per tile (``num_sm_parts = SMs / cdiv(query_len x heads, 64)``)."""


@dataclass(frozen=True)
class WarmupBatch:
    """The warmup dummy run's requests as FlashMLA splits them (decodes first, all of one query length)."""

    requests: int
    decode_requests: int
    decode_query_len: int

    @property
    def decode_tokens(self) -> int:
        return self.decode_requests * self.decode_query_len


def warmup_batch(tokens: int, max_num_seqs: int, query_per_request: int = 0) -> WarmupBatch:
    """``_dummy_run`` (v1/worker/gpu/model_runner.py): ``min(tokens, max_num_seqs)`` requests, and with a speculator
    at most ``tokens // num_query_per_req`` (``query_per_request``: DSpark's ``num_speculative_tokens``, 1 for an
    EAGLE3 drafter, 0 without one); ``tokens // requests`` each, the remainder one more on the last ones. Uniform
    query lengths only: with a remainder, the first ``requests - remainder`` are the decodes."""
    requests = max(1, min(tokens, max_num_seqs))
    if query_per_request:
        requests = max(1, min(requests, tokens // query_per_request))
    query_len, remainder = divmod(tokens, requests)
    if query_len > FLASHMLA_DECODE_THRESHOLD:
        return WarmupBatch(requests, 0, query_len)
    return WarmupBatch(requests, requests - remainder, query_len)


def mla_base_bytes_per_token(mla: MlaProjections, heads: int, dtype_bytes: int) -> int:
    """What an MLA layer holds per token in any forward, up to its attention (``_forward_q_lora``): the fused
    q/kv(/gate) latent projection, the normed q and kv latents, the query (heads x (nope + rope)) and the attention
    output (heads x v); the profile run holds these too."""
    latent = mla.q_lora_rank + mla.kv_lora_rank + mla.qk_rope_head_dim + (heads * mla.v_head_dim if mla.output_gate else 0)
    normed = mla.q_lora_rank + mla.kv_lora_rank
    return dtype_bytes * (latent + normed + heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim) + heads * mla.v_head_dim)


def mla_decode_bytes(batch: WarmupBatch, mla: MlaProjections, heads: int, dtype_bytes: int,
                     compute_capability: tuple[int, int]) -> int:
    """The decode path's tensors at FlashMLA's call, beside ``mla_base_bytes_per_token``'s: ``ql_nope``, ``mqa_q``,
    the output and its fp32 log-sum-exp, and the split-KV accumulators (fp32 output and log-sum-exp for
    ``decode_requests + num_sm_parts`` splits of ``query_len x heads`` rows)."""
    if not batch.decode_tokens:
        return 0
    latent = mla.kv_lora_rank
    per_token = heads * (dtype_bytes * (latent + latent + mla.qk_rope_head_dim + latent) + 4)
    rows = batch.decode_query_len * heads
    sm_parts = max(SM_COUNT.get(compute_capability, SM_COUNT[(9, 0)]) // -(-rows // FLASHMLA_QUERY_TILE), 1)
    accumulators = (batch.decode_requests + sm_parts) * rows * (latent + 1) * 4
    return batch.decode_tokens * per_token + accumulators


def mla_prefill_bytes(prefill_tokens: int, mla: MlaProjections, heads: int, dtype_bytes: int) -> int:
    """The prefill path's own tensors (``_forward_prefill_fused``, no cached context): ``kv_b_proj``'s output
    (heads x (nope + v)) and the concatenated key (heads x (nope + rope)); freed before the decode path runs."""
    return prefill_tokens * heads * dtype_bytes * (2 * mla.qk_nope_head_dim + mla.v_head_dim + mla.qk_rope_head_dim)


def mla_warmup_extra_bytes(tokens: int, max_num_seqs: int, query_per_request: int, mla: MlaProjections, heads: int,
                           dtype_bytes: int, compute_capability: tuple[int, int]) -> tuple[int, int, WarmupBatch]:
    """What one MLA layer of the warmup forward holds beyond the profile run's, (bytes, its decode part, the batch):
    the larger of its prefill part and its decode part (they run one after the other)."""
    batch = warmup_batch(tokens, max_num_seqs, query_per_request)
    decode = mla_decode_bytes(batch, mla, heads, dtype_bytes, compute_capability)
    prefill = mla_prefill_bytes(tokens - batch.decode_tokens, mla, heads, dtype_bytes)
    return max(decode, prefill), decode, batch
