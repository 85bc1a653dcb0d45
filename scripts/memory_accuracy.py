"""The memory model against what vLLM measured on the H200 (and on one H100 host): writes docs/memory-accuracy.md.

Every run recorded under tests/fixtures/gpu/<date>/<run>/ (vLLM's log, the rehearsal's result) is predicted again
with today's model, with the run's own settings (scripts/gpu/matrix.py names them) on the GPU the run saw, and
compared with vLLM's numbers:
- weights: the plan's weights + draft against "Model loading took";
- profile: the non-KV memory vLLM's profile charged besides weights (requested - CUDA-graph estimate - KV - weights)
  against the plan's activation + non-torch + profiled workspaces;
- CUDA-graph estimate: the plan's against vLLM's (deducted from the budget);
- KV cache: the plan's pool against "Available KV cache memory";
- verdict: the plan's against how vLLM's start ended.
Each run is marked ``fit`` when its numbers set one of the model's fitted constants, else ``validation``.

    python scripts/memory_accuracy.py [--out docs/memory-accuracy.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

import make_kimi_slice  # noqa: E402
import matrix  # noqa: E402

from kimi_k3_serve import recorded  # noqa: E402
from kimi_k3_serve.units import GiB  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "gpu"
HOST_SLICE_LAYERS = 4
"""The slice scripts/gpu/run_all.sh makes on the host (make_kimi_slice.py --layers 4)."""
FIT_RUNS = {
    "k4-tp1-serve-defaults-dspark": "sampler copies, TP1 non-torch, DSpark's per-graph CUDA-graph cost",
    "k4-tp1-b8192-s1024-nodraft": "Kimi-K3 per-graph CUDA-graph cost (without a draft); FlashKDA's scratch share "
                                  "(its warmup OOM asked for the 14.09 GiB workspace)",
    "k6-tp1-b8192-s768-dspark-u080": "none fitted: the shared workspace's sizes, read from vLLM's workspace log, match "
                                     "planning/workspace.py's shapes to the MiB",
    "k4-tp1-b8192-s256-u080": "sampler copies, TP1 non-torch",
    "k4-tp1-llm-defaults-b16384-s1024": "sampler copies, TP1 non-torch",
    "llama-3.1-8b-tp1": "default per-graph CUDA-graph cost",
    "rehearse-tp2": "TP2 non-torch (NON_TORCH_TP1 at TP2, with serve-one-gpu)",
    "k8-tp1-b8192-s512-nodraft": "sampler copies, TP1 non-torch, Kimi-K3 per-graph CUDA-graph cost (a second full-width "
                                 "run without a draft)",
    "r23-s3-pp4-dspark": "DSpark's per-layer CUDA-graph cost (23 layers)",
    "r31-s2-pp3-dspark": "DSpark's per-layer CUDA-graph cost (31 layers)",
    "r49-s0-b16384-s16": "sampler copies, TP1 non-torch (stage 0's rank at 16,384 tokens)",
    "r31-s1-pp3-b16384": "sampler copies, TP1 non-torch (a 31-layer rank at 16,384 tokens)",
    "k4-tp1-b8192-s16-nodraft": "the profile group (a full-width slice without a draft at 16 sequences: the KDA "
                                "layer's peak with almost nothing held beside it)",
    "r44-s1-dspark-b16384-s16": "the profile group (stage 1's rank with DSpark at 16,384 tokens and 16 sequences: "
                                "DSpark's step apart from the target's forward)",
    "r44-s1-dspark-b8192-s256": "the CUDA-graph group (stage 1's rank with DSpark at 256 sequences: 51 sizes, 48 "
                                "FULL target graphs and 48 of DSpark's own)",
    "k4-tp1-b4096-s128-dspark": "the profile and CUDA-graph groups (a full-width slice with DSpark at 4,096 tokens "
                                "and 128 sequences: the profile at a small token budget)",
    "k6-tp1-b4096-s128-dspark": "the CUDA-graph group (6 layers with DSpark at 4,096 tokens and 128 sequences: the "
                                "cache released at the second sampled FULL graph at 496 tokens)",
    "k8-tp1-b4096-s32-dspark": "the CUDA-graph group (8 layers with DSpark at 4,096 tokens and 32 sequences: the "
                               "released cache at 248 tokens)",
    "k4-tp1-b4096-s32-eagle3mla-u095-h100": "the EAGLE3 drafter's graph group (the MLA EAGLE3 at 32 requests: the "
                                            "largest prefill and decode graphs over 32 requests)",
    "k4-tp1-b8192-s512-eagle3mla-u092-h100": "the EAGLE3 drafter's graph group (the MLA EAGLE3 at 512 requests: the "
                                             "largest prefill graph over 128 requests, decode over 512)",
    "k4-tp1-b8192-s128-eagle3mla-u0985-h100": "the MLA EAGLE3 drafter's warmup reserve (planning/warmup.py "
                                              "DRAFT_STEP_RESERVE_FRACTION: vLLM started with 1.20 times its 1.51 GiB "
                                              "request left, round 63; round 62 was stopped by its --timeout)",
}
"""Runs whose numbers set a fitted constant of kimi_k3_serve.planning.memory, and which constant."""
READ_BEFORE_A_CHANGE = {
    "k4-tp1-b6144-s384-nodraft-u096-expseg-h100": "called \"does not fit\" (capturing its largest CUDA graph), where "
                                                  "vLLM started under PyTorch's expandable segments: the plan did not "
                                                  "read the setting; the capture's reserve under it was chosen on "
                                                  "this run (planning/capture.py, 2026-12-07)",
    "k4-tp1-b2048-s96-nodraft-h100": "KV pool 17.38 / 16.56 GiB (+4.96 %), CUDA-graph estimate 0.44 / 1.27 GiB: FlashKDA "
                                     "grew vLLM's workspace while its CUDA graphs were profiled, before the KV cache, "
                                     "where the plan had it after (planning/memory.py _flashkda_runs_in_graph_profile, "
                                     "chosen on this run, 2026-12-06)",
    "k4-tp1-b8192-s256-dspark-u0945-h100": "called \"fits\" at the utilization the plan proposed (0.945), where vLLM "
                                           "ran out of memory in kernel warmup: the MLA decode path of warmup's "
                                           "forward (planning/warmup.py) was read from vLLM's code after this run "
                                           "(2026-12-06)",
    "k4-tp1-b8192-s256-dspark-u0915-h100": "called \"fits\" at the utilization the plan proposed (0.915, with the "
                                           "warmup term's first form), where vLLM ran out of memory in warmup; what "
                                           "warmup began with and the allocator's reserve were fitted on round 26",
    "k4-tp1-b6144-s256-dspark-u0925-h100": "called \"fits\" at the utilization the plan proposed (0.925), where vLLM "
                                           "ran out of memory in warmup (round 26's refit, as above)",
    "k4-tp1-b8192-s256-dspark-u092-h100": "called \"at risk\" 0.005 above the proposal; vLLM ran out of memory in "
                                          "warmup (round 26's refit)",
    "k4-tp1-b8192-s128-nodraft-u0945-h100": "called \"fits\" at the proposal (0.945) and started; the allocator's "
                                            "reserve was bounded on it (round 26's refit)",
    "k4-tp1-b8192-s128-nodraft-u095-h100": "called \"at risk\" 0.005 above the proposal; vLLM ran out of memory in "
                                           "warmup (round 26's refit bounded the reserve on it)",
    "k4-tp1-b8192-s128-dspark-u095-h100": "called \"does not fit\" 0.005 above the proposal (0.33 GiB short in "
                                          "warmup), where vLLM started: the warmup forward dropped DSpark's held "
                                          "profile copies and the allocator's reserve got its band after this run "
                                          "(2026-12-06)",
    "k4-tp1-b8192-s256-dspark-u091-h100": "called \"does not fit\" 0.005 above the proposal (0.17 GiB short in "
                                          "warmup), where vLLM started (the same changes, 2026-12-06)",
    "k4-tp1-b8192-s256-nodraft-u0955-h100": "called \"does not fit\" 0.005 above the proposal, and vLLM ran out of "
                                            "memory in warmup; the allocator reserve's band was chosen after this run",
    "k4-tp1-b6144-s384-nodraft-u096-h100": "called \"fits\" at the utilization the plan proposed (0.96), where vLLM "
                                           "ran out of memory capturing its largest CUDA graph (KDA's 2.25 GiB of "
                                           "gathered states): the capture term (planning/capture.py) and its "
                                           "reserve's low end were chosen on this run (2026-12-06)",
    "k4-tp1-b8192-s256-nodraft-u095-h100": "called \"fits\" at the proposal (0.95) and started; the capture "
                                           "reserve (planning/capture.py) was set to what its capture passed with "
                                           "(2026-12-06)",
    "k4-tp1-b4096-s512-nodraft-u090-h100": "called \"fits\" at the utilization the plan proposed (0.90), where vLLM "
                                           "ran out of memory in kernel warmup's prefill asking for FlashKDA's 7.04 "
                                           "GiB beside 512 gathered states (3.0 GiB): that term (planning/capture.py "
                                           "warmup_prefill_requests) was read from vLLM's code after this run "
                                           "(2026-12-06)",
    "k4-tp1-b2048-s1024-nodraft-u0825-h100": "called \"fits\" at the utilization the plan proposed (0.825), where "
                                             "vLLM ran out of memory in kernel warmup's prefill asking for FlashKDA's "
                                             "13.47 GiB beside 350 gathered states (the same term, 2026-12-06)",
    "k4-tp1-b8192-s128-eagle3mla-u099-h100": "called \"fits\" at the utilization the plan proposed (0.99), where "
                                             "vLLM ran out of memory in FlashInfer's autotune, in the MLA EAGLE3 "
                                             "drafter's FlashMLA decode accumulators (1.51 GiB): the drafter's "
                                             "warmup step (planning/memory.py _eagle3_mla_warmup_step), its reserve "
                                             "and what warmup began with for it were chosen on this run (2026-12-06)",
    "k4-tp1-b8192-s128-eagle3mla-u098-h100": "called \"does not fit\" 0.005 above the proposal (0.14 GiB short "
                                             "through the warmup prefill term, added beside the drafter's step), "
                                             "where vLLM started: that term's band was chosen on this run; it "
                                             "has been weighed at its own moment since round 41 (2026-12-06)",
    "k4-tp1-b4096-s512-nodraft-u087-h100": "called \"does not fit\" 0.01 above the proposal (0.22 GiB short in "
                                           "warmup's prefill), and vLLM ran out of memory there; the same band was "
                                           "bounded by it, and the prefill step at its own moment was checked "
                                           "against it (2026-12-06)",
    "k4-tp1-b16384-s128-eagle3mla-u0915-h100": "called \"fits\" at the utilization the plan proposed (0.915), where "
                                               "vLLM ran out of memory in FlashInfer's autotune, asking for the MLA "
                                               "EAGLE3 drafter's 3.02 GiB accumulator with 1.16 times it left in the "
                                               "plan's terms: the drafter reserve's band (planning/warmup.py "
                                               "DRAFT_STEP_RESERVE_FRACTION) was measured with it (2026-12-06)",
    "k4-tp1-b12288-s64-nodraft-u0985-h100": "called \"fits\" at the utilization the plan proposed (0.985), where "
                                            "vLLM ran out of memory in FlashInfer's autotune, at the MLA's prefill "
                                            "path (the concatenated key, 0.42 GiB): the prefill path's reserve "
                                            "(planning/warmup.py PREFILL_RESERVE_FRACTION) was read on it "
                                            "(2026-12-06)",
    "k4-tp1-b2048-s256-dspark3-u0945-h100": "KV pool +1.88 % (profile 1.62 / 1.77 GiB): DSpark's Markov sampling in "
                                            "the profile (planning/memory.py dspark_markov_step_bytes) was read from "
                                            "vLLM's code after this run, and DSPARK_PROFILE_LOGITS_COPIES refitted "
                                            "(2026-12-06)",
    "k6-tp1-b8192-s256-dspark3-u0965": "called \"does not fit\" (1.48 GiB short, kernel warmup's prefill step "
                                       "added beside the other after-KV terms), where vLLM started: that step was "
                                       "weighed at its own moment after this run (planning/memory.py "
                                       "_warmup_prefill_moments, 2026-12-06)",
    "r44-s1-dspark-b8192-s512-u097": "called \"does not fit\" (0.57 GiB short: TRITON_MLA's 4.26 GiB reservation "
                                     "added beside warmup's need, clamped at zero), where vLLM started: the after-KV "
                                     "terms were weighed inside each warmup moment's room after this run "
                                     "(planning/memory.py _warmup_outside, 2026-12-06)",
    "k4-tp1-b4096-s512-dspark3-u0925-h100": "called \"fits\" at the utilization the plan proposed (0.925), where "
                                            "vLLM ran out of memory capturing DSpark's graphs after FlashKDA's "
                                            "growth: the growth was weighed beside the autotune's forward after "
                                            "this run (planning/memory.py estimate_memory, 2026-12-07)",
    "k4-tp1-b2048-s256-dspark3-u0955-h100": "called \"fits\" at the utilization the plan proposed (0.955, 0.44 GiB "
                                            "to spare by the capture's stand-in), where vLLM ran out of memory "
                                            "before its first FULL graph: the stand-in's error band was measured on "
                                            "this run (planning/capture.py CAPTURE_AFTER_GROWTH_ERROR, 2026-12-07)",
    "k4-tp1-b2048-s256-dspark3-u095-h100": "called \"fits\" at the utilization the plan proposed (0.95, 0.83 GiB "
                                           "to spare by the capture's stand-in, 0.33 beyond its band), where vLLM ran "
                                           "out of memory capturing DSpark's first graph: the stand-in's error band "
                                           "was widened to it (planning/capture.py CAPTURE_AFTER_GROWTH_ERROR, "
                                           "0.5 -> 0.875 GiB, 2026-12-07)",
    "k4-tp1-b8192-s512-dspark3-u090-h100": "called \"does not fit\" (1.53 GiB short by the capture's stand-in after "
                                           "FlashKDA's growth), where vLLM started: the capture's own moment with "
                                           "DSpark replaced the stand-in after this run (planning/capture.py "
                                           "CAPTURE_ROOM_DSPARK, chosen on rounds 40 and 47, 2026-12-07)",
}
"""Validation runs that a change of the model was chosen on after they were read: their row is today's model, no
longer out of sample; the error a user met before the change is kept here and printed beside the goals."""
SAME_AS = {"k4-tp1-serve-defaults-dspark-first-start": "k4-tp1-serve-defaults-dspark",
           "serve-one-gpu-eagle3-mla-passed": "serve-one-gpu-eagle3-mla"}
"""A repeat of another run's settings (the first engine start of the host, kernels still being built; the MLA EAGLE3
serve test again, 2026-12-01 round 3, where it passed)."""
SERVE_RUNS = {
    # `serve run` of deploy/gpu-rehearsal.yaml at PP1 (tests/test_gpu.py::test_serve_run_on_one_gpu). Its vllm.log is
    # the replica's and the Ray worker's logs together. max_num_batched_tokens is what the replica's engine chose.
    "serve-one-gpu": matrix.kimi("serve-one-gpu", 4, tokens=8192, seqs=64, util=0.85),
    # The same app with the MLA EAGLE3 draft (test_serve_run_with_the_mla_eagle3_draft_on_one_gpu, 2026-12-01).
    "serve-one-gpu-eagle3-mla": matrix.kimi("serve-one-gpu-eagle3-mla", 4, tokens=8192, seqs=64, util=0.85,
                                            draft=matrix.EAGLE3_MLA),
    # The same app at PP2 across two Ray nodes (test_serve_run_across_two_ray_nodes, 2 x H200): its vllm.log is the
    # replica's log and both stages' worker logs.
    "serve-two-nodes": matrix.kimi("serve-two-nodes", 4, pp=2, tokens=8192, seqs=64, util=0.85),
    # The same with the MLA EAGLE3 draft in place of DSpark (test_serve_run_with_the_mla_eagle3_draft_across_two_ray_nodes).
    "serve-two-nodes-eagle3-mla": matrix.kimi("serve-two-nodes-eagle3-mla", 4, pp=2, tokens=8192, seqs=64, util=0.85,
                                              draft=matrix.EAGLE3_MLA),
    # At TP4 x PP2 across two Ray nodes of four GPUs (test_serve_run_tp4_pp2_across_two_ray_nodes_of_four_gpus, 8 GPUs).
    "serve-tp4-pp2-two-nodes": matrix.kimi("serve-tp4-pp2-two-nodes", 4, tp=4, pp=2, tokens=8192, seqs=64, util=0.85),
}
"""Engines that Ray Serve started (not a rehearsal): the rehearsal flags with the deploy config's settings."""


@dataclass(frozen=True)
class RunAccuracy:
    """One GPU of one run: plan / vLLM for each estimate (vLLM's value None where that rank did not log it)."""

    name: str
    role: str
    started: bool
    measured_verdict: str
    predicted_verdict: str
    weights: tuple[int, int | None]
    profile: tuple[int, int | None]
    cuda_graph: tuple[int, int | None]
    kv: tuple[int, int | None]
    note: str = ""
    rank: int = 0
    ranks: int = 1
    utilization: float | None = None
    """The run's --gpu-memory-utilization, where its flags set one."""
    proposal: float | None = None
    """The largest safe utilization today's plan proposes for the run's settings on the run's GPU."""
    shape: str = ""
    """The run's settings but its utilization, and its GPU: runs of one shape differ in utilization alone."""

    @property
    def label(self) -> str:
        return self.name if self.ranks == 1 else f"{self.name} (rank {self.rank})"

    @staticmethod
    def error(pair: tuple[int, int | None]) -> float | None:
        plan, vllm = pair
        return None if vllm is None or not vllm else (plan - vllm) / vllm


def _job(name: str) -> matrix.Job:
    jobs = {j.name: j for js in matrix.SETS.values() for j in js} | SERVE_RUNS
    return jobs[SAME_AS.get(name, name)]


def _root_cause(errors) -> str:
    """vLLM's own reason among a failed start's error lines (not the engine core's generic wrapper)."""
    causes = [e.split("] ", 1)[-1] for e in errors if "Error:" in e and "Engine core initialization failed" not in e
              and "Worker failed with error" not in e]
    return (causes[0] if causes else errors[-1].split("] ", 1)[-1] if errors else "no error logged")[:200]


def _recorded_flags(run_dir: Path) -> list[str]:
    """The rehearsal flags the run was started with (job.json's command), else its matrix entry's. Files are named
    relative to the checkout the run started in (its working directory): the same files of this one."""
    job = run_dir / "job.json"
    command = json.loads(job.read_text()).get("command") if job.is_file() else None
    from_job = command is not None and "rehearse" in command
    flags = command[command.index("rehearse") + 1:] if from_job else list(_job(run_dir.name).args)
    out, skip = [], False
    for i, flag in enumerate(flags):  # where the run wrote, and how long it could take, do not change the prediction
        if skip:
            skip = False
        elif flag in ("--work-dir", "--timeout"):
            skip = True
        elif flag != "--json":
            if i and flags[i - 1] in ("--config", "--model") and not Path(flag).is_absolute():
                # A file the run read from its checkout: the date's snapshot of it where kept (a deploy config
                # changes after the run), else this checkout's.
                snapshot = run_dir.parent / "checkout" / flag
                flag = str(snapshot if snapshot.is_file() else ROOT / flag) if (snapshot.is_file() or (ROOT / flag).exists()) else flag
            out.append(flag)
    return out


def _recorded_role(run_dir: Path) -> str:
    """The role the matrix gave the run before it ran (job.json), or "" for runs recorded before roles were."""
    job = run_dir / "job.json"
    return json.loads(job.read_text()).get("role", "") if job.is_file() else ""


LENT_HOST_ENV = {"NCCL_NVLS_ENABLE": "0"}
"""What every lent GPU host exported to the engines it ran (../shared/gpu/host_setup.sh: its GPUs have no NVLink
multicast), so no recorded run had NCCL NVLS buffers."""


def predict_run(run_dir: Path, flags: list[str] | None = None):
    """(memory report, vLLM reading) of one recorded run, predicted with today's model on the run's GPU; ``flags``
    are the run's recorded flags where the caller has read them already (``_recorded_flags``)."""
    from kimi_k3_serve.cluster.nvml import parse_readings
    from kimi_k3_serve.planning.layout import RankDevice
    from kimi_k3_serve.rehearsal.vllm_log import parse_vllm_log

    host = json.loads((run_dir.parent / "host.json").read_text())
    total = host["torch_devices"][0]["total_bytes"]
    reading = parse_vllm_log(recorded.read_text(run_dir / "vllm.log", errors="replace"), device_total_bytes=total)
    worker = reading.workers[0] if reading.workers else None
    free = worker.free_at_start_bytes if worker and worker.free_at_start_bytes else total
    (gpu, *_), _ = parse_readings(host["nvml"])  # the run's GPU as NVML read it on the host
    device = RankDevice(total, gpu.compute_capability, free_bytes=free, name=gpu.name)
    return predict_flags(flags if flags is not None else _recorded_flags(run_dir), device), reading


def predict_flags(flags: list[str], device):
    """The memory report of ``rehearse`` with these flags on ``device``, its models built as the rehearsal builds
    them: the rank slice vLLM ran at TP1 (``--rank-of``), the stage at the layout's TP (``--stage-of``), or the
    slice of ``--layers``."""
    from kimi_k3_serve.cli import build_parser
    from kimi_k3_serve.commands import rehearse

    ns = build_parser().parse_args(["rehearse", *flags])
    with tempfile.TemporaryDirectory() as work, _host_model_cache(Path(work) / "cache"):
        args = rehearse.serve_args_of(ns)
        if ns.rank_of is not None:  # the rank slice vLLM ran, at TP1: its plan is what vLLM's numbers score
            args = rehearse.materialize_rank_slice(args, Path(work), ns.rank_of)[0]
        elif ns.stage_of is not None:  # the stage as a model of its own, at the layout's TP
            args = rehearse.materialize_stage(args, Path(work), ns.stage_of)[0]
        else:
            args = rehearse.materialize_models(args, Path(work), ns.layers)[0]
        return rehearse.predict(args, device, inherited_env=LENT_HOST_ENV)


@contextmanager
def _host_model_cache(cache: Path):
    """The model cache the GPU host had (scripts/gpu/run_all.sh: the 4-layer slice and its drafts), configs only,
    for runs started from a deploy config's ``cache:`` sources; this checkout's own cache may lack them."""
    from kimi_k3_serve.config.args import MODEL_CACHE_ENV

    make_kimi_slice.make_slice(cache, HOST_SLICE_LAYERS, tokenizer=False)
    before = os.environ.get(MODEL_CACHE_ENV)
    os.environ[MODEL_CACHE_ENV] = str(cache)
    try:
        yield cache
    finally:
        if before is None:
            os.environ.pop(MODEL_CACHE_ENV)
        else:
            os.environ[MODEL_CACHE_ENV] = before


def accuracy(run_dir: Path) -> list[RunAccuracy]:
    from kimi_k3_serve.errors import ConfigError
    from kimi_k3_serve.rehearsal.compare import compare, measured_verdict
    from kimi_k3_serve.rehearsal.vllm_log import parse_vllm_log

    base = SAME_AS.get(run_dir.name, run_dir.name)
    role = _recorded_role(run_dir) or ("fit" if base in FIT_RUNS else "validation")
    note = FIT_RUNS.get(base, "")
    if run_dir.name in SAME_AS:
        note = f"repeat of {SAME_AS[run_dir.name]} (first start on the host)"
    if run_dir.name in READ_BEFORE_A_CHANGE:
        note = f"scored before a change chosen on it: {READ_BEFORE_A_CHANGE[run_dir.name]}"
    flags = _recorded_flags(run_dir)
    utilization, shape = _utilization_and_shape(run_dir, flags)
    try:
        report, reading = predict_run(run_dir, flags)
    except ConfigError as error:  # today's plan refuses the settings the run used
        reading = parse_vllm_log(recorded.read_text(run_dir / "vllm.log", errors="replace"))
        w = reading.workers[0] if reading.workers else None
        refused = _root_cause(reading.errors)
        return [RunAccuracy(run_dir.name, role, reading.started, measured_verdict(reading), "refused",
                            (0, w.model_load_bytes if w else None), (0, None), (0, None), (0, None),
                            note=f"the plan now refuses these settings ({error}); vLLM: {refused}")]
    measured = measured_verdict(reading)
    stderr = run_dir / "stderr.txt"
    timed_out = recorded.exists(stderr) and "(--timeout)" in recorded.read_text(stderr, errors="replace")
    if not reading.started and reading.oom is None:
        kv_sized = any(w.available_kv_bytes is not None for w in reading.workers)
        if reading.errors:
            why = f"vLLM stopped: {_root_cause(reading.errors)}"
        elif timed_out and any(w.consumed_bytes is not None for w in reading.workers):
            # vLLM's closing memory summary (gpu_worker.py), logged once warmup and the real capture are done
            why = ("stopped at its --timeout after warmup and CUDA-graph capture, before vLLM logged the engine ready: "
                   "the memory terms are measured, vLLM's verdict is not")
        elif timed_out and kv_sized:
            # vLLM logged its profile, CUDA-graph estimate and KV cache; the warmup after them never ended
            why = ("stopped at its --timeout after vLLM sized the KV cache, during kernel warmup: the memory terms "
                   "are measured, vLLM's verdict is not")
        else:
            stopper = "its --timeout" if timed_out else "the call's deadline"
            where = "while loading" if reading.last_step in ("start", "load") else f"in vLLM's {reading.last_step} step"
            why = f"stopped at {stopper} {where}: weights only"
        note = (note + "; " if note else "") + why
    if reading.started and timed_out:
        note = ((note + "; " if note else "") + "stopped at its --timeout after vLLM's engine start (KV cache sized, "
                "CUDA graphs captured, warmup done: vLLM's `init engine` line), while its first generation was "
                "compiling kernels")
    ranks = compare(report, reading).ranks  # one per GPU of the engine (a DP run: one engine's, DP rank 0)

    def pair(rank, name: str) -> tuple[int, int | None]:
        row = rank.row(name)
        return row.predicted_bytes, row.measured_bytes

    return [RunAccuracy(
        name=run_dir.name, role=role, started=reading.started, measured_verdict=measured,
        predicted_verdict=report.verdict, weights=pair(rank, "weights"), profile=pair(rank, "profile_non_kv"),
        cuda_graph=pair(rank, "cuda_graph_estimate"), kv=pair(rank, "kv_cache"), note=note if rank.rank == 0 else "",
        rank=rank.rank, ranks=len(ranks), utilization=utilization, proposal=report.safe_gpu_memory_utilization,
        shape=shape,
    ) for rank in ranks]


def _utilization_and_shape(run_dir: Path, flags: list[str]) -> tuple[float | None, str]:
    """The run's utilization flag, and its other settings with the GPU it ran on (files by name, not by path)."""
    if "--gpu-memory-utilization" not in flags:
        return None, ""
    at = flags.index("--gpu-memory-utilization")
    rest = [Path(f).name if Path(f).is_absolute() else f for f in flags[:at] + flags[at + 2:]]
    gpu = json.loads((run_dir.parent / "host.json").read_text())["torch_devices"][0].get("name", "")
    return float(flags[at + 1]), " ".join([gpu, *rest])


def run_dirs() -> list[Path]:
    """Every recorded engine start (a folder with vLLM's log), but the GQA EAGLE3 run the plan refuses outright."""
    return [d for d in sorted(FIXTURES.glob("*/*"))
            if recorded.exists(d / "vllm.log") and d.name != "k8-tp1-b2048-s256-eagle3"]


def captures_against_estimates() -> list[tuple[str, int, int]]:
    """``(run, vLLM's CUDA-graph estimate, the real capture)`` of every GPU of every recorded run that captured."""
    from kimi_k3_serve.rehearsal.vllm_log import captures_against_estimates as of_log

    return [(d.name, estimate, actual) for d in run_dirs()
            for estimate, actual in of_log(recorded.read_text(d / "vllm.log", errors="replace"))]


def all_runs() -> list[RunAccuracy]:
    return [row for d in run_dirs() for row in accuracy(d)]


def _cell(pair: tuple[int, int | None]) -> str:
    plan, vllm = pair
    if not plan and vllm is None:
        return "-"
    if not plan:
        return f"- / {vllm / GiB:.2f}"
    if vllm is None:
        return f"{plan / GiB:.2f} / - "
    err = RunAccuracy.error(pair)
    return f"{plan / GiB:.2f} / {vllm / GiB:.2f} ({err * 100:+.2f}%)"


def _capture_lines() -> list[str]:
    captures = captures_against_estimates()
    if not captures:
        return []
    spare = min(captures, key=lambda c: c[1] - c[2])
    ratios = [actual / estimate for _, estimate, actual in captures]
    return [
        "## The real CUDA-graph capture against vLLM's estimate",
        "",
        "The plan predicts vLLM's CUDA-graph estimate (`profile_cudagraph_memory`), which vLLM deducts before it sizes "
        "the KV cache; the real capture runs later, into what the estimate left. That is safe only while the real "
        "capture stays at or below the estimate (tests/test_rehearsal.py checks every recorded GPU).",
        "",
        f"- {len(captures)} GPUs logged both; the real capture took {min(ratios) * 100:.0f} % to "
        f"{max(ratios) * 100:.0f} % of the estimate; the least room left: {(spare[1] - spare[2]) / GiB:.2f} GiB "
        f"({spare[0]}: {spare[2] / GiB:.2f} of {spare[1] / GiB:.2f} GiB).",
        "",
    ]


MEMORY_FAILURES = ("cannot_start", "oom_at_load", "no_kv_space", "oom_at_warmup")
"""How a start ends when memory, not the settings, stopped it: the outcomes a lower utilization can change."""


def _proposal_lines(runs: list[RunAccuracy]) -> list[str]:
    """Today's proposal at every shape run at two or more utilizations, or where vLLM failed for memory or started at
    or above it, against what vLLM did there: a failure at or below the proposal is the error a user would meet."""
    shapes: dict[str, list[RunAccuracy]] = {}
    for r in runs:
        if r.shape and r.rank == 0 and r.measured_verdict != "unknown":
            shapes.setdefault(r.shape, []).append(r)
    rows, supported, failed_below, untried, below_only = [], 0, [], 0, []
    for shape_runs in shapes.values():
        started = sorted(r.utilization for r in shape_runs if r.measured_verdict == "fits")
        failures = sorted(r.utilization for r in shape_runs if r.measured_verdict in MEMORY_FAILURES)
        # Each run against its own proposal: the GPU's free memory at the start, and so the proposal, can differ.
        failed_at = [r.utilization for r in shape_runs if r.measured_verdict in MEMORY_FAILURES
                     and r.proposal is not None and r.utilization <= r.proposal]
        started_at = [r.utilization for r in shape_runs
                      if r.measured_verdict == "fits" and r.proposal is not None and r.utilization >= r.proposal]
        proposals = sorted({r.proposal for r in shape_runs if r.proposal is not None})
        proposal = "-" if not proposals else " to ".join(map(str, proposals[::max(1, len(proposals) - 1)]))
        name = min((r.name for r in shape_runs), key=len)
        if len(shape_runs) < 2 and not failures and not started_at:
            if started and proposals:  # one start, below the proposal: it neither supports nor contradicts it
                below_only.append(f"{name} ({started[0]} < {proposal})")
            continue
        others = sorted({f"{r.measured_verdict} at {r.utilization}" for r in shape_runs
                         if r.measured_verdict not in ("fits", *MEMORY_FAILURES)})
        if not started and not failures:
            outcome = f"vLLM stopped for its settings ({', '.join(others)})"
        elif not proposals:
            outcome = "no utilization proposed" + (f"; vLLM started at {started[-1]}" if started else "")
        elif failed_at:
            outcome = f"**vLLM failed at {max(failed_at)}, at or below the proposal**"
            failed_below.append(name)
        elif started_at:
            supported += 1
            top = max(started_at)
            outcome = "started at the proposal" if top == proposals[0] else f"started at {top}, above it"
        else:
            untried += 1
            outcome = "not tried at or above it" + (f"; started at {started[-1]}" if started else "")
        rows.append(f"| {name} | {len(shape_runs)} | {', '.join(map(str, started)) or '-'} | "
                    f"{', '.join(map(str, failures)) or '-'} | {proposal} | {outcome} |")
    return [
        "## Today's proposal against every shape vLLM tried",
        "",
        "A shape is a run's settings and GPU but its utilization. For each shape run at two or more utilizations, or "
        "where vLLM ran out of memory or started at or above the proposal, the utilizations vLLM started and failed "
        "at (for memory) beside the largest safe utilization today's plan proposes there (a range where the runs "
        "began with different free memory; each run is held to its own). A failure at or below the proposal is a "
        "proposal that would not start; a start at or above it shows that it does. The runs these outcomes come "
        "from include the ones the proposal's terms were chosen on (listed above), so this table checks the "
        "proposal, it does not score it out of sample.",
        "",
        f"- {len(rows)} shapes: vLLM started at or above the proposal on {supported}; failed at or below it on "
        f"{len(failed_below)}" + (f" ({', '.join(failed_below)})" if failed_below else "")
        + f"; not tried at or above it on {untried}.",
        f"- {len(below_only)} more {'shape' if len(below_only) == 1 else 'shapes'} ran once, started below today's "
        "proposal, and are not in the table: the proposal is not tried there"
        + (f" ({', '.join(below_only)})." if below_only else "."),
        "",
        "| shape (its shortest run name) | runs | started at | failed at (memory) | proposal | outcome |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]


def render(runs: list[RunAccuracy]) -> str:
    lines = [
        "# Memory model accuracy against vLLM 0.32 on the H200 and the H100",
        "",
        f"Generated by `python scripts/memory_accuracy.py` on {date.today().isoformat()} from the runs recorded in "
        "`tests/fixtures/gpu/` (vLLM's own log of each engine start; commands in `scripts/gpu/matrix.py`, host in each "
        "date's `host.json`; every run is on an H200 but those named `-h100`, on an H100 80GB). Every value is GiB "
        "(2^30 B), plan / vLLM (error relative to vLLM). vLLM prints GiB to two decimals, so a measured value is exact "
        "to +-0.005 GiB.",
        "",
        "| run | role | weights | profile non-KV | CUDA-graph estimate | KV cache | verdict plan / vLLM |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        verdict = f"{r.predicted_verdict} / {r.measured_verdict}"
        lines.append(f"| {r.label} | {r.role} | {_cell(r.weights)} | {_cell(r.profile)} | {_cell(r.cuda_graph)} | "
                     f"{_cell(r.kv)} | {verdict} |")
    lines.append("")
    for r in runs:
        if r.note:
            lines.append(f"- {r.name}: {r.note}.")
    lines.append("")

    def errors(kind: str, role: str | None = None) -> list[float]:
        return [abs(e) for r in runs if role in (None, r.role) and getattr(r, kind)[0]
                for e in [RunAccuracy.error(getattr(r, kind))] if e is not None]

    val = [r for r in runs if r.role == "validation"]
    weights_val, kv_val, kv_fit = errors("weights", "validation"), errors("kv", "validation"), errors("kv", "fit")
    ended = [r for r in val if r.measured_verdict != "unknown" and r.rank == 0]  # a verdict is the run's
    failed = ("cannot_start", "oom_at_load", "no_kv_space", "seqs_over_state_blocks", "oom_at_warmup", "refused")
    fits_where_failed = [r.name for r in ended if r.predicted_verdict == "fits" and r.measured_verdict in failed]
    refused_where_served = [r.name for r in ended if r.predicted_verdict in failed and r.measured_verdict == "fits"]
    at_risk = [r.name for r in ended if r.predicted_verdict == "at_risk"]
    lines += [
        "## Against the goals, on validation runs only",
        "",
        "A validation run's numbers set no constant: its error is what a user meets on a configuration the model was "
        "not fitted on. The fit runs' residuals are shown apart.",
        "",
        f"- Weights per GPU (goal <= 0.5 % on every rank): max {max(weights_val) * 100:.2f} %, median "
        f"{statistics.median(weights_val) * 100:.2f} % over {len(weights_val)} GPUs.",
        f"- KV pool per GPU (goal <= 1 % median, <= 3 % on every run): median {statistics.median(kv_val) * 100:.2f} %, "
        f"max {max(kv_val) * 100:.2f} % over {len(kv_val)} GPUs; within 3 %: {sum(e <= 0.03 for e in kv_val)} of "
        f"{len(kv_val)}.",
        f"- Verdicts: {len(ended)} validation runs ended; called \"fits\" where vLLM failed: {len(fits_where_failed)}"
        + (f" ({', '.join(fits_where_failed)})" if fits_where_failed else "")
        + f"; called \"does not fit\" where vLLM served: {len(refused_where_served)}"
        + (f" ({', '.join(refused_where_served)})" if refused_where_served else "")
        + f"; \"at risk\": {len(at_risk)}" + (f" ({', '.join(at_risk)})" if at_risk else "") + ".",
        *[f"- Read before a change chosen on it, so no longer out of sample (the error a user met, before): {name}, "
          f"{before}." for name, before in READ_BEFORE_A_CHANGE.items()],
        f"- Fit runs' KV residual (not a user's error): median {statistics.median(kv_fit) * 100:.2f} %, max "
        f"{max(kv_fit) * 100:.2f} % over {len(kv_fit)} GPUs.",
        "",
        *_proposal_lines(runs),
        *_capture_lines(),
        "## The bands the verdict takes against the pool (kimi_k3_serve/planning/bands.py)",
        "",
        "Each band is the largest error in the unsafe direction (the plan below vLLM) its validation runs show; the "
        "verdict is \"fits\" only with every band against the pool, \"at risk\" where only the point estimate fits.",
        "",
        "| term | band | worst validation error (plan - vLLM) | set by |",
        "| --- | --- | --- | --- |",
    ]
    from kimi_k3_serve.planning.bands import BANDS, PROFILE, PROFILE_OTHER_FAMILIES

    others = ("llama", "qwen", "deepseek")
    for band in BANDS:
        kind = {"weights": "weights", "profile_non_kv": "profile", "cuda_graph_estimate": "cuda_graph"}[band.name]
        scored = [r for r in val if (band is not PROFILE or not r.name.startswith(others))
                  and (band is not PROFILE_OTHER_FAMILIES or r.name.startswith(others))]
        worst = min(((getattr(r, kind)[0] - getattr(r, kind)[1], r.label) for r in scored
                     if getattr(r, kind)[0] and getattr(r, kind)[1] is not None), default=(0, "-"))
        label = band.name + (" (other families)" if band is PROFILE_OTHER_FAMILIES else "")
        lines.append(f"| {label} | max({band.floor_bytes / GiB:.2f} GiB, {band.fraction * 100:.1f} %) | "
                     f"{worst[0] / GiB:+.2f} GiB ({worst[1]}) | {band.measured} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "memory-accuracy.md")
    args = parser.parse_args(argv)
    runs = all_runs()
    import fit_memory_constants  # it reads this module's runs: imported here, not at the top

    fit_lines = []
    for group in fit_memory_constants.GROUPS:
        fit_lines += fit_memory_constants.report(fit_memory_constants.fit_piecewise(group)[1], group)[1]
    text = render(runs) + "\n".join([
        "", "## The fitted constants: fitted on their fit runs alone, scored out of sample", "",
        "`scripts/fit_memory_constants.py` fits each group of `planning/memory.py`'s fitted constants by non-negative "
        "least squares on the relative errors of the fit runs the group names (`CUDA_GRAPH_FIT_RUNS`, "
        "`PROFILE_FIT_RUNS`, `EAGLE3_GRAPH_FIT_RUNS`; each a fit run of the matrix), and tests/test_rehearsal.py "
        "checks the shipped values are "
        "that fit. Leave-one-out refits a group without each of its fit runs and predicts that run: a term that rests "
        "on one run is badly predicted without it. Since round 4 (2026-12-02) every CUDA-graph term has at least two "
        "fit runs (deep DSpark stages of 11, 23, 31 and, since 2026-12-03, 44 layers; two runs without a draft at full "
        "width and two on TP8 ranks), and the profile group is fitted on every Kimi-K3 fit run: its worst "
        "leave-one-out is the TP2 run (-10 %; +14 % on the 1024-sequence run without a draft before the KDA layer's "
        "own peak was modelled, 2026-12-02). The CUDA-graph group's worst leave-one-out in GiB is its newest run, "
        "stage 1's rank at 256 sequences (+9 %, +0.26 GiB, the safe side: no other fit run has DSpark at 48 graphs on "
        "a TP8 rank); in per cent, the 0.22 GiB of r31-s1-pp3 (+17 %). DSpark's per-layer term is charged per target "
        "head on the rank since the eleventh session (2026-12-03), so a full-width layer (96 heads) costs 8 times a "
        "TP8 rank's (12); its fit runs are the full-width slices of 4 and 6 layers with DSpark and the TP8 ranks of "
        "11 to 44 layers (and 6 at the serve defaults since the twelfth session), and the structure was chosen after "
        "k8-tp1-serve-defaults-dspark had been read: ranks-round11's validation runs scored it out of sample (7 "
        "full-width layers at the serve defaults 3.71 / 3.72 GiB, 5 at 4,096 tokens 3.62 / 3.70). "
        "DSpark's capture workspace (the drafter's lane, `planning/memory.py _dspark_capture_lane_bytes`) is not "
        "fitted: vLLM's shapes give each size it logged, to the 2 MiB block. The EAGLE3 drafter's graph group "
        "(since the forty-fourth session) has two constants on two fit runs (ranks-round41-h100, 32 and 512 "
        "requests): each fit run is poorly predicted without the other (+83 % and -30 %), so its out-of-sample score "
        "is its validation runs, within 2 % each; the decode manager's cost a request is read from vLLM's code. "
        "The validation runs "
        "set nothing; their worst errors in the unsafe direction set the bands. FlashKDA's scratch share "
        "(`FLASHKDA_SCRATCH_FRACTION`) was read from the one run where FlashKDA alone grew vLLM's workspace: no "
        "leave-one-out exists for it.", "",
        *fit_lines])
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
