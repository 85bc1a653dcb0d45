"""What PyTorch's CUDA caching allocator adds to each weight tensor in vLLM 0.32's "Model loading took".

vLLM 0.32's ``Worker.load_model`` (v1/worker/gpu_worker.py, ~l.587-594) loads the model under
``_scoped_allocator_max_split(max_split_size_mb=20)``, and "Model loading took" is
``torch.cuda.max_memory_allocated()`` after a peak reset: it counts whole allocator blocks, not tensor bytes.
PyTorch's caching allocator (c10/cuda/CUDACachingAllocator.cpp) serves a request of >= 10 MiB (``kMinLargeAlloc``)
from a new segment rounded up to 2 MiB (``kRoundLarge``). Under a 20 MiB max split size a block for a request of
>= 20 MiB is never split (``should_split``: ``size < max_split_size``), so the whole rounded block counts; a block for a
10-20 MiB request keeps its tail too when that tail is <= 1 MiB (a large block's remainder is split off only when
it is > ``kSmallSize``, 1 MiB). Smaller requests share 2 / 20 MiB segments whose remainders are split off; their
512-byte rounding is left out (under 512 bytes a tensor).

Verified by replaying Kimi-K3 rank slices' allocations on an H200 (2026-12-02): 49-layer TP8 rank slice
103.877 GiB of tensors + 280.4 MiB of rounding = 104.151 GiB against vLLM's 104.15 GiB.

The remainder split off a 10-20 MiB request's block is free but stays reserved: ``empty_cache`` returns only whole
segments, and the segment holds the live tensor. "Model loading took" leaves it out (it is not allocated), but vLLM's
profile counts it: its "consumed memory" is the drop in free device memory (utils/mem_utils.py ``memory_profiling``).
Pure Python.
"""

from __future__ import annotations

from kimi_k3_serve.units import MiB, round_up

LARGE_ROUNDING = 2 * MiB
"""``kRoundLarge``: a large segment's size is a multiple of this."""
ROUNDED_FROM = 10 * MiB
"""``kMinLargeAlloc``: requests this size and above get a segment of their own, rounded to ``LARGE_ROUNDING``."""
LOAD_MAX_SPLIT = 20 * MiB
"""vLLM's ``max_split_size_mb=20`` while loading: blocks for requests this size and above are never split."""
SPLIT_MIN_REMAINDER = MiB
"""``kSmallSize``: a large block's remainder is split off (freed for others) only when it is larger than this."""


def allocator_rounding_bytes(nbytes: int) -> int:
    """Bytes the caching allocator counts beyond one ``nbytes`` tensor allocated while vLLM loads the model."""
    if nbytes < ROUNDED_FROM:
        return 0
    tail = round_up(nbytes, LARGE_ROUNDING) - nbytes
    if nbytes >= LOAD_MAX_SPLIT:
        return tail
    return tail if tail <= SPLIT_MIN_REMAINDER else 0


def allocator_slack_bytes(nbytes: int) -> int:
    """Bytes one ``nbytes`` tensor allocated while vLLM loads the model leaves free but reserved in its own segment:
    the remainder split off the block of a 10-20 MiB request, when it is larger than 1 MiB (the rest of
    ``allocator_rounding_bytes``'s rule). Kimi-K3's MoE router gate (896 x 7168 bf16, 12.25 MiB in a 14 MiB
    segment) leaves 1.75 MiB in every MoE layer."""
    if not ROUNDED_FROM <= nbytes < LOAD_MAX_SPLIT:
        return 0
    tail = round_up(nbytes, LARGE_ROUNDING) - nbytes
    return tail if tail > SPLIT_MIN_REMAINDER else 0
