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
               "r44-s1-eagle3-mla (2026-12-01): 95.77 GiB planned, 96.15 GiB loaded (-0.39 %) before the MLA EAGLE3's "
               "RoPE table and the caching allocator's whole blocks were counted (2026-12-02: every Kimi-K3 run "
               "within 0.01 GiB since); the band stays for Llama-3.1-8B's -0.28 % (llama-3.1-8b-tp1-b16384-s1024)")
PROFILE = Band("profile_non_kv", 0.07, int(0.45 * GiB),
               "serve-one-gpu (2026-11-30): 4.47 GiB planned, 4.73 GiB profiled (-0.26 GiB, -5.6 %), the worst Kimi-K3 "
               "validation error in the unsafe direction since the forward's peak is read from vLLM's code (2026-12-02, "
               "round 5: the TP8 rank slices' profiles within 0.1 GiB, r49-s0-b12288-s128-u090 exact; eighth session: "
               "-0.25 GiB with the KDA layer's peak and the held buffers; 2026-12-03: -0.26 GiB with DSpark's step as "
               "a peak of its own; tenth session: r44-s1-dspark-b8192-s512, stage 1's rank at 512 sequences, 4.88 / 5.15 GiB, "
               "-0.27 GiB, -5.2 %, the worst now; twenty-first session: a KDA layer's peak holds the hidden states "
               "captured for DSpark before it, read from vLLM's code after the 4,096-token full-width runs had missed "
               "by up to -0.22 GiB: k5-tp1-b4096-s128-dspark 2.69 / 2.72 and k8-tp1-b4096-s64-dspark 2.65 / 2.66 GiB; "
               "the profile constants refitted, r49-s0-b2048-s64 1.20 / 1.29, -0.09 GiB; twenty-fifth session: the "
               "weights' allocator slack and the TP2 run's fused all-reduce residuals counted and the profile "
               "constants refitted, the worst -0.13 GiB, r44-s1-dspark-b8192-s512 5.02 / 5.15); the band stays "
               "max(0.45 GiB, 7 %), which also covers the group's worst leave-one-out error (rehearse-tp2, -0.30 GiB; "
               "-0.42 GiB before)")
PROFILE_OTHER_FAMILIES = Band("profile_non_kv", 0.07, int(0.65 * GiB),
                              "llama-3.1-8b-tp1 (2026-11-30): 0.83 GiB planned, 1.39 GiB profiled (-0.56 GiB) once the "
                              "max_num_seqs x vocab buffers were fitted as held (2026-12-02, eighth session): a model "
                              "other than Kimi-K3 has a generic forward (6 hidden-size copies per token), not one read "
                              "from vLLM's code, so its profile keeps a wider floor; 0.77 / 1.39 GiB (-0.62 GiB) since "
                              "the non-torch constant, fitted on Kimi-K3's runs, no longer stands for their weights' "
                              "allocator slack (twenty-fifth session)")
"""The profile band of a model whose forward is the generic estimate (every family but Kimi-K3's)."""
CUDA_GRAPHS = Band("cuda_graph_estimate", 0.02, int(0.18 * GiB),
                   "k8-tp1-serve-defaults-dspark (2026-11-30): 3.65 / 3.82 GiB (-0.17 GiB), the worst validation error "
                   "in the unsafe direction once round 2's fit runs were replayed at the 15 sequences they ran with "
                   "(2026-12-02, round 5: the CUDA-graph constants refitted); then b200-r43-s1-dspark's 1.68 / 1.81 GiB "
                   "(-0.13 GiB) and llama-3.1-8b-tp1-b16384-s1024's 0.78 / 0.92 GiB (-0.14 GiB); one shape's spread "
                   "between two engine starts is 0.08 GiB (r44-s1-dspark 1.27, r44-s1-dspark-u0995 1.19). Since "
                   "DSpark's capture workspace is counted from vLLM's shapes (2026-12-03, tenth session): 3.64 / "
                   "3.82 GiB (-0.18 GiB) on the same run, then b200-r43-s1-dspark 1.70 / 1.81 (-0.11) and "
                   "r44-s1-dspark 1.18 / 1.27 (-0.09); out of sample at 131,072 tokens (eleventh session), "
                   "r44-s1-dspark-l131072-s20 1.98 / 2.10 (-0.12). Since DSpark's per-layer term is charged per "
                   "target head on the rank (eleventh session, a structure chosen after k8 was read): k8 3.75 / 3.82 "
                   "(-0.07), b200-r43-s1-dspark 1.70 / 1.81 (-0.11), r44-s1-dspark-l131072-s20 1.99 / 2.10 (-0.11), "
                   "llama-3.1-8b-tp1-b16384-s1024 0.78 / 0.92 (-0.14); k8 started again (thirteenth session) "
                   "logged the same 3.82 GiB, so its -0.06 GiB is the model's, not one start's spread. Read from "
                   "vLLM 0.32's code (v1/worker/gpu/cudagraph_utils.py, profile_cudagraph_memory): the estimate "
                   "captures the 2 largest FULL graphs and charges the rest at the second one's drop in free memory, "
                   "at least 1 MiB. Measured with rehearse's plugin (ranks-round16, twentieth session), both drops "
                   "are negative on every run (torch.cuda.graph empties the allocator's cache as each capture "
                   "begins), so the estimate is the measured capture + the cache released at the second sampled graph "
                   "+ (FULL graphs - 1) x 1 MiB. That release is memory no graph holds, and it is not smooth in the "
                   "shapes: 374, 316, 318 and 428 MiB at full width, 496 tokens and 4, 6, 7 and 8 layers with DSpark "
                   "(428 on both 8-layer runs, the extra 0.11 GiB of k8's estimate). The new 8-layer validation runs "
                   "of round 16 missed by -0.05 and -0.10 GiB. Since the plan's capture sizes are vLLM's (twenty-first "
                   "session: a max_num_seqs off the grid is a size of its own; 77 of 77 logged runs agree) and the "
                   "constants were refitted: k8 3.78 / 3.82 (-0.04), the worst r44-s1-dspark 1.17 / 1.27 (-0.10). "
                   "Since the FULL graphs are charged as vLLM samples them (twenty-second session: 1 MiB each but the "
                   "2 captured, which keep a fitted base and the release's trend; before, each cost a captured graph's "
                   "7.78 MiB and stage 1's rank at 64 to 512 sequences was 0.10 GiB over) and the constants were "
                   "refitted: k8 3.85 / 3.82 (+0.03), k8-tp1-b4096-s64-dspark 3.62 / 3.63 (was 3.56), stage 1's rank "
                   "at 256 sequences 2.89 / 2.86 (was 2.96); the worst Kimi-K3 errors b200-r43-s1-dspark 1.70 / 1.81 "
                   "and r44-s1-dspark-l131072-s20 1.99 / 2.10 (-0.11), r49-s0-b12288-s128-u090 0.66 / 0.75 (-0.09). "
                   "Round 19's fit runs (twenty-third session) logged what the release is made of (FlashMLA's decode "
                   "buffers the most, then the projections' outputs and KDA's chunk state: the eager warm-up's "
                   "buffers the allocator still caches), and joined the fit: the worst Kimi-K3 errors "
                   "b200-r43-s1-dspark 1.69 / 1.81 and r44-s1-dspark-l131072-s20 1.98 / 2.10 (-0.12), "
                   "k8-tp1-b4096-s64-dspark 3.60 / 3.63 (-0.03). Round 20's validation runs (twenty-seventh "
                   "session), scored before any constant saw them: k6-tp1-b4096-s96-dspark-u090 3.70 / 3.70 and "
                   "k7-tp1-b3072-s64-dspark 3.54 / 3.54 (+0.00), stage 1's rank at 35 sequences "
                   "r44-s1-dspark-b8192-s35 2.07 / 2.22 (-0.15), 0.03 GiB inside the band. Refitted on "
                   "ranks-round18's fit runs (twenty-eighth session: stage 1's rank at 24 and 48 sequences, the "
                   "23-layer last stage at 35; the structure unchanged): that run 2.12 / 2.22 (-0.10), and "
                   "round 22's validation runs, scored after the refit was committed: r44-s1-dspark-b4096-s28-u090 "
                   "1.81 / 1.90 (-0.09), r44-s1-dspark-b8192-s42 2.29 / 2.33 (-0.04), r31-s2-pp3-dspark-b8192-s40 "
                   "2.10 / 2.12 (-0.02); the worst Kimi-K3 error now -0.10, Llama-3.1-8B's -0.14; the band stays")
BANDS = (WEIGHTS, PROFILE, PROFILE_OTHER_FAMILIES, CUDA_GRAPHS)


def kv_band_bytes(weights_bytes: int, profile_bytes: int, cuda_graph_bytes: int, kimi_k3: bool = True) -> int:
    """What a rank's KV pool loses with every band against it: each cost at the top of its band (``kimi_k3``: the
    profile's forward is read from vLLM's Kimi-K3 code, else ``PROFILE_OTHER_FAMILIES``)."""
    profile = PROFILE if kimi_k3 else PROFILE_OTHER_FAMILIES
    return WEIGHTS.of(weights_bytes) + profile.of(profile_bytes) + CUDA_GRAPHS.of(cuda_graph_bytes)
