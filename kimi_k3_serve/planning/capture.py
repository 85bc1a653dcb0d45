"""vLLM 0.32's real CUDA-graph capture, after kernel warmup: the single request KDA makes at its largest graph.

``gpu_worker.compile_or_warm_up_model`` captures the graphs once warmup is done (``model_runner.capture_model``),
largest size first. Each PIECEWISE capture is a dummy run of ``size`` tokens over ``min(size, max_num_seqs)``
requests (v1/worker/gpu/model_runner.py ``_dummy_run``); past ``max_num_seqs`` x the decode query length a request
has more than a decode step's tokens, so KDA takes its prefill path (models/kimi_k3/nvidia/kda.py ``_forward``), and
``gather_initial_states`` (model_executor/layers/mamba/ops/gather_initial_states.py) allocates one recurrent state
per request, ``(requests, heads, head_dim, head_dim)`` in the state's dtype, with ``torch.empty``: one block, layer
after layer. Round 30 (H100, tests/fixtures/gpu/2026-12-06-round30): a 4-layer full-width slice with no draft at
384 sequences asked for 384 x 96 x 128 x 128 x 4 B = 2.25 GiB there, at the plan's proposed utilization (0.96), and
ran out of memory with 2.16 GiB free and 2.27 GiB cached by the allocator in segments warmup had left in use. The
CUDA-graph estimate vLLM sized the KV cache with had held the same request twice and let it go (the released cache
at its first FULL sample), so nothing inside the budget keeps room for it.

Kernel warmup's prefill step (v1/worker/gpu/warmup.py ``_warmup_kernels``) gathers the same way, and where FlashKDA's
buffers are first asked for there, the gathered states are held beside that request (round 33, H100: a 4-layer slice
with no draft at 512 sequences asked for 7.04 GiB of FlashKDA buffers with 512 states, 3.0 GiB, gathered and 6.64 GiB
free, at the plan's proposal). The plan weighs that step at its own moment, after FlashInfer's autotune
(planning/memory.py ``_warmup_prefill_moments``), its gathered states with the capture's reserve
(``CAPTURE_RESERVE_FRACTION``): the next KDA layer gathers into blocks the last one's left, as at the capture (round 37,
H100: out of memory on a later KDA layer's 2.75 GiB gather with 2.78 GiB cached). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from kimi_k3_serve.units import GiB

CAPTURE_RESERVE_FRACTION = 2.85
"""Room the allocator needs at the capture beyond the gathered states, as a multiple of them, in the plan's terms
(what the plan leaves outside the budget, the profile's transient peak and the graphs' estimate not yet captured,
less what warmup left allocated): warmup's own cached blocks sit in segments that later allocations keep in use, so
far more than the request itself must be left. Measured on the H100's 4-layer slices with no draft, both validation
runs read before this term was chosen (2026-12-06): the capture ran out of memory with 1.09 times the request left
(384 sequences, 2.25 GiB, round 30) and passed with 2.89 (256 sequences, 1.50 GiB, round 27). "Fits" and the
proposed utilization take the passing run's, rounded down; from there down to ``CAPTURE_RESERVE_FRACTION_LOW`` the
verdict is "at risk". Warmup's own largest request needs far less (``warmup.ALLOCATOR_RESERVE_FRACTION``): it comes
before warmup's blocks are cached. Kernel warmup's prefill step, whose KDA layers gather the same way after the
autotune's forward has cached its blocks, is judged with it too (planning/memory.py ``_warmup_prefill_moments``):
there, in the same terms, vLLM ran out of memory with 1.54 times the states left (round 37, H100) and started with
2.04 (round 36), within this band."""
CAPTURE_RESERVE_FRACTION_LOW = 1.1
"""The low end of the capture reserve's band: the failed capture had 1.09 times its request left; below 1.1 the
verdict is "does not fit"."""

CAPTURE_RESERVE_FRACTION_EXPANDABLE = 1.05
"""``CAPTURE_RESERVE_FRACTION`` under PyTorch's expandable segments (``expandable_segments``), where the allocator
maps and unmaps a segment's pages as they are used, so a block cached inside a segment still in use is no longer
lost to a large request. Round 59 (H100, validation, fixed in the thirty-ninth session before it ran): round 30's
failed shape and utilization with the setting started, with 1.09 times the gathered states left beyond them in the
plan's terms, where round 30 ran out of memory with the same. Chosen on that one run (2026-12-07), so in sample:
"fits" takes its room, rounded down; below it the verdict is "at risk" down to
``CAPTURE_RESERVE_FRACTION_EXPANDABLE_LOW``. Kernel warmup's prefill step keeps ``CAPTURE_RESERVE_FRACTION``: no run
has measured it under the setting."""
CAPTURE_RESERVE_FRACTION_EXPANDABLE_LOW = 0.0
"""The low end under expandable segments: no room beyond the request itself. No run has failed under the setting,
so the band reaches down to where the request alone no longer fits."""

CAPTURE_AFTER_GROWTH_ERROR = 7 * GiB // 8
"""The error band of the capture's stand-in once FlashKDA has grown in warmup's prefill (planning/memory.py
``estimate_memory``: the autotune's forward with the growth held beside it), as measured where it failed, on an H100
with 3 speculative tokens at 2,048 tokens over 256: round 46 (0.955) ran out of memory before its first FULL graph
where the stand-in left 0.44 GiB, and round 47 (0.95, the proposal with a 0.5 GiB band) capturing DSpark's first
graph, with the target's 0.95 GiB of graph pools and 0.54 GiB of cached, unused blocks held, where it left 0.83 GiB.
So the stand-in was at least 0.83 GiB under; the band is that, rounded up to the next 1/8 GiB. Within it the verdict
is "at risk", and the proposal keeps clear of it; beyond it, "does not fit" as before. Elsewhere the stand-in is
over: vLLM started with 0.29 GiB left by it at 8,192 tokens over 256 and 0.004 GiB on an H200's 6-layer slice. With a
DSpark draft the capture's own moment (``CAPTURE_ROOM_DSPARK``) has replaced the stand-in since the forty-seventh
session; the stand-in and this band stay only for a capture without DSpark, where FlashKDA grows in warmup."""

CAPTURE_ROOM_DSPARK = 11 * GiB // 4
"""What vLLM's real CUDA-graph capture needs beyond what it starts on, with a DSpark draft whose FlashKDA buffers
grow in warmup, in the plan's terms (outside the budget): the target's graph pool, DSpark's first eager forward and
the allocator's fragmentation at its worst moment, DSpark's first graph (docs/capture-moment.md). What the capture
starts on is warmup's entry level, held after the autotune has freed its forward, with FlashKDA's growth
(planning/memory.py ``estimate_memory``). Chosen on the two runs of the candidate's first table (H100, 3 speculative
tokens, 2,048 tokens over 256, 51 PIECEWISE, 49 FULL and 49 DSpark graphs): vLLM ran out of memory with 2.38 GiB of
room beyond the start in these terms (round 47, 0.95) and started with 2.77 (round 40, 0.945); "fits" and the
proposal take the start's, rounded down to 1/8 GiB. It replaces the stand-in (the autotune's forward with the growth
beside it, ``CAPTURE_AFTER_GROWTH_ERROR``), which called round 67's 8,192 tokens over 512 at 0.90 "does not fit" by
1.53 GiB where vLLM started with 5.45 GiB of room in these terms: the capture's eager forwards are at most 512
tokens, not the autotune's 8,192. Other graph sets (42 DSpark graphs at 128 sequences: out of memory at 2.11, started
at the allocator's retry at 2.51) are judged with the same room, their own not separated yet."""
CAPTURE_ROOM_DSPARK_LOW = 19 * GiB // 8
"""The low end of the capture room's band: just below the most room a capture ran out of memory with when it was
chosen (2.38 GiB, round 47); from it up to ``CAPTURE_ROOM_DSPARK`` the verdict is "at risk"."""


ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""Where PyTorch reads its allocator's options, the first one set winning (``PYTORCH_CUDA_ALLOC_CONF`` is the older
name): comma-separated ``option:value`` pairs."""


def expandable_segments(env_vars: Mapping[str, str] | None) -> bool:
    """Whether the engine's environment turns on the caching allocator's expandable segments
    (``expandable_segments:True``)."""
    conf = next((env_vars[name] for name in ALLOC_CONF_VARIABLES if name in (env_vars or {})), "")
    options = dict(item.partition(":")[::2] for item in conf.replace(" ", "").split(",") if item)
    return options.get("expandable_segments") == "True"


def gather_reserve(expandable: bool) -> tuple[float, float]:
    """The allocator's reserve beside gathered states, as (the "fits" point, the low end of its band), in times the
    states: ``CAPTURE_RESERVE_FRACTION`` and its low end, or, under expandable segments, their ``_EXPANDABLE``
    values."""
    if expandable:
        return CAPTURE_RESERVE_FRACTION_EXPANDABLE, CAPTURE_RESERVE_FRACTION_EXPANDABLE_LOW
    return CAPTURE_RESERVE_FRACTION, CAPTURE_RESERVE_FRACTION_LOW


def gather_outside_budget(gathered: int, beside: int, room: int,
                          reserve: tuple[float, float] = (CAPTURE_RESERVE_FRACTION, CAPTURE_RESERVE_FRACTION_LOW),
                          ) -> tuple[int, int]:
    """What a step whose KDA layers gather ``gathered`` bytes of recurrent states needs outside the budget, beside
    ``beside`` bytes of its other transients, with the allocator's ``reserve`` (``gather_reserve``: its "fits" point
    and low end, in times the states) once ``room`` (what the budget leaves a step's transients) is spent; and the
    part of it within the reserve's band."""
    reserve, low = reserve
    over = max(0, beside + int((1 + reserve) * gathered) - room)
    return over, min(over, int((reserve - low) * gathered))


def capture_prefill_requests(max_num_seqs: int, decode_query_len: int, largest_capture: int) -> int:
    """The requests of the largest PIECEWISE capture whose states KDA gathers: ``min(size, max_num_seqs)`` where the
    size exceeds ``max_num_seqs`` decode steps (KDA's prefill path), else 0 (a decode batch gathers nothing)."""
    seqs = max(max_num_seqs, 1)
    return min(largest_capture, seqs) if largest_capture > seqs * decode_query_len else 0


def gathered_states_bytes(requests: int, local_heads: int, head_dim: int, state_dtype_bytes: int) -> int:
    """``gather_initial_states``' output for one KDA layer: one ``(heads, head_dim, head_dim)`` state a request."""
    return requests * local_heads * head_dim * head_dim * state_dtype_bytes


def warmup_prefill_requests(max_num_seqs: int, max_num_batched_tokens: int, decode_query_len: int, num_blocks: int,
                            blocks_per_request: int) -> int:
    """The requests of kernel warmup's prefill step (v1/worker/gpu/warmup.py ``_warmup_kernels``): prompts of
    ``decode_query_len + 1`` tokens, so KDA takes its prefill path and gathers one state a request; at most
    ``max_num_seqs``, ``max_num_batched_tokens // (decode_query_len + 1)`` and what the KV cache's blocks hold past
    the null block (``blocks_per_request``: what warmup reserves for one request in all its groups)."""
    prompt_len = decode_query_len + 1
    requests = min(max_num_seqs, max_num_batched_tokens // prompt_len)
    if blocks_per_request > 0:
        requests = min(requests, max(1, (num_blocks - 1) // blocks_per_request))
    return max(requests, 0)
