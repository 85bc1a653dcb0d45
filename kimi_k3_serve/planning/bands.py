"""The error bands of the plan's estimated terms, as measured on validation runs, and what they take from a KV pool.

A band is the largest error in the unsafe direction (the plan below vLLM for a cost) that the validation runs of
``scripts/gpu/matrix.py`` showed on the H200 (vLLM 0.32; docs/memory-accuracy.md lists the runs and recomputes the
worst errors from them, and tests/test_rehearsal.py checks that each band covers them). A rank's pool with every band
taken against it is the pool the verdict proves; where only the point estimate fits, the verdict is ``at_risk``. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimi_k3_serve.units import GiB


@dataclass(frozen=True)
class Band:
    """``max(floor_bytes, fraction x estimate)``: what one term may be short by."""

    name: str
    fraction: float
    floor_bytes: int
    measured: str
    """The validation run that set it, and its error."""

    def of(self, estimate_bytes: int) -> int:
        return max(self.floor_bytes, int(self.fraction * estimate_bytes)) if estimate_bytes else 0


WEIGHTS = Band("weights", 0.004, 0,
               "r44-s1-eagle3-mla's -0.39 % (2026-12-01), before the MLA EAGLE3's RoPE table and the caching "
               "allocator's whole blocks were counted; every Kimi-K3 rank is within 0.01 GiB since (2026-12-02), and "
               "the band stays for Llama-3.1-8B's -0.28 % (llama-3.1-8b-tp1-b16384-s1024)")
PROFILE = Band("profile_non_kv", 0.07, int(0.45 * GiB),
               "serve-one-gpu's -0.26 GiB (-5.6 %, 2026-11-30), the worst Kimi-K3 validation error in the unsafe "
               "direction once the forward's peak was read from vLLM's code, and the profile group's worst "
               "leave-one-out error (rehearse-tp2, -0.30 GiB). Every term read from the code since (the KDA layer's "
               "peak, the held buffers, DSpark's step and the hidden states captured for it, the weights' allocator "
               "slack) has narrowed the validation errors (docs/memory-accuracy.md gives the worst now); the band "
               "is kept until a round of validation runs scored out of sample shows it can shrink. The history: "
               "docs/gpu-runs.md, \"The bands' history\"")
PROFILE_OTHER_FAMILIES = Band("profile_non_kv", 0.07, int(0.65 * GiB),
                              "llama-3.1-8b-tp1: 0.77 / 1.39 GiB (-0.62 GiB). A model other than Kimi-K3 has a "
                              "generic forward (6 hidden-size copies per token), not one read from vLLM's code, and "
                              "the non-torch constant is fitted on Kimi-K3's runs, so its profile keeps a wider floor")
"""The profile band of a model whose forward is the generic estimate (every family but Kimi-K3's)."""
CUDA_GRAPHS = Band("cuda_graph_estimate", 0.02, int(0.18 * GiB),
                   "the worst validation errors in the unsafe direction have stayed between -0.10 and -0.18 GiB "
                   "through every refit (k8-tp1-serve-defaults-dspark -0.17 on 2026-11-30 and -0.18 on 2026-12-03; "
                   "Llama-3.1-8B's -0.14; stage 1's DSpark rank at 35 sequences, r44-s1-dspark-b8192-s35, -0.15 "
                   "before the refit of 2026-12-05 and -0.10 after), and one shape's estimate moves 0.08 GiB between "
                   "two engine starts (r44-s1-dspark 1.27, r44-s1-dspark-u0995 1.19). How vLLM 0.32 takes it "
                   "(v1/worker/gpu/cudagraph_utils.py, profile_cudagraph_memory): it captures the 2 largest FULL "
                   "graphs and charges each other one the second's drop in free memory, at least 1 MiB. rehearse's "
                   "plugin measured that drop negative on every run (torch.cuda.graph empties the allocator's cache "
                   "as each capture begins), so the estimate is the captures + the cache released at the second "
                   "sample + (FULL graphs - 1) x 1 MiB. That release is memory no graph holds (FlashMLA's decode "
                   "buffers, the projections' outputs and KDA's chunk state the eager warm-up left cached), and it is "
                   "not smooth in the shapes: 316 to 428 MiB at full width with DSpark, 4 to 8 layers "
                   "(ranks-round16); at stage 1's TP8 rank with DSpark, 40, 76, 64, 60, 42 and 84 MiB cached at the "
                   "second sample at 20, 24, 28, 35, 42 and 48 sequences. The history: docs/gpu-runs.md, "
                   "\"The bands' history\"")
BANDS = (WEIGHTS, PROFILE, PROFILE_OTHER_FAMILIES, CUDA_GRAPHS)


def kv_band_bytes(weights_bytes: int, profile_bytes: int, cuda_graph_bytes: int, kimi_k3: bool = True) -> int:
    """What a rank's KV pool loses with every band against it: each cost at the top of its band (``kimi_k3``: the
    profile's forward is read from vLLM's Kimi-K3 code, else ``PROFILE_OTHER_FAMILIES``)."""
    profile = PROFILE if kimi_k3 else PROFILE_OTHER_FAMILIES
    return WEIGHTS.of(weights_bytes) + profile.of(profile_bytes) + CUDA_GRAPHS.of(cuda_graph_bytes)
