"""Per-GPU memory of one vLLM 0.32 engine layout, before anything is launched.

For every rank: budget ``ceil(gpu_memory_utilization x total)``; non-KV = weights (exact, from the
inventory's sharding rules, per PP stage) + draft (last stage) + activation peak, non-torch memory, the
CUDA-graph pool and workspaces (estimates, each with its margin); the rest is the KV pool, cut into blocks
exactly as vLLM 0.32 does (``kimi_k3_serve.planning.kvcache``), with the engine's block count the minimum over ranks.
A rank "fits" when it can start (free >= budget) and its pool holds one ``max_model_len`` request.

Identical ranks (same stage, same device) are computed once; the inventory caches per-layer bytes per
TP/EP shape, so a Kimi-K3 estimate costs well under a millisecond after the first call. Pure Python.
"""

from __future__ import annotations

import bisect
import math
import weakref
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.kvcache import (
    FP8_DS_MLA_BYTES_PER_TOKEN,
    MLA_HYBRID_MIN_BLOCK,
    AttentionPageSpec,
    KvGrouping,
    LayerSpec,
    StatePageSpec,
    group_layers,
    hybrid_block_size,
)
from kimi_k3_serve.planning.allocator import allocator_rounding_bytes, allocator_slack_bytes
from kimi_k3_serve.planning.layout import EngineSettings, Layout, RankDevice, SpeculativeSettings
from kimi_k3_serve.models.inventory import DTYPE_BITS, KdaState, MlaKv, MlaProjections, ModelInventory
from kimi_k3_serve.planning.optimisations import Optimisations, decide_optimisations
from kimi_k3_serve.units import GiB, KiB, MiB, cdiv
from kimi_k3_serve.planning.wide_ep import check_eplb, eplb_costs, expert_split, pools_per_engine
from kimi_k3_serve.planning.bands import kv_band_bytes
from kimi_k3_serve.planning.fused_allreduce import zero_residual
from kimi_k3_serve.planning.nvls import nvls_basis, nvls_buffer_bytes
from kimi_k3_serve.planning.capture import (
    CAPTURE_AFTER_GROWTH_ERROR,
    CAPTURE_RESERVE_FRACTION,
    CAPTURE_RESERVE_FRACTION_LOW,
    CAPTURE_ROOM_DSPARK,
    CAPTURE_ROOM_DSPARK_LOW,
    capture_prefill_requests,
    expandable_segments,
    gather_outside_budget,
    gather_reserve,
    gathered_states_bytes,
    warmup_prefill_requests,
)
from kimi_k3_serve.planning.warmup import (
    ALLOCATOR_RESERVE_FRACTION,
    ALLOCATOR_RESERVE_FRACTION_LOW,
    DRAFT_STEP_RESERVE_FRACTION,
    DRAFT_STEP_RESERVE_FRACTION_LOW,
    FLASHMLA_DECODE_THRESHOLD,
    PREFILL_RESERVE_FRACTION,
    PREFILL_RESERVE_FRACTION_LOW,
    mla_base_bytes_per_token,
    mla_warmup,
    persistent_after_profile_bytes,
)
from kimi_k3_serve.planning.workspace import SharedWorkspace, moe_buffer_bytes, triton_mla_logits_bytes

NON_TORCH_TP1 = int(300.70 * MiB)
NON_TORCH_TP_MULTI = int(2.1 * GiB)
"""Post-snapshot memory the profile sees besides weights and activations. TP1: 0.29 GiB (0.32 until
``DSPARK_KDA_PEAK_HIDDEN_COPIES``, thirtieth session), fitted with the profile group's other constants on
``PROFILE_FIT_RUNS`` by scripts/fit_memory_constants.py (H200 runs of 2026-11-30 to 2026-12-05; leave-one-out in
docs/memory-accuracy.md; the llm-d v0.19 H100 sweep had 0.25 GiB). 0.36 GiB until the weights' allocator slack (``ALLOCATOR_SLACK_BASIS``) and,
at TP2, the fused all-reduce's residuals (planning/fused_allreduce.py) were counted apart (twenty-fifth session): the
constant had stood for the slack of the fit runs' depths.
TP2 (one node): ``NON_TORCH_TP1`` too, looked up when a plan is made (an alias bound at import kept the fitter's
probes from reaching the TP2 fit run). vLLM's own split of the TP2 rehearsal (2 x H200,
tests/fixtures/gpu/2026-11-30-two-gpus/rehearse-tp2) has 32.72 - 30.03 = 2.69 GiB consumed besides weights, against
61.52 - 58.69 = 2.83 GiB at TP1 with the same settings (2026-11-30-second-host/serve-one-gpu): the TP group's buffers
add nothing measurable there.
TP > 2: ~2.1 GiB (custom all-reduce buffers), the llm-d H100 figure (vllm-memory.md 1.2, 5), not yet measured here."""
PROFILE_FIT_RUNS = ("k4-tp1-serve-defaults-dspark", "k4-tp1-b8192-s256-u080", "k4-tp1-llm-defaults-b16384-s1024",
                    "k8-tp1-b8192-s512-nodraft", "k4-tp1-b8192-s1024-nodraft", "k6-tp1-b8192-s768-dspark-u080",
                    "rehearse-tp2", "r11-s7-pp8-dspark", "r23-s0-pp4", "r31-s1-pp3", "r23-s3-pp4-dspark",
                    "r31-s2-pp3-dspark", "r49-s0-b16384-s16", "r31-s1-pp3-b16384", "k4-tp1-b8192-s16-nodraft",
                    "r44-s1-dspark-b16384-s16", "k6-tp1-serve-defaults-dspark", "k4-tp1-b4096-s128-dspark",
                    "k6-tp1-b4096-s128-dspark", "k8-tp1-b4096-s32-dspark")
"""The fit runs the profile group (``NON_TORCH_TP1``, ``SAMPLER_FP32_VOCAB_COPIES``, ``DSPARK_PROFILE_LOGITS_COPIES``,
``DRAFT_HIDDEN_COPIES``, ``DSPARK_KDA_PEAK_HIDDEN_COPIES``) is fitted on together: every Kimi-K3 fit run of the matrix
(full-width slices of 4 to 8 layers at 256 to 1024 sequences, with DSpark and without, TP2, and TP8 rank slices of 11
to 49 layers at 8,192 and 16,384 tokens, stage 1's rank with DSpark at 16,384 among them; H200, 2026-11-30 to
2026-12-03; ``scripts/fit_memory_constants.py``), and, since the thirtieth session, the two full-width DSpark fit runs
at 4,096 tokens of round 19 (6 and 8 layers), whose peak is a KDA layer's."""
SAMPLER_FP32_VOCAB_COPIES = 1.13
"""A fitted factor of fp32 ``max_num_seqs x vocab`` tensors held through the last stage's whole profile run, under
either peak (with ``NON_TORCH_TP1`` on ``PROFILE_FIT_RUNS``, 16 to 1024 sequences). What vLLM 0.32's code holds
there: the dummy sampler run stays under the forward's peak (v1/worker/gpu/model_runner.py ``profile_run``), and what
grows with ``max_num_seqs`` is persistent, made after the weights: the penalties' ``output_bin_counts`` (int32,
``max_num_reqs x vocab``) and bitmasks (sample/penalties.py, structured_outputs.py), 1.06 fp32 copies by the code's
shapes; the fit says 1.13 (1.15 until ``DSPARK_KDA_PEAK_HIDDEN_COPIES``, thirtieth session; 1.06 until the
weights' allocator slack was counted apart, twenty-fifth session; 1.09 until the KDA layer's peak held DSpark's
hidden states, twenty-first session; 0.92 while DSpark's draft logits were added to the forward's peak; until
2026-12-02 it was added to the forward's peak as 2.54 copies, which the KDA layer's own peak,
``kda_forward_peak_bytes_per_token``, now explains on the full-width slices)."""
DSPARK_PROFILE_LOGITS_COPIES = 1.22
"""In vLLM 0.32's profile run the DSpark speculator's ``propose`` runs on the dummy batch (v1/worker/gpu/
model_runner.py ``_dummy_run``; spec_decode/dflash/speculator.py, the ``skip_attn_for_dummy_run`` path, then
``_generate_draft``), and DSpark's ``_sample_sequential`` takes the draft logits of every request's speculative
positions at once (``base_logits = compute_draft_logits(sample_hidden)``, ``num_reqs x num_speculative_steps`` rows x
vocab, bf16: one copy by the code). A fitted factor of those bf16 ``rows x vocab`` tensors, with ``NON_TORCH_TP1`` and
``SAMPLER_FP32_VOCAB_COPIES`` on ``PROFILE_FIT_RUNS``; what the Markov loop holds beside them (three ``requests x
vocab`` bf16 tensors and the sampled rows' hidden states) is counted exactly, ``dspark_markov_step_bytes``.
``propose`` runs after the target's forward has returned, so these logits peak beside what the forward leaves held
(the MoE workspace and the hidden states), not on top of its peak: the larger of the two is the profile's. 1.74 until
the Markov loop's tensors were taken from vLLM's code (thirty-ninth session, 2026-12-06; the group's other constants
refitted unchanged): fitted on 7 speculative tokens, where they are 0.43 + 0.09 copies, the factor fell 0.15 GiB
short at 3 (2,048 tokens over 256 sequences on an H100, round 40: profile -8.2 %, KV pool +1.9 %; -0.7 % and +0.6 %
since); 1.18 copies while they were added on top of the forward's peak (2026-12-03), which put stage 1's rank at
16,384 tokens and 256 sequences 0.46 GiB over."""
DRAFT_HIDDEN_COPIES = {"dspark": 5.39, "default": 6}
"""Copies of ``max_num_batched_tokens x the draft's hidden size`` (model dtype) that a draft's step adds to the last
stage's profile: held from the target's forward into the draft's step (under both peaks). DSpark's is fitted with
``NON_TORCH_TP1`` on ``PROFILE_FIT_RUNS`` (6 before it was, 5.70 until the weights' allocator slack and the TP2
run's fused all-reduce residuals were counted apart, 4.61 while the draft logits were added on top of the forward's
peak), a TP8 rank at 16,384 tokens among them (2026-12-03). The default (EAGLE3, whose MLA step is taken apart,
``eagle3_mla_profile_bytes``) is the unfitted 6 of the first plan."""
DSPARK_KDA_PEAK_HIDDEN_COPIES = 1.31
"""Copies of ``max_num_batched_tokens x the target's hidden size`` (model dtype) that a DSpark draft adds to a KDA
layer's forward peak, beside the aux hidden states counted there: a fitted factor, not yet read from vLLM's code. On
every full-width DSpark slice whose peak is a KDA layer's, the plan without it was under vLLM's by about one such
tensor (0.011 to 0.131 GiB at 2,048 to 8,192 tokens), and without a draft the same branch was not (docs/gpu-runs.md,
round 23). Fitted with ``NON_TORCH_TP1`` on ``PROFILE_FIT_RUNS`` (2026-12-05); the structure was chosen after the
validation runs it moves had been read, so only runs defined after it score it: ``ranks-round21-h100`` (4 layers at
3,072 to 12,288 tokens, on an H100 80GB, round 24) put the profile within 0.9 % of vLLM's, where it was 2.2 to 2.9 %
under without the term; ``ranks-round22-h100`` (8,192 tokens, round 25) within 0.5 %. It is requested memory, not the
caching allocator's whole blocks: the profile's allocated peak was 18.7 MiB over the requested one with DSpark
(12.4 MiB without), where the term adds 0.14 GiB. ``ranks-round20`` (5 to 8 layers, H200) has not run."""
CUDA_GRAPH_PER_GRAPH = {"kimi_k3": int(10.85 * MiB), "default": 14 * MiB}
"""Per graph that vLLM's CUDA-graph estimate captures (``profile_cudagraph_memory``: the graphs captured into a
throwaway pool), for the target model, before its layers: ``CUDA_GRAPH_PER_LAYER`` adds what each local layer adds
once (in breakable mode every KDA and MLA op is a graph break, so a graph has about one segment per layer). For
Kimi-K3 that is each PIECEWISE graph; its FULL graphs are sampled, not captured (``CUDA_GRAPH_FULL_SAMPLED``). The
Kimi-K3 values are set by ``scripts/fit_memory_constants.py`` on the fit runs only (``CUDA_GRAPH_FIT_RUNS``); the
default is Llama-3.1-8B at TP1 (0.76 GiB, H200, vLLM 0.32), every graph charged."""
CUDA_GRAPH_PER_LAYER = {"kimi_k3": int(3.71 * MiB), "default": 0}
"""What one local decoder layer adds to the estimate, once for the stage, not per graph (fitted with
``CUDA_GRAPH_PER_GRAPH``; charged per graph and refitted, it over-predicted r49-s0-b2048-s512 by 164 %)."""
CUDA_GRAPH_PER_HEAD = {"kimi_k3": 0, "default": 0}
"""What each of the target's attention heads on the rank adds per captured graph: the graphs' sharded activations
(a TP8 rank holds 12 of Kimi-K3's 96 heads and an eighth of each expert; fitted with ``CUDA_GRAPH_PER_GRAPH``)."""
CUDA_GRAPH_DRAFT_PER_GRAPH = {"dspark": int(18.33 * MiB)}
"""What a draft adds per captured graph on the last stage (its forward is captured with the target's), before its
heads: ``CUDA_GRAPH_DRAFT_PER_HEAD`` adds what each of the draft's attention heads on the rank adds, so a TP8 rank
(12 of 96 heads) is not charged a full-width draft's graphs. DSpark's graphs are its own FULL graphs (sizes in
multiples of its N query rows a request), and beside them the plan charges, exactly, the drafter's workspace lane that
capturing its largest graph fills (``_dspark_capture_lane_bytes``: 170 MiB at 16 sequences, 748 MiB from 71 on, at a
TP8 rank and 32,768 tokens; twice that at 65,536). Before that lane was counted (2026-12-03) these terms absorbed it:
15.28 MiB per graph, 0.39 per head and 0.50 per layer, 8 % over on stage 1's TP8 rank at 64 to 512 sequences. EAGLE3:
none per target graph; its drafter's own graphs are counted instead (``eagle3_drafter_graphs_bytes``)."""
CUDA_GRAPH_DRAFT_PER_HEAD = {"dspark": 0}
CUDA_GRAPH_DRAFT_PER_LAYER_HEAD = {"dspark": int(15.08 * KiB)}
"""What each target layer of the last stage adds per FULL graph when DSpark rides on it, per target attention head on
the rank (fitted with ``CUDA_GRAPH_PER_GRAPH``, in KiB). vLLM's estimate charges all but one FULL graph at 1 MiB
(the second sample's drop in free memory is negative: ``bands.CUDA_GRAPHS`` says why, and what that adds); with
DSpark the estimate grows with depth at the same graph
counts, where without a draft it barely does: on TP8 rank slices 11 -> 44 layers gave 0.90 -> 1.27 GiB (no draft,
23 -> 49 layers: 0.20 -> 0.25), and on full-width slices (96 heads, 8 times a TP8 rank's 12) 4 -> 6 -> 8 layers gave
3.55 -> 3.70 -> 3.82 GiB. Charged per layer alone (until 2026-12-03, eleventh session), the fit put it at the ranks'
scale (0.10 MiB) and k8-tp1-serve-defaults-dspark's estimate was 0.18 GiB under; per layer and head, a full-width
layer costs 8 times a rank's. That structure was chosen after k8 had been read; ranks-round11 scored it out of
sample (twelfth session): 7 full-width layers at the serve defaults 3.71 / 3.72 GiB, 5 at 4,096 tokens 3.62 / 3.70;
ranks-round12 (thirteenth): 5 at 2,048 tokens and 64 sequences 3.41 / 3.52, and k8 started again logged the same
3.82 GiB as its first start (plan 3.76): that miss is the model's, inside the CUDA-graph band."""
CUDA_GRAPH_FULL_SAMPLED = {"kimi_k3": int(24.47 * MiB)}
"""What vLLM's estimate keeps of the 2 FULL graphs it samples, besides the release below. vLLM 0.32 captures only the
2 largest FULL graphs (v1/worker/gpu/cudagraph_utils.py ``profile_cudagraph_memory``) and charges every other one
the second sample's drop in free memory, at least ``VLLM_FULL_GRAPH_FLOOR``; the drop is negative on every run the
rehearsal's plugin logged (``bands.CUDA_GRAPHS`` says why), so the FULL graphs cost the estimate the first one's
capture + the allocator cache released as the second begins + 1 MiB for each but the first. Until the twenty-second
session the plan charged every FULL graph ``CUDA_GRAPH_PER_GRAPH`` (7.78 MiB then), so its estimate grew with
``max_num_seqs`` faster than vLLM's: stage 1's TP8 rank 0.10 GiB over at 64 to 512 sequences. Fitted with
``CUDA_GRAPH_PER_GRAPH`` on the fit runs; the structure, read from vLLM's code, was chosen with the validation runs
already read (ranks-round17's score it out of sample)."""
CUDA_GRAPH_RELEASE_PER_TOKEN_HEAD = {"kimi_k3": int(3.47 * KiB)}
"""The part of the cache released at the second sampled FULL graph that grows with its tokens and the target's heads
on the rank (its eager warm-up's head-sharded activations), in KiB. Fitted on the estimates, not on the releases: the
plugin logged 316 to 428 MiB at full width and 496 tokens (this term: 190 MiB), 130 MiB on stage 1's TP8 rank
(24 MiB), 20 MiB at 8 tokens; the rest sits in the other constants. The release is the eager warm-up's buffers that
the allocator still caches (round 19: FlashMLA's decode buffers the most, then the projections' outputs), and which
are still cached depends on the allocator's state, so it is not smooth in the shapes: this is its trend, and the
CUDA-graph band holds the rest."""
VLLM_FULL_GRAPH_FLOOR = MiB
"""vLLM 0.32's ``_MIN_PER_GRAPH_BYTES`` (v1/worker/gpu/cudagraph_utils.py): what its estimate charges each FULL
graph after the first once the second sample's drop is below it."""
EAGLE3_DRAFTER_GRAPHS_BASE = int(49.93 * MiB)
"""What the EAGLE3 drafter's graphs add to vLLM's CUDA-graph estimate before their requests: each capture manager's
FlashMLA accumulators sized by its SM partitions, and the PIECEWISE graphs' pool at the largest capture size. Fitted
with ``EAGLE3_DRAFTER_PER_PREFILL_REQUEST`` on ``EAGLE3_GRAPH_FIT_RUNS`` (``eagle3_drafter_graphs_bytes``)."""
EAGLE3_DRAFTER_PER_PREFILL_REQUEST = int(7.92 * MiB)
"""What each request of the drafter's largest FULL prefill graph adds (k + 1 tokens a request: the MLA step's query,
FlashMLA's split accumulators, the logits over the vocabulary). vLLM's code sums its allocations to about 3.5 MiB a
request at 96 heads; what the estimate measured is about twice that (perhaps each manager's eager run before its
capture, on the manager's own stream, which the measurement would also see: not verified), so it is fitted, not
read."""
EAGLE3_DRAFTER_DECODE_PER_REQUEST = 928 * KiB
"""What each request of the drafter's largest decode graph adds (one token a request: bf16 logits over the
163,840-token vocabulary, the embeddings and FlashMLA's tensors at 96 heads), read from vLLM's code in the forty-third
session (spec_decode/target_dependent_ar/speculator.py ``_generate_draft``); not fitted."""
EAGLE3_GRAPH_FIT_RUNS = ("k4-tp1-b4096-s32-eagle3mla-u095-h100", "k4-tp1-b8192-s512-eagle3mla-u092-h100")
"""The runs (fit role, ranks-round41-h100, fixed before they ran) the EAGLE3 drafter's graph constants are fitted on:
32 and 512 requests, the largest prefill graph over 32 and 128 requests, the largest decode graph over 32 and 512."""
CUDA_GRAPH_FIT_RUNS = ("k4-tp1-b8192-s1024-nodraft", "r23-s0-pp4", "r31-s1-pp3", "k4-tp1-serve-defaults-dspark",
                       "k6-tp1-b8192-s768-dspark-u080", "rehearse-tp2", "r11-s7-pp8-dspark", "k8-tp1-b8192-s512-nodraft",
                       "r23-s3-pp4-dspark", "r31-s2-pp3-dspark", "r44-s1-dspark-b8192-s256",
                       "k6-tp1-serve-defaults-dspark", "k4-tp1-b4096-s128-dspark", "k6-tp1-b4096-s128-dspark",
                       "k8-tp1-b4096-s32-dspark", "r23-s3-pp4-dspark-b8192-s35", "r44-s1-dspark-b8192-s24",
                       "r44-s1-dspark-b8192-s48", "r31-s2-pp3-dspark-b8192-s24", "r11-s7-pp8-dspark-b8192-s35")
"""The runs (fit role, fixed in scripts/gpu/matrix.py before they ran) the Kimi-K3 CUDA-graph constants are fitted
on: full-width slices of 4 and 6 layers, TP2, and TP8 rank slices of 11, 23, 31 and 44 layers, with DSpark and
without (the 44-layer one, stage 1's rank at 256 sequences, since 2026-12-03; the 6-layer slice at the serve
defaults with DSpark, round 11, since the twelfth session; the 4-layer slice with DSpark at 4,096 tokens and 128
sequences, round 12, since the thirteenth; 6 and 8 layers with DSpark at 4,096 tokens and 128 and 32 sequences,
round 19, since the twenty-third, the first fit runs that logged what the released cache is made of; the 23-layer
last stage of a PP4 layout at 35 sequences and stage 1's rank at 24 and 48, ranks-round18's fit runs, since the
twenty-eighth, where the estimate of that rank missed most; the 31- and 11-layer ranks with DSpark at 24 and 35
sequences, ranks-round19's, since the thirtieth, the same step at two more depths)."""
CUDA_GRAPH_FITTED_LAYERS = (4, 49)
"""The stage sizes the CUDA-graph constants were fitted on, in local layers with a KV cache (a draft's included, as
the plan counts them: stage 1's rank with DSpark has 44 + 5); deeper stages are an extrapolation of the per-layer
term, and the plan says so (the 50-layer rank of the B200 config is a validation run of it)."""
PRE_SNAPSHOT_CONTEXT = GiB // 2
PRE_SNAPSHOT_NCCL = GiB
"""CUDA context (~0.5 GiB) and NCCL communicators (~1 GiB at TP >= 2) exist before vLLM's snapshot: they sit
outside the budget and must fit in the (1 - util) headroom (vllm-memory.md 1.2)."""
FLASHINFER_MXFP4_WORKSPACE = int(1.6 * GiB)
"""FlashInfer TRTLLM MXFP4 MoE allocates ~1.6 GiB outside vLLM's pool on the first forward on Blackwell
(kimi-k3-facts.md 2.5); charged to the headroom, not to the KV budget."""
USAGE_CONTEXTS = ("ray_serve", "openai_api_server", "llm_class")
PROPOSAL_STEPS_DOWN = 4
"""How far below the first reading (0.005 a step) the proposed utilization is searched for where the plan is short
in warmup there: warmup's prefill need grows with the pool, so the first reading, taken at the utilization asked
for, can sit a step or two above the largest that fits."""
VERDICTS = ("fits", "cannot_start", "oom_at_load", "no_kv_space", "seqs_over_state_blocks", "oom_at_warmup", "at_risk")
"""vLLM's engine start, in order: the free-memory check (``request_memory``), loading the weights, sizing the KV
cache from the profile (budget minus non-KV must hold one request), then warmup (allocations after the KV cache).
``at_risk``: it fits at the plan's point estimates, not with every measured error band against it."""
KV_DTYPE_BYTES = {"auto": 0, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_ds_mla": 1}


@dataclass(frozen=True)
class Estimate:
    """A number vLLM only knows after profiling: our value, its margin and how we got it."""

    name: str
    stage: int
    bytes: int
    margin_bytes: int
    basis: str


@dataclass(frozen=True)
class StageCosts:
    """What every rank of one pipeline stage holds besides its KV pool (identical ranks share one)."""

    weights_bytes: int
    weights_by_category: Mapping[str, int]
    draft_bytes: int
    activation_bytes: int
    cuda_graph_bytes: int
    non_torch_bytes: int
    workspace_bytes: int
    """Workspaces vLLM's profile sees: taken from the KV budget."""
    after_kv_bytes: int
    """Allocated after vLLM sizes the KV cache: must fit outside the budget."""
    warmup_band_bytes: int
    """How much less of ``after_kv_bytes`` warmup needs at the low end of the allocator reserve's band
    (``ALLOCATOR_RESERVE_FRACTION_LOW``)."""

    @property
    def non_kv_bytes(self) -> int:
        """What vLLM deducts from the budget before the KV cache."""
        return (self.weights_bytes + self.draft_bytes + self.activation_bytes + self.cuda_graph_bytes
                + self.non_torch_bytes + self.workspace_bytes)


@dataclass(frozen=True)
class RankMemory(StageCosts):
    """One world rank: its stage's costs, its budget and its share of the engine's KV pool."""

    rank: int
    pp_stage: int
    tp_rank: int
    dp_rank: int
    total_bytes: int
    free_bytes: int
    budget_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: float
    block_size: int
    page_bytes: int
    bytes_per_block: int
    state_bytes_per_seq: int
    num_blocks: int
    shortfall_bytes: int
    headroom_bytes: int
    local_layers: int = 0
    warmup_shortfall_bytes: int = 0
    """How far ``after_kv_bytes`` overruns the headroom: vLLM would OOM during warmup by this much (it may start where
    this is within ``warmup_band_bytes``)."""
    warmup_forward_bytes: int = 0
    """What kernel warmup's forward allocates at its peak (``MlaWarmupPeak.forward_bytes``; 0: not modelled)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "pp_stage": self.pp_stage, "tp_rank": self.tp_rank, "dp_rank": self.dp_rank,
            "total_bytes": self.total_bytes, "free_bytes": self.free_bytes,
            "weights_bytes": self.weights_bytes, "weights_by_category": dict(self.weights_by_category),
            "kv_bytes_per_token": self.kv_bytes_per_token, "block_size": self.block_size, "page_bytes": self.page_bytes,
            "bytes_per_block": self.bytes_per_block, "state_bytes_per_seq": self.state_bytes_per_seq,
            "activation_bytes": self.activation_bytes, "cuda_graph_bytes": self.cuda_graph_bytes,
            "non_torch_bytes": self.non_torch_bytes, "workspace_bytes": self.workspace_bytes, "draft_bytes": self.draft_bytes,
            "budget_bytes": self.budget_bytes, "kv_cache_bytes": self.kv_cache_bytes, "num_blocks": self.num_blocks,
            "shortfall_bytes": self.shortfall_bytes, "headroom_bytes": self.headroom_bytes,
            "after_kv_bytes": self.after_kv_bytes, "warmup_shortfall_bytes": self.warmup_shortfall_bytes,
            "warmup_forward_bytes": self.warmup_forward_bytes, "warmup_band_bytes": self.warmup_band_bytes,
        }


@dataclass(frozen=True)
class MemoryReport:
    layout: Layout
    engine: EngineSettings
    ranks: tuple[RankMemory, ...]
    num_blocks: int
    block_size: int
    kv_cache_tokens: int
    max_concurrency: float
    blocks_per_request: int
    fits: bool
    shortfall_bytes: int
    binding_rank: int
    estimates: tuple[Estimate, ...]
    optimisations: Optimisations
    notes: tuple[str, ...]
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    enable_prefix_caching: bool = True
    stage_layers: tuple[tuple[int, int], ...] = ()
    kv_grouping: str = ""
    num_kv_groups: int = 0
    padding_layers: int = 0
    verdict: str = "fits"
    """One of VERDICTS: what vLLM 0.32 would do with this layout, in the order it would find out."""
    safe_gpu_memory_utilization: float | None = None
    """The largest gpu_memory_utilization (to 0.005) at which every rank still has room for what vLLM allocates after
    sizing the KV cache, and at which the plan says "fits"; None when no value does."""
    engine_concurrency: tuple[float, ...] = ()
    """Requests of max_model_len each DP engine's own pool holds, by DP rank (``max_concurrency`` is the smallest)."""
    no_safe_utilization: str = ""
    """Why no gpu_memory_utilization fits, where the largest that leaves room after the KV cache fails on another
    count (too few KV blocks, free memory); empty otherwise."""
    kv_band_bytes: int = 0
    """The most any rank's KV pool loses with every measured error band against it (``planning/bands.py``)."""
    banded_max_concurrency: float = 0.0
    """Requests of max_model_len the pools hold with every band against them: what the verdict proves."""

    def stage_ranks(self) -> list[RankMemory]:
        """The first rank of every stage (ranks of a stage on identical devices are identical)."""
        seen: dict[int, RankMemory] = {}
        for r in self.ranks:
            seen.setdefault(r.pp_stage, r)
        return [seen[s] for s in sorted(seen)]

    def to_json(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "layout": {"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "dp": lay.dp, "dcp": lay.dcp,
                       "layer_partition": [e - s for s, e in self.stage_layers]},
            "ranks": [r.to_json() for r in self.ranks],
            "engine": {
                "num_blocks": self.num_blocks, "block_size": self.block_size, "kv_cache_tokens": self.kv_cache_tokens,
                "max_concurrency": self.max_concurrency, "blocks_per_request": self.blocks_per_request,
                "engine_concurrency": list(self.engine_concurrency),
                "max_model_len": self.engine.max_model_len, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "gpu_memory_utilization": self.engine.gpu_memory_utilization,
                "kv_cache_dtype": self.engine.kv_cache_dtype, "enable_prefix_caching": self.enable_prefix_caching,
                "kv_cache_groups": self.num_kv_groups, "kv_grouping": self.kv_grouping, "padding_layers": self.padding_layers,
            },
            "fits": self.fits,
            "verdict": self.verdict,
            "safe_gpu_memory_utilization": self.safe_gpu_memory_utilization,
            "kv_band_bytes": self.kv_band_bytes, "banded_max_concurrency": self.banded_max_concurrency,
            "shortfall_bytes": self.shortfall_bytes,
            "binding_rank": self.binding_rank,
            "estimates": [
                {"name": e.name, "stage": e.stage, "bytes": e.bytes, "margin_bytes": e.margin_bytes, "basis": e.basis}
                for e in self.estimates
            ],
            "optimisations": self.optimisations.to_json(),
            "env": self.optimisations.env,
            "notes": list(self.notes),
        }


# -- engine defaults ----------------------------------------------------------------------------------

def batch_defaults(total_bytes: int, device_name: str = "", usage_context: str = "ray_serve") -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that vLLM 0.32 picks when the engine args leave them unset
    (``EngineArgs.get_batch_defaults``, engine/arg_utils.py). The tier comes from the device that the process
    building the engine args sees, and the usage context picks the column:

    - ``ray_serve``: Ray Serve LLM 2.60 builds the args with ``UsageContext.OPENAI_API_SERVER`` in a Ray task on the
      replica's placement group that holds a sliver of a GPU (``num_gpus: 0.001``: vllm_engine.py
      ``_prepare_engine_config``, accelerators.py ``GPUAccelerator.get_remote_options``), so vLLM sees the GPU and
      takes the ``vllm serve`` column. Measured: 8192 on an H200 (serve run of 2026-11-30, tests/fixtures/gpu);
    - ``openai_api_server`` (``vllm serve``): >= 160 GiB 16384 / 1024; >= 70 GiB and not an A100 8192 / 1024;
      else 2048 / 256;
    - ``llm_class`` (``vllm.LLM``): >= 160 GiB 16384 / 1024; >= 70 GiB and not an A100 16384 / 1024; else 8192 / 256.
    """
    if usage_context not in USAGE_CONTEXTS:
        raise ConfigError("engine.usage_context", usage_context, f"expected one of {', '.join(USAGE_CONTEXTS)}")
    llm = usage_context == "llm_class"
    if total_bytes >= 160 * GiB:
        return 16384, 1024
    if total_bytes >= 70 * GiB and "a100" not in device_name.lower():
        return (16384 if llm else 8192), 1024
    return (8192 if llm else 2048), 256


def resolved_batch(engine: EngineSettings, device: RankDevice) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) the engine runs with when ``device`` is the smallest GPU of its
    layout: the configured limits, else vLLM's defaults (``batch_defaults``), the token budget capped at
    ``max_num_seqs x max_model_len``. The one place an unset limit is resolved."""
    default_tokens, default_seqs = batch_defaults(device.total_bytes, device.name, engine.usage_context)
    seqs = engine.max_num_seqs or default_seqs
    return engine.max_num_batched_tokens or min(default_tokens, seqs * engine.max_model_len), seqs


def default_block_size(model: ModelInventory, cc: tuple[int, int]) -> int:
    """The block size vLLM 0.32 picks before hybrid alignment (platforms ``update_block_size_for_backend``):
    MLA on SM100 -> FLASHINFER_MLA (kernel blocks 32/64, 16 unsupported) -> 32; otherwise 16."""
    if model.uses_mla and cc[0] == 10:
        return 32
    return 16


def stage_layer_ranges(num_layers: int, layout: Layout) -> list[tuple[int, int]]:
    """vLLM ``get_pp_indices``: an even split, the remainder on the stages before the last
    (``VLLM_PP_LAYER_PARTITION`` = ``layout.layer_partition`` overrides)."""
    pp = layout.pp
    if layout.layer_partition is not None:
        parts = list(layout.layer_partition)
        if sum(parts) != num_layers:
            raise ConfigError("layout.layer_partition", list(parts), f"must sum to the model's {num_layers} layers")
    else:
        if pp > num_layers:
            raise ConfigError("layout.pp", pp, f"must be <= the model's {num_layers} layers")
        parts = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):
            parts[-i] += 1
    out, start = [], 0
    for n in parts:
        out.append((start, start + n))
        start += n
    return out


_MEMOS: "weakref.WeakKeyDictionary[ModelInventory, dict]" = weakref.WeakKeyDictionary()


def _memo(model: ModelInventory) -> dict:
    """This module's memo of what it derives from one inventory (stage weights, KV grouping, draft totals), kept
    here with its own keys; it goes with the inventory. The inventory's own caches are its business."""
    memo = _MEMOS.get(model)
    if memo is None:
        memo = _MEMOS[model] = {}
    return memo


# -- the estimate -------------------------------------------------------------------------------------

def estimate_memory(
    model: ModelInventory,
    layout: Layout,
    engine: EngineSettings,
    devices: RankDevice | Sequence[RankDevice],
    *,
    optimisations: Optimisations | None = None,
    check_proposal: bool = True,
) -> MemoryReport:
    """Per-rank memory of ``model`` under ``layout`` and ``engine`` on ``devices`` (one per world rank in
    vLLM's rank order, or one for all). Raises ConfigError for a layout vLLM would refuse. ``check_proposal``: plan
    again at the proposed utilization and propose it only where it fits (see ``_proven_proposal``)."""
    world = layout.world_size
    if isinstance(devices, RankDevice):
        devs = [devices] * world
    else:
        devs = list(devices)
        if len(devs) == 1:
            devs = devs * world
        if len(devs) != world:
            raise ConfigError("devices", len(devs), f"expected one device per rank (world size {world}) or one for all")
    _validate(model, layout, engine, min(d.compute_capability for d in devs))
    notes: list[str] = []
    ref = min(devs, key=lambda d: d.total_bytes)
    cc = ref.compute_capability
    mnbt, seqs = resolved_batch(engine, ref)
    prefix = True if engine.enable_prefix_caching is None else engine.enable_prefix_caching
    unset = [f"{name} {value:,}" for name, value, given in (("max_num_batched_tokens", mnbt, engine.max_num_batched_tokens),
                                                             ("max_num_seqs", seqs, engine.max_num_seqs)) if given is None]
    if unset:
        why = {"ray_serve": f"Ray Serve LLM builds the engine args on a GPU of the replica, so vLLM takes its `vllm serve` "
                            f"defaults for {ref.name or 'this GPU'}",
               "openai_api_server": f"vLLM's `vllm serve` defaults for {ref.name or 'this GPU'}",
               "llm_class": f"vLLM's `vllm.LLM` defaults for {ref.name or 'this GPU'}"}[engine.usage_context]
        notes.append(f"unset limits, as vLLM 0.32 will set them: {', '.join(unset)} ({why})")
    spec = engine.speculative
    num_spec = spec.num_speculative_tokens if spec else 0
    draft = spec.draft if spec else None
    if spec and draft is None:
        notes.append("speculative draft config not given: its weights and KV layers are not counted")
    if draft is not None and engine.load_format == "dummy":
        head = draft.group_bytes("draft_extra", spec.draft_tp or layout.tp, spec.draft_tp or layout.tp, False)
        if head.get("draft_lm_head"):
            notes.append(f"dummy weights: the draft shares the target's lm_head, as vLLM does when no checkpoint gives it "
                         f"one; a draft checkpoint with its own lm_head adds {head['draft_lm_head'] / GiB:.2f} GiB per GPU "
                         f"of the last stage")
    if optimisations is None:
        optimisations = decide_optimisations(model, layout, engine, cc, True, max_num_batched_tokens=mnbt, max_num_seqs=seqs)
    sp = optimisations.sequence_parallel
    ep_size = layout.tp * layout.dp
    stages = stage_layer_ranges(model.num_layers, layout)

    # KV specs for the whole model (target layers, then the draft's on the last stage).
    grouping, block_size, layer_names, spec_notes = _kv_grouping(model, layout, engine, cc, num_spec, prefix, optimisations, draft, spec)
    notes += spec_notes
    local: list[frozenset[str]] = []
    for s, (start, end) in enumerate(stages):
        names = set(layer_names[start:end])
        if s == layout.pp - 1 and draft is not None:
            names |= set(layer_names[model.num_layers:])
        local.append(frozenset(names))

    # Per stage (exact) weights and (estimated) non-KV.
    stage_costs: list[StageCosts] = []
    warmup_forwards: list[int] = []
    own_moments: list[tuple[int, int]] = []  # per stage: an after-KV need at its own moment, and its band
    beside_flashkda: list[_WarmupPrefill] = []  # per stage: what kernel warmup's prefill step holds, and beside what
    estimates: list[Estimate] = []
    tp_nodes = {d.node_id for d in devs[:layout.tp] if d.node_id}
    spans_nodes = len(tp_nodes) > 1
    nvls = nvls_buffer_bytes(layout.tp, cc, engine.env_vars, spans_nodes=spans_nodes)
    if said := nvls_basis(nvls, layout.tp, cc, spans_nodes=spans_nodes):
        notes.append(said)
    for s, (start, end) in enumerate(stages):
        weights, by_cat = _stage_weights(model, layout, engine, s, start, end, ep_size, sp)
        eplb_weights, eplb_state = eplb_costs(model, layout, engine.num_redundant_experts, start, end,
                                              engine.eplb_window_size)
        if eplb_weights:  # the redundant experts: exact, whole experts like the others
            weights += eplb_weights
            by_cat = {**by_cat, "routed_experts": by_cat.get("routed_experts", 0) + eplb_weights}
        draft_bytes = _draft_bytes(model, draft, spec, layout, s, engine.load_format) if spec else 0
        act, act_margin, act_basis, warmup_peak = _activation(
            model, layout, s, start, end, mnbt, seqs, draft, (spec.draft_tp or layout.tp) if spec else layout.tp,
            engine.max_model_len, block_size, num_spec, cc)
        non_torch = (NON_TORCH_TP1 if layout.tp <= 2 else NON_TORCH_TP_MULTI) + nvls
        nt_margin = GiB if layout.tp > 1 else GiB // 4
        cg, cg_margin, cg_basis, cg_kept = _cuda_graph(model, layout, engine, s, start, end, mnbt, seqs, cc)
        ws = 0
        ws_margin = 0
        after_kv = 0
        has_kda = _memo(model).get(("has_kda", start, end))
        if has_kda is None:
            has_kda = _memo(model)[("has_kda", start, end)] = any(isinstance(model.layers[i].kv, KdaState) for i in range(start, end))
        flashkda = 0
        for item in optimisations.items:
            if not item.on or not item.workspace_bytes:
                continue
            if item.name == "flashkda" and not has_kda:
                continue
            if item.name == "flashkda":
                flashkda = item.workspace_bytes  # shares lane 0 of vLLM's workspace: see shared_workspace below
            elif item.after_kv:
                after_kv += item.workspace_bytes
            else:
                ws += item.workspace_bytes
                ws_margin += item.margin_bytes
            if item.estimate:
                estimates.append(Estimate(f"workspace:{item.name}", s, item.workspace_bytes, item.margin_bytes, item.reason))
        shared = shared_workspace(model, layout, engine, s, start, end, mnbt, seqs, flashkda, cc)
        in_graphs = bool(shared.after_kv_bytes) and _flashkda_runs_in_graph_profile(engine, mnbt, seqs, cc)
        if in_graphs:
            # FlashKDA grows the workspace while vLLM profiles its CUDA graphs: its estimate, before the KV cache,
            # holds the growth (k4-tp1-b2048-s96-nodraft-h100: 608 -> 1,483.5 MiB at the first PIECEWISE capture).
            cg += shared.after_kv_bytes
            cg_kept += shared.after_kv_bytes
            cg_basis += f" + {shared.after_kv_bytes / MiB:,.0f} MiB of FlashKDA's buffers, grown while it is taken"
        unseen = shared.before_kv_bytes if in_graphs else shared.unseen_bytes
        after_kv += unseen
        prefill_state = (_warmup_prefill_state(model, layout, engine, start, end)
                         if shared.after_kv_bytes and not in_graphs and not engine.enforce_eager else (0, 0))
        # FlashKDA first asks for its buffers in warmup's prefill step, after the autotune's forward
        # (_warmup_prefill_moments): its growth is held from that moment on, not at the autotune's.
        growth = shared.after_kv_bytes if prefill_state[0] else 0
        if unseen or in_graphs:
            estimates.append(Estimate("workspace:shared_unseen", s, unseen, 0, shared.describe()
                                      + ("; FlashKDA's growth is inside the CUDA-graph estimate" if in_graphs else "")))
        slack = _stage_allocator_bytes(model, layout, engine, s, start, end, ep_size, sp, allocator_slack_bytes)
        if spec and s == layout.pp - 1:
            slack += _draft_allocator_bytes(model, draft, spec, layout, engine.load_format, allocator_slack_bytes)
        if slack:  # from the weights' shapes; at most this, should a later 1-1.75 MiB request reuse a remainder
            ws += slack
            estimates.append(Estimate("workspace:allocator_slack", s, slack, 0, ALLOCATOR_SLACK_BASIS))
        residual = zero_residual(model, layout, start, end, sp, cc)
        if residual is not None:  # computed from vLLM's code: its shapes and the fusion's budget
            if residual.in_profile(mnbt):
                ws += residual.total_bytes
            elif engine.enforce_eager:
                after_kv += residual.total_bytes
            else:  # inside vLLM's CUDA-graph estimate, which a TP1 fit run cannot have seen
                cg += residual.total_bytes
                cg_basis += f" + {residual.total_bytes / MiB:,.0f} MiB of FlashInfer's fused all-reduce residuals"
            estimates.append(Estimate("fused_allreduce_residual", s, residual.total_bytes, 0,
                                      residual.describe(mnbt, not engine.enforce_eager)))
        pp_receive = pp_receive_buffer_bytes(model, s, start, mnbt, aux_hidden_state_layers(draft))
        if pp_receive:  # exact: shapes from vLLM's code
            ws += pp_receive
            estimates.append(Estimate("workspace:pp_receive", s, pp_receive, 0, PP_RECEIVE_BASIS))
        if eplb_state:  # allocated while the model loads (EplbState.add_model), so the profile sees it
            ws += eplb_state
            ws_margin += eplb_state // 10
            estimates.append(Estimate("workspace:eplb", s, eplb_state, eplb_state // 10,
                                      "EPLB state (vllm/distributed/eplb/eplb_state.py add_model): one MoE layer's local "
                                      f"experts as a receive buffer + expert maps and a {engine.eplb_window_size}-pass "
                                      "load window per MoE layer; +-10%"))
        estimates.append(Estimate("activation_bytes", s, act, act_margin, act_basis))
        estimates.append(Estimate("non_torch_bytes", s, non_torch, nt_margin,
                                  f"post-snapshot non-torch: {NON_TORCH_TP1 / GiB:.2f} GiB TP1 and TP2 (fitted, H200 "
                                  "2026-11-30 to 2026-12-05), 2.1 GiB TP>2 (llm-d, H100)"
                                  + (f", + {nvls / MiB:,.0f} MiB of NCCL NVLS buffers (computed)" if nvls else "")))
        estimates.append(Estimate("cuda_graph_bytes", s, cg, cg_margin, cg_basis))
        # Kernel warmup runs before any graph is captured: its forward's peak over the profile's first fills the
        # CUDA-graph estimate (less the workspace its profiling grew and kept); that, what was allocated since the
        # profile, what is held after the KV cache by then and the allocator's reserve must fit outside the budget.
        # Without FlashKDA's growth: the autotune's moment comes before it, and where it grows in warmup the capture
        # gathers nothing (both follow capture_prefill_requests), so the prefill's moment is the one that holds it.
        held = after_kv - growth
        warmup, warmup_band, own_moment, own_moment_band = held, 0, 0, 0
        graphs_free = max(0, cg - cg_kept)
        since = persistent_after_profile_bytes(mnbt, model.hidden_size, DTYPE_BITS[model.dtype] // 8,
                                               _draft_kind(draft), s == layout.pp - 1)
        if warmup_peak.bytes and not engine.enforce_eager:
            warmup, warmup_band, over, reserve = _warmup_outside(warmup_peak, act, graphs_free, since, held)
            measured = (f"{warmup_peak.reserve_fraction_low:.0%} to {warmup_peak.reserve_fraction:.0%} measured"
                        if warmup_peak.reserve_fraction_low < warmup_peak.reserve_fraction
                        else "none measured" if not warmup_peak.reserve_fraction
                        else "its reserve read on one failed run")
            estimates.append(Estimate("warmup_mla_decode", s, warmup, 0, warmup_peak.basis
                                      + f"; {over / GiB:+.2f} GiB over the profile's peak, less the "
                                      f"{graphs_free / GiB:.2f} GiB of CUDA-graph estimate not yet captured, plus "
                                      f"{since / GiB:.2f} GiB allocated since the profile (fitted), "
                                      f"{held / GiB:.2f} GiB held after the KV cache and the allocator's reserve, "
                                      f"{warmup_peak.reserve_fraction:.0%} of its largest request "
                                      f"({reserve / GiB:.2f} GiB; {measured}): {warmup / GiB:.2f} GiB outside the "
                                      "budget"))
            if warmup_peak.target is not None:
                # The drafter's step is its own moment of the autotune's dummy run (before FlashKDA's growth):
                # the target's forward, freed before it, is what the capture is weighed beside.
                own_moment, own_moment_band = warmup, warmup_band
                warmup, warmup_band, _, _ = _warmup_outside(warmup_peak.target, act, graphs_free, since, held)
            # The capture runs once warmup has freed its forward: on what warmup began with.
            held_after_warmup = warmup_peak.bytes - warmup_peak.forward_bytes + held
            capture, capture_band = _capture_gather(model, layout, engine, s, start, end, mnbt, seqs, cc,
                                                    held=held_after_warmup, act=act, graphs_free=graphs_free,
                                                    since=since, estimates=estimates)
            warmup, warmup_band = _larger_need(warmup, warmup_band, capture, capture_band)
            if growth and _draft_kind(draft) == "dspark":
                # FlashKDA's growth is held by then too; the capture needs its measured room beyond that at DSpark's
                # first graph (docs/capture-moment.md).
                moment = _dspark_capture_moment(held_after_warmup + growth - act - graphs_free + since, growth,
                                                estimates, s)
                warmup, warmup_band = _larger_need(warmup, warmup_band, *moment)
            elif growth:
                # After warmup's prefill FlashKDA's growth is held too, while the capture's eager forwards run
                # into the same room: weighed as the autotune's forward with the growth beside it. A stand-in, not
                # the capture's own forward: round 44 (H100, 3 speculative tokens, 4,096 over 512, 0.925) ran out
                # of memory capturing DSpark's graphs where the autotune's moment alone left room. No capture
                # without DSpark has run out of memory this way, so its own room is unmeasured.
                grown, grown_band, _, _ = _warmup_outside(warmup_peak.target or warmup_peak, act, graphs_free, since,
                                                          held + growth)
                warmup, warmup_band = _larger_need(warmup, warmup_band, grown + CAPTURE_AFTER_GROWTH_ERROR,
                                                   grown_band + CAPTURE_AFTER_GROWTH_ERROR)
        warmup_forwards.append(warmup_peak.forward_bytes if not engine.enforce_eager else 0)
        stage_costs.append(StageCosts(weights, by_cat, draft_bytes, act, cg, non_torch, ws, warmup, warmup_band))
        own_moments.append((own_moment, own_moment_band))
        beside_flashkda.append(_WarmupPrefill(*prefill_state, after_kv, growth, act + graphs_free - since))

    # Per rank: budget and KV pool; identical (stage, device) pairs computed once.
    rank_stage = [layout.stage_of_rank(r) for r in range(world)]
    avail = []
    budgets = []
    for r in range(world):
        d = devs[r]
        budget = math.ceil(d.total_bytes * engine.gpu_memory_utilization)
        budgets.append(budget)
        avail.append(budget - stage_costs[rank_stage[r]].non_kv_bytes)
    # Each DP rank is its own engine core that sizes its own pool (vLLM v1/engine/core.py _initialize_kv_caches).
    pool = pools_per_engine(grouping, [local[rank_stage[r]] for r in range(world)], avail,
                            ranks_per_engine=layout.tp * layout.pp, max_model_len=engine.max_model_len, dcp=layout.dcp)
    # The same pools with every estimated term at the top of its measured band (planning/bands.py).
    bands = [kv_band_bytes(c.weights_bytes + c.draft_bytes, c.activation_bytes + c.non_torch_bytes + c.workspace_bytes,
                           c.cuda_graph_bytes, model.family == "kimi_k3")
             for c in (stage_costs[rank_stage[r]] for r in range(world))]
    banded = pools_per_engine(grouping, [local[rank_stage[r]] for r in range(world)],
                              [a - b for a, b in zip(avail, bands)], ranks_per_engine=layout.tp * layout.pp,
                              max_model_len=engine.max_model_len, dcp=layout.dcp)
    state_groups = [g for g in grouping.groups if isinstance(g.spec, StatePageSpec)]
    state_blocks = sum(g.blocks_per_request(engine.max_model_len) for g in state_groups)
    prefill_moments = [(0, 0)] * len(stage_costs)
    if any(p.per_request_bytes for p in beside_flashkda):
        prefill_moments = _warmup_prefill_moments(beside_flashkda, grouping, engine, mnbt, seqs, num_spec, block_size,
                                                  pool.num_blocks, estimates)
    stage_costs = [_with_own_moment(_with_own_moment(c, *own), *prefill)
                   for c, own, prefill in zip(stage_costs, own_moments, prefill_moments)]
    page = grouping.groups[0].page_of(0) if grouping.groups else 0
    ranks = []
    for r in range(world):
        d = devs[r]
        s = rank_stage[r]
        c = stage_costs[s]
        start_short = max(0, budgets[r] - d.free)
        shortfall = start_short + pool.shortfall_bytes[r]
        outside = _outside_budget(model, world, cc)
        headroom = d.total_bytes - budgets[r] - outside
        bpb = pool.bytes_per_block[r]
        ranks.append(RankMemory(
            rank=r, pp_stage=s, tp_rank=layout.tp_rank_of(r), dp_rank=layout.dp_rank_of(r),
            total_bytes=d.total_bytes, free_bytes=d.free, weights_bytes=c.weights_bytes,
            weights_by_category=c.weights_by_category, draft_bytes=c.draft_bytes, activation_bytes=c.activation_bytes,
            cuda_graph_bytes=c.cuda_graph_bytes, non_torch_bytes=c.non_torch_bytes, workspace_bytes=c.workspace_bytes,
            budget_bytes=budgets[r], kv_cache_bytes=avail[r], kv_bytes_per_token=bpb / block_size if block_size else 0.0,
            block_size=block_size, page_bytes=page, bytes_per_block=bpb, state_bytes_per_seq=state_blocks * bpb,
            num_blocks=pool.num_blocks_per_worker[r], shortfall_bytes=shortfall,
            headroom_bytes=headroom, local_layers=len(local[s]),
            after_kv_bytes=c.after_kv_bytes, warmup_band_bytes=c.warmup_band_bytes,
            warmup_shortfall_bytes=max(0, c.after_kv_bytes - max(headroom, 0)) if c.after_kv_bytes else 0,
            warmup_forward_bytes=warmup_forwards[s],
        ))
    worst = max(ranks, key=lambda x: x.shortfall_bytes)
    full_graphs = bool(state_groups) and not engine.enforce_eager
    verdict = _verdict(ranks, devs, [stage_costs[s] for s in rank_stage], pool, seqs if full_graphs else 0)
    if verdict == "fits" and any(r.warmup_shortfall_bytes for r in ranks):
        verdict = "at_risk"  # the note below says by how much, and within what
    elif verdict == "fits" and (any(banded.shortfall_bytes) or banded.num_blocks < banded.blocks_per_request
                              or (full_graphs and seqs > banded.num_blocks)):
        verdict = "at_risk"
        notes.append(f"at risk: it fits at the plan's point estimates, not with their measured error bands against it "
                     f"(up to {max(bands) / GiB:.2f} GiB of KV pool per GPU: weights, profile and CUDA graphs at the top "
                     f"of the errors their validation runs showed); vLLM may refuse or OOM")
    elif verdict == "seqs_over_state_blocks" and max(bands) and min(pool.bytes_per_block):
        # The boundary is a count of blocks, which a fraction of a percent of the pool moves (vLLM made 513 blocks for
        # 512 sequences on k8-tp1-b8192-s512-nodraft): short by less than the bands, it may as well fit.
        short = (seqs - pool.num_blocks) * max(pool.bytes_per_block)
        # Not where warmup would run out of memory beyond its band once the graphs were allowed.
        if short <= max(bands) and not _fails_in_warmup(ranks):
            verdict = "at_risk"
            notes.append(f"at risk: {pool.num_blocks} KV blocks at the plan's point estimates for max_num_seqs={seqs} "
                         f"(each decoding sequence holds a state block), {short / GiB:.2f} GiB short, within the "
                         f"{max(bands) / GiB:.2f} GiB its measured error bands allow either way; vLLM may refuse "
                         f"(max_num_seqs > num_blocks) or start")
    fits = verdict == "fits"
    safe_util = _safe_utilization(ranks, model, world, cc)
    no_safe_reason = ""
    if check_proposal and safe_util is not None:
        safe_util, no_safe_reason = _proven_proposal(safe_util, verdict, pool.num_blocks, ranks, model, layout, engine,
                                                     devs, optimisations)
    if verdict == "seqs_over_state_blocks":
        notes.append(
            f"vLLM would refuse to capture CUDA graphs: max_num_seqs {seqs:,} exceeds the {pool.num_blocks:,} KV-cache "
            f"blocks, and every decoding sequence holds one KDA state block (config/compilation.py); set max_num_seqs "
            f"to at most {pool.num_blocks:,}" + raise_utilization_advice(engine.gpu_memory_utilization, safe_util))
    if no_safe_reason:
        notes.append(f"no gpu_memory_utilization fits: {no_safe_reason}")
    warm = max(ranks, key=lambda x: x.warmup_shortfall_bytes)
    if warm.warmup_shortfall_bytes:
        within = warm.warmup_shortfall_bytes <= warm.warmup_band_bytes
        notes.append(
            (f"at risk: vLLM may OOM in warmup on rank {warm.rank}, short by {warm.warmup_shortfall_bytes / GiB:.2f} "
             f"GiB, within its measured band ({warm.warmup_band_bytes / GiB:.2f} GiB) either way: "
             if within else f"vLLM would OOM allocating the KV cache or in warmup on rank {warm.rank} by "
             f"{warm.warmup_shortfall_bytes / GiB:.2f} GiB: ")
            + f"{warm.after_kv_bytes / GiB:.2f} GiB that vLLM's KV sizing does "
            f"not see (its shared workspace grown past the profile's: TRITON_MLA's decode logits for a DSpark draft "
            f"before the KV cache, FlashKDA's prefill buffers in warmup; what kernel warmup's MLA decode path holds "
            f"beyond the CUDA-graph estimate; KDA's gathered states at the largest CUDA-graph capture, with the "
            f"allocator's reserve; the capture's graph pool and DSpark's first eager forward, beyond what warmup "
            f"left; with enforce_eager at TP > 1, the fused all-reduce's residuals) and only "
            f"{max(warm.headroom_bytes, 0) / GiB:.2f} GiB is left outside the budget"
            + (f"; gpu_memory_utilization {safe_util} or lower leaves room" if safe_util else ""))
    # The rank that decides: the one furthest short, else the one whose pool sets the engine's block count.
    binding = worst.rank if worst.shortfall_bytes else min(range(world), key=lambda r: (pool.num_blocks_per_worker[r], r))
    if any(x.headroom_bytes < 0 for x in ranks):
        low = min(ranks, key=lambda x: x.headroom_bytes)
        notes.append(
            f"rank {low.rank}: only {(low.total_bytes - low.budget_bytes) / GiB:.2f} GiB outside the budget for the CUDA context, "
            f"NCCL{' and the FlashInfer MXFP4 workspace' if cc[0] == 10 and 'mxfp4' in model.quantization else ''} "
            f"(~{(low.total_bytes - low.budget_bytes - low.headroom_bytes) / GiB:.1f} GiB): lower gpu_memory_utilization"
        )
    deepest = max(ranks, key=lambda x: x.local_layers)
    if (engine.accelerator == "gpu" and not engine.enforce_eager and deepest.cuda_graph_bytes
            and deepest.local_layers > CUDA_GRAPH_FITTED_LAYERS[1]):
        notes.append(
            f"CUDA graphs: {deepest.cuda_graph_bytes / GiB:.2f} GiB on rank {deepest.rank} is extrapolated: the "
            f"per-layer term was fitted on stages of {CUDA_GRAPH_FITTED_LAYERS[0]}-{CUDA_GRAPH_FITTED_LAYERS[1]} layers "
            f"(H200); this stage has {deepest.local_layers}, and its error band is the one the validation "
            f"runs showed. `kimi-k3-serve rehearse --rank-of` measures it")
    if layout.dcp > 1:
        notes.append(f"DCP {layout.dcp}: MLA tokens are split across ranks (blocks per request use max_model_len / DCP); "
                     "not covered by the conformance tests")
    if layout.dp > 1:
        total = sum(min(c, seqs) for c in pool.engine_concurrency)
        notes.append(f"DP {layout.dp}: each DP rank is its own engine core with its own KV pool (the figures above are "
                     f"the smallest engine's); all {layout.dp} together hold {total:,.1f} requests of max_model_len at "
                     f"once (each capped at max_num_seqs {seqs})")
    if model.is_moe and (layout.dp > 1 or engine.num_redundant_experts):
        notes.append("experts: " + expert_split(model, layout, engine.num_redundant_experts).describe())
    return MemoryReport(
        layout=layout, engine=engine, ranks=tuple(ranks), num_blocks=pool.num_blocks, block_size=block_size,
        kv_cache_tokens=pool.kv_cache_tokens, max_concurrency=pool.max_concurrency, blocks_per_request=pool.blocks_per_request,
        fits=fits, shortfall_bytes=worst.shortfall_bytes, binding_rank=binding, estimates=tuple(estimates),
        optimisations=optimisations, notes=tuple(notes), max_num_seqs=seqs, max_num_batched_tokens=mnbt,
        enable_prefix_caching=prefix, stage_layers=tuple(stages), kv_grouping=grouping.kind,
        num_kv_groups=len(grouping.groups), padding_layers=grouping.padding_layers,
        verdict=verdict, safe_gpu_memory_utilization=safe_util, engine_concurrency=pool.engine_concurrency,
        kv_band_bytes=max(bands), banded_max_concurrency=banded.max_concurrency, no_safe_utilization=no_safe_reason,
    )


def shared_workspace(model: ModelInventory, layout: Layout, engine: EngineSettings, stage: int, start: int, end: int,
                     mnbt: int, seqs: int, flashkda_bytes: int, cc: tuple[int, int]) -> SharedWorkspace:
    """Lane 0 of vLLM's shared workspace on a rank of ``stage`` (``planning/workspace.py``)."""
    w = model.widths
    moe = 0
    if w.num_experts and any(model.layers[i].mlp == "moe" for i in range(start, end)):
        inter = w.moe_intermediate_size if layout.ep else max(w.moe_intermediate_size // layout.tp,
                                                              model.expert_min_intermediate_per_rank)
        gathered = layout.dp if layout.ep and layout.dp > 1 else 1
        moe = moe_buffer_bytes(mnbt * gathered, w.experts_per_token, inter, w.moe_hidden_size)
    logits = 0
    spec = engine.speculative
    if spec is not None and spec.method == "dspark" and spec.draft is not None and stage == layout.pp - 1:
        mla = next((layer.kv for layer in spec.draft.layers if isinstance(layer.kv, MlaKv)), None)
        if mla is not None:  # DSpark's non-causal MLA has no FLASHMLA kernel: it runs on TRITON_MLA
            heads = max(1, spec.draft.num_attention_heads // (spec.draft_tp or layout.tp))
            logits = triton_mla_logits_bytes(seqs, 1 + spec.num_speculative_tokens, heads, mla.kv_lora_rank,
                                             engine.max_model_len, cc)
    return SharedWorkspace(moe, logits, flashkda_bytes)


ALLOCATOR_SLACK_BASIS = ("allocator slack: the free remainders that the weights' 10-20 MiB tensors leave in "
                         "their own segments of PyTorch's caching allocator (planning/allocator.py "
                         "allocator_slack_bytes); vLLM's profile counts them (consumed memory is the drop in free "
                         "memory), \"Model loading took\" does not; Kimi-K3: the MoE router gate's 1.75 MiB per MoE "
                         "layer, and 1.5 MiB more at a TP8 rank")
"""Computed from the weights' shapes. The profile of TP8 rank slices grew with depth by what it predicts (H200: 23 to
49 layers, 84.5 MiB predicted, 94 +- 10 MiB logged), before it was counted."""


PP_RECEIVE_BASIS = ("pipeline receive buffer: hidden state + residual at max_num_batched_tokens, kept for the CUDA "
                    "graphs' addresses (vLLM v1/worker/gpu/model_runner.py load_model, make_empty_intermediate_tensors; "
                    "Kimi-K3: one residual per AttnRes block before the stage; with DSpark, one slot per aux hidden "
                    "state captured on an earlier stage, eagle3_utils.py reserve_aux_intermediate_tensor_slots); exact")


def pp_receive_buffer_bytes(model: ModelInventory, stage: int, start: int, max_num_batched_tokens: int,
                            aux_layers: Sequence[int] = ()) -> int:
    """What a stage after the first allocates while its model loads to receive the previous stage's tensors: the
    hidden state and the residual, ``max_num_batched_tokens`` rows each; under Block Attention Residuals the residual
    holds one row per block before the stage (``cdiv(start_layer, attn_res_block_size)``). With a draft that taps
    the target's hidden states, a slot for each one captured before the stage (``aux_layers``, see
    ``aux_hidden_state_layers``: ``bisect_right(aux_layers, start_layer)`` of them, ``EagleModelMixin.
    _cache_aux_pp_layout``): 3 on stage 1 of deploy/config.yaml, 0.33 GiB at 8,192 tokens."""
    if stage == 0:
        return 0
    residuals = cdiv(start, model.attn_res_block_size) if model.attn_res_block_size else 1
    aux = received_aux_states(aux_layers, start)
    return (1 + residuals + aux) * hidden_state_bytes(model, max_num_batched_tokens)


def hidden_state_bytes(model: ModelInventory, tokens: int) -> int:
    """One hidden state of ``tokens`` rows in the model dtype."""
    return tokens * model.hidden_size * (DTYPE_BITS[model.dtype] // 8)


def received_aux_states(aux_layers: Sequence[int], start: int) -> int:
    """How many aux hidden states (``aux_layers`` sorted, as ``aux_hidden_state_layers`` gives them) a stage starting
    at layer ``start`` receives from the stages before it:
    ``bisect_right(aux_layers, start_layer)`` (``EagleModelMixin._cache_aux_pp_layout``); 0 on the first stage."""
    return bisect.bisect_right(aux_layers, start) if start else 0


def aux_hidden_state_layers(draft: ModelInventory | None) -> tuple[int, ...]:
    """The target layers whose input vLLM 0.32 keeps for a DSpark draft (the model's ``aux_hidden_state_layers``):
    each of its ``target_layer_ids`` + 1 (``get_eagle3_aux_layers_from_config``), so the hidden state after layer
    ``id`` is captured as the next layer begins (models/kimi_k3/nvidia/model.py ``forward``) and held to the end of
    the forward, then sent on to the last stage. () for other drafts: an EAGLE3 draft's layers are not in its
    inventory, and its profile is fitted apart."""
    if draft is None or draft.draft is None or draft.draft.method != "dspark":
        return ()
    return tuple(sorted({layer + 1 for layer in draft.draft.target_layer_ids}))


def _aux_held_bytes(model: ModelInventory, aux_layers: Sequence[int], start: int, layer: int, tokens: int) -> int:
    """The aux hidden states this stage has captured, and still holds, while ``layer`` runs: those after a layer
    of the stage before it (``start < aux <= layer``), ``tokens`` x hidden each. The ones captured on an earlier
    stage sit in the receive buffer (``pp_receive_buffer_bytes``)."""
    held = sum(1 for aux in aux_layers if start < aux <= layer)
    return held * hidden_state_bytes(model, tokens)


def _outside_budget(model: ModelInventory, world: int, cc: tuple[int, int]) -> int:
    """Memory that exists outside vLLM's budget before warmup: the CUDA context, NCCL communicators (world > 1) and,
    on Blackwell with MXFP4 experts, FlashInfer's MoE workspace."""
    outside = PRE_SNAPSHOT_CONTEXT + (PRE_SNAPSHOT_NCCL if world > 1 else 0)
    if cc[0] == 10 and "mxfp4" in model.quantization:
        outside += FLASHINFER_MXFP4_WORKSPACE
    return outside


def _verdict(ranks: Sequence[RankMemory], devs: Sequence[RankDevice], costs: Sequence[StageCosts], pool,
             seqs_needing_state_blocks: int) -> str:
    """The first failure vLLM's start would meet (VERDICTS), or "fits". ``seqs_needing_state_blocks``: max_num_seqs
    where full CUDA graphs decode a hybrid model (each sequence then needs one state block), else 0."""
    if any(r.budget_bytes > r.free_bytes for r in ranks):
        return "cannot_start"  # request_memory: free < util x total
    for r in ranks:
        if costs[r.rank].weights_bytes + costs[r.rank].draft_bytes > devs[r.rank].free - PRE_SNAPSHOT_CONTEXT:
            return "oom_at_load"
    if any(s for s in pool.shortfall_bytes) or pool.num_blocks < pool.blocks_per_request:
        return "no_kv_space"
    if seqs_needing_state_blocks > pool.num_blocks:
        return "seqs_over_state_blocks"  # compilation.py: max_num_seqs > kv_cache_config.num_blocks with Mamba layers
    if _fails_in_warmup(ranks):
        return "oom_at_warmup"
    return "fits"  # a warmup shortfall within the reserve's band is "at risk" (estimate_memory)


def _fails_in_warmup(ranks: Sequence[RankMemory]) -> bool:
    """Some rank is short in warmup beyond the allocator reserve's band: vLLM runs out of memory there."""
    return any(r.warmup_shortfall_bytes > r.warmup_band_bytes for r in ranks)


def _safe_utilization(ranks: Sequence[RankMemory], model: ModelInventory, world: int, cc: tuple[int, int]) -> float | None:
    """The largest utilization (a multiple of 0.005) at which every rank's after-KV allocations fit outside the budget."""
    outside = _outside_budget(model, world, cc)
    best = 1.0
    for r in ranks:
        room = r.total_bytes - outside - r.after_kv_bytes
        if room <= 0:
            return None
        best = min(best, math.floor(room / r.total_bytes * 200) / 200)
    return best if best > 0 else None


def raise_utilization_advice(util: float, safe_util: float | None) -> str:
    """" or raise gpu_memory_utilization to X" where the proposal X is above ``util``, else nothing: raising it past
    the proposal trades this failure for an OOM after the KV cache."""
    return f" or raise gpu_memory_utilization to {safe_util}" if safe_util is not None and safe_util > util else ""


def _proven_proposal(safe_util: float, verdict: str, num_blocks: int, ranks: Sequence[RankMemory],
                     model: ModelInventory, layout: Layout, engine: EngineSettings, devs: Sequence[RankDevice],
                     optimisations: Optimisations | None) -> tuple[float | None, str]:
    """``safe_util`` if the plan says "fits" there, else None and why. The proposal bounds the utilization from
    above (room after the KV cache); the KV pool bounds it from below (a state block for each of max_num_seqs, one
    request of max_model_len, the bands), and where the two cross no utilization fits: proposing the upper bound
    then sends the user to a start vLLM refuses (4 layers, DSpark, 2,048 tokens, 576 sequences on an H100: warmup
    leaves room up to 0.84, where the pool holds fewer state blocks than sequences). ``verdict``, ``num_blocks``
    and ``ranks``: the plan's at the utilization asked for.

    ``safe_util`` is read from the after-KV need at the utilization asked for, and that need grows with the pool
    (warmup's prefill step takes as many requests as the pool has blocks for): where the plan is short in warmup at
    ``safe_util``, the proposal steps down by 0.005, up to ``PROPOSAL_STEPS_DOWN`` times, to the largest that fits."""
    asked = engine.gpu_memory_utilization
    at_asked = (verdict, num_blocks, ranks)
    for step in range(PROPOSAL_STEPS_DOWN + 1):
        util = round(safe_util - 0.005 * step, 3)
        if util == asked:
            verdict, num_blocks, ranks = at_asked
        else:
            at_util = estimate_memory(model, layout, replace(engine, gpu_memory_utilization=util), devs,
                                      optimisations=optimisations, check_proposal=False)
            verdict, num_blocks, ranks = at_util.verdict, at_util.num_blocks, at_util.ranks
        if verdict == "fits":
            return util, ""
        if verdict not in ("at_risk", "oom_at_warmup") or not any(r.warmup_shortfall_bytes for r in ranks):
            break  # not short in warmup: a lower utilization gives the pool less, and warmup nothing
    why = {
        "cannot_start": "less memory is free than that budget",
        "oom_at_load": "the weights do not load",
        "no_kv_space": "the KV cache does not hold one request of max_model_len; lower max_model_len",
        "seqs_over_state_blocks": f"the KV cache holds {num_blocks:,} blocks, fewer than max_num_seqs, and each "
                                  f"decoding sequence holds a KDA state block; lower max_num_seqs to at most "
                                  f"{num_blocks:,}",
        "at_risk": "it fits only at the plan's point estimates, not with their measured error bands against it; "
                   "lower max_num_seqs or max_model_len",
    }.get(verdict, f"the plan says {verdict}")
    where = f"at {safe_util}" if util == safe_util else f"from {safe_util} down to {util}"
    return None, f"{where}, the largest that leaves room for what vLLM allocates after the KV cache, {why}"


def _validate_kimi_kv_dtype(engine: EngineSettings, cc: tuple[int, int]) -> None:
    """vLLM 0.32's Kimi-K3 MLA (models/kimi_k3/nvidia/mla.py) asserts an fp8 prefill query for a plain fp8 KV cache and
    a bf16 one for fp8_ds_mla; mla_attention.backend_supports_prefill_query_quantization grants the fp8 query on
    compute capability 10.x alone, so the flag cannot help on Hopper."""
    dtype = engine.kv_cache_dtype
    if not dtype.startswith("fp8"):
        return
    if dtype == "fp8_ds_mla":
        if engine.fp8_prefill_query and cc[0] == 10:
            raise ConfigError("engine_kwargs.attention_config.use_prefill_query_quantization", True,
                              "false with kv_cache_dtype fp8_ds_mla: vLLM 0.32's Kimi-K3 asserts a bf16 prefill query for it")
        return
    if cc[0] != 10:
        raise ConfigError("engine.kv_cache_dtype", dtype,
                          f"auto or bfloat16 on compute capability {cc[0]}.{cc[1]}: vLLM 0.32 runs Kimi-K3's fp8 KV cache only "
                          "with an fp8 prefill query, and grants that query on compute capability 10.x alone "
                          "(it asserted at load on an H200 on 2026-12-01, with the flag set)")
    if not engine.fp8_prefill_query:
        raise ConfigError("engine_kwargs.attention_config.use_prefill_query_quantization", False,
                          f"expected true: vLLM 0.32 refuses Kimi-K3 with kv_cache_dtype {dtype} without an fp8 "
                          "prefill query (it asserts at load; seen on an H200 on 2026-11-30)")


def check_draft(model: ModelInventory, spec: SpeculativeSettings) -> None:
    """What vLLM refuses about a draft whatever the layout: checked once, before a search tries every layout."""
    d = spec.draft
    if d is None:
        return
    if d.draft is None:
        raise ConfigError("speculative.draft", d.architecture, "expected a draft architecture (LlamaForCausalLMEagle3, Eagle3DeepseekV2ForCausalLM or K3DSparkModel)")
    if d.draft.method != spec.method:
        raise ConfigError("speculative.method", spec.method, f"the draft {d.name} is a {d.draft.method} draft")
    if spec.method == "dspark" and model.family != "kimi_k3":
        raise ConfigError("speculative.method", "dspark", "the MLA DSpark draft (K3DSparkModel) serves Kimi-K3 targets only")
    if d.vocab_size != model.vocab_size and d.draft.shares_target_lm_head:
        raise ConfigError("speculative.draft", d.vocab_size, f"must share the target vocab size {model.vocab_size}")


def _validate(model: ModelInventory, layout: Layout, engine: EngineSettings, compute_capability: tuple[int, int]) -> None:
    for name, n in model.tp_divisors:
        if n % layout.tp:
            raise ConfigError("layout.tp", layout.tp, f"must divide {model.name} {name} = {n} (vLLM asserts it)")
    kv = model.num_kv_heads
    if not model.uses_mla and kv and (kv % layout.tp if layout.tp <= kv else layout.tp % kv):
        raise ConfigError("layout.tp", layout.tp, f"must divide num_key_value_heads = {kv} or be a multiple of it")
    check_eplb(model, layout, engine.num_redundant_experts)
    if engine.kv_cache_dtype == "fp8_ds_mla" and not model.uses_mla:
        raise ConfigError("engine.kv_cache_dtype", "fp8_ds_mla", "fp8_ds_mla is an MLA cache format; this model has no MLA layers")
    if model.family == "kimi_k3":
        _validate_kimi_kv_dtype(engine, compute_capability)
    if model.is_hybrid and engine.mamba_ssm_cache_dtype == "float16":
        raise ConfigError("engine.mamba_ssm_cache_dtype", "float16", "KDA recurrent state supports auto, float32 and bfloat16")
    spec = engine.speculative
    if spec is not None:
        if spec.draft_tp not in (None, 1, layout.tp):
            raise ConfigError("speculative.draft_tp", spec.draft_tp, f"vLLM allows 1 or the target's TP ({layout.tp})")
        check_draft(model, spec)
        d = spec.draft
        if d is not None:
            for name, n in d.tp_divisors:
                if n % (spec.draft_tp or layout.tp):
                    raise ConfigError("speculative.draft_tp", spec.draft_tp or layout.tp, f"must divide the draft's {name} = {n}")


def _stage_weights(model: ModelInventory, layout: Layout, engine: EngineSettings, stage: int, start: int, end: int,
                   ep_size: int, sp: bool) -> tuple[int, Mapping[str, int]]:
    key = ("stage", layout.tp, ep_size, layout.ep, sp, start, end, stage == 0, stage == layout.pp - 1,
           engine.language_model_only)
    cached = _memo(model).get(key)
    if cached is not None:
        return cached
    by_cat: dict[str, int] = {}
    per_layer = model.layer_bytes(layout.tp, ep_size, layout.ep, sp)
    parts = list(per_layer[start:end])
    if stage == 0:
        parts.append(model.group_bytes("embedding", layout.tp, ep_size, layout.ep, sp))
        if not engine.language_model_only and model.vision:
            parts.append(model.group_bytes("vision", layout.tp, ep_size, layout.ep, sp))
    if stage == layout.pp - 1:
        head = dict(model.group_bytes("head", layout.tp, ep_size, layout.ep, sp))
        if model.tie_word_embeddings and layout.pp == 1:
            head.pop("lm_head", None)  # one tensor serves both on a single stage
        parts.append(head)
    for p in parts:
        for k, v in p.items():
            by_cat[k] = by_cat.get(k, 0) + v
    # The caching allocator's whole blocks that "Model loading took" counts, per tensor as sharded on the rank.
    rounding = _stage_allocator_bytes(model, layout, engine, stage, start, end, ep_size, sp, allocator_rounding_bytes)
    if rounding:
        by_cat["allocator_rounding"] = rounding
    result = (sum(by_cat.values()), MappingProxyType(by_cat))  # read-only: shared by every rank of the stage
    _memo(model)[key] = result
    return result


def _stage_allocator_bytes(model: ModelInventory, layout: Layout, engine: EngineSettings, stage: int, start: int,
                           end: int, ep_size: int, sp: bool, rule: Callable[[int], int]) -> int:
    """``rule`` (planning/allocator.py) summed over the tensors one rank of the stage allocates as vLLM loads it."""
    total = sum(_layer_allocator_bytes(model, layout.tp, ep_size, layout.ep, sp, rule)[start:end])
    if stage == 0:
        total += _tensors_allocator_bytes(model, model.embedding, layout.tp, ep_size, layout.ep, sp, rule)
        if not engine.language_model_only and model.vision:
            total += _tensors_allocator_bytes(model, model.vision, layout.tp, ep_size, layout.ep, sp, rule)
    if stage == layout.pp - 1:
        tied = model.tie_word_embeddings and layout.pp == 1
        total += _tensors_allocator_bytes(model, [t for t in model.head if not (tied and t.category == "lm_head")],
                                          layout.tp, ep_size, layout.ep, sp, rule)
    return total


def _tensors_allocator_bytes(model: ModelInventory, tensors, tp: int, ep_size: int, ep: bool, sp: bool,
                             rule: Callable[[int], int]) -> int:
    """``rule`` (planning/allocator.py's rounding or slack) over ``tensors`` as vLLM allocates them on one rank.

    Applied to every tensor as loaded, whatever the MoE backend: on Hopper, Marlin's MXFP4 processing
    (quantization/utils/marlin_utils_fp4.py ``prepare_moe_mxfp4_layer_for_marlin``) rebuilds the expert scales with
    ``torch.cat`` as new tensors of the same bytes, so the same rule holds; Blackwell's backends are not measured."""
    return sum(rule(each) for each in model.allocations(tensors, tp, ep_size, ep, sp))


def _layer_allocator_bytes(model: ModelInventory, tp: int, ep_size: int, ep: bool, sp: bool,
                           rule: Callable[[int], int]) -> tuple[int, ...]:
    """Per layer, ``rule`` over its tensors on one rank (memoised per rule and TP/EP shape)."""
    key = ("allocator", rule, tp, ep_size, ep, sp)
    cached = _memo(model).get(key)
    if cached is None:
        cached = _memo(model)[key] = tuple(_tensors_allocator_bytes(model, layer.tensors, tp, ep_size, ep, sp, rule)
                                           for layer in model.layers)
    return cached


def _draft_bytes(model: ModelInventory, draft: ModelInventory | None, spec, layout: Layout, stage: int,
                 load_format: str = "auto") -> int:
    """The draft's weights on the last stage, plus the target embedding vLLM builds there under PP for
    EAGLE-family drafts (models/utils.py ``spec_decode_needs_target_embed``).

    With dummy weights an EAGLE3 draft's own lm_head is built and then freed: vLLM 0.32's ``load_eagle_model``
    (v1/worker/gpu/spec_decode/eagle/utils.py) keeps it only when the checkpoint's weights named one
    (``has_own_lm_head``, set by ``process_eagle_weight`` in ``load_weights``, which the dummy loader never calls),
    and otherwise points the draft at the target's lm_head, before "Model loading took" is measured."""
    if stage != layout.pp - 1:
        return 0
    total = 0
    if _draft_builds_target_embedding(spec, layout):
        total += sum(model.group_bytes("embedding", layout.tp, layout.tp * layout.dp, layout.ep).values())
    if draft is not None:
        dtp = spec.draft_tp or layout.tp
        key = ("draft_total", dtp, load_format)
        own = _memo(draft).get(key)
        if own is None:
            own = sum(sum(d.values()) for d in draft.layer_bytes(dtp, dtp, False))
            extra = draft.group_bytes("draft_extra", dtp, dtp, False)
            own += sum(v for k, v in extra.items() if not (k == "draft_lm_head" and load_format == "dummy"))
            _memo(draft)[key] = own
        total += own
    # The allocator's rounding of these tensors (planning/allocator.py), as for the target's.
    return total + _draft_allocator_bytes(model, draft, spec, layout, load_format, allocator_rounding_bytes)


def _draft_builds_target_embedding(spec, layout: Layout) -> bool:
    """Under PP the last stage builds its own share of the target embedding for an EAGLE-family draft (vLLM
    models/utils.py ``spec_decode_needs_target_embed``): ``_draft_bytes`` and ``_draft_allocator_bytes`` count it."""
    return layout.pp > 1 and spec.method in ("eagle", "eagle3", "dflash", "dspark")


def _draft_allocator_bytes(model: ModelInventory, draft: ModelInventory | None, spec, layout: Layout,
                           load_format: str, rule: Callable[[int], int]) -> int:
    """``rule`` (planning/allocator.py) over the tensors ``_draft_bytes`` counts on the last stage."""
    total = 0
    if _draft_builds_target_embedding(spec, layout):
        total += _tensors_allocator_bytes(model, model.embedding, layout.tp, layout.tp * layout.dp, layout.ep, False,
                                          rule)
    if draft is not None:
        dtp = spec.draft_tp or layout.tp
        total += sum(_layer_allocator_bytes(draft, dtp, dtp, False, False, rule))
        total += _tensors_allocator_bytes(draft, [t for t in draft.draft_extra
                                                  if not (t.category == "draft_lm_head" and load_format == "dummy")],
                                          dtp, dtp, False, False, rule)
    return total


def _kv_dtype_bytes(model: ModelInventory, engine: EngineSettings) -> int:
    b = KV_DTYPE_BYTES[engine.kv_cache_dtype]
    return b or DTYPE_BITS[model.dtype] // 8


def _kv_grouping(model, layout, engine, cc, num_spec, prefix, opts, draft, spec) -> tuple[KvGrouping, int, list[str], list[str]]:
    key = ("kv", layout.tp, layout.dcp, engine.kv_cache_dtype, engine.mamba_ssm_cache_dtype, cc, num_spec, prefix,
           opts.flashkda, draft, spec.draft_tp if spec else None)  # the draft itself: identity-hashed
    cached = _memo(model).get(key)
    if cached is not None:
        return cached
    notes: list[str] = []
    kv_bytes = _kv_dtype_bytes(model, engine)
    ds_mla = engine.kv_cache_dtype == "fp8_ds_mla"
    block = default_block_size(model, cc)
    state_spec = None
    kda = next((layer.kv for layer in model.layers if isinstance(layer.kv, KdaState)), None)
    if kda is not None:
        conv_bytes = DTYPE_BITS[model.dtype] // 8  # mamba_cache_dtype auto -> model dtype (not the KV dtype)
        rec_bytes = 2 if engine.mamba_ssm_cache_dtype == "bfloat16" else 4
        state_spec = StatePageSpec(
            shapes=((kda.conv_dim // layout.tp, kda.conv_kernel_size - 1 + num_spec),
                    (kda.num_heads // layout.tp, kda.head_dim, kda.head_dim)),
            dtype_bytes=(conv_bytes, rec_bytes),
            num_speculative_blocks=num_spec,
            num_prefill_checkpoint_blocks=1 if opts.flashkda else 0,
            align_mode=prefix,
        )
        if model.uses_mla:
            mla = next(layer.kv for layer in model.layers if isinstance(layer.kv, MlaKv))
            per_token = mla.head_size * kv_bytes  # the alignment uses the plain MLA spec (no 656-byte layout)
            backend_min = 32 if cc[0] == 10 else 16
            block = hybrid_block_size(per_token, state_spec.state_bytes,
                                      kernel_alignment=max(backend_min, block, MLA_HYBRID_MIN_BLOCK), backend_alignment=backend_min)
            state_spec = _padded_state(state_spec, block * per_token)
    names: list[str] = []
    layers: list[tuple[str, LayerSpec]] = []

    def attn(kv, tp: int, marker: bool) -> AttentionPageSpec:
        if isinstance(kv, MlaKv):
            return AttentionPageSpec(block, 1, kv.head_size, 0, kv_bytes, mla=True,
                                     state_content_bytes=FP8_DS_MLA_BYTES_PER_TOKEN if ds_mla else None, draft_marker=marker)
        heads = kv.num_kv_heads // tp if tp <= kv.num_kv_heads else 1
        return AttentionPageSpec(block, max(1, heads), kv.head_size, kv.head_size_v, kv_bytes)

    for layer in model.layers:
        name = f"model.layers.{layer.index}"
        names.append(name)
        layers.append((name, state_spec if isinstance(layer.kv, KdaState) else attn(layer.kv, layout.tp, False)))
    if draft is not None:
        dtp = spec.draft_tp or layout.tp
        for layer in draft.layers:
            name = f"draft.layers.{layer.index}"
            names.append(name)
            # Only DSpark's non-causal layers keep apart; a causal MLA EAGLE3 draft joins the target's MLA bucket.
            layers.append((name, attn(layer.kv, dtp, draft.family == "dspark")))
    grouping = group_layers(layers)
    if grouping.padding_layers:
        notes.append(f"vLLM adds {grouping.padding_layers} padding layers to the KV-cache groups")
    result = (grouping, grouping.block_size or block, names, notes)
    _memo(model)[key] = result
    return result


def _padded_state(spec: StatePageSpec, attn_page: int) -> StatePageSpec:
    return spec if attn_page == spec.state_bytes else replace(spec, page_size_padded=attn_page)


def _activation(model: ModelInventory, layout: Layout, stage: int, start: int, end: int, mnbt: int, seqs: int,
                draft: ModelInventory | None, draft_tp: int = 1, max_model_len: int = 0,
                block_size: int = 0, num_spec: int = 0,
                cc: tuple[int, int] = (9, 0)) -> tuple[int, int, str, MlaWarmupPeak]:
    """Peak memory of vLLM's profile run besides weights: the larger of a MoE layer's forward at
    ``max_num_batched_tokens`` (then, on the last stage, the draft's step on top of the forward's output) and a KDA
    layer's forward (``kda_forward_peak_bytes_per_token``), plus, on the last stage, what grows with ``max_num_seqs``
    and is held throughout (``SAMPLER_FP32_VOCAB_COPIES``). An MLA EAGLE3 draft's own step can set the peak instead
    (``eagle3_mla_profile_bytes``): the larger is taken. Also the peak of the kernel-warmup forward's last MLA
    layer, on the same terms (``_mla_warmup_peak``; zero where the stage has no Kimi-K3 MLA layer)."""
    # With DP x EP, vLLM 0.32's default all2all (AgRsAll2AllManager, distributed/device_communicators/all2all.py;
    # MoEPrepareAndFinalizeNaiveDPEPModular, fused_moe/prepare_finalize/naive_dp_ep.py) all-gathers every DP rank's
    # tokens before the experts, so each rank's MoE runs on dp x the batch in the profile run.
    gathered = layout.dp if layout.ep and layout.dp > 1 else 1
    fwd = _forward_activation(model, layout, mnbt, start, end, moe_tokens=mnbt * gathered)
    basis = f"forward at max_num_batched_tokens={mnbt}" + (f" (experts on the {gathered} DP ranks' tokens)" if gathered > 1 else "")
    peak, held, held_basis, hidden = fwd, 0, "", 0
    aux_layers = aux_hidden_state_layers(draft)
    last_stage = stage == layout.pp - 1
    dspark_step = MlaWarmupPeak(0, 0, 0, "")  # DSpark's step, a moment of warmup too (on the last stage)
    if aux_layers and not last_stage:
        # A stage before the draft's holds what it has captured for it (on the last stage the draft's hidden
        # states, fitted below, stand for them).
        last_moe = max((i for i in range(start, end) if model.layers[i].mlp == "moe"), default=end - 1)
        if aux := _aux_held_bytes(model, aux_layers, start, last_moe, mnbt):
            peak += aux
            basis += f" + the draft's aux hidden states captured before layer {last_moe} ({aux / MiB:,.0f} MiB)"
    if last_stage:
        if draft is not None:
            copies = DRAFT_HIDDEN_COPIES.get(draft.family, DRAFT_HIDDEN_COPIES["default"])
            hidden = int(mnbt * draft.hidden_size * 2 * copies)
            # Fitted on single-stage engines, where every aux hidden state is made in the forward; on a later
            # stage the ones captured before it are views of the receive buffer, counted there.
            received = received_aux_states(aux_layers, start) * hidden_state_bytes(model, mnbt)
            hidden = max(hidden - received, 0)
            peak += hidden
            basis += f" + the draft's hidden states, {copies:g} copies of max_num_batched_tokens x {draft.hidden_size}"
            if received:
                basis += f", less the {received / MiB:,.0f} MiB of them received from earlier stages"
        # Held through the whole profile run, under either peak: the buffers that grow with max_num_seqs x vocab.
        held = int(seqs * model.vocab_size * 4 * SAMPLER_FP32_VOCAB_COPIES)
        held_basis = f" + max_num_seqs={seqs} x vocab {model.vocab_size} ({SAMPLER_FP32_VOCAB_COPIES:g} fp32 copies, fitted)"
        if draft is not None and draft.family == "dspark" and num_spec:
            # DSpark's propose runs once the target's forward has returned and its temporaries are freed: its draft
            # logits peak beside what is still held (the MoE workspace, never freed, and the target's hidden states),
            # not on top of the forward's own peak. The larger of the two is the profile's.
            requests = dspark_profile_requests(mnbt, seqs, num_spec)
            rows = requests * num_spec
            logits = int(rows * draft.vocab_size * 2 * DSPARK_PROFILE_LOGITS_COPIES)
            markov = dspark_markov_step_bytes(requests, num_spec, draft.vocab_size, draft.hidden_size)
            gather = dspark_logits_gather_bytes(rows, draft.vocab_size, draft.hidden_size, layout.tp)
            moe = _moe_workspace_held(model, layout, start, end, mnbt * gathered)
            step = moe + hidden + logits + max(markov, gather)
            dspark_step = _dspark_warmup_step(step, moe, rows * draft.vocab_size * 2)
            basis += (f"; or DSpark's step, if larger ({step / GiB:.2f} GiB): the MoE workspace and the hidden states "
                      f"held + its draft logits, {rows:,} rows x vocab {draft.vocab_size} "
                      f"({DSPARK_PROFILE_LOGITS_COPIES:g} bf16 copies, fitted) + the larger of its Markov sampling's "
                      f"{markov / MiB:,.0f} MiB ({min(num_spec + 1, 3)} bf16 tensors of {requests:,} requests x vocab "
                      f"and the sampled rows' hidden states, exact shapes, vLLM dspark/speculator.py)"
                      + (f" and the TP{layout.tp} all-gather of its logits, {gather / MiB:,.0f} MiB (exact shapes, "
                         "vLLM logits_processor.py)" if gather else ""))
            peak = max(peak, step)
        if _is_mla_eagle3(draft):
            step_held, simulated = eagle3_mla_profile_bytes(model, draft, draft_tp, mnbt, seqs, max_model_len,
                                                            block_size, layout.dcp)
            moe = _moe_workspace_held(model, layout, start, end, mnbt * gathered)
            step = moe + step_held + simulated
            basis += (f"; or the draft's step, if larger ({step / GiB:.2f} GiB): MoE buffers {moe / GiB:.2f} + "
                      f"{step_held / GiB:.2f} held + its MLA's profile-run stand-in for the chunked-context kv_b_proj "
                      f"output {simulated / GiB:.2f} (exact shapes, vLLM mla_attention.py forward_impl)")
            peak = max(peak, step)
    kda = mnbt * kda_forward_peak_bytes_per_token(model, layout, start, end)
    # The MoE buffers the forward grew (its peak less the per-token part): still held under a later attention layer.
    moe_held = fwd - mnbt * kimi_forward_peak_bytes_per_token(model, start, end) if model.attn_res_block_size else 0
    if kda:
        # A KDA layer's own forward peaks apart from the MoE layer's, and before the last stage's sampler and draft
        # steps, which run once the forward's temporaries are freed: the larger of the two peaks is the profile's.
        # The MoE workspace is held there only once a MoE layer of the stage has run before a KDA layer (a stage
        # whose KDA layers all come first, such as stage 0 of a PP2 slice, has not grown it yet).
        moe_before_kda = any(model.layers[i].mlp == "moe" and any(isinstance(model.layers[j].kv, KdaState)
                                                                  for j in range(i + 1, end)) for i in range(start, end))
        # The last KDA layer's, beside the aux hidden states captured before it (H200: the profile of full-width
        # slices with DSpark at 4,096 tokens ran 0.09 GiB over the plan with 2 held, 0.20-0.22 GiB with 4).
        last_kda = max(i for i in range(start, end) if isinstance(model.layers[i].kv, KdaState))
        aux = _aux_held_bytes(model, aux_layers, start, last_kda, mnbt)
        kda_peak = kda + (moe_held if moe_before_kda else 0) + aux + _dspark_held_copies_bytes(model, aux_layers, mnbt)
        if kda_peak > peak:
            basis = (f"a KDA layer's forward at max_num_batched_tokens={mnbt} ({kda // mnbt:,} B per token, exact "
                     f"shapes, vLLM models/kimi_k3/nvidia/kda.py)"
                     + (f" + the draft's aux hidden states captured before layer {last_kda} ({aux / MiB:,.0f} MiB)"
                        if aux else "")
                     + (f" + {DSPARK_KDA_PEAK_HIDDEN_COPIES:g} hidden states the draft adds there (fitted)"
                        if aux_layers else "") + f" over the MoE layers' peak and what follows it ({basis})")
            peak = kda_peak
    eagle3_aux = 0
    if last_stage and draft is not None and draft.draft is not None and draft.draft.method == "eagle3":
        # The target keeps the hidden states an EAGLE3 drafter fuses to the end of its forward (on a later stage, the
        # ones captured before it are views of the receive buffer: counted twice there, the safe side).
        eagle3_aux = (draft.draft.num_aux_hidden_states or 3) * hidden_state_bytes(model, mnbt)
    warmup = _mla_warmup_peak(model, layout, start, end, mnbt, seqs, moe_held, aux_layers, draft, num_spec, cc,
                              eagle3_aux)
    if warmup.bytes and last_stage and _is_mla_eagle3(draft):
        step = _eagle3_mla_warmup_step(model, layout, draft, draft_tp, start, end, mnbt * gathered, mnbt, seqs, cc)
        if step.need_bytes > warmup.need_bytes:
            warmup = replace(step, basis=step.basis + f"; over the target's forward ({warmup.bytes / GiB:.2f} GiB, "
                             f"{warmup.forward_bytes / GiB:.2f} GiB of it allocated by the forward)",
                             target=replace(warmup, bytes=warmup.bytes + held))
        else:
            warmup = replace(warmup, basis=warmup.basis + f"; over the MLA EAGLE3 drafter's step ({step.bytes / GiB:.2f} "
                             f"GiB, {step.reserve_fraction:.0%} reserve)")
    dense = _dense_mlp_warmup_peak(model, layout, start, end, mnbt, mnbt * gathered)
    warmup = _larger_warmup_moment(warmup, dense, "the forward peaks at layer 0's dense MLP")
    warmup = _larger_warmup_moment(warmup, dspark_step, "autotune's dummy run peaks at DSpark's step after the forward")
    if warmup.bytes:
        warmup = replace(warmup, bytes=warmup.bytes + held)
    peak += held
    return peak, max(peak // 4, 256 * MiB), basis + held_basis + "; +-25% (H200 residuals <= 0.3 GiB)", warmup


@dataclass(frozen=True)
class MlaWarmupPeak:
    """What kernel warmup's forward holds at its peak MLA layer, its largest single request, and what of it the forward
    allocates (all but the workspace and the held buffers, there before it begins)."""

    bytes: int
    largest_request_bytes: int
    forward_bytes: int
    basis: str
    reserve_fraction: float = ALLOCATOR_RESERVE_FRACTION
    """Of ``largest_request_bytes``: what the caching allocator could not hand to it (``warmup``'s reserves)."""
    reserve_fraction_low: float = ALLOCATOR_RESERVE_FRACTION_LOW
    """The low end of the reserve's measured band (down to it, the verdict is "at risk")."""
    target: MlaWarmupPeak | None = None
    """Where this is the MLA EAGLE3 drafter's step: the target's forward before it, which warmup's later steps are
    weighed beside."""

    @property
    def need_bytes(self) -> int:
        """The peak and the allocator's reserve for its largest request: what the larger of two peaks is judged by."""
        return self.bytes + int(self.reserve_fraction * self.largest_request_bytes)


def _larger_warmup_moment(warmup: MlaWarmupPeak, other: MlaWarmupPeak, other_names: str) -> MlaWarmupPeak:
    """Kernel warmup's peak with another moment of the autotune's dummy run weighed beside the MLA's: the larger need
    counts; where the other's need, with no reserve, is the smaller but it allocates more, its bytes are what
    rehearse's plugin reads (``forward_bytes``). ``other_names``: how the basis names that moment."""
    if not warmup.bytes:
        return warmup
    if other.need_bytes > warmup.need_bytes:
        return replace(other, basis=other.basis + f"; over the MLA's ({warmup.bytes / GiB:.2f} GiB)")
    if other.forward_bytes > warmup.forward_bytes:
        return replace(warmup, forward_bytes=other.forward_bytes, basis=warmup.basis + (
            f"; {other_names} ({other.forward_bytes / GiB:.2f} GiB allocated), whose need, with no reserve, is the "
            "smaller"))
    return warmup


def _dspark_warmup_step(step_bytes: int, moe_bytes: int, base_logits_bytes: int) -> MlaWarmupPeak:
    """DSpark's step in kernel warmup: FlashInfer's autotune dummy run calls the speculator's ``propose`` once the
    target's forward has returned (v1/worker/gpu/model_runner.py ``_dummy_run``, as in the profile run, on the same
    ``dspark_profile_requests``), so the step the profile's peak weighs (``step_bytes``, the MoE workspace held
    beside it) is a moment of warmup too, allocating all but that workspace. On stage 1's TP8 rank slice at 512
    sequences (round 42, H200) it is autotune's peak: 2,602,861,568 B read, 2,671,855,533 planned, where the MLA's
    forward is 1.85 GiB. No allocator reserve: its largest request, the base logits (1,174,405,120 B there), went
    through at 0.97 once the allocator had released its cache."""
    return MlaWarmupPeak(step_bytes, base_logits_bytes, step_bytes - moe_bytes,
                         f"DSpark's step in the autotune's dummy run ({step_bytes / GiB:.2f} GiB, as in the profile)",
                         0.0, 0.0)


def _dense_mlp_warmup_peak(model: ModelInventory, layout: Layout, start: int, end: int, mnbt: int,
                           moe_tokens: int) -> MlaWarmupPeak:
    """Kernel warmup's forward at a Kimi-K3 dense-MLP layer (global layer 0, ``first_k_dense_replace``): the MoE
    workspace the profile grew is held from the start of warmup, so this layer, which the profile ran before any MoE
    layer grew it, can set warmup's peak (models/kimi_k3/nvidia/model.py ``KimiMLP.forward``: ``gate_up_proj``'s
    output, 2 x intermediate, and the activation's, 1 x, beside ``down_proj``'s output and the residual side of a
    layer that opens a block). Round 40 (H100, 12,288 tokens, no draft): the plugin read autotune's peak at
    3,372,222,976 B over what warmup began with, this term 3,372,220,416. No allocator reserve: there ``gate_up``'s
    1.55 GiB went through with 0.08 times it left in the plan's terms, once the allocator had released its cache.
    Zero where the stage has no dense layer or the model is not Kimi-K3."""
    w = model.widths
    if not model.attn_res_block_size or not any(model.layers[i].mlp == "dense" for i in range(start, end)):
        return MlaWarmupPeak(0, 0, 0, "", 0.0, 0.0)
    b = DTYPE_BITS[model.dtype] // 8
    inter = max(w.intermediate_size // layout.tp, 1)
    # down_proj's output beside the residual side, and gate_up's and the activation's outputs.
    per_token = b * (w.hidden_size * (_residual_side_rows(model, end) + 1) + 3 * inter)
    workspace = _moe_workspace_held(model, layout, start, end, moe_tokens)
    forward = mnbt * per_token
    basis = (f"kernel warmup's forward at max_num_batched_tokens={mnbt} holds {(forward + workspace) / GiB:.2f} GiB at "
             f"the dense MLP of layer 0, with the MoE workspace held from the profile ({per_token:,} B per token, "
             "exact shapes, vLLM models/kimi_k3/nvidia/model.py KimiMLP.forward); no allocator reserve (round 40's "
             "went through with 0.08 times its largest request left)")
    return MlaWarmupPeak(forward + workspace, mnbt * 2 * inter * b, forward, basis, 0.0, 0.0)


def _warmup_outside(peak: MlaWarmupPeak, act: int, graphs_free: int, since: int,
                    held: int) -> tuple[int, int, int, int]:
    """What kernel warmup's peak needs outside the budget: its excess over the profile's peak less the CUDA-graph
    estimate not yet captured, what was allocated since the profile, what is ``held`` after the KV cache by then
    and the allocator's reserve for its largest request; with the part of it within the reserve's measured band, the
    excess and the reserve."""
    over = peak.bytes - act
    reserve = int(peak.reserve_fraction * peak.largest_request_bytes)
    warmup = max(0, held + over - graphs_free + since + reserve)
    band = min(warmup, reserve - int(peak.reserve_fraction_low * peak.largest_request_bytes))
    return warmup, band, over, reserve


def _dspark_capture_moment(start_bytes: int, growth_bytes: int, estimates: list[Estimate],
                           stage: int) -> tuple[int, int]:
    """What vLLM's real CUDA-graph capture needs outside the budget with a DSpark draft whose FlashKDA buffers grew in
    warmup: what it starts on (``start_bytes``, outside the budget) and ``capture.CAPTURE_ROOM_DSPARK`` beyond it;
    with the part of it within the room's measured band."""
    need = max(0, start_bytes + CAPTURE_ROOM_DSPARK)
    band = min(need, CAPTURE_ROOM_DSPARK - CAPTURE_ROOM_DSPARK_LOW)
    estimates.append(Estimate("capture_moment", stage, need, 0,
                              f"the CUDA-graph capture after warmup starts on {start_bytes / GiB:.2f} GiB outside the "
                              f"budget (warmup's entry level once its forward is freed, FlashKDA's growth of "
                              f"{growth_bytes / GiB:.2f} GiB with it) and needs {CAPTURE_ROOM_DSPARK / GiB:.2f} GiB "
                              f"beyond that at DSpark's first graph (measured on H100 runs; at risk down to "
                              f"{CAPTURE_ROOM_DSPARK_LOW / GiB:.2f}; docs/capture-moment.md): {need / GiB:.2f} GiB "
                              "outside the budget"))
    return need, band


def _with_own_moment(costs: StageCosts, own_bytes: int, own_band_bytes: int) -> StageCosts:
    """The stage's after-KV need once a need at its own moment of warmup is weighed apart from what
    ``after_kv_bytes`` adds up (the MLA EAGLE3 drafter's step, after the target's forward has freed its temporaries):
    the larger need counts, and vLLM fails for sure where either one is short beyond its own band."""
    if own_bytes <= 0:
        return costs
    after, band = _larger_need(costs.after_kv_bytes, costs.warmup_band_bytes, own_bytes, own_band_bytes)
    return replace(costs, after_kv_bytes=after, warmup_band_bytes=band)


def _larger_need(need: int, band: int, other: int, other_band: int) -> tuple[int, int]:
    """Two moments' needs outside the budget, each with the part of it within its reserve's band: the larger need
    counts, and vLLM fails for sure where either one is short beyond its own band."""
    beyond = max(need - band, other - other_band)
    larger = max(need, other)
    return larger, larger - beyond


def _dspark_held_copies_bytes(model: ModelInventory, aux_layers: Sequence[int], mnbt: int) -> int:
    """The hidden states a DSpark draft adds beside an attention layer's forward (``DSPARK_KDA_PEAK_HIDDEN_COPIES``,
    fitted); 0 without one (``aux_layers`` empty)."""
    return int(hidden_state_bytes(model, mnbt) * DSPARK_KDA_PEAK_HIDDEN_COPIES) if aux_layers else 0


def _gathered_state_bytes(model: ModelInventory, layout: Layout, engine: EngineSettings, start: int, end: int) -> int:
    """One request's recurrent state as KDA's prefill path gathers it on a rank of the stage (``gather_initial_states``,
    in the state's dtype); 0 where the stage has no KDA layer."""
    kda = next((model.layers[i].kv for i in range(start, end) if isinstance(model.layers[i].kv, KdaState)), None)
    if kda is None:
        return 0
    state_bytes = 2 if engine.mamba_ssm_cache_dtype == "bfloat16" else 4
    return gathered_states_bytes(1, max(1, kda.num_heads // layout.tp), kda.head_dim, state_bytes)


def _warmup_prefill_state(model: ModelInventory, layout: Layout, engine: EngineSettings, start: int,
                          end: int) -> tuple[int, int]:
    """What kernel warmup's prefill step holds at a KDA layer, as (bytes a request, bytes a token): one gathered
    recurrent state a request and the layer's forward per token."""
    per_request = _gathered_state_bytes(model, layout, engine, start, end)
    return (per_request, kda_forward_peak_bytes_per_token(model, layout, start, end)) if per_request else (0, 0)


@dataclass(frozen=True)
class _WarmupPrefill:
    """Kernel warmup's prefill step on a rank of one stage, where FlashKDA first asks for its buffers there, and
    what the stage holds beside it (``_warmup_prefill_moments``)."""

    per_request_bytes: int
    """One request's gathered recurrent state; 0 where FlashKDA does not first ask for its buffers in that step."""
    per_token_bytes: int
    """The KDA layer's forward, a token."""
    held_after_kv_bytes: int
    """The stage's after-KV terms held for good by then, FlashKDA's growth of the shared workspace among them."""
    growth_bytes: int
    """FlashKDA's growth of the shared workspace (in ``held_after_kv_bytes``): first asked for in that step."""
    room_bytes: int
    """What the budget leaves free for a warmup step's transients: the profile's transient peak and the CUDA-graph
    estimate not yet captured, less what was allocated since the profile."""


def _warmup_prefill_moments(prefills: Sequence[_WarmupPrefill], grouping: KvGrouping, engine: EngineSettings,
                            mnbt: int, seqs: int, num_spec: int, block_size: int, num_blocks: int,
                            estimates: list[Estimate]) -> list[tuple[int, int]]:
    """Each stage's need after the KV cache at kernel warmup's prefill step, its own moment, and its band (weighed
    with ``_with_own_moment`` against the autotune's moment, which ``after_kv_bytes`` holds without FlashKDA's growth).

    vLLM 0.32's order (v1/worker/gpu_worker.py ``compile_or_warm_up_model``): ``kernel_warmup`` runs FlashInfer's
    autotune, ``_dummy_run(max_num_batched_tokens, is_profile=True)`` (model_executor/warmup/kernel_warmup.py
    ``_run_flashinfer_autotune_dummy_runs``), whose metadata leaves the Mamba-spec groups out (v1/worker/gpu/
    model_runner.py ``execute_model``: "Mamba layers take a cheap warmup path with no metadata"), so KDA's ``_forward``
    returns before FlashKDA; then ``warmup_kernels`` (v1/worker/gpu/warmup.py ``_warmup_kernels``) runs its prefill
    step, prompts of ``decode_query_len + 1`` tokens, where each KDA layer gathers one recurrent state a request
    (models/kimi_k3/nvidia/kda.py ``_forward``, ``gather_initial_states``) and then asks the shared workspace for
    FlashKDA's buffers (``get_simultaneous(*self._flashkda_buffer_specs)``). The workspace drops its old buffer and
    releases the allocator's cache before it allocates the new one (v1/worker/workspace.py ``_ensure_workspace_size``),
    and no view of lane 0 outlives the MoE call or TRITON_MLA's reservation: the growth is what is added. Logged
    (``kda.py:1202:_forward``) after the autotune's peak: 3,078 -> 4,236 MB (round 41, H200), 1,216 -> 7,212 MB (round
    37, H100). At that moment the rank holds what it holds for good, the growth with it, the gathered states and the
    layer's forward; the next KDA layer gathers again into blocks the last one's states left and later requests split
    (round 37 ran out of memory there, on a 2.75 GiB gather with 2.78 GiB cached), as the capture's gather does: the
    transients are judged as ``_capture_gather`` judges them, in the same terms (``CAPTURE_RESERVE_FRACTION`` of the
    gathered states beside them, less the room the budget leaves a warmup step). In those terms round 37 failed with
    1.54 times the gathered states left and round 36 (0.86) started with 2.04, both in that reserve's band; round 33
    failed with 0.43 and 0.53, and every run that started had 2.04 or more (round 41, H200: 5.67)."""
    query_len = 1 + num_spec
    decode_len = query_len + 1 + (5 if num_spec else 3) * query_len  # warmup's prompt and its decode steps
    reserved = sum(1 + g.spec.num_speculative_blocks if isinstance(g.spec, StatePageSpec)
                   else -(-min(decode_len + num_spec, engine.max_model_len) // max(block_size, 1))
                   for g in grouping.groups)
    requests = warmup_prefill_requests(seqs, mnbt, query_len, num_blocks, reserved)
    moments = []
    for s, p in enumerate(prefills):
        if not p.per_request_bytes:
            moments.append((0, 0))
            continue
        gathered = requests * p.per_request_bytes
        forward = requests * (query_len + 1) * p.per_token_bytes
        need, band = gather_outside_budget(gathered, forward + p.held_after_kv_bytes, p.room_bytes)
        estimates.append(Estimate("warmup_prefill_gather", s, gathered + forward, 0,
                                  f"kernel warmup's prefill ({requests} requests of {query_len + 1} tokens, vLLM "
                                  f"_warmup_kernels): {gathered / GiB:.2f} GiB of gathered recurrent states and the "
                                  f"KDA layer's forward, held while FlashKDA first asks for its buffers (exact "
                                  f"shapes), at its own moment: with the allocator's reserve, "
                                  f"{CAPTURE_RESERVE_FRACTION:.2f} times the states ({CAPTURE_RESERVE_FRACTION_LOW:.2f}"
                                  f" to {CAPTURE_RESERVE_FRACTION:.2f} measured at the capture's gather), less the "
                                  f"{p.room_bytes / GiB:.2f} GiB the budget leaves a warmup step, "
                                  f"with the {p.held_after_kv_bytes / GiB:.2f} GiB held after the KV cache by then "
                                  f"(FlashKDA's growth, {p.growth_bytes / GiB:.2f} GiB, with them; the autotune's "
                                  f"moment before it does not hold it): {need / GiB:.2f} GiB outside the budget"))
        moments.append((need, band))
    return moments


def _capture_gather(model: ModelInventory, layout: Layout, engine: EngineSettings, stage: int, start: int, end: int,
                    mnbt: int, seqs: int, cc: tuple[int, int], *, held: int, act: int, graphs_free: int, since: int,
                    estimates: list[Estimate]) -> tuple[int, int]:
    """What the real capture of the largest PIECEWISE graph needs outside the budget for KDA's gathered states and the
    allocator's reserve (planning/capture.py), and the part of it within the reserve's measured band; (0, 0) where
    that capture makes no such request."""
    query_len = 1 + (engine.speculative.num_speculative_tokens if engine.speculative else 0)
    largest = cuda_graph_capture_sizes(seqs, query_len, mnbt, cc)[-1]
    requests = capture_prefill_requests(seqs, query_len, largest)
    gather = requests * _gathered_state_bytes(model, layout, engine, start, end)
    if not gather:
        return 0, 0
    expandable = expandable_segments(engine.env_vars)
    reserve, low = gather_reserve(expandable)
    capture, band = gather_outside_budget(gather, held, act + graphs_free - since, (reserve, low))
    estimates.append(Estimate("capture_kda_gather", stage, capture, 0,
                              f"the CUDA-graph capture after warmup, at its largest graph ({largest} tokens over "
                              f"{requests} requests, KDA's prefill path): {gather / GiB:.2f} GiB of gathered recurrent "
                              f"states in one request (vLLM gather_initial_states) and the allocator's reserve, "
                              f"{reserve:.2f} times it ("
                              f"{'where vLLM started under expandable segments' if expandable else 'measured'}; "
                              f"at risk down to {low:.2f}), less the profile's transient peak and the "
                              f"{graphs_free / GiB:.2f} GiB of CUDA-graph estimate not yet captured: "
                              f"{capture / GiB:.2f} GiB outside the budget"))
    return capture, band


def _mla_warmup_peak(model: ModelInventory, layout: Layout, start: int, end: int, mnbt: int, seqs: int, moe_held: int,
                     aux_layers: Sequence[int], draft: ModelInventory | None, num_spec: int,
                     cc: tuple[int, int], eagle3_aux: int = 0) -> MlaWarmupPeak:
    """What the kernel-warmup forward holds at its last MLA layer's FlashMLA call, as the profile's KDA branch counts
    a KDA layer's: the residual side of a layer that opens no block, the layer's own tensors
    (``warmup.mla_base_bytes_per_token``) and its decode or prefill part (``warmup.mla_warmup``), the
    aux hidden states captured before it, and the MoE workspace once a MoE layer has run before it. Not the held
    copies DSpark adds to the profile's KDA peak (``DSPARK_KDA_PEAK_HIDDEN_COPIES``): the plugin read this forward at
    5.35 GiB with DSpark where the plan, with them, said 5.49 (round 26's fit run, k4-tp1-b8192-s256-dspark-u088-h100,
    H100), and 5.02 / 5.02 with no draft. ``eagle3_aux``: the hidden states an EAGLE3 drafter fuses, held from their
    capture (5.35 GiB read with the MLA EAGLE3, round 33's k4-tp1-b8192-s128-eagle3mla-u099-h100, the plan 5.02 without
    its 3 and 5.35 with them). Zero where the stage has no MLA layer or the model is not Kimi-K3."""
    mla = model.mla
    mla_layers = [i for i in range(start, end) if isinstance(model.layers[i].kv, MlaKv)]
    if mla is None or not mla_layers or not model.attn_res_block_size:
        return MlaWarmupPeak(0, 0, 0, "")
    b = DTYPE_BITS[model.dtype] // 8
    heads = max(1, model.num_attention_heads // layout.tp)
    last = mla_layers[-1]
    query_per_request = (num_spec if draft.family == "dspark" else 1) if draft is not None else 0
    layer = mla_warmup(mnbt, seqs, query_per_request, mla, heads, b, cc)
    extra, batch = layer.extra_bytes, layer.batch
    residual_side = _residual_side_rows(model, end)
    per_token = b * model.hidden_size * residual_side + mla_base_bytes_per_token(mla, heads, b)
    moe_before = any(model.layers[i].mlp == "moe" for i in range(start, last))
    workspace = moe_held if moe_before else 0
    aux = _aux_held_bytes(model, aux_layers, start, last, mnbt) + eagle3_aux
    peak = mnbt * per_token + extra + workspace + aux
    split = (f"{batch.decode_requests:,} decodes of {batch.decode_query_len} tokens"
             + (f" and {mnbt - batch.decode_tokens:,} prefill tokens" if batch.decode_tokens < mnbt else ""))
    basis = (f"kernel warmup's forward at max_num_batched_tokens={mnbt} ({split}; FlashMLA decodes up to "
             f"{FLASHMLA_DECODE_THRESHOLD} tokens a request) holds {peak / GiB:.2f} GiB at layer {last}'s MLA: "
             f"{extra / GiB:.2f} GiB of its decode path that the profile run never makes (exact shapes, vLLM "
             f"models/kimi_k3/nvidia/mla.py, FlashMLA dense_decode_fwd)")
    if cc[0] != 9:
        basis += (f"; on compute capability {cc[0]}.{cc[1]} vLLM picks another MLA backend, whose buffers FlashMLA's "
                  "shapes stand in for (not read from its code)")
    if batch.decode_tokens:
        return MlaWarmupPeak(peak, layer.largest_request_bytes, peak - workspace, basis)
    return MlaWarmupPeak(peak, layer.largest_request_bytes, peak - workspace, basis + "; the prefill path's reserve",
                         PREFILL_RESERVE_FRACTION, PREFILL_RESERVE_FRACTION_LOW)


def _eagle3_mla_warmup_step(model: ModelInventory, layout: Layout, draft: ModelInventory, draft_tp: int, start: int,
                            end: int, moe_tokens: int, mnbt: int, seqs: int, cc: tuple[int, int]) -> MlaWarmupPeak:
    """What the MLA EAGLE3 drafter's step holds in kernel warmup's dummy run, at its FlashMLA call: the drafter runs
    on the target's attention metadata (v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py ``propose`` ->
    ``_prefill``), so its generic ``MLAAttention`` decodes the same requests as the target's MLA did
    (``forward_impl``'s ``mqa_ql_nope``, the concatenated query in flashmla.py ``forward_mqa``, FlashMLA's output,
    log-sum-exp and split-KV accumulators: ``warmup.mla_warmup`` at the drafter's widths), beside what its profile
    step holds (``eagle3_mla_profile_bytes``: the target's hidden and aux states, the fused ``fc`` output, the
    drafter's embeddings, latents, query and output) and the MoE workspace. Its largest request is judged with
    ``DRAFT_STEP_RESERVE_FRACTION``: it comes second in the dummy run, into blocks the target's forward left."""
    g = draft.draft.generic_mla
    b = DTYPE_BITS.get(draft.dtype, 16) // 8
    heads = max(1, draft.num_attention_heads // max(draft_tp, 1))
    mla = MlaProjections(g.q_lora_rank, g.kv_lora_rank, g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim, False)
    layer = mla_warmup(mnbt, seqs, 1, mla, heads, b, cc)
    held, _ = eagle3_mla_profile_bytes(model, draft, draft_tp, mnbt, seqs, 0, 0)
    workspace = _moe_workspace_held(model, layout, start, end, moe_tokens)
    peak = workspace + held + layer.extra_bytes
    batch = layer.batch
    basis = (f"the MLA EAGLE3 drafter's step in kernel warmup holds {peak / GiB:.2f} GiB at its FlashMLA call "
             f"({batch.decode_requests:,} decodes of {batch.decode_query_len} tokens on the target's metadata): "
             f"{layer.extra_bytes / GiB:.2f} GiB of its decode path and {held / GiB:.2f} GiB its step holds (exact "
             f"shapes, vLLM mla_attention.py forward_impl, target_dependent_ar/speculator.py _prefill), its largest "
             f"request judged with its own reserve, {DRAFT_STEP_RESERVE_FRACTION_LOW:.0%} to "
             f"{DRAFT_STEP_RESERVE_FRACTION:.0%} (measured on seven H100 runs)")
    buffer = mnbt * draft.hidden_size * b  # the speculator's hidden-state buffer, held before warmup begins
    return MlaWarmupPeak(peak, layer.largest_request_bytes, peak - workspace - buffer, basis,
                         DRAFT_STEP_RESERVE_FRACTION, DRAFT_STEP_RESERVE_FRACTION_LOW)


def _is_mla_eagle3(draft: ModelInventory | None) -> bool:
    """The draft's attention is vLLM's generic ``MLAAttention`` (the MLA EAGLE3), whose steps the plan takes apart."""
    return draft is not None and draft.draft is not None and draft.draft.generic_mla is not None


def _draft_kind(draft: ModelInventory | None) -> str | None:
    """The draft as ``warmup.PERSISTENT_AFTER_PROFILE`` is keyed: None, "eagle3_mla" or the family."""
    if draft is None:
        return None
    return "eagle3_mla" if _is_mla_eagle3(draft) else draft.family


def _moe_workspace_held(model: ModelInventory, layout: Layout, start: int, end: int, moe_tokens: int) -> int:
    """The MoE buffers of vLLM's shared workspace that the target's forward grew: held after it (never freed), under
    whatever the last stage's draft step allocates."""
    w = model.widths
    if not w.num_experts or not any(model.layers[i].mlp == "moe" for i in range(start, end)):
        return 0
    inter = w.moe_intermediate_size if layout.ep else max(w.moe_intermediate_size // layout.tp,
                                                          model.expert_min_intermediate_per_rank)
    return moe_buffer_bytes(moe_tokens, w.experts_per_token, inter, w.moe_hidden_size)


def dspark_profile_requests(mnbt: int, seqs: int, num_spec: int) -> int:
    """Requests of vLLM 0.32's profile-run dummy batch with DSpark: ``min(max_num_seqs, max_num_batched_tokens //
    num_query_per_req)`` (``_dummy_run``; DSpark samples from the anchor, so a request's query is its ``num_spec``
    positions: ``DSparkSpeculator.__init__``'s ``num_query_per_req``)."""
    return min(seqs, mnbt // max(num_spec, 1))


def dspark_profile_logit_rows(mnbt: int, seqs: int, num_spec: int) -> int:
    """Rows of DSpark's draft logits in vLLM 0.32's profile run: the dummy batch's requests
    (``dspark_profile_requests``), each with ``num_spec`` positions."""
    return dspark_profile_requests(mnbt, seqs, num_spec) * num_spec


def dspark_markov_step_bytes(requests: int, num_spec: int, vocab: int, draft_hidden: int) -> int:
    """What DSpark's sequential Markov sampling holds beside its base draft logits (``DSPARK_PROFILE_LOGITS_COPIES``),
    from vLLM 0.32's shapes (v1/worker/gpu/spec_decode/dspark/speculator.py ``DSparkSpeculator._sample_sequential``,
    greedy, the default ``draft_sample_method``): the draft model's output ``head_hidden`` and its gathered
    ``sample_hidden`` (``requests x num_spec`` rows x the draft's hidden size each, bf16), and, in the loop over the
    positions, while step i's ``markov_bias`` (model_executor/models/qwen3_dspark.py ``DSparkMarkovHead.bias``:
    ``requests x vocab``, bf16, through its own ``disable_tp`` lm-head, so the whole vocab on every rank) and
    ``logits_i = base_logits[:, i] + bias`` are made, step i-1's bias and logits are still bound: three ``requests x
    vocab`` bf16 tensors from the second position on (two with one position). No fp32 vocab-wide tensor: the logits
    processor keeps the model dtype (``head_dtype``'s default) and greedy sampling is an ``argmax``."""
    rows = requests * num_spec
    return min(num_spec + 1, 3) * requests * vocab * 2 + 2 * rows * draft_hidden * 2


def dspark_logits_gather_bytes(rows: int, vocab: int, draft_hidden: int, lm_head_tp: int) -> int:
    """What DSpark's base draft logits hold while they are gathered, beside the fitted copies of ``rows x vocab``
    (``DSPARK_PROFILE_LOGITS_COPIES``), where the lm_head they come from is split over the vocabulary: 0 at TP 1.
    Kimi-K3's DSpark draft has no lm_head of its own (models/kimi_k3/nvidia/dspark_mla.py); it is given the target's
    (spec_decode/dspark/utils.py ``load_dspark_model``), a ``ParallelLMHead`` at the target's TP, so
    ``compute_draft_logits`` ends in ``LogitsProcessor._get_logits``'s ``tensor_model_parallel_all_gather``
    (``use_all_gather`` on CUDA): the rank's shard (``rows x vocab / TP``), the gathered ``[TP x rows, vocab / TP]``
    output and its reshape to ``[rows, vocab]``, a second full copy (distributed/device_communicators
    ``all_gather``), all bf16, beside the sampled rows' hidden states (``head_hidden``, ``sample_hidden``). The Markov
    loop comes after (``dspark_markov_step_bytes``): the larger of the two is the step's. No rank slice sees it: a
    slice runs at TP 1 with the whole lm_head."""
    if lm_head_tp <= 1:
        return 0
    return rows * (vocab // lm_head_tp) * 2 + rows * vocab * 2 + 2 * rows * draft_hidden * 2


MLA_CHUNKED_PREFILL_MAX_ROWS = 64 * 1024
"""``MLACommonMetadataBuilder.determine_chunked_prefill_workspace_size``'s cap (vLLM 0.32 mla_attention.py)."""


def mla_chunked_prefill_rows(max_model_len: int, max_num_seqs: int, block_size: int, dcp: int = 1) -> int:
    """Rows of vLLM 0.32's MLA chunked-prefill workspace: ``min(max(8 x max_model_len, 4 x max_num_seqs x
    block_size), 64 Ki)``, rounded up to the cache block (``align_mla_chunked_context_workspace_size``; under DCP to
    ``lcm(block, dcp x cp_kv_cache_interleave_size)``, the interleave taken as its default 1). ``block_size`` is the
    cache config's, which a hybrid model has already raised to its attention block (5,888 tokens at full width)."""
    rows = min(max(8 * max_model_len, 4 * max_num_seqs * block_size), MLA_CHUNKED_PREFILL_MAX_ROWS)
    align = max(block_size, 1) if dcp <= 1 else math.lcm(max(block_size, 1), dcp)
    return cdiv(max(rows, align), align) * align


def eagle3_mla_profile_bytes(model: ModelInventory, draft: ModelInventory, draft_tp: int, tokens: int, seqs: int,
                             max_model_len: int, block_size: int, dcp: int = 1) -> tuple[int, int]:
    """What vLLM 0.32's profile run holds at the peak of an MLA EAGLE3 draft's step, as (held, stand-in) bytes.

    ``profile_run`` -> ``_dummy_run(max_num_batched_tokens, skip_attn=True)`` (v1/worker/gpu/model_runner.py) runs the
    target with no attention metadata, keeps its output and its aux hidden states, and runs the drafter's
    ``propose`` on the same tokens, eagerly (target_dependent_ar/speculator.py: ``combine_hidden_states``, then
    ``_prefill`` over every token). The draft's first layer (deepseek_eagle3.py) is ``DeepseekV2MLAAttention`` over
    vLLM's generic ``MLAAttention``, whose ``forward_impl`` with no metadata "simulates the worst case" of the
    chunked-context ``kv_b_proj`` output: ``torch.empty(chunked_prefill_workspace_size, local heads,
    qk_nope + v_head)`` (layers/attention/mla_attention.py). Kimi-K3's own MLA (target and DSpark) zero their output
    instead (models/kimi_k3/nvidia/mla.py ``_attention``), so only this draft pays it.

    Held at that moment, ``tokens`` rows each, in the model dtype: the target's last hidden state and its
    ``num_aux`` aux hidden states (``_dummy_run``), the fused ``fc`` output (``propose``) and the speculator's own
    ``hidden_states`` buffer it is copied into (``TargetDependentARSpeculator.__init__``: ``max_num_batched_tokens``
    rows, allocated with the runner and held throughout; the drafter's residual is a view of it), the draft's input
    embedding and its normed copy, ``cat([embeds, hidden])`` (2 x hidden), ``fused_qkv_a_proj``'s output
    (q_lora + kv_lora + rope) and the normed q/kv latents, ``q`` (local heads x (nope + rope)) and the attention
    output (local heads x v). The target's forward temporaries are freed by then; the MoE workspace is not (the
    caller adds it). 4.75 GiB at full width (96 heads, 70,656 rows), 1.48 GiB on a TP8 rank (12 heads), each beside
    the buffer (0.11 GiB at 8,192 tokens), which is held before the step begins. The buffer was found on round 39's
    H100 runs: the profile was 0.05, 0.12 and 0.24 GiB over the plan at 4,096, 8,192 and
    16,384 tokens, 14,362 B a token (its 14,336 and the runner's two input buffers), from the plugin's load peak."""
    g = draft.draft.generic_mla
    b = DTYPE_BITS.get(draft.dtype, 16) // 8
    heads = max(1, draft.num_attention_heads // max(draft_tp, 1))
    hidden, target_hidden = draft.hidden_size, model.hidden_size
    aux = draft.draft.num_aux_hidden_states or 3
    latent = g.q_lora_rank + g.kv_lora_rank + g.qk_rope_head_dim
    normed = g.q_lora_rank + g.kv_lora_rank
    width = (target_hidden * (1 + aux) + hidden * 4 + 2 * hidden + latent + normed
             + heads * (g.qk_nope_head_dim + g.qk_rope_head_dim) + heads * g.v_head_dim)
    rows = mla_chunked_prefill_rows(max_model_len, seqs, block_size, dcp)
    return tokens * width * b, rows * heads * (g.qk_nope_head_dim + g.v_head_dim) * b


def _forward_activation(model: ModelInventory, layout: Layout, tokens: int, start: int, end: int,
                        moe_tokens: int | None = None) -> int:
    """``moe_tokens``: the tokens the experts see when the dispatch gathers other ranks' (default ``tokens``)."""
    w = model.widths
    tp = layout.tp
    if model.family == "kimi_k3" and model.attn_res_block_size:
        hidden = tokens * kimi_forward_peak_bytes_per_token(model, start, end)
    else:
        hidden = tokens * w.hidden_size * 2 * 6
    widest = max(2 * w.intermediate_size // tp, 4 * w.num_attention_heads * w.head_dim // tp, 1)
    dense = tokens * widest * 2 * 2
    moe = 0
    if w.num_experts:
        inter = w.moe_intermediate_size if layout.ep else max(w.moe_intermediate_size // tp, model.expert_min_intermediate_per_rank)
        rows = (moe_tokens or tokens) * w.experts_per_token
        moe = rows * (max(2 * inter, w.moe_hidden_size) + max(inter, w.moe_hidden_size)) * 2
    return hidden + max(dense, moe)


def _residual_side_rows(model: ModelInventory, end: int) -> int:
    """Hidden-width rows per token that a Kimi-K3 layer holds on its residual side, from vLLM 0.32's
    models/kimi_k3/nvidia/model.py: ``block_residual`` (one row per block from global layer 0 to ``end``, allocated
    once), ``prefix_sum``, the previous layer's output (still bound in the caller's loop) and the layer's input."""
    return cdiv(end, model.attn_res_block_size) + 3


def kimi_forward_peak_bytes_per_token(model: ModelInventory, start: int, end: int) -> int:
    """Bytes per token held at the peak of a Kimi-K3 stage's forward in vLLM 0.32's profile run, besides the MoE
    workspace (counted apart): the add of the shared and routed experts' outputs (``MoERunner.forward``,
    ``result = shared_output + fused_output``) in a MoE layer, read from vLLM's code (models/kimi_k3/nvidia/model.py,
    fused_moe/runner/moe_runner.py, router/gate_linear.py):
    - the residual side: ``block_residual`` [T, cdiv(end_layer, block), H], allocated once for every block from
      global layer 0 (a later PP stage copies the received blocks in), ``prefix_sum``, the previous layer's output
      (still bound in the caller's loop) and the MoE input; at a layer that opens a block (``layer % block == 0``)
      ``_post_attn_norm`` makes the attention output the new prefix while the caller holds the old one;
    - the MoE tail: the shared experts' output, the routed output's up-projection and their sum (3 x H), the routed
      experts' latent input and output (2 x ``routed_expert_hidden_size``), and the router logits in fp32
      (``GateLinear(out_dtype=torch.float32)``, every expert).
    The TP8 rank slices' measured peaks (8,192 tokens at 23-49 layers, 16,384 and 2,048 at 49; H200, 2026-12-01/02)
    match this to vLLM's 0.01 GiB. At TP > 1 vLLM fuses the up-projection into the shared output
    (``LatentMoERunner._fused_forward``), a few KiB per token less: this TP1 form is the cautious one there."""
    w = model.widths
    b = DTYPE_BITS[model.dtype] // 8
    block = model.attn_res_block_size
    opens_block_in_moe = any(i % block == 0 and model.layers[i].mlp == "moe" for i in range(start, end))
    residual_side = _residual_side_rows(model, end) + opens_block_in_moe
    return b * (w.hidden_size * (residual_side + 3) + 2 * w.moe_hidden_size) + 4 * w.num_experts


def kda_forward_peak_bytes_per_token(model: ModelInventory, layout: Layout, start: int, end: int) -> int:
    """Bytes per token held at the peak of a KDA layer's forward in vLLM 0.32's profile run, besides the MoE workspace
    (grown by an earlier MoE layer and never freed): 0 when the stage has no KDA layer. With no attention metadata
    the kernels return at once (``_forward``), but ``forward`` still makes its projections
    (models/kimi_k3/nvidia/kda.py): ``in_proj_qkvgfab``'s output (q, k, v and the output gate, then ``f_a`` and
    beta: 4 x heads x head_dim + head_dim + heads), ``f_b_proj``'s gate (heads x head_dim), ``core_attn_out``
    (heads x head_dim) and ``o_proj``'s output, all held together at ``o_proj``; beside them the residual side of a
    layer that opens no block. At full width (96 heads) that is more than a MoE layer's tail, at a TP8 rank (12) less."""
    kda = next((model.layers[i].kv for i in range(start, end) if isinstance(model.layers[i].kv, KdaState)), None)
    if kda is None or not model.attn_res_block_size:
        return 0
    b = DTYPE_BITS[model.dtype] // 8
    heads = max(1, kda.num_heads // layout.tp)
    projection = heads * kda.head_dim
    residual_side = _residual_side_rows(model, end)
    return b * (model.widths.hidden_size * (residual_side + 1) + 6 * projection + kda.head_dim + heads)


def _cuda_graph(model: ModelInventory, layout: Layout, engine: EngineSettings, stage: int, start: int, end: int,
                mnbt: int, seqs: int, cc: tuple[int, int]) -> tuple[int, int, str, int]:
    """vLLM's CUDA-graph estimate, its margin and basis, and how much of it is workspace the profiling grew and
    keeps (DSpark's capture lane), which kernel warmup cannot reuse."""
    if engine.enforce_eager:
        return 0, 0, "enforce_eager: no CUDA graphs", 0
    query_len = 1 + (engine.speculative.num_speculative_tokens if engine.speculative else 0)
    sizes = cuda_graph_capture_sizes(seqs, query_len, mnbt, cc)
    largest = sizes[-1]
    num_sizes = len(sizes)
    # FULL_AND_PIECEWISE (hybrid or MLA models): a PIECEWISE graph per capture size, and a FULL graph per uniform
    # decode batch (v1/worker/gpu/cudagraph_utils.py CudaGraphManager._init_candidates: each size rounded up to a
    # multiple of the decode query length, up to max_num_seqs of them); the drafter's graphs follow the decode batches.
    full_tokens = uniform_decode_graph_tokens(sizes, seqs, query_len) if model.is_hybrid or model.uses_mla else []
    num_full = len(full_tokens)
    graphs = num_sizes + num_full
    shared = _forward_activation(model, layout, largest, start, end)
    family = model.family if model.family in CUDA_GRAPH_PER_GRAPH else "default"
    target_heads = max(1, model.num_attention_heads // layout.tp)
    per_graph = CUDA_GRAPH_PER_GRAPH[family] + CUDA_GRAPH_PER_HEAD[family] * target_heads
    est = shared + CUDA_GRAPH_PER_LAYER[family] * (end - start)
    if family in CUDA_GRAPH_FULL_SAMPLED and num_full:
        full, full_basis = sampled_full_graphs_bytes(family, full_tokens, target_heads)
        est += num_sizes * per_graph + full
        graphs_basis = f"{num_sizes} PIECEWISE graphs x {per_graph / MiB:.1f} MiB + {full_basis}"
    else:
        est += graphs * per_graph
        graphs_basis = f"{num_sizes} PIECEWISE and {num_full} FULL graphs x {per_graph / MiB:.1f} MiB"
    spec = engine.speculative
    draft = ""
    kept = 0
    if spec is not None and stage == layout.pp - 1:
        heads = max(1, spec.draft.num_attention_heads // (spec.draft_tp or layout.tp)) if spec.draft is not None else 0
        per_draft_graph = (CUDA_GRAPH_DRAFT_PER_GRAPH.get(spec.method, 0) + CUDA_GRAPH_DRAFT_PER_HEAD.get(spec.method, 0) * heads
                           + CUDA_GRAPH_DRAFT_PER_LAYER_HEAD.get(spec.method, 0) * (end - start) * target_heads)
        num_draft = num_full
        if spec.method == "dspark":
            # DSpark's own FULL graphs: N query rows a request (anchor + N-1 noise), not the target's 1 + N
            # (spec_decode/dspark/speculator.py num_query_per_req; dflash/cudagraph.py), so their own sizes.
            draft_tokens = uniform_decode_graph_tokens(sizes, seqs, spec.num_speculative_tokens)
            num_draft = len(draft_tokens)
            lane = _dspark_capture_lane_bytes(spec, layout, max(draft_tokens, default=0), engine.max_model_len, cc)
            est += lane
            kept = lane
            draft = f" + DSpark's capture workspace {lane / MiB:,.0f} MiB" if lane else ""
        est += num_draft * per_draft_graph
        draft += f" + {num_draft} draft graphs x {per_draft_graph / MiB:.1f} MiB" if per_draft_graph else ""
        if spec.method == "eagle3":
            drafter, drafter_basis = eagle3_drafter_graphs_bytes(sizes, seqs, spec.num_speculative_tokens, full_tokens)
            est += drafter
            draft += f" + {drafter_basis}"
    return est, max(est // 2, GiB // 2), (
        f"vLLM profile_cudagraph_memory shape: first capture ({largest} tokens) + {end - start} layers x "
        f"{CUDA_GRAPH_PER_LAYER[family] / MiB:.1f} MiB + {graphs_basis}{draft} (fitted on H200 fit runs, "
        f"scripts/fit_memory_constants.py)"
    ), kept


def _flashkda_runs_in_graph_profile(engine: EngineSettings, mnbt: int, seqs: int, cc: tuple[int, int]) -> bool:
    """Whether vLLM's CUDA-graph profiling runs a KDA prefill, so FlashKDA asks for its buffers before the KV cache.
    Each PIECEWISE capture is a dummy run of ``size`` tokens over ``min(size, max_num_seqs)`` requests
    (v1/worker/gpu/model_runner.py ``_dummy_run``): past ``max_num_seqs`` x the decode query length, a request has more
    tokens than a decode step, and KDA takes its prefill path (FlashKDA), which sizes its buffers for
    ``max_num_batched_tokens`` and ``max_num_seqs`` whatever the batch. Seen at 96 sequences and 2,048 tokens (largest
    capture 192, H100, round 25); at 512 sequences (largest 512, one token a request) FlashKDA grew in warmup."""
    if engine.enforce_eager:
        return False
    query_len = 1 + (engine.speculative.num_speculative_tokens if engine.speculative else 0)
    return capture_prefill_requests(seqs, query_len, cuda_graph_capture_sizes(seqs, query_len, mnbt, cc)[-1]) > 0


def sampled_full_graphs_bytes(family: str, full_tokens: Sequence[int], target_heads: int) -> tuple[int, str]:
    """What vLLM 0.32's CUDA-graph estimate charges the FULL graphs of ``full_tokens`` (ascending), as (bytes, basis):
    it captures the 2 largest and charges each other one the second's drop in free memory, negative on the H200, so
    ``VLLM_FULL_GRAPH_FLOOR`` (``_extrapolate_full_graph_memory``); what the 2 captures leave is
    ``CUDA_GRAPH_FULL_SAMPLED`` + the cache released as the second begins (``CUDA_GRAPH_RELEASE_PER_TOKEN_HEAD`` x its
    tokens x the target's heads on the rank). With one FULL graph there is no second sample, and no release."""
    second = full_tokens[-2] if len(full_tokens) >= 2 else 0
    sampled = CUDA_GRAPH_FULL_SAMPLED[family] + CUDA_GRAPH_RELEASE_PER_TOKEN_HEAD[family] * second * target_heads
    floor = (len(full_tokens) - 1) * VLLM_FULL_GRAPH_FLOOR
    return sampled + floor, (f"{len(full_tokens)} FULL graphs as vLLM samples them: the {min(len(full_tokens), 2)} "
                             f"largest captured ({sampled / MiB:,.0f} MiB with the cache released at {second} tokens) "
                             f"and {len(full_tokens) - 1} x {VLLM_FULL_GRAPH_FLOOR / MiB:g} MiB")


def cuda_graph_capture_sizes(max_num_seqs: int, decode_query_len: int, max_num_batched_tokens: int,
                             cc: tuple[int, int]) -> tuple[int, ...]:
    """The token counts vLLM 0.32 captures CUDA graphs for, ascending, as ``VllmConfig._set_cudagraph_sizes`` sets
    them when the config names none (config/vllm.py): 1, 2, 4, steps of 8 below 256 and of 16 from 256, up to
    ``min(max_num_seqs x decode_query_len x 2, 1024 on compute capability 10.x else 512, max_num_batched_tokens)``;
    then ``max_num_batched_tokens`` where it is below that ceiling, and the uniform decode batches wherever they
    are off that grid: ``max_num_seqs`` itself with one query a request (15 sequences add a 15: H200, r23-s0-pp4,
    7 PIECEWISE graphs), and with a draft each request count of the same grid up to ``max_num_seqs``, and that
    count itself, times the decode query length."""
    platform_max = 1024 if cc[0] == 10 else 512
    seqs = max(max_num_seqs, 1)
    ceiling = min(seqs * decode_query_len * 2, platform_max)
    if decode_query_len > 1:
        max_reqs = min(seqs, platform_max)
        counts = set(_grid(max_reqs)) | {max_reqs}
        uniform = {n * decode_query_len for n in counts if n * decode_query_len <= ceiling}
    else:
        uniform = {seqs} if seqs <= ceiling else set()
    ceiling = min(max_num_batched_tokens, ceiling)
    sizes = set(_grid(ceiling))
    if max_num_batched_tokens <= ceiling:
        sizes.add(max_num_batched_tokens)
    sizes |= {size for size in uniform if size <= max_num_batched_tokens}
    return tuple(sorted(sizes))


def _grid(largest: int) -> list[int]:
    """vLLM's default capture grid up to ``largest``: 1, 2, 4, then steps of 8 to 256, then of 16."""
    return [s for s in [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, largest + 1, 16)) if s <= largest]


def uniform_decode_graph_tokens(sizes: Sequence[int], seqs: int, query_len: int) -> list[int]:
    """The tokens of vLLM's FULL uniform-decode graphs: the capture ``sizes`` rounded up to a multiple of the decode
    query length, within ``max_num_seqs`` requests and the largest size, without repeats
    (``CudaGraphManager._init_candidates``)."""
    largest = max(sizes, default=0)
    rounded = {cdiv(s, query_len) * query_len for s in sizes}
    return sorted(r for r in rounded if r <= max(seqs, 1) * query_len and r <= largest)


def _dspark_capture_lane_bytes(spec: SpeculativeSettings, layout: Layout, rows: int, max_model_len: int,
                               cc: tuple[int, int]) -> int:
    """The drafter's workspace lane (lane 1) that capturing DSpark's largest graph of ``rows`` query rows fills: its
    MLA runs on TRITON_MLA, whose ``forward_mqa`` takes its split-KV logits from the lane, and the capture's dummy
    batch runs at ``max_model_len``, so they are sized as at full context. The lane is empty until then: all of it is
    new memory inside vLLM's CUDA-graph estimate (the profiling capture measures it), never freed (the real capture
    finds it big enough). vLLM logged 157.81 to 1,493.91 MB for these shapes (H200, 2026-12-01 to 03); charged in
    the caching allocator's 2 MiB blocks, as ``triton_mla_logits_bytes`` charges lane 0's reservation."""
    mla = next((layer.kv for layer in spec.draft.layers if isinstance(layer.kv, MlaKv)), None) if spec.draft else None
    if mla is None or not rows:
        return 0
    heads = max(1, spec.draft.num_attention_heads // (spec.draft_tp or layout.tp))
    return triton_mla_logits_bytes(rows, 1, heads, mla.kv_lora_rank, max_model_len, cc)


def eagle3_draft_graphs(sizes: Sequence[int], seqs: int, num_spec: int, full_tokens: Sequence[int]) -> int:
    """The EAGLE3 drafter's CUDA graphs, which ``profile_cudagraph_memory`` captures in full (v1/worker/gpu/
    cudagraph_utils.py; only the target's FULL graphs are sampled). ``TargetDependentARSpeculator.
    init_cudagraph_manager`` (spec_decode/target_dependent_ar/speculator.py) builds a prefill manager in the target's
    mode with ``decode_query_len = k + 1``: a PIECEWISE graph per capture size and, under FULL_AND_PIECEWISE, a FULL
    graph per uniform-decode size, the target's own ``full_tokens`` (``uniform_decode_graph_tokens`` at k + 1; empty
    when PIECEWISE only); and, for k > 1 under a FULL decode mode, a FULL_DECODE_ONLY decode manager with one token per
    request: a FULL graph per capture size up to ``max_num_seqs``. 51 + 33 + 11 at 512 / 64 sequences / k = 3, as
    vLLM logged on the H200 (2026-12-01)."""
    return len(sizes) + len(full_tokens) + len(_eagle3_decode_sizes(sizes, seqs, num_spec, full_tokens))


def _eagle3_decode_sizes(sizes: Sequence[int], seqs: int, num_spec: int, full_tokens: Sequence[int]) -> list[int]:
    """The EAGLE3 drafter's decode manager's graph sizes, one token a request: none for one speculative token or
    without FULL graphs."""
    return [s for s in sizes if s <= seqs] if full_tokens and num_spec > 1 else []


def eagle3_drafter_graphs_bytes(sizes: Sequence[int], seqs: int, num_spec: int,
                                full_tokens: Sequence[int]) -> tuple[int, str]:
    """What the EAGLE3 drafter's graphs add to vLLM's CUDA-graph estimate, as (bytes, basis); ``full_tokens`` are the
    FULL uniform-decode graphs' tokens at k + 1 a request (``uniform_decode_graph_tokens``). A drafter graph keeps
    no tensor once captured (its outputs go to buffers made outside the capture), and each capture manager captures
    on a stream of its own (``graph_capture``), where the caching allocator reuses blocks only among that manager's
    graphs: the drafter costs the high-water of its prefill manager, set by its largest FULL graph's requests (k + 1
    tokens each), and of its decode manager, set by its largest graph's requests (one token each), not a cost per
    graph (``eagle3_draft_graphs`` counts them). Until the forty-fourth session each was charged the target's
    per-graph cost: 0.11 to 0.39 GiB over vLLM's estimate on every EAGLE3 run."""
    prefill_requests = max(full_tokens, default=0) // (num_spec + 1)
    decode_requests = max(_eagle3_decode_sizes(sizes, seqs, num_spec, full_tokens), default=0)
    total = (EAGLE3_DRAFTER_GRAPHS_BASE + EAGLE3_DRAFTER_PER_PREFILL_REQUEST * prefill_requests
             + EAGLE3_DRAFTER_DECODE_PER_REQUEST * decode_requests)
    return total, (f"the EAGLE3 drafter's {eagle3_draft_graphs(sizes, seqs, num_spec, full_tokens)} graphs: "
                   f"{EAGLE3_DRAFTER_GRAPHS_BASE / MiB:.1f} MiB + {prefill_requests} prefill requests x "
                   f"{EAGLE3_DRAFTER_PER_PREFILL_REQUEST / MiB:.2f} MiB + {decode_requests} decode requests x "
                   f"{EAGLE3_DRAFTER_DECODE_PER_REQUEST / KiB:.0f} KiB (each capture manager's largest graph)")


def kv_grouping(model: ModelInventory, layout: Layout, engine: EngineSettings, compute_capability: tuple[int, int] = (9, 0)) -> KvGrouping:
    """The KV-cache groups (whole model, per-rank page sizes) vLLM 0.32 would build for this layout."""
    spec = engine.speculative
    tokens, seqs = resolved_batch(engine, RankDevice(0, compute_capability))  # FlashKDA on/off, not the batch, shapes it
    opts = decide_optimisations(model, layout, engine, compute_capability, True, max_num_batched_tokens=tokens,
                                max_num_seqs=seqs)
    prefix = True if engine.enable_prefix_caching is None else engine.enable_prefix_caching
    return _kv_grouping(model, layout, engine, compute_capability, spec.num_speculative_tokens if spec else 0, prefix, opts,
                        spec.draft if spec else None, spec)[0]
