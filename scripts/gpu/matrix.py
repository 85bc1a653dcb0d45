"""The rehearsal matrix for the GPU host: many ``kimi-k3-serve rehearse`` runs, packed onto the host's GPUs.

Each job is one rehearsal (dummy weights) with its own work folder under ``--work`` (spec, vLLM's whole log,
result.json with the plan's prediction and vLLM's measurement). One-GPU jobs run side by side, one per GPU;
two-GPU jobs take both. A job starts only if its expected time fits before ``--deadline`` seconds; running jobs
are stopped at the deadline (their logs are kept and say where they were). After every job the folder is packed
into ``--out/<name>.tar.gz``, so what finished comes back even if the call is cut short.

    python scripts/gpu/matrix.py --set tp1 --deadline 520 --work /var/tmp/kk3-runs --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "fixtures" / "configs"
DSPARK = '{"method": "dspark", "model": "kimi-k3-dspark", "num_speculative_tokens": 7}'
DSPARK_3 = '{"method": "dspark", "model": "kimi-k3-dspark", "num_speculative_tokens": 3}'
EAGLE3 = '{"method": "eagle3", "model": "kimi-k3-eagle3", "num_speculative_tokens": 3}'
EAGLE3_MLA = '{"method": "eagle3", "model": "kimi-k3-eagle3-mla", "num_speculative_tokens": 3}'
KIMI_ENGINE = {"moe_backend": "marlin", "attention_backend": "FLASHMLA"}
"""vLLM 0.32 asserts an fp8 prefill query for Kimi-K3 with an fp8 KV cache; the fp8 jobs add it."""


ROLES = ("fit", "validation")
"""A job's role, fixed here before it runs: a ``fit`` run may set a constant of the memory model, a ``validation``
run only scores it (scripts/memory_accuracy.py reports errors on validation runs alone)."""


@dataclass(frozen=True)
class Job:
    name: str
    gpus: int
    expected_s: float
    args: tuple[str, ...]
    tags: tuple[str, ...] = field(default_factory=tuple)
    role: str = ""


def kimi(name: str, layers: int, *, tp: int = 1, pp: int = 1, dp: int = 1, ep: bool = False, tokens: int = 2048,
         seqs: int = 256, util: float = 0.92, draft: str | None = DSPARK, kv: str = "auto", max_len: int = 8192,
         expected_s: float = 150, extra=(), role: str = "") -> Job:
    kimi_kwargs = ["--engine-kwargs", json.dumps({**KIMI_ENGINE, **({"attention_config": {"use_prefill_query_quantization": True}}
                                                                   if kv.startswith("fp8") else {})})]
    args = ["--model", "moonshotai/Kimi-K3", *kimi_kwargs, "--layers", str(layers), "--tp", str(tp), "--pp", str(pp),
            "--max-num-batched-tokens", str(tokens),
            "--max-num-seqs", str(seqs), "--gpu-memory-utilization", str(util), "--kv-cache-dtype", kv,
            "--max-model-len", str(max_len), "--speculative-config", draft or "none", *extra]
    if dp > 1:
        args += ["--dp", str(dp)]
    if ep:
        args += ["--enable-expert-parallel"]
    return Job(name, tp * pp * dp, expected_s, tuple(args), ("kimi",), role)


DEPLOY = "deploy/config.yaml"
HOPPER_KERNELS = ("--engine-kwargs", json.dumps(KIMI_ENGINE))
"""A Blackwell config's rank on the H200: its MoE backend (flashinfer_trtllm) needs SM100, so Hopper's kernels run it."""


def rank(name: str, stage: int, *, role: str, config: str = DEPLOY, pp: int | None = None, tokens: int | None = None,
         seqs: int | None = None, util: float | None = None, draft: str | None = None, kv: str | None = None,
         extra: tuple[str, ...] = (), expected_s: float = 240) -> Job:
    """One TP rank of pipeline stage ``stage`` of a deploy config (``rehearse --rank-of``), on one GPU; the config's
    own limits unless overridden. ``draft``: a speculative config's JSON, or "none"; ``kv`` fp8 adds the fp8
    prefill query vLLM 0.32 requires for Kimi-K3."""
    assert role in ROLES
    args = ["--config", config, "--rank-of", str(stage), *extra]
    if kv is not None:
        args += ["--kv-cache-dtype", kv]
        if kv.startswith("fp8"):
            args += ["--engine-kwargs", json.dumps({"attention_config": {"use_prefill_query_quantization": True}})]
    for flag, value in (("--pp", pp), ("--max-num-batched-tokens", tokens), ("--max-num-seqs", seqs),
                        ("--gpu-memory-utilization", util), ("--speculative-config", draft)):
        if value is not None:
            args += [flag, str(value)]
    return Job(name, 1, expected_s, tuple(args), ("rank",), role)


NVLS_ON = ("--env", "NCCL_NVLS_ENABLE=2", "--env", "NCCL_DEBUG=INFO", "--env", "NCCL_DEBUG_SUBSYS=INIT,NVLS")
"""NCCL's own default (NVLS where the GPUs support multicast), with NCCL logging what it finds and allocates
("NVLS multicast support is (not) available", "NVLS comm ... nvlsTotalSize"): on a host without multicast the log
says so, and what NCCL would have allocated is planning/nvls.py's formula."""
NVLS_OFF = ("--env", "NCCL_NVLS_ENABLE=0")
EXPANDABLE_SEGMENTS = ("--env", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
"""PyTorch's caching allocator with expandable segments, as a user turns it on for vLLM's engine."""


def stage(name: str, stage_index: int, *, role: str, nvls: bool, config: str = DEPLOY, gpus: int = 8,
          expected_s: float = 480) -> Job:
    """Pipeline stage ``stage_index`` of a deploy config as it runs, at the config's TP on one node
    (``rehearse --stage-of``): the stage's layers at full width, the draft on the last stage, at the config's limits,
    with NCCL's NVLS on (``NVLS_ON``) or off."""
    assert role in ROLES
    args = ["--config", config, "--stage-of", str(stage_index), *(NVLS_ON if nvls else NVLS_OFF)]
    return Job(name, gpus, expected_s, tuple(args), ("stage",), role)


def other(name: str, config: str, *, tokens: int = 2048, seqs: int = 256, util: float = 0.92, expected_s: float = 120) -> Job:
    # Named relative to the checkout, where the jobs run (and where the accuracy replay looks them up).
    args = ["--model", str((CONFIGS / config).relative_to(ROOT)), "--max-model-len", "8192",
            "--max-num-batched-tokens", str(tokens), "--max-num-seqs", str(seqs), "--gpu-memory-utilization", str(util)]
    return Job(name, 1, expected_s, tuple(args), ("other",))


SETS: dict[str, list[Job]] = {
    # One GPU each, two at a time on a 2-GPU host. The first starts alone (FlashInfer builds its kernels once).
    "tp1": [
        kimi("k4-tp1-serve-defaults-dspark", 4, expected_s=300),
        kimi("k4-tp1-llm-defaults-b16384-s1024", 4, tokens=16384, seqs=1024),
        # The plan refuses a GQA EAGLE3 draft beside the slice's MLA pages: vLLM is started anyway for its verdict.
        kimi("k8-tp1-b2048-s256-eagle3", 8, draft=EAGLE3, expected_s=120, extra=("--start-anyway",)),
        # The MLA EAGLE3 draft (Eagle3DeepseekV2ForCausalLM) shares the slice's MLA pages. With its profile-run MLA
        # stand-in counted (memory.eagle3_mla_profile_bytes) the plan says 209 blocks for 256 sequences'
        # state blocks (seqs_over_state_blocks): vLLM is started anyway for its verdict.
        kimi("k8-tp1-b2048-s256-eagle3-mla", 8, draft=EAGLE3_MLA, extra=("--start-anyway",)),
        kimi("k4-tp1-b8192-s256-u080", 4, tokens=8192, util=0.80),
        other("llama-3.1-8b-tp1", "llama-3.1-8b.json"),
        # Not in the first calibration: what predicts these is held out (docs/memory-accuracy.md).
        kimi("k8-tp1-serve-defaults-dspark", 8),
        kimi("k4-tp1-b2048-s256-fp8kv", 4, kv="fp8"),
        other("deepseek-v2-lite-tp1", "deepseek-v2-lite.json"),
        other("llama-3.1-8b-tp1-b16384-s1024", "llama-3.1-8b.json", tokens=16384, seqs=1024),
        kimi("k4-tp1-b8192-s1024-nodraft", 4, tokens=8192, seqs=1024, draft=None),
        kimi("k8-tp1-b16384-s1024-u080", 8, tokens=16384, seqs=1024, util=0.80),
        other("qwen3-30b-a3b-tp1", "qwen3-30b-a3b.json", expected_s=200),
        kimi("k8-tp1-b2048-s1024-u080-dspark", 8, seqs=1024, util=0.80),
    ],
    # Both GPUs of the host.
    "tp2": [
        kimi("k4-tp2-serve-defaults-dspark", 4, tp=2, expected_s=300),
        kimi("k4-pp2-serve-defaults-dspark", 4, pp=2, expected_s=200),
        kimi("k8-tp2-b8192-s1024-u092-eagle3", 8, tp=2, tokens=8192, seqs=1024, draft=EAGLE3, expected_s=300,
             extra=("--start-anyway",)),
        kimi("k8-tp2-b8192-s1024-u092-eagle3-mla", 8, tp=2, tokens=8192, seqs=1024, draft=EAGLE3_MLA, expected_s=300),
        kimi("k8-pp2-b2048-s256-u080-fp8kv", 8, pp=2, util=0.80, kv="fp8", expected_s=300),
        # Data-parallel attention with the experts over both GPUs (DP2 x EP2): one engine per GPU, each with the
        # whole attention, its own KV cache and KDA states, and 448 of a layer's 896 experts.
        kimi("k4-dp2-ep2-serve-defaults-dspark", 4, dp=2, ep=True, expected_s=240),
    ],
    # One GPU: ranks of the real deployment (deploy/config.yaml, TP8 x PP2, 49/44 layers) at full depth, and the
    # shapes where the verdict missed. Roles are set here before the runs (2026-12-01, first round): the validation
    # runs score the model and set nothing.
    "ranks": [
        rank("r44-s1-dspark", 1, role="validation", expected_s=360),
        rank("r49-s0", 0, role="validation", expected_s=360),
        # The FlashKDA buffers at 768 sequences, where they fit (VLLM_DEBUG_WORKSPACE logs each growth and its caller).
        kimi("k6-tp1-b8192-s768-dspark-u080", 6, tokens=8192, seqs=768, util=0.80, expected_s=120, role="fit"),
        rank("r44-s1-eagle3-mla", 1, role="validation", draft=EAGLE3_MLA, expected_s=330),
        # Where the plan said "fits" and vLLM ran out of memory allocating the KV cache (first seen 2026-12-01).
        kimi("k6-tp1-b8192-s768-dspark-u092", 6, tokens=8192, seqs=768, util=0.92, expected_s=120, role="validation"),
        rank("r44-s1-dspark-u095", 1, role="validation", util=0.95, expected_s=200),
        rank("r23-s3-pp4-dspark-b16384-s64", 3, role="validation", pp=4, tokens=16384, seqs=64, util=0.90, expected_s=200),
    ],
    # The next round on one GPU, roles fixed on 2026-12-01 before any of them ran. The edge runs sit at the plan's
    # proposed largest safe utilization (rehearse --dry-run, 2026-12-01) and just past its predicted boundary.
    "ranks-round2": [
        rank("r44-s1-dspark-u0995", 1, role="validation", util=0.995, expected_s=200),  # the proposal for this rank
        kimi("k6-tp1-b8192-s768-dspark-u088", 6, tokens=8192, seqs=768, util=0.88, expected_s=120, role="validation"),
        kimi("k6-tp1-b8192-s768-dspark-u0905", 6, tokens=8192, seqs=768, util=0.905, expected_s=120, role="validation"),
        # CUDA graphs at a TP8 rank's shapes: a shallow and a half-depth stage set the depth term, the deep ones score it.
        rank("r11-s7-pp8-dspark", 7, role="fit", pp=8, expected_s=120),
        rank("r23-s0-pp4", 0, role="fit", pp=4, expected_s=150),
        rank("r49-s0-b2048-s512", 0, role="validation", tokens=2048, seqs=512, expected_s=200),
        rank("r44-s1-dspark-u080-b16384-s256", 1, role="validation", tokens=16384, seqs=256, util=0.80, expected_s=200),
        rank("r44-s1-dspark-fp8kv", 1, role="validation", kv="fp8", expected_s=200),
        rank("r49-s0-eager", 0, role="validation", extra=("--enforce-eager",), expected_s=150),
    ],
    # The third round on one GPU, roles fixed on 2026-12-01 (third session) before any of them ran. The fit runs add a
    # second point to the CUDA-graph terms that rested on one run each (leave-one-out: the no-draft rank +242 %, the
    # no-draft full-width slice +277 %). The validation runs: stage 1 with no draft, and the B200 config's two ranks,
    # which one H200 holds (50 and 43 layers at TP8, 65,536 tokens), on the Hopper kernels.
    "ranks-round3": [
        rank("r31-s1-pp3", 1, role="fit", pp=3, expected_s=150),
        kimi("k8-tp1-b8192-s512-nodraft", 8, tokens=8192, seqs=512, draft=None, expected_s=120, role="fit"),
        rank("r44-s1-nodraft", 1, role="validation", draft="none", expected_s=200),
        rank("b200-r50-s0", 0, role="validation", config="deploy/config-b200.yaml", extra=HOPPER_KERNELS, expected_s=240),
        rank("b200-r43-s1-dspark", 1, role="validation", config="deploy/config-b200.yaml", extra=HOPPER_KERNELS,
             expected_s=240),
    ],
    # The fourth round on one GPU, roles fixed on 2026-12-01 (third session) before any of them ran. The DSpark
    # per-layer CUDA-graph term rests on one deep fit run (r11-s7-pp8-dspark, 11 layers) and over-predicts the
    # 44-layer ranks by 25-37 %: two DSpark last stages of 23 and 31 layers fit it; the validation runs score it at
    # 64 sequences and stage 0 at a large token budget.
    "ranks-round4": [
        rank("r31-s2-pp3-dspark", 2, role="fit", pp=3, expected_s=150),
        rank("r23-s3-pp4-dspark", 3, role="fit", pp=4, expected_s=150),
        rank("r44-s1-dspark-s64", 1, role="validation", seqs=64, expected_s=200),
        rank("r49-s0-b16384-s64-u090", 0, role="validation", tokens=16384, seqs=64, util=0.90, expected_s=200),
    ],
    # The fifth round on one GPU, roles fixed on 2026-12-02 before any of them ran. Round 4's one unsafe KV miss on a
    # deployment shape was stage 0's rank at 16,384 batched tokens (r49-s0-b16384-s64-u090, +3.7 %: its profile
    # 0.24 GiB under), and no fit run of the profile group has more than 8,192 tokens on a rank slice: two fit runs
    # at 16,384 tokens, and two validation runs between the budgets, on both stages.
    "ranks-round5": [
        rank("r49-s0-b16384-s16", 0, role="fit", tokens=16384, expected_s=200),
        rank("r31-s1-pp3-b16384", 1, role="fit", pp=3, tokens=16384, expected_s=200),
        rank("r49-s0-b12288-s128-u090", 0, role="validation", tokens=12288, seqs=128, util=0.90, expected_s=220),
        rank("r44-s1-dspark-b12288-s128", 1, role="validation", tokens=12288, seqs=128, expected_s=240),
    ],
    # Round 6 (roles fixed 2026-12-02, seventh session, before they run): the profile split into the buffers vLLM
    # keeps from the sampler and the speculator (persistent, growing with max_num_seqs) and the forward's transient.
    # The full-width slice without a draft at 16 sequences fits the full-width constant apart from any seqs term;
    # the two ranks between the recorded sequence counts score it.
    "ranks-round6": [
        kimi("k4-tp1-b8192-s16-nodraft", 4, tokens=8192, seqs=16, draft=None, expected_s=120, role="fit"),
        rank("r44-s1-dspark-b8192-s192", 1, role="validation", seqs=192, expected_s=240),
        rank("r49-s0-b4096-s256", 0, role="validation", tokens=4096, seqs=256, expected_s=220),
    ],
    # Round 7 (roles fixed 2026-12-02, eighth session, before they run): the DSpark step's growth with the token
    # budget at a TP8 rank's shapes. Its fit runs away from 8,192 tokens are full-width slices (DRAFT_HIDDEN_COPIES
    # 4.61), and the ranks with DSpark at 12,288 and 16,384 tokens profile 0.2-0.45 GiB under the plan. Stage 1's
    # rank at 16,384 tokens and 16 sequences fits it; two ranks between the recorded budgets score it.
    "ranks-round7": [
        rank("r44-s1-dspark-b16384-s16", 1, role="fit", tokens=16384, seqs=16, expected_s=240),
        rank("r44-s1-dspark-b4096-s512", 1, role="validation", tokens=4096, seqs=512, expected_s=240),
        rank("r31-s2-pp3-dspark-b12288-s64", 2, role="validation", pp=3, tokens=12288, seqs=64, expected_s=200),
    ],
    # Round 8 (roles fixed 2026-12-03, ninth session, before they run): DSpark's step as a peak of its own (its draft
    # logits beside the MoE workspace and the hidden states, not on top of the forward's peak), chosen after round 7's
    # runs: two ranks where the step sets the peak (few tokens, many sequences) score it out of sample. The fit run is
    # for the CUDA-graph group: no fit run of it is a TP8 rank with DSpark and many graph sizes (its validation ranks
    # at 64 to 512 sequences are 4-13 % over, k8-tp1-serve-defaults-dspark 0.17 GiB under).
    "ranks-round8": [
        rank("r44-s1-dspark-b8192-s256", 1, role="fit", seqs=256, expected_s=240),
        rank("r44-s1-dspark-b2048-s256", 1, role="validation", tokens=2048, seqs=256, expected_s=240),
        rank("r44-s1-dspark-b8192-s512", 1, role="validation", seqs=512, expected_s=240),
    ],
    # Roles fixed 2026-12-03 (tenth session), after round 8 ran and before these run: validation for the CUDA-graph
    # group's refit with round 8's fit run (a TP8 rank with DSpark at 128 sequences and 4,096 tokens).
    "ranks-round9": [
        rank("r44-s1-dspark-b4096-s128", 1, role="validation", tokens=4096, seqs=128, expected_s=200),
    ],
    # Roles fixed 2026-12-03 (tenth session), after DSpark's capture workspace was counted and before these run:
    # that lane grows with max_model_len (TRITON_MLA's KV splits), and the B200 and GB300 configs run at 65,536 and
    # 131,072 tokens; only the B200 rank (22 sequences) has measured it past 32,768.
    "ranks-round10": [
        rank("r44-s1-dspark-l131072-s64", 1, role="validation", seqs=64, extra=("--max-model-len", "131072"),
             expected_s=220),
        rank("r44-s1-dspark-l65536-s128", 1, role="validation", seqs=128, extra=("--max-model-len", "65536"),
             expected_s=220),
        rank("r44-s1-dspark-l131072-s20", 1, role="validation", seqs=20, extra=("--max-model-len", "131072"),
             expected_s=220),
    ],
    # Roles fixed 2026-12-03 (eleventh session), after round 10 and before these run: the CUDA-graph estimate's
    # growth with depth at full width. vLLM's FULL-graph increment per graph is 9.1 MiB at 4 layers and 10.2 at 8 on
    # full-width slices (2.3-4.4 MiB on TP8 ranks at 44-49), and the one full-width fit run deeper than 4 layers with
    # DSpark (6 layers, 8,192 tokens, 768 sequences) is itself 2 % under, so k8-tp1-serve-defaults-dspark's estimate
    # was 0.18 GiB under (its KV sliver +18 %). Since then DSpark's per-layer term is charged per target head on the
    # rank (a structure chosen after k8 was read): a 6-layer fit run at the serve defaults adds to its fit, and 7
    # layers at the serve defaults and 5 layers at another budget score it.
    "ranks-round11": [
        kimi("k6-tp1-serve-defaults-dspark", 6, role="fit", expected_s=200),
        kimi("k7-tp1-serve-defaults-dspark", 7, role="validation", expected_s=200),
        kimi("k5-tp1-b4096-s128-dspark", 5, tokens=4096, seqs=128, role="validation", expected_s=200),
    ],
    # Roles fixed 2026-12-03 (twelfth session), after round 11 and before these run. What the validation runs still
    # miss: k8-tp1-serve-defaults-dspark's KV sliver (0.92 GiB) +5.9 %, its CUDA-graph estimate 0.06 GiB under, less
    # than one shape's spread between two engine starts seen before (0.08 GiB): the same shape started again says
    # whether that miss is the model or the start. And the profile at small budgets on full-width slices
    # (k5-tp1-b4096-s128-dspark 0.23 GiB under, inside the band): a fit run at 4,096 tokens, 4 layers, and a
    # validation run at 2,048 tokens and 64 sequences, 5 layers.
    "ranks-round12": [
        kimi("k8-tp1-serve-defaults-dspark-again", 8, role="validation", expected_s=200),
        kimi("k4-tp1-b4096-s128-dspark", 4, tokens=4096, seqs=128, role="fit", expected_s=200),
        kimi("k5-tp1-b2048-s64-dspark", 5, tokens=2048, seqs=64, role="validation", expected_s=200),
    ],
    # Roles fixed 2026-12-03 (thirteenth session), after round 12 and the refit it fed (NON_TORCH_TP1 380.73 ->
    # 403.62 MiB, DSpark's hidden copies 5.61 -> 5.44) and before these run: k8 started again gave the same 0.92 GiB
    # and 3.82 GiB as its first start, so its miss is the model's. What the refit has not met: the profile at the
    # smallest budgets on a full-width slice deeper than 5 layers, and stage 1's TP8 rank with DSpark at 2,048 tokens
    # and 64 sequences (its nearest run, 256 sequences, is 0.09 GiB under). The 4,096-token fit run stopped at its
    # timeout in kernel warmup after vLLM sized its KV cache (its memory terms measured, vLLM's verdict not): 300 s.
    "ranks-round13": [
        kimi("k6-tp1-b2048-s32-dspark", 6, tokens=2048, seqs=32, role="validation", expected_s=240),
        # 254 s on a fresh host reached only the CUDA-graph estimate (fifteenth session): give it a whole call
        rank("r44-s1-dspark-b2048-s64", 1, role="validation", tokens=2048, seqs=64, expected_s=420),
    ],
    # Roles fixed 2026-12-04 (sixteenth session), after round 13 and before this runs. Stage 1's rank at 2,048 tokens
    # and 64 sequences came within -0.19 % of vLLM's KV pool; stage 0's rank has not run below 2,048 x 512, where
    # the profile is smallest and the CUDA-graph estimate the largest share of what is not KV. A whole call: 324 s
    # for its stage-1 twin on a fresh host.
    "ranks-round14": [
        rank("r49-s0-b2048-s64", 0, role="validation", tokens=2048, seqs=64, expected_s=420),
    ],
    # Roles fixed 2026-12-04 (eighteenth session), after ranks-round14 ran (r49-s0-b2048-s64: KV +0.19 %) and before
    # these run. The one KV miss left is a small pool (k8 at the serve defaults: 0.92 GiB, +4.0 %, 0.04 GiB): what the
    # plan's absolute error is worth where a real rank runs near full. Stage 0's rank at the config's own limits and
    # utilization 0.80 holds a 5.6 GiB pool, stage 1's with DSpark 10.3 GiB (the dry runs' plan of the real TP8 rank;
    # the one-GPU rank slice that vLLM runs holds 3.8 and 9.5 GiB: its vocabulary tables are whole, 4.1 GiB more on
    # stage 0, against 2.3 GiB less of non-torch memory and CUDA graphs); each a call of its own on a fresh host.
    "ranks-round15": [
        rank("r49-s0-u080", 0, role="validation", util=0.80, expected_s=420),
        rank("r44-s1-dspark-u080", 1, role="validation", util=0.80, expected_s=420),
    ],
    # Roles fixed 2026-12-04 (twentieth session), before these run. The one KV miss left (k8 at the serve defaults:
    # 0.92 GiB, +4.0 %) is the CUDA-graph estimate's: vLLM captures 2 of its FULL graphs and charges the other 46 at
    # the second one's drop in free memory, which it logs nowhere. Every rehearsal now logs the samples
    # (kimi_k3_serve/rehearsal/graph_samples.py). The fit runs are shapes the CUDA-graph constants are already fitted
    # on, started again to read what vLLM measured and what it extrapolated; the validation runs are new shapes with
    # small KV pools at full width (where a 0.05 GiB error is over 3 %), scored by the model shipped after the fit
    # runs are read and before these are.
    "ranks-round16": [
        kimi("k6-tp1-serve-defaults-dspark-samples", 6, role="fit", expected_s=150),
        kimi("k4-tp1-serve-defaults-dspark-samples", 4, role="fit", expected_s=150),
        kimi("k8-tp1-b8192-s512-nodraft-samples", 8, tokens=8192, seqs=512, draft=None, role="fit", expected_s=150),
        rank("r44-s1-dspark-b8192-s256-samples", 1, role="fit", tokens=8192, seqs=256, expected_s=360),
        rank("r23-s0-pp4-samples", 0, role="fit", pp=4, expected_s=150),
        kimi("k8-tp1-b2048-s128-dspark", 8, seqs=128, role="validation", expected_s=170),
        kimi("k7-tp1-b2048-s128-dspark-u081", 7, seqs=128, util=0.81, role="validation", expected_s=170),
        kimi("k8-tp1-b4096-s64-dspark", 8, tokens=4096, seqs=64, role="validation", expected_s=170),
    ],
    # Roles fixed 2026-12-04 (twenty-first session), before these run, after the plan's CUDA-graph sizes were made
    # vLLM's own (planning/memory.py cuda_graph_capture_sizes: a max_num_seqs off the grid of 8s and 16s is a size of
    # its own, and with a draft so is each uniform decode batch off it; 77 of 77 logged runs agree) and the
    # CUDA-graph constants refitted on their fit runs. Fit runs: full-width slices that log the cache vLLM's second
    # sampled FULL graph releases (graph_samples.py) at 4,096 tokens, where the profile ran 0.09 to 0.22 GiB over
    # the plan's (k4, k5, k8). Validation runs: new shapes, among them
    # max_num_seqs off the grid on both stages' ranks (35 with DSpark adds a 280-token size; 27 without a draft adds
    # a 27), scored by the model shipped once the fit runs are read, and before these are opened. Since the roles
    # were fixed the plan counts the hidden states vLLM keeps for DSpark (planning/memory.py aux_hidden_state_layers,
    # same session): the full-width validation runs at 4,096 and 3,072 tokens, where a KDA layer's peak is the
    # profile's, score that term out of sample too.
    "ranks-round17": [
        kimi("k6-tp1-b4096-s128-dspark", 6, tokens=4096, seqs=128, role="fit", expected_s=170),
        kimi("k8-tp1-b4096-s32-dspark", 8, tokens=4096, seqs=32, role="fit", expected_s=170),
        rank("r44-s1-dspark-b8192-s35", 1, role="validation", tokens=8192, seqs=35, expected_s=300),
        # 450 s: its 44-layer sibling took 443 s in round 20 (about 2 minutes of first-start kernel warm-up).
        rank("r49-s0-b8192-s27", 0, role="validation", tokens=8192, seqs=27, expected_s=450),
        kimi("k6-tp1-b4096-s96-dspark-u090", 6, tokens=4096, seqs=96, util=0.90, role="validation", expected_s=170),
        kimi("k7-tp1-b3072-s64-dspark", 7, tokens=3072, seqs=64, role="validation", expected_s=170),
    ],
    # Roles fixed 2026-12-05 (twenty-seventh session), before these run. The CUDA-graph estimate of stage 1's TP8 rank
    # with DSpark is the plan's largest unsafe miss between 15 and 35 sequences (-0.07 to -0.15 GiB, validation runs;
    # r44-s1-dspark-b8192-s35 the worst), and within +0.03 GiB from 64 on. Take away DSpark's capture lane, which
    # the plan has to the 2 MiB block, and vLLM's estimate is 1.04, 1.11, 1.86, 2.07 and 2.13 GiB at 15, 16, 35, 64
    # and 128 or more sequences: it grows with the FULL and DSpark graphs' count and tokens, and not as the per-graph
    # terms charge it. The fit runs sample that range at the deploy config's limits; the validation runs are new
    # shapes inside it, scored by the model shipped after the fit runs are read and before these are opened. Each is
    # one call of its own on a fresh host (r44-s1-dspark-b8192-s35 took 443 s). The 23-layer last stage of a PP4
    # layout at 35 sequences (a fit run, added the same session, before any of the set ran) says whether the step
    # grows with depth: at 15 or 16 sequences the plan is within 0.01 GiB there, 0.09 GiB under at 44 layers. The
    # 31-layer last stage of a PP3 layout at 40 sequences scores the depth the fit runs leave out.
    "ranks-round18": [
        rank("r23-s3-pp4-dspark-b8192-s35", 3, role="fit", pp=4, tokens=8192, seqs=35, expected_s=300),
        rank("r44-s1-dspark-b8192-s24", 1, role="fit", tokens=8192, seqs=24, expected_s=450),
        rank("r44-s1-dspark-b8192-s48", 1, role="fit", tokens=8192, seqs=48, expected_s=450),
        rank("r44-s1-dspark-b4096-s28-u090", 1, role="validation", tokens=4096, seqs=28, util=0.90, expected_s=450),
        rank("r44-s1-dspark-b8192-s42", 1, role="validation", tokens=8192, seqs=42, expected_s=450),
        rank("r31-s2-pp3-dspark-b8192-s40", 2, role="validation", pp=3, tokens=8192, seqs=40, expected_s=300),
    ],
    # Roles fixed 2026-12-05 (twenty-eighth session), before these run, after ranks-round18 was read and the
    # CUDA-graph constants refitted on its fit runs (structure unchanged). What is left unsafe: stage 1's rank with
    # DSpark at 28 and 35 sequences, -0.09 and -0.10 GiB (r44-s1-dspark-b4096-s28-u090, r44-s1-dspark-b8192-s35), and
    # within 0.05 GiB at 15 to 24, 42 and 48; the 23- and 31-layer last stages at 35 and 40 within 0.04 GiB. The
    # fit runs take that range at two more depths (11 and 31 layers), to say whether the step is per layer; the
    # validation runs are new shapes inside it, and a full-width 8-layer slice at the edge of fitting (a KV pool under
    # 1 GiB, where the plan still misses 3 %: k8-tp1-b4096-s64-dspark +7.6 %), scored by the model shipped after the
    # fit runs are read and before these are opened. In round 22 a 44-layer run's call took 163 to 255 s, and the
    # 49-layer one's 328 s on the fresh host (its first setup included).
    "ranks-round19": [
        rank("r31-s2-pp3-dspark-b8192-s24", 2, role="fit", pp=3, tokens=8192, seqs=24, expected_s=300),
        rank("r11-s7-pp8-dspark-b8192-s35", 7, role="fit", pp=8, tokens=8192, seqs=35, expected_s=240),
        rank("r44-s1-dspark-b4096-s20", 1, role="validation", tokens=4096, seqs=20, expected_s=330),
        rank("r23-s3-pp4-dspark-b4096-s30-u088", 3, role="validation", pp=4, tokens=4096, seqs=30, util=0.88,
             expected_s=300),
        kimi("k8-tp1-b4096-s48-dspark", 8, tokens=4096, seqs=48, role="validation", expected_s=170),
    ],
    # Roles fixed 2026-12-05 (thirtieth session), before these run: every one is a validation run of
    # DSPARK_KDA_PEAK_HIDDEN_COPIES (planning/memory.py), the hidden states a DSpark draft adds where a KDA layer's
    # forward sets the profile's peak. That term was chosen after every full-width DSpark run it moves had been read,
    # so none of those scores it. These are new token budgets and depths where the plan puts the peak there (the term
    # 0.05 to 0.14 GiB), and one 8-layer slice at the edge, whose pool of 0.71 GiB the term alone takes 0.11 GiB
    # from (the plan says "at risk"). The 4- to 8-layer full-width slices took 130 to 170 s a start in round 23.
    "ranks-round20": [
        kimi("k5-tp1-b6144-s64-dspark", 5, tokens=6144, seqs=64, role="validation", expected_s=170),
        kimi("k7-tp1-b8192-s32-dspark", 7, tokens=8192, seqs=32, role="validation", expected_s=170),
        kimi("k6-tp1-b3072-s128-dspark", 6, tokens=3072, seqs=128, role="validation", expected_s=170),
        kimi("k8-tp1-b6144-s32-dspark", 8, tokens=6144, seqs=32, role="validation", expected_s=170),
    ],
    # Roles fixed 2026-12-06 (thirty-first session), before these run, for an H100 80GB when no H200 is lent: no run
    # has been made on one, and the catalogue's H100 total (79.19 GiB) comes from public logs. Validation runs of the
    # whole model on a GPU the constants never saw, and of DSPARK_KDA_PEAK_HIDDEN_COPIES, which moves each of them
    # 0.06 to 0.22 GiB (the 4-layer slice's peak is a KDA layer's forward at these budgets). A 4-layer slice with
    # DSpark holds 58.69 GiB, so the KV pool is 6 to 10 GiB and 0.20 GiB of recurrent state a sequence.
    "ranks-round21-h100": [
        kimi("k4-tp1-b6144-s16-dspark-h100", 4, tokens=6144, seqs=16, role="validation", expected_s=150),
        kimi("k4-tp1-b12288-s16-dspark-h100", 4, tokens=12288, seqs=16, role="validation", expected_s=150),
        kimi("k4-tp1-b3072-s32-dspark-h100", 4, tokens=3072, seqs=32, role="validation", expected_s=150),
    ],
    # Roles fixed 2026-12-06 (thirty-second session), before these run, for an H100 80GB. All four are validation
    # runs. The first two are one shape with and without DSpark, for the plugin's first reading of the profile's
    # allocated and requested peaks (rehearsal/profile_peak.py): does DSpark's KDA-layer peak hold whole allocator
    # blocks beyond what it asked for (DSPARK_KDA_PEAK_HIDDEN_COPIES moves the DSpark run 0.14 GiB)? The last two
    # test the proposed largest safe utilization on the H100: at 256 sequences FlashKDA's buffers (3.64 GiB) are
    # allocated after vLLM sizes the KV cache, and the plan, on the catalogue's measured H100 total, proposes 0.945
    # and predicts a warmup OOM from 0.95 on. The fifth, with no draft, has FlashKDA's prefill buffers outgrow the
    # MoE buffers in warmup (608 MiB at 2,048 tokens; the plan says 1,382 MiB at 96 sequences): vLLM logs the size
    # (VLLM_DEBUG_WORKSPACE), to score the kernel's workspace at a shape no run had. A 4-layer start took 102 to 121 s
    # on a warm H100 host (round 24).
    "ranks-round22-h100": [
        kimi("k4-tp1-b8192-s32-nodraft-h100", 4, tokens=8192, seqs=32, draft=None, role="validation", expected_s=150),
        kimi("k4-tp1-b8192-s32-dspark-h100", 4, tokens=8192, seqs=32, role="validation", expected_s=150),
        kimi("k4-tp1-b8192-s256-dspark-u0945-h100", 4, tokens=8192, seqs=256, util=0.945, role="validation",
             expected_s=150),
        kimi("k4-tp1-b8192-s256-dspark-u095-h100", 4, tokens=8192, seqs=256, util=0.95, role="validation",
             expected_s=150),
        kimi("k4-tp1-b2048-s96-nodraft-h100", 4, tokens=2048, seqs=96, draft=None, role="validation", expected_s=150),
    ],
    # Roles fixed 2026-12-06 (thirty-third session), before these run, for an H100 80GB. All are validation runs of
    # the warmup term that session read from vLLM's code after round 25's miss (planning/warmup.py: kernel warmup's
    # forward takes FlashMLA's decode path after the KV cache exists) and of its band, set on that one miss
    # (bands.WARMUP_MLA_DECODE, in-sample). Each pair is the plan's proposed largest safe utilization, where vLLM must
    # start, and 0.005 above it, where the plan says "at risk" (its point estimate fits up to 0.93 and 0.955). The
    # first pair is round 25's shape; the second has no draft and 64-token decodes (128 sequences), a shape the band
    # never saw; the fifth, DSpark at 6,144 tokens, is a third shape at its proposal. rehearse's plugin logs what
    # each warmup forward held (rehearsal/warmup_peak.py), so the term is scored on every run that reaches warmup.
    "ranks-round23-h100": [
        kimi("k4-tp1-b8192-s256-dspark-u0915-h100", 4, tokens=8192, seqs=256, util=0.915, role="validation",
             expected_s=150),
        kimi("k4-tp1-b8192-s256-dspark-u092-h100", 4, tokens=8192, seqs=256, util=0.92, role="validation",
             expected_s=150),
        kimi("k4-tp1-b8192-s128-nodraft-u0945-h100", 4, tokens=8192, seqs=128, util=0.945, draft=None,
             role="validation", expected_s=150),
        kimi("k4-tp1-b8192-s128-nodraft-u095-h100", 4, tokens=8192, seqs=128, util=0.95, draft=None,
             role="validation", expected_s=150),
        kimi("k4-tp1-b6144-s256-dspark-u0925-h100", 4, tokens=6144, seqs=256, util=0.925, role="validation",
             expected_s=150),
        # Added after the first four ran (both DSpark runs failed in warmup): round 25's shape low enough to start,
        # so the plugin logs the whole warmup peak. A fit run: it sets the warmup term's band.
        kimi("k4-tp1-b8192-s256-dspark-u088-h100", 4, tokens=8192, seqs=256, util=0.88, role="fit", expected_s=150),
    ],
    # Roles fixed 2026-12-06 (thirty-third session), before these run, for an H100 80GB. All validation runs of the
    # warmup term as refitted on ranks-round23-h100 (round 26): what warmup began with beyond the profile
    # (warmup.PERSISTENT_AFTER_PROFILE, fitted at 256 sequences with DSpark and 128 with none) and the allocator's
    # reserve (half of the largest request). Each shape's proposed utilization, where vLLM must start, then 0.005
    # above it, where the plan says vLLM runs out of memory in warmup: round 26's DSpark shape, and two shapes it
    # never saw (DSpark at 128 sequences, no draft at 256), which score the fitted constants' form.
    "ranks-round24-h100": [
        kimi("k4-tp1-b8192-s256-dspark-u0905-h100", 4, tokens=8192, seqs=256, util=0.905, role="validation",
             expected_s=150),
        kimi("k4-tp1-b8192-s128-dspark-u0945-h100", 4, tokens=8192, seqs=128, util=0.945, role="validation",
             expected_s=150),
        kimi("k4-tp1-b8192-s256-nodraft-u095-h100", 4, tokens=8192, seqs=256, util=0.95, draft=None,
             role="validation", expected_s=150),
        kimi("k4-tp1-b8192-s128-dspark-u095-h100", 4, tokens=8192, seqs=128, util=0.95, role="validation",
             expected_s=150),
        kimi("k4-tp1-b8192-s256-nodraft-u0955-h100", 4, tokens=8192, seqs=256, util=0.955, draft=None,
             role="validation", expected_s=150),
        kimi("k4-tp1-b8192-s256-dspark-u091-h100", 4, tokens=8192, seqs=256, util=0.91, role="validation",
             expected_s=150),
    ],
    # Roles fixed 2026-12-06 (thirty-fourth session), before these run, for an H200. All validation runs of the warmup
    # term (planning/warmup.py; PERSISTENT_AFTER_PROFILE and ALLOCATOR_RESERVE_FRACTION fitted on an H100's 4-layer
    # slices) where no run has been: an H200, 6 layers, 16,384 batched tokens (a warmup forward of 10.68 GiB, twice
    # any run's), 3 speculative tokens, and a TP8 rank of stage 1 at 512 sequences (12 MLA heads, 44 layers; FlashKDA's
    # buffers and the warmup decode set the plan's 4.26 GiB after the KV cache). Each is the plan's proposed largest
    # safe utilization, where vLLM must start, or 0.005 above it, where the plan says vLLM runs out of memory in
    # warmup. Utilizations are the proposals of the plan shipped with this set (the warmup forward without DSpark's
    # held profile copies, same session), before any of them ran.
    "ranks-round25": [
        kimi("k6-tp1-b16384-s256-dspark-u094", 6, tokens=16384, seqs=256, util=0.94, role="validation",
             expected_s=200),
        kimi("k6-tp1-b8192-s256-dspark3-u0965", 6, tokens=8192, seqs=256, util=0.965, draft=DSPARK_3,
             role="validation", expected_s=170),
        rank("r44-s1-dspark-b8192-s512-u0965", 1, role="validation", tokens=8192, seqs=512, util=0.965, expected_s=330),
        kimi("k6-tp1-b16384-s256-dspark-u0945", 6, tokens=16384, seqs=256, util=0.945, role="validation",
             expected_s=170),
        rank("r44-s1-dspark-b8192-s512-u097", 1, role="validation", tokens=8192, seqs=512, util=0.97, expected_s=300),
    ],
    # Roles fixed 2026-12-06 (thirty-fourth session), before these run, for an H100 80GB when no H200 came: validation
    # runs of the warmup term as shipped with ranks-round25 (the forward without DSpark's held profile copies, the
    # allocator reserve's band), at shapes no H100 run had: 3 speculative tokens (DSpark's warmup batch splits at
    # tokens // 3), and 12,288 tokens over 192 requests (64-token decodes, a warmup forward of 8.01 GiB). Each at the
    # plan's proposed largest safe utilization, where vLLM must start.
    "ranks-round26-h100": [
        kimi("k4-tp1-b12288-s192-dspark3-u0925-h100", 4, tokens=12288, seqs=192, util=0.925, draft=DSPARK_3,
             role="validation", expected_s=150),
        kimi("k4-tp1-b8192-s256-dspark3-u093-h100", 4, tokens=8192, seqs=256, util=0.93, draft=DSPARK_3,
             role="validation", expected_s=150),
    ],
    # Roles fixed 2026-12-06 (thirty-fifth session), before these run, for an H100 80GB: validation runs of the warmup
    # term and the allocator reserve's band at shapes no run has had: no draft at 16,384 batched tokens (a warmup
    # forward of 10.04 GiB, FlashKDA's prefill buffers at their largest) and no draft at 384 sequences. Each at the
    # plan's proposed largest safe utilization, where vLLM must start, and the 16,384-token shape at 0.905, the first
    # utilization the plan calls "does not fit" (0.92 GiB short in warmup, beyond the band).
    "ranks-round27-h100": [
        kimi("k4-tp1-b16384-s128-nodraft-u089-h100", 4, tokens=16384, seqs=128, util=0.89, draft=None,
             role="validation", expected_s=150),
        kimi("k4-tp1-b16384-s128-nodraft-u0905-h100", 4, tokens=16384, seqs=128, util=0.905, draft=None,
             role="validation", expected_s=150),
        kimi("k4-tp1-b6144-s384-nodraft-u096-h100", 4, tokens=6144, seqs=384, util=0.96, draft=None,
             role="validation", expected_s=150),
    ],
    # Roles fixed 2026-12-06 (thirty-fifth session), before these run, for an H100 80GB: validation runs of the
    # capture term (planning/capture.py: KDA's gathered states at the largest PIECEWISE graph, and the allocator's
    # reserve for them, chosen on round 30's failed capture and round 27's passing one). Round 30's shape (no draft,
    # 384 sequences) at the proposal of the plan with the term, where vLLM must start, then at 0.93, which the plan
    # calls "at risk" (1.59 GiB short, within the reserve's band).
    "ranks-round28-h100": [
        kimi("k4-tp1-b6144-s384-nodraft-u0905-h100", 4, tokens=6144, seqs=384, util=0.905, draft=None,
             role="validation", expected_s=150),
        kimi("k4-tp1-b6144-s384-nodraft-u093-h100", 4, tokens=6144, seqs=384, util=0.93, draft=None,
             role="validation", expected_s=120),
    ],
    # Roles fixed 2026-12-06 (thirty-sixth session), before these run, for an H100 80GB: validation runs of the
    # proposed largest safe utilization at shapes no run has had, each at the proposal of the plan shipped with this
    # set: no draft at 512 and 1,024 sequences (the 1,024-sequence shape's proposal is set by warmup, 0.825), no draft
    # at 12,288 tokens over 256 sequences, and the MLA EAGLE3 draft at 8,192 / 128, which the plan lets start at 0.99.
    "ranks-round29-h100": [
        kimi("k4-tp1-b4096-s512-nodraft-u090-h100", 4, tokens=4096, seqs=512, util=0.90, draft=None,
             role="validation", expected_s=150),
        kimi("k4-tp1-b8192-s128-eagle3mla-u099-h100", 4, tokens=8192, seqs=128, util=0.99, draft=EAGLE3_MLA,
             role="validation", expected_s=150),
        kimi("k4-tp1-b2048-s1024-nodraft-u0825-h100", 4, tokens=2048, seqs=1024, util=0.825, draft=None,
             role="validation", expected_s=150),
        kimi("k4-tp1-b12288-s256-nodraft-u092-h100", 4, tokens=12288, seqs=256, util=0.92, draft=None,
             role="validation", expected_s=150),
    ],
    # Roles fixed 2026-12-06 (thirty-seventh session), before these run, for an H100 80GB: validation runs of round 33's
    # warmup prefill term and of the MLA EAGLE3 drafter's warmup step (planning/memory.py _eagle3_mla_warmup_step, its
    # reserve and what warmup began with read on round 33's one run), at round 33's shapes. Each at the proposal of the
    # plan shipped with this set (no draft at 4,096 / 512: 0.86, proposed from round 33's 0.90; the MLA EAGLE3 at
    # 8,192 / 128: 0.975), then 0.005 or 0.01 above it, where the plan says vLLM runs out of memory in warmup (0.22
    # and 0.14 GiB short: the EAGLE3 shape only through the prefill term added beside the drafter's step).
    "ranks-round30-h100": [
        kimi("k4-tp1-b4096-s512-nodraft-u086-h100", 4, tokens=4096, seqs=512, util=0.86, draft=None,
             role="validation", expected_s=150),
        kimi("k4-tp1-b8192-s128-eagle3mla-u0975-h100", 4, tokens=8192, seqs=128, util=0.975, draft=EAGLE3_MLA,
             role="validation", expected_s=150),
        kimi("k4-tp1-b8192-s128-eagle3mla-u098-h100", 4, tokens=8192, seqs=128, util=0.98, draft=EAGLE3_MLA,
             role="validation", expected_s=150),
        kimi("k4-tp1-b4096-s512-nodraft-u087-h100", 4, tokens=4096, seqs=512, util=0.87, draft=None,
             role="validation", expected_s=150),
    ],
    # Roles fixed 2026-12-06 (thirty-seventh session), before these run, for an H100 80GB: validation runs of the MLA
    # EAGLE3 drafter's warmup step and its reserve (read at 8,192 / 128 only, rounds 33 and 36) at other token budgets,
    # each at the proposal of the plan shipped with this set: 16,384 tokens over 128 requests (128-token decodes, a
    # 3.02 GiB accumulator; the drafter's step sets the proposal, 0.915) and 4,096 over 128 (the prefill term sets it,
    # 0.97).
    "ranks-round31-h100": [
        kimi("k4-tp1-b16384-s128-eagle3mla-u0915-h100", 4, tokens=16384, seqs=128, util=0.915, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
        kimi("k4-tp1-b4096-s128-eagle3mla-u097-h100", 4, tokens=4096, seqs=128, util=0.97, draft=EAGLE3_MLA,
             role="validation", expected_s=150),
    ],
    # Roles fixed 2026-12-06 (thirty-eighth session), before these run, for an H100 80GB: just above the MLA EAGLE3
    # drafter's boundary at 16,384 tokens (0.92, 0.08 GiB short in the drafter's step, where round 31 tries the
    # proposal, 0.915), and two shapes no run has had, each at the proposal of the plan shipped with this set: DSpark
    # with 3 speculative tokens at 2,048 tokens over 256 requests (0.945) and no draft at 12,288 over 64 (0.985).
    "ranks-round32-h100": [
        kimi("k4-tp1-b16384-s128-eagle3mla-u092-h100", 4, tokens=16384, seqs=128, util=0.92, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
        kimi("k4-tp1-b2048-s256-dspark3-u0945-h100", 4, tokens=2048, seqs=256, util=0.945, draft=DSPARK_3,
             role="validation", expected_s=150),
        kimi("k4-tp1-b12288-s64-nodraft-u0985-h100", 4, tokens=12288, seqs=64, util=0.985, draft=None,
             role="validation", expected_s=150),
    ],
    # Roles fixed 2026-12-06 (thirty-eighth session), before these run, for an H100 80GB, after rounds 39 and 40 set
    # the MLA EAGLE3 drafter reserve's band (1.15 to 1.5 of its request) and the MLA prefill path's reserve (1.0): no
    # draft at 12,288 tokens over 64 requests at the new proposal (0.98), and the MLA EAGLE3 at 16,384 over 128 at
    # 0.90, where the drafter's step leaves 1.55 times its request (the plan "at risk" there by the pool's bands alone;
    # it proposes no utilization for this shape on an H100).
    "ranks-round33-h100": [
        kimi("k4-tp1-b12288-s64-nodraft-u098-h100", 4, tokens=12288, seqs=64, util=0.98, draft=None,
             role="validation", expected_s=150),
        kimi("k4-tp1-b16384-s128-eagle3mla-u090-h100", 4, tokens=16384, seqs=128, util=0.90, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
    ],
    # Defined in the thirty-ninth session, before it ran and before the DSpark step's logits were taken from vLLM's
    # code (DSparkSpeculator._sample_sequential's 3 x requests x vocab beside base_logits): 3 speculative tokens at
    # 512 requests, where that step sets the profile's peak and the two forms differ by about 0.12 GiB. Its KV pool
    # scores the change out of sample; 0.90 is the plan's proposal before it.
    "ranks-round34-h100": [
        kimi("k4-tp1-b4096-s512-dspark3-u090-h100", 4, tokens=4096, seqs=512, util=0.90, draft=DSPARK_3,
             role="validation", expected_s=150),
    ],
    # Round 30's failed shape and utilization again with PyTorch's expandable segments (thirty-ninth session, before
    # it ran): its capture ran out of memory with 2.27 GiB cached in segments still in use and 2.16 GiB free for a
    # 2.25 GiB request. Whether the setting lets it start, and what it does to the profile and warmup, says whether
    # the plan's allocator reserves should depend on it; the plan does not read the setting today.
    "ranks-round35-h100": [
        kimi("k4-tp1-b6144-s384-nodraft-u096-expseg-h100", 4, tokens=6144, seqs=384, util=0.96, draft=None,
             role="validation", expected_s=150, extra=EXPANDABLE_SEGMENTS),
    ],
    # Kernel warmup's prefill step weighed at its own moment (planning/memory.py _warmup_prefill_moments, thirty-ninth
    # session, chosen on round 41) raised proposals above any run: these are the new proposals, fixed before they
    # run. DSpark with 3 speculative tokens at round 40's shape (0.945 then) and the MLA EAGLE3 at round 39's (0.97).
    "ranks-round36-h100": [
        kimi("k4-tp1-b2048-s256-dspark3-u0955-h100", 4, tokens=2048, seqs=256, util=0.955, draft=DSPARK_3,
             role="validation", expected_s=150),
        kimi("k4-tp1-b4096-s128-eagle3mla-u098-h100", 4, tokens=4096, seqs=128, util=0.98, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
    ],
    # The same change on an H200: round 41's shape, which started at 0.965 where the plan said "does not fit", at the
    # new proposal, 0.97 (fixed in the thirty-ninth session, before it ran).
    "ranks-round26": [
        kimi("k6-tp1-b8192-s256-dspark3-u097", 6, tokens=8192, seqs=256, util=0.97, draft=DSPARK_3,
             role="validation", expected_s=170),
    ],
    # What vLLM holds after sizing the KV cache weighed inside each warmup moment's room (planning/memory.py
    # _warmup_outside, fortieth session, chosen on round 42's 0.97): the new proposals on an H100, fixed before they
    # run (the MLA EAGLE3 at 4,096 over 128, 0.98 -> 0.99; 3 speculative tokens at 4,096 over 512, 0.915 -> 0.925),
    # and on an H200 stage 1's rank slice just above its proposal, where the plan now says 0.12 GiB short: vLLM fails
    # as predicted, or the plan was conservative by what it says.
    "ranks-round37-h100": [
        kimi("k4-tp1-b4096-s128-eagle3mla-u099-h100", 4, tokens=4096, seqs=128, util=0.99, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
        kimi("k4-tp1-b4096-s512-dspark3-u0925-h100", 4, tokens=4096, seqs=512, util=0.925, draft=DSPARK_3,
             role="validation", expected_s=150),
    ],
    "ranks-round27": [
        rank("r44-s1-dspark-b8192-s512-u0975", 1, role="validation", tokens=8192, seqs=512, util=0.975, expected_s=300),
    ],
    # The capture stand-in's band (planning/capture.py CAPTURE_AFTER_GROWTH_ERROR, fortieth session): the proposals
    # of rounds 44 and 46's shapes with it kept clear (0.905 at 4,096 / 512, 0.95 at 2,048 / 256), and two shapes no
    # run has had, each at its proposal: the MLA EAGLE3 at 8,192 over 256 requests (0.975) and 3 speculative tokens at
    # 16,384 over 64 (0.985). Fixed 2026-12-07 (forty-first session), before they run, for an H100 80GB.
    "ranks-round38-h100": [
        kimi("k4-tp1-b4096-s512-dspark3-u0905-h100", 4, tokens=4096, seqs=512, util=0.905, draft=DSPARK_3,
             role="validation", expected_s=150),
        kimi("k4-tp1-b2048-s256-dspark3-u095-h100", 4, tokens=2048, seqs=256, util=0.95, draft=DSPARK_3,
             role="validation", expected_s=150),
        kimi("k4-tp1-b8192-s256-eagle3mla-u0975-h100", 4, tokens=8192, seqs=256, util=0.975, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
        kimi("k4-tp1-b16384-s64-dspark3-u0985-h100", 4, tokens=16384, seqs=64, util=0.985, draft=DSPARK_3,
             role="validation", expected_s=170),
    ],
    # Today's proposal where recorded runs bracket it (docs/memory-accuracy.md "Today's proposal"), fixed 2026-12-07
    # (forty-first session) before they run: on an H100, 6,144 tokens over 256 with DSpark (0.915; round 25 failed at
    # 0.925); on an H200, 6 layers at 8,192 over 768 with DSpark (0.89; started at 0.88, failed at 0.905) and 8 layers
    # with no draft at 8,192 over 512 (0.93; started at 0.92).
    "ranks-round39-h100": [
        kimi("k4-tp1-b6144-s256-dspark-u0915-h100", 4, tokens=6144, seqs=256, util=0.915, role="validation",
             expected_s=150),
    ],
    # The proposals the capture stand-in's wider band (0.875 GiB, round 47) set, fixed 2026-12-07 (forty-first
    # session) before they run, for an H100 80GB: the MLA EAGLE3 at 8,192 over 256 (0.97; 0.975 started in round 48)
    # and 3 speculative tokens at three token budgets and request counts no run has had (3,072 / 384 at 0.925,
    # 2,048 / 128 at 0.965, 4,096 / 256 at 0.935): shapes the candidate for the capture's own moment
    # (docs/capture-moment.md) was not fitted on.
    "ranks-round40-h100": [
        kimi("k4-tp1-b8192-s256-eagle3mla-u097-h100", 4, tokens=8192, seqs=256, util=0.97, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
        kimi("k4-tp1-b3072-s384-dspark3-u0925-h100", 4, tokens=3072, seqs=384, util=0.925, draft=DSPARK_3,
             role="validation", expected_s=150),
        kimi("k4-tp1-b2048-s128-dspark3-u0965-h100", 4, tokens=2048, seqs=128, util=0.965, draft=DSPARK_3,
             role="validation", expected_s=150),
        kimi("k4-tp1-b4096-s256-dspark3-u0935-h100", 4, tokens=4096, seqs=256, util=0.935, draft=DSPARK_3,
             role="validation", expected_s=150),
    ],
    # Fit runs for the MLA EAGLE3 drafter's own CUDA graphs (fixed 2026-12-07, forty-second session, before they run,
    # for an H100 80GB): the plan charges each drafter graph the target's per-graph cost, never fitted on an EAGLE3
    # run, and its estimate is 0.11 GiB over vLLM's at 128 requests (119 drafter graphs) and 0.16 GiB at 256. Two
    # request counts far apart, 32 and 512, give the drafter's decode graphs a wide range; 4,096 and 8,192 tokens.
    "ranks-round41-h100": [
        kimi("k4-tp1-b4096-s32-eagle3mla-u095-h100", 4, tokens=4096, seqs=32, util=0.95, draft=EAGLE3_MLA,
             role="fit", expected_s=170),
        kimi("k4-tp1-b8192-s512-eagle3mla-u092-h100", 4, tokens=8192, seqs=512, util=0.92, draft=EAGLE3_MLA,
             role="fit", expected_s=170),
    ],
    # Just above the proposals rounds 52, 53 and 55 started at (fixed 2026-12-07, forty-second session, before they
    # run, for an H100 80GB), where the plan says "at risk" (the capture stand-in's band): 2,048 / 128 at 0.97, where
    # the capture's room replayed from round 53 (docs/capture-moment.md section 6) is 0.39 GiB under what round 53
    # needed; 3,072 / 384 at 0.935, inside the bracket of the capture's own need; 4,096 / 256 at 0.945, 0.68 GiB clear
    # of it. vLLM fails as predicted, or the report says by how much the plan was conservative.
    "ranks-round42-h100": [
        kimi("k4-tp1-b2048-s128-dspark3-u097-h100", 4, tokens=2048, seqs=128, util=0.97, draft=DSPARK_3,
             role="validation", expected_s=150),
        kimi("k4-tp1-b3072-s384-dspark3-u0935-h100", 4, tokens=3072, seqs=384, util=0.935, draft=DSPARK_3,
             role="validation", expected_s=150),
        kimi("k4-tp1-b4096-s256-dspark3-u0945-h100", 4, tokens=4096, seqs=256, util=0.945, draft=DSPARK_3,
             role="validation", expected_s=150),
    ],
    # PyTorch's expandable segments at shapes the capture's reserve under them was not chosen on (fixed 2026-12-07,
    # forty-third session, before they run, for an H100 80GB; the reserve was chosen on round 59 alone). No draft, so
    # the largest capture gathers a state a request: the plan's proposals under the setting, 4,096 / 448 at 0.945
    # (0.885 without it) and 8,192 / 320 at 0.975 (0.93 without); and round 59's shape 0.01 above it, where the plan
    # says "does not fit" (0.70 GiB short of warmup's room, 0.20 beyond the band). vLLM starts at the proposals and
    # fails at 0.97, or the report says by how much the plan was conservative.
    "ranks-round43-h100": [
        kimi("k4-tp1-b4096-s448-nodraft-u0945-expseg-h100", 4, tokens=4096, seqs=448, util=0.945, draft=None,
             role="validation", expected_s=150, extra=EXPANDABLE_SEGMENTS),
        kimi("k4-tp1-b8192-s320-nodraft-u0975-expseg-h100", 4, tokens=8192, seqs=320, util=0.975, draft=None,
             role="validation", expected_s=150, extra=EXPANDABLE_SEGMENTS),
        kimi("k4-tp1-b6144-s384-nodraft-u097-expseg-h100", 4, tokens=6144, seqs=384, util=0.97, draft=None,
             role="validation", expected_s=150, extra=EXPANDABLE_SEGMENTS),
    ],
    # Today's proposals at shapes no run has had (fixed 2026-12-07, forty-fourth session, before they run, for an H100
    # 80GB; each value the plan's proposal on round 58's host): the MLA EAGLE3 at 64, 192 and 512 requests (2,048 /
    # 64 at 0.99, 12,288 / 192 at 0.94, 4,096 / 512 at 0.945), whose drafter graphs the plan charges at the target's
    # per-graph cost; DSpark at 3,072 / 160 (0.955); no draft at 12,288 / 96 (0.915). vLLM starts at each, or the
    # proposal failed where it was tried; the EAGLE3 runs also score, out of sample, a drafter-graph term fitted on
    # ranks-round41-h100's two fit runs.
    "ranks-round44-h100": [
        kimi("k4-tp1-b2048-s64-eagle3mla-u099-h100", 4, tokens=2048, seqs=64, util=0.99, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
        kimi("k4-tp1-b12288-s192-eagle3mla-u094-h100", 4, tokens=12288, seqs=192, util=0.94, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
        kimi("k4-tp1-b4096-s512-eagle3mla-u0945-h100", 4, tokens=4096, seqs=512, util=0.945, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
        kimi("k4-tp1-b3072-s160-dspark-u0955-h100", 4, tokens=3072, seqs=160, util=0.955, role="validation",
             expected_s=150),
        kimi("k4-tp1-b12288-s96-nodraft-u0915-h100", 4, tokens=12288, seqs=96, util=0.915, draft=None,
             role="validation", expected_s=150),
    ],
    # A fit run for the MLA EAGLE3 drafter's warmup reserve (planning/warmup.py DRAFT_STEP_RESERVE_FRACTION, 1.15 to
    # 1.5 of its FlashMLA accumulator), read while the plan's pool was 0.11 GiB under vLLM's; with the drafter's
    # graphs as vLLM's code builds them (forty-fourth session) the runs at 8,192 / 128 leave 1.61 (0.975, started),
    # 1.48 (0.98, started) and 1.22 (0.99, out of memory) times it. This one leaves 1.35 (fixed 2026-12-07 before it
    # runs, for an H100 80GB): where it starts, the fits point may come down to it; where it fails, the low end up.
    # Corrected in the forty-fifth session: those ratios took 16,384 tokens' 3.03 GiB request; at 8,192 over 128 the
    # request is 1.51 GiB, and the runs left 1.72, 1.46, 0.94 and, this one, 1.20 times it (rounds 62 and 63).
    "ranks-round45-h100": [
        kimi("k4-tp1-b8192-s128-eagle3mla-u0985-h100", 4, tokens=8192, seqs=128, util=0.985, draft=EAGLE3_MLA,
             role="fit", expected_s=170),
    ],
    # Today's proposals at four shapes no run has had (fixed 2026-12-07, forty-fifth session, before they run, for an
    # H100 80GB; all validation). The MLA EAGLE3 at 96 requests on either side of FlashMLA's decode path: 12,288 tokens
    # give the warmup's dummy run 128 tokens a request, which the drafter's step decodes (proposal 0.935), and 16,384
    # give 170, which it prefills, so its decode accumulator is never asked for (proposal 0.99, the cap). DSpark's 7
    # speculative tokens at 4,096 / 64 (0.975) and 12,288 / 96 (0.925).
    "ranks-round46-h100": [
        kimi("k4-tp1-b16384-s96-eagle3mla-u099-h100", 4, tokens=16384, seqs=96, util=0.99, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
        kimi("k4-tp1-b12288-s96-eagle3mla-u0935-h100", 4, tokens=12288, seqs=96, util=0.935, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
        kimi("k4-tp1-b4096-s64-dspark-u0975-h100", 4, tokens=4096, seqs=64, util=0.975, role="validation",
             expected_s=150),
        kimi("k4-tp1-b12288-s96-dspark-u0925-h100", 4, tokens=12288, seqs=96, util=0.925, role="validation",
             expected_s=150),
    ],
    # The proposals that rose above where vLLM started when the drafter's warmup reserve came down on round 63 (1.5 ->
    # 1.19), each at today's proposal on round 64's host: the MLA EAGLE3 at 12,288 tokens over 192 (0.945; started at
    # 0.94) and over 96 (0.94; 0.935), and at 16,384 over 128 (0.91; started at 0.90, out of memory at 0.915). Fixed
    # 2026-12-07 (forty-fifth session), before they run, for an H100 80GB; all validation.
    "ranks-round47-h100": [
        kimi("k4-tp1-b16384-s128-eagle3mla-u091-h100", 4, tokens=16384, seqs=128, util=0.91, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
        kimi("k4-tp1-b12288-s192-eagle3mla-u0945-h100", 4, tokens=12288, seqs=192, util=0.945, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
        kimi("k4-tp1-b12288-s96-eagle3mla-u094-h100", 4, tokens=12288, seqs=96, util=0.94, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
    ],
    # Shapes no run has had, each at today's proposal on round 64's host (f0fd823), and one the plan refuses: DSpark
    # at 16,384 tokens over 32 requests (0.985), the MLA EAGLE3 at 2,048 over 256 (0.98), no draft at 16,384 over 256
    # (0.895), and DSpark with 3 draft tokens at 8,192 over 512 at 0.90, where the plan says vLLM runs out of memory
    # by 1.53 GiB in warmup and no utilization fits. Fixed 2026-12-07 (forty-sixth session), before they run, for an
    # H100 80GB; all validation.
    "ranks-round48-h100": [
        kimi("k4-tp1-b16384-s32-dspark-u0985-h100", 4, tokens=16384, seqs=32, util=0.985, role="validation",
             expected_s=150),
        kimi("k4-tp1-b2048-s256-eagle3mla-u098-h100", 4, tokens=2048, seqs=256, util=0.98, draft=EAGLE3_MLA,
             role="validation", expected_s=170),
        kimi("k4-tp1-b16384-s256-nodraft-u0895-h100", 4, tokens=16384, seqs=256, util=0.895, draft=None,
             role="validation", expected_s=150),
        kimi("k4-tp1-b8192-s512-dspark3-u090-h100", 4, tokens=8192, seqs=512, util=0.90, draft=DSPARK_3,
             role="validation", expected_s=150),
    ],
    # The capture's own moment with DSpark (planning/capture.py CAPTURE_ROOM_DSPARK, forty-seventh session), scored
    # out of sample, each on round 67's host (its shapes no run had, or its proposal between a start and a failure):
    # 6,144 tokens over 384 at its proposal (0.93; the stand-in proposed 0.905), 2,048 over 192 at 0.96, where the plan
    # says vLLM runs out of memory capturing DSpark's first graph, 0.09 GiB beyond the room's band (the stand-in
    # proposed 0.965), 4,096 over 512 at its proposal (0.915; started at 0.905, out of memory at 0.925) and 8,192 over
    # 512 at its proposal (0.905; started at 0.90). Fixed 2026-12-07 (forty-seventh session), before they run, for an
    # H100 80GB; all validation.
    "ranks-round49-h100": [
        kimi("k4-tp1-b6144-s384-dspark3-u093-h100", 4, tokens=6144, seqs=384, util=0.93, draft=DSPARK_3,
             role="validation", expected_s=150),
        kimi("k4-tp1-b2048-s192-dspark3-u096-h100", 4, tokens=2048, seqs=192, util=0.96, draft=DSPARK_3,
             role="validation", expected_s=150),
        kimi("k4-tp1-b4096-s512-dspark3-u0915-h100", 4, tokens=4096, seqs=512, util=0.915, draft=DSPARK_3,
             role="validation", expected_s=150),
        kimi("k4-tp1-b8192-s512-dspark3-u0905-h100", 4, tokens=8192, seqs=512, util=0.905, draft=DSPARK_3,
             role="validation", expected_s=150),
    ],
    # The proposals that rose above where vLLM last started when the capture's room replaced the stand-in (forty-
    # seventh session), each at today's proposal on round 67's host: 3,072 tokens over 384 at 0.93 (started at 0.925,
    # out of memory capturing at 0.935), 4,096 over 256 at 0.95 (started at 0.945) and 8,192 over 256 at 0.945
    # (started at 0.93; the autotune's moment sets it). Fixed 2026-12-07, before they run, for an H100 80GB; all
    # validation.
    "ranks-round50-h100": [
        kimi("k4-tp1-b3072-s384-dspark3-u093-h100", 4, tokens=3072, seqs=384, util=0.93, draft=DSPARK_3,
             role="validation", expected_s=150),
        kimi("k4-tp1-b4096-s256-dspark3-u095-h100", 4, tokens=4096, seqs=256, util=0.95, draft=DSPARK_3,
             role="validation", expected_s=150),
        kimi("k4-tp1-b8192-s256-dspark3-u0945-h100", 4, tokens=8192, seqs=256, util=0.945, draft=DSPARK_3,
             role="validation", expected_s=150),
    ],
    "ranks-round28": [
        kimi("k6-tp1-b8192-s768-dspark-u089", 6, tokens=8192, seqs=768, util=0.89, role="validation", expected_s=150),
        kimi("k8-tp1-b8192-s512-nodraft-u093", 8, tokens=8192, seqs=512, util=0.93, draft=None, role="validation",
             expected_s=150),
    ],
    # Eight GPUs of one host: Kimi-K3's own TP degree, where each rank holds 12 of 96 KDA heads, the whole MLA cache
    # and an eighth of every expert, and the 2-node shape (TP x PP) at half scale on one node.
    "tp8": [
        kimi("k4-tp8-serve-defaults-dspark", 4, tp=8, expected_s=300),
        kimi("k4-tp4-pp2-serve-defaults-dspark", 4, tp=4, pp=2, expected_s=300),
        kimi("k8-tp8-b8192-s1024-u092-eagle3-mla", 8, tp=8, tokens=8192, seqs=1024, draft=EAGLE3_MLA, expected_s=300),
    ],
    # Each stage of deploy/config.yaml as it runs, on one node of 8 GPUs (issue 27; roles fixed 2026-12-02, before
    # they run): what the rank slices cannot show (NCCL, NVLS, all-reduce buffers and graphs at TP8) is measured
    # here. NVLS off is how the lent hosts run; on is NCCL's default and what the plan assumes for a real cluster.
    "stages-tp8": [
        stage("s0-tp8-nvls-off", 0, role="validation", nvls=False),
        stage("s1-tp8-nvls-off", 1, role="validation", nvls=False),
        stage("s0-tp8-nvls-on", 0, role="validation", nvls=True),
        stage("s1-tp8-nvls-on", 1, role="validation", nvls=True),
    ],
}


AT_THE_SLICES_OWN_EDGE = frozenset({"r44-s1-dspark-b8192-s512-u0965", "r44-s1-dspark-b8192-s512-u097",
                                    "r44-s1-dspark-b8192-s512-u0975"})
"""Rank jobs at the rank slice's own proposal or just above it: they score the slice's warmup terms, so the real
layout, whose NCCL and all-reduce buffers take room the slice has, does not fit there."""


REFUSED_SINCE_THEY_RAN = {"r44-s1-dspark-fp8kv": "engine.kv_cache_dtype"}
"""Jobs that vLLM refused at load on the H200 and that the plan refuses since (the field it names): kept for their
record; their dry run now stops at the plan. fp8 KV for Kimi-K3 needs compute capability 10.x (2026-12-01, round 3)."""


def pack(work: Path, out: Path, name: str) -> None:
    """Every job folder's log, result and stdout into one archive (what comes back from the host)."""
    target = out / f"{name}.tar.gz"
    tmp = target.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for job_dir in sorted(p for p in work.iterdir() if p.is_dir()):
            for f in ("vllm.log", "result.json", "stdout.json", "stderr.txt", "spec.json", "job.json"):
                if (job_dir / f).is_file():
                    tar.add(job_dir / f, arcname=f"{job_dir.name}/{f}")
    tmp.replace(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=sorted(SETS), required=True)
    parser.add_argument("--deadline", type=float, required=True, help="seconds from now when everything must be done")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all NVML sees)")
    parser.add_argument("--only", nargs="*", default=None, help="job names to run (default: the whole set)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    end = start + args.deadline
    if args.gpus is None:
        import pynvml

        pynvml.nvmlInit()
        args.gpus = pynvml.nvmlDeviceGetCount()
    jobs = [j for j in SETS[args.set] if j.gpus <= args.gpus and (args.only is None or j.name in args.only)]
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    free = list(range(args.gpus))
    running: dict[str, tuple[subprocess.Popen, list[int], float, Path]] = {}
    first_done = False
    summary = []
    while jobs or running:
        now = time.monotonic()
        for name, (proc, gpus, t0, job_dir) in list(running.items()):
            timed_out = now > end - 5
            if proc.poll() is None and not timed_out:
                continue
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            code = proc.returncode
            record = json.loads((job_dir / "job.json").read_text())  # keeps the command and the GPUs
            record.update(exit_code=code, seconds=round(now - t0, 1), stopped_at_deadline=timed_out)
            (job_dir / "job.json").write_text(json.dumps(record))
            summary.append(f"{name}: exit {code} after {now - t0:.0f} s{' (stopped at the deadline)' if timed_out else ''}")
            print(summary[-1], flush=True)
            free.extend(gpus)
            del running[name]
            first_done = True
            pack(args.work, args.out, f"rehearse-{args.set}")
        if not first_done and running:
            time.sleep(2)
            continue
        for job in list(jobs):
            if len(free) < job.gpus:
                continue
            if time.monotonic() + job.expected_s > end:
                jobs.remove(job)
                summary.append(f"{job.name}: not started (expected {job.expected_s:.0f} s, {end - time.monotonic():.0f} s left)")
                print(summary[-1], flush=True)
                continue
            gpus = [free.pop(0) for _ in range(job.gpus)]
            job_dir = args.work / job.name
            job_dir.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
            cmd = [sys.executable, "-m", "kimi_k3_serve.cli", "rehearse", *job.args, "--json", "--work-dir", str(job_dir),
                   "--timeout", str(int(max(30, end - time.monotonic() - 10)))]
            (job_dir / "job.json").write_text(json.dumps({"name": job.name, "command": cmd, "gpus": gpus, "role": job.role}))
            with open(job_dir / "stdout.json", "w") as out, open(job_dir / "stderr.txt", "w") as err:
                proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT, start_new_session=True)
            running[job.name] = (proc, gpus, time.monotonic(), job_dir)
            jobs.remove(job)
            print(f"{job.name}: started on GPU {gpus} at {time.monotonic() - start:.0f} s", flush=True)
            if not first_done:
                break
        if not running and jobs and not free:
            break
        time.sleep(2)
    pack(args.work, args.out, f"rehearse-{args.set}")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
