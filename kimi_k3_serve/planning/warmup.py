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
PERSISTENT_AFTER_PROFILE = {"dspark": int(0.95 * (1 << 30)), "none": int(0.09 * (1 << 30)),
                            "eagle3_mla": int(0.28 * (1 << 30))}
"""Bytes that hold memory as warmup begins beyond what vLLM's profile held, by draft, beside one hidden state of
``max_num_batched_tokens`` (``persistent_after_profile_bytes``). Fitted on round 26's six H100 runs: rehearse's plugin
logs what warmup began with; less the weights and KV cache vLLM logged, the workspace lanes as they stood and the
profile's held sampler buffers, and one hidden state, 0.943 to 0.950 GiB is left with DSpark (256 sequences, 6,144
and 8,192 tokens) and 0.089 to 0.094 GiB with no draft (128 sequences). Not yet read from vLLM's code. Not charged
per sequence: at DSpark's 6.06 fp32 ``max_num_seqs x vocab`` copies, the H200's 6-layer DSpark slice at 768
sequences, which started at 0.88, could not have. Round 27 scored it out of sample, at shapes the fit never saw:
0.933 GiB with DSpark at 128 sequences, 0.948 at 256, and 0.081 with no draft at 256 (the plan 0.002 to 0.018 GiB
over). Rounds 29 to 32 (H100, out of sample): 0.021 to 0.026 GiB under at 3 speculative tokens and with no draft at
384 sequences, inside the allocator reserve's margin; 0.11 GiB over with no draft at 16,384 tokens. The MLA EAGLE3
drafter's, 0.276 GiB, is read on its one run (round 33, k4-tp1-b8192-s128-eagle3mla-u099-h100, H100: 0.67 GiB under
DSpark's, which it was charged before); another EAGLE3 drafter is charged DSpark's (not measured)."""
ALLOCATOR_RESERVE_FRACTION = 0.5
"""Of warmup's largest single request (FlashMLA's fp32 output accumulator where it decodes, 1.51 GiB at 8,192 tokens
over 128 or 256 requests): what the caching allocator could not hand to it (cached blocks too small or split, and
non-torch memory past the plan's). Round 26 (H100), in the plan's own terms: warmup ran out of memory with 0.48 GiB
left outside the budget beyond the rest of its need (k4-tp1-b8192-s128-nodraft-u095-h100), and started with 0.88 (the
same shape at 0.945): 32 to 58 % of the request. "Fits" and the proposed utilization take this, near the top; down
to ``ALLOCATOR_RESERVE_FRACTION_LOW`` the verdict is "at risk". A TP8 rank at 0.995, whose warmup makes no request
near that size, started (r44-s1-dspark-u0995)."""
ALLOCATOR_RESERVE_FRACTION_LOW = 0.3
"""The low end of the reserve's band: round 26's fit runs ran out of memory with 32 % of the request left (once the
warmup forward no longer counted DSpark's held profile copies) and started with 58 %. Between this and
``ALLOCATOR_RESERVE_FRACTION`` warmup may start or not: the verdict is "at risk", not "does not fit"."""

PREFILL_RESERVE_FRACTION = 1.0
"""``ALLOCATOR_RESERVE_FRACTION`` where warmup's MLA takes the prefill path (every request over
``FLASHMLA_DECODE_THRESHOLD`` tokens), whose largest request is ``kv_b_proj``'s output. Round 40 (H100, 12,288 tokens
over 64 requests, no draft, at the proposal 0.985 of the plan with 0.5 here, scored out of sample): the forward held
what the plan says at the MLA to 0.01 GiB, and vLLM ran out of memory there asking for the concatenated key (0.42
GiB) with, in the plan's own terms, 0.97 times the largest request left beyond the rest of the need. Before the MLA,
layer 0's dense MLP asked for 1.55 GiB (``memory._dense_mlp_warmup_peak``), which needed the allocator's cache
released and left its blocks split. Read on that one failed run: no run has started near it, so the band below it is
only the failure's own."""
PREFILL_RESERVE_FRACTION_LOW = 0.95
"""The low end of the prefill path's band: just below the room vLLM ran out of memory with (0.97, round 40)."""

DRAFT_STEP_RESERVE_FRACTION = 1.19
"""Of the MLA EAGLE3 drafter's largest request in warmup (its FlashMLA output accumulator, the size of the target's
just before it): what the caching allocator could not hand to it. The drafter's step runs in the same dummy run,
right after the target's forward has freed its temporaries, and carves its own tensors out of the blocks they left
(the accumulator's among them), so the second request of that size finds less whole room than the first.
Measured in the plan's own terms, as the room left beyond the rest of the step's need over the request (H100, all at
128 requests; today's terms, with the drafter's graphs charged as vLLM builds them): vLLM ran out of memory at 0.94
(round 33, 8,192 tokens, a 1.51 GiB request) and at 1.12 (round 39, 16,384 tokens, 3.03 GiB), and started at 1.20
(round 63, 8,192 at 0.985: the fit run fixed for this, ranks-round45-h100), 1.46 and 1.72 (round 36, 8,192), 1.51
(round 50, 16,384) and 3.97 (round 39, 4,096). "Fits" and the proposal take this, just below the least room vLLM
started with (1.5, below round 36's, until round 63); down to ``DRAFT_STEP_RESERVE_FRACTION_LOW`` the verdict is
"at risk". Scored since on round 65 (validation, at the proposals it raised): vLLM started with 1.25 (16,384 tokens,
0.91) and 1.35 (12,288 tokens over 192 and over 96 requests)."""
DRAFT_STEP_RESERVE_FRACTION_LOW = 1.15
"""The low end of the drafter reserve's band: just below the most room vLLM ran out of memory with when it was set
(1.16, round 39; 1.12 in today's terms, so that run is "does not fit")."""


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
    gate = heads * mla.v_head_dim if mla.output_gate else 0
    latent = mla.q_lora_rank + mla.kv_lora_rank + mla.qk_rope_head_dim + gate
    normed = mla.q_lora_rank + mla.kv_lora_rank
    query = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    return dtype_bytes * (latent + normed + query + heads * mla.v_head_dim)


def _flashmla_splits(batch: WarmupBatch, heads: int, compute_capability: tuple[int, int]) -> int:
    """FlashMLA's split-KV slots: ``decode_requests + num_sm_parts``, ``num_sm_parts = SMs / cdiv(query_len x heads,
    64)`` (at least 1)."""
    rows = batch.decode_query_len * heads
    sm_parts = max(SM_COUNT.get(compute_capability, SM_COUNT[(9, 0)]) // -(-rows // FLASHMLA_QUERY_TILE), 1)
    return batch.decode_requests + sm_parts


def mla_decode_bytes(batch: WarmupBatch, mla: MlaProjections, heads: int, dtype_bytes: int,
                     compute_capability: tuple[int, int]) -> int:
    """The decode path's tensors at FlashMLA's call, beside ``mla_base_bytes_per_token``'s: ``ql_nope``, ``mqa_q``,
    the output and its fp32 log-sum-exp, and the split-KV accumulators (fp32 output and log-sum-exp for each split
    slot of ``query_len x heads`` rows)."""
    if not batch.decode_tokens:
        return 0
    latent = mla.kv_lora_rank
    per_token = heads * (dtype_bytes * (latent + latent + mla.qk_rope_head_dim + latent) + 4)
    rows = batch.decode_query_len * heads
    accumulators = _flashmla_splits(batch, heads, compute_capability) * rows * (latent + 1) * 4
    return batch.decode_tokens * per_token + accumulators


def mla_prefill_bytes(prefill_tokens: int, mla: MlaProjections, heads: int, dtype_bytes: int) -> int:
    """The prefill path's own tensors (``_forward_prefill_fused``, no cached context): ``kv_b_proj``'s output
    (heads x (nope + v)) and the concatenated key (heads x (nope + rope)); freed before the decode path runs."""
    return prefill_tokens * heads * dtype_bytes * (2 * mla.qk_nope_head_dim + mla.v_head_dim + mla.qk_rope_head_dim)


@dataclass(frozen=True)
class MlaWarmup:
    """One MLA layer of the warmup forward: what it holds beyond the profile run's, its decode part, and the largest
    single request it makes (FlashMLA's output accumulator, where it decodes)."""

    extra_bytes: int
    decode_bytes: int
    largest_request_bytes: int
    batch: WarmupBatch


def mla_warmup(tokens: int, max_num_seqs: int, query_per_request: int, mla: MlaProjections, heads: int,
               dtype_bytes: int, compute_capability: tuple[int, int]) -> MlaWarmup:
    """The larger of the layer's prefill part and its decode part (they run one after the other)."""
    batch = warmup_batch(tokens, max_num_seqs, query_per_request)
    decode = mla_decode_bytes(batch, mla, heads, dtype_bytes, compute_capability)
    prefill_tokens = tokens - batch.decode_tokens
    prefill = mla_prefill_bytes(prefill_tokens, mla, heads, dtype_bytes)
    largest = prefill_tokens * heads * dtype_bytes * (mla.qk_nope_head_dim + mla.v_head_dim)  # kv_b_proj's output
    if batch.decode_tokens:
        accumulator = _flashmla_splits(batch, heads, compute_capability) * batch.decode_query_len * heads \
            * mla.kv_lora_rank * 4
        query = batch.decode_tokens * heads * (mla.kv_lora_rank + mla.qk_rope_head_dim) * dtype_bytes
        largest = max(largest, accumulator, query)
    return MlaWarmup(max(decode, prefill), decode, largest, batch)


def persistent_after_profile_bytes(tokens: int, hidden_size: int, dtype_bytes: int, draft_kind: str | None,
                                   last_stage: bool) -> int:
    """What holds memory as kernel warmup begins, beyond the weights, the KV cache, the workspace lanes and what vLLM's
    profile held: one hidden state of ``tokens`` on every stage, and on the last stage ``PERSISTENT_AFTER_PROFILE``
    (fitted) by ``draft_kind`` (None, "dspark", "eagle3_mla"; another is charged DSpark's)."""
    kind = "none" if draft_kind is None else draft_kind if draft_kind in PERSISTENT_AFTER_PROFILE else "dspark"
    rest = PERSISTENT_AFTER_PROFILE[kind] if last_stage else 0
    return tokens * hidden_size * dtype_bytes + rest
