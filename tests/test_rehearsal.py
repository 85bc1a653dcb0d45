"""The rehearsal on the CPU: the Kimi-K3 slice, the vLLM log parser and the predicted-vs-measured comparison, replayed
on the H200 runs recorded in tests/fixtures/gpu/ (vLLM 0.32 CUDA, 2026-11-30), and the command's bad-input paths."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from conftest import REPO_ROOT, comment_prose, load_script
from kimi_k3_serve import recorded
from kimi_k3_serve.cli import main
from kimi_k3_serve.planning.inventory import GpuInfo
from kimi_k3_serve.commands.rehearse import visible_gpus
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning import bands, memory
from kimi_k3_serve.planning.hardware import lookup_gpu
from kimi_k3_serve.planning.layout import EngineSettings, Layout, RankDevice, SpeculativeSettings
from kimi_k3_serve.planning.memory import estimate_memory
from kimi_k3_serve.models import inventory_from_config, load_model, read_config
from kimi_k3_serve.models.inventory import KdaState, MlaKv
from kimi_k3_serve.rehearsal.compare import compare, measured_verdict, render_table
from kimi_k3_serve.rehearsal.slicing import min_slice_layers, slice_draft_config, slice_text_config, spread
from kimi_k3_serve.rehearsal.vllm_log import parse_vllm_log
from kimi_k3_serve.units import GiB

RUNS = REPO_ROOT / "tests" / "fixtures" / "gpu" / "2026-11-30"
TWO_GPUS = REPO_ROOT / "tests" / "fixtures" / "gpu" / "2026-11-30-two-gpus"
SECOND_HOST = REPO_ROOT / "tests" / "fixtures" / "gpu" / "2026-11-30-second-host"
H200 = RankDevice(150109880320, (9, 0), name="NVIDIA H200")  # torch's total on the host (host.json)


def run_log(name: str):
    return parse_vllm_log(recorded.read_text(RUNS / name / "vllm.log"))


def gib(x: float) -> int:
    return round(x * GiB)


# -- the slice --------------------------------------------------------------------------------------------------------

def test_slice_keeps_every_layer_kind_of_kimi_k3() -> None:
    full = read_config("kimi-k3")[0]
    assert min_slice_layers(full["text_config"]) == 4
    sliced = slice_text_config(full, 4)
    model = inventory_from_config(sliced, name="slice")
    assert [type(layer.kv) for layer in model.layers] == [KdaState, KdaState, KdaState, MlaKv]
    assert [(layer.attention, layer.mlp) for layer in model.layers] == [
        ("kda", "dense"), ("kda", "moe"), ("kda", "moe"), ("mla", "moe")]
    assert model.architecture == "KimiLinearForCausalLM" and "mxfp4" in model.quantization
    # Every per-layer number is the full model's: the slice's layer 3 weighs what Kimi-K3's layer 3 weighs.
    k3 = load_model("kimi-k3")
    assert model.layer_bytes(1, 1, False)[3] == k3.layer_bytes(1, 1, False)[3]


def test_slice_refuses_a_layer_count_that_drops_a_kind() -> None:
    full = read_config("kimi-k3")[0]
    for bad in (3, 94, 0):
        with pytest.raises(ConfigError, match="--layers"):
            slice_text_config(full, bad)


def test_sliced_drafts_tap_only_layers_of_the_slice() -> None:
    dspark = slice_draft_config(read_config("kimi-k3-dspark")[0], 4)
    assert dspark["target_layer_ids"] == [0, 1, 2, 3] and dspark["num_target_layers"] == 4
    assert dspark["dspark_noise_token_id"] == 163839
    eagle = slice_draft_config(read_config("kimi-k3-eagle3")[0], 8)
    assert eagle["eagle_aux_hidden_state_layer_ids"] == [0, 4, 7]
    mla = slice_draft_config(read_config("kimi-k3-eagle3-mla")[0], 8)  # both places vLLM reads the taps
    assert mla["eagle_aux_hidden_state_layer_ids"] == mla["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 4, 7]
    assert spread(93, 5) == [0, 23, 46, 69, 92]


def test_shipped_expert_targets_use_the_names_vllm_matches() -> None:
    # vLLM 0.32 matches compressed-tensors targets against experts.N.gate_proj|up_proj|down_proj; with w1/w2/w3
    # it left the experts unquantized and moe_backend=marlin refused to start (H200, 2026-11-30).
    from kimi_k3_serve.models.quant import parse_quantization

    q = parse_quantization(read_config("kimi-k3")[0], "bfloat16")
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert q.quantizes(f"model.layers.1.block_sparse_moe.experts.7.{name}")
    assert not q.quantizes("model.layers.1.block_sparse_moe.experts.7.w1")
    # ... and the planner's numbers are those of the documented checkpoint: 102.7 GB per GPU on stage 0 at TP8 x PP2,
    # and 268.75 MiB of the caching allocator's whole blocks on them (planning/allocator.py).
    r = estimate_memory(load_model("kimi-k3"), Layout(tp=8, pp=2), EngineSettings(max_model_len=32768), H200)
    assert r.ranks[0].weights_bytes == 102_708_199_104 + r.ranks[0].weights_by_category["allocator_rounding"]
    assert r.ranks[0].weights_by_category["allocator_rounding"] == int(268.75 * 2**20)


# -- vLLM's log, replayed -----------------------------------------------------------------------------------------------

def test_parser_reads_a_whole_h200_engine_start() -> None:
    r = run_log("k4-tp1-serve-defaults-dspark")
    (w,) = r.workers
    assert (w.rank, w.pp_rank, w.tp_rank) == (0, 0, 0)
    assert w.model_load_bytes == gib(58.69) and w.available_kv_bytes == gib(64.22)
    assert (w.cuda_graph_estimate_bytes, w.cuda_graph_actual_bytes) == (gib(3.55), gib(1.59))
    assert (w.total_bytes, w.requested_bytes, w.consumed_bytes, w.peak_activation_bytes) == (
        gib(139.8), gib(128.62), gib(59.83), gib(4.57))
    assert (r.kv_cache_tokens, r.max_model_len, r.max_concurrency) == (1_900_348, 8192, 231.98)
    assert r.started and r.last_step == "serving" and r.oom is None and r.init_seconds == 55.03


def test_parser_places_the_oom_vllm_met_after_sizing_the_kv_cache() -> None:
    # vllm.LLM's H200 defaults (16384 tokens, 1024 sequences): FlashKDA's buffers were not in the profile, and the
    # KV cache vLLM sized could no longer be allocated.
    r = run_log("k4-tp1-llm-defaults-b16384-s1024")
    assert not r.started and r.oom is not None
    assert r.oom.step == "kv_cache"
    assert (r.oom.tried_bytes, r.oom.free_bytes, r.oom.device_index) == (gib(55.66), gib(52.76), 0)
    w = r.workers[0]
    assert w.available_kv_bytes == gib(55.66) and w.total_bytes == gib(139.80)
    # No summary line: the budget and the CUDA-graph estimate come from vLLM's "equivalent utilization" line.
    assert w.requested_bytes == math.ceil(0.92 * gib(139.80))
    assert abs(w.cuda_graph_estimate_bytes - gib(3.55)) <= 15 * 2**20
    assert measured_verdict(r) == "oom_at_warmup"


@pytest.mark.parametrize("run_dir, measured_short_gib", [
    (RUNS / "k4-tp1-llm-defaults-b16384-s1024", 2.90),
    (REPO_ROOT / "tests" / "fixtures" / "gpu" / "2026-12-01" / "k6-tp1-b8192-s768-dspark-u092", 0.42),
])
def test_plan_short_at_least_by_what_vllm_was_short(run_dir, measured_short_gib) -> None:
    """Both runs had DSpark: TRITON_MLA's decode logits grew vLLM's shared workspace after the profile, and the KV
    cache vLLM sized could not be allocated (55.66 GiB with 52.76 free; 27.82 with 27.40). The plan counts that growth
    outside the budget, never less than vLLM was short; the rest of its shortfall is what warmup needs again (the
    profile's activations and the CUDA graphs, free while the KV cache is allocated): its proposal is conservative by
    that much (docs/gpu-runs.md)."""
    report, reading = accuracy.predict_run(run_dir)
    measured_short = reading.oom.tried_bytes - reading.oom.free_bytes
    assert abs(measured_short - measured_short_gib * GiB) <= 0.011 * GiB
    rank = report.ranks[0]
    assert report.verdict == "oom_at_warmup" and rank.warmup_shortfall_bytes >= measured_short
    shared = next(e for e in report.estimates if e.name == "workspace:shared_unseen")
    assert "TRITON_MLA decode logits" in shared.basis
    safe_budget = math.ceil(report.safe_gpu_memory_utilization * rank.total_bytes)
    assert rank.budget_bytes - safe_budget >= measured_short


def test_the_shared_workspace_is_the_size_vllm_logged() -> None:
    """vLLM's own log of its workspace (VLLM_DEBUG_WORKSPACE=1, H200, 2026-12-01): the MoE buffers and TRITON_MLA's
    reservation, to the MiB, from the shapes in planning/workspace.py."""
    from kimi_k3_serve.planning.workspace import moe_buffer_bytes, triton_mla_logits_bytes

    day = REPO_ROOT / "tests" / "fixtures" / "gpu" / "2026-12-01"
    log = recorded.read_text(day / "k6-tp1-b8192-s768-dspark-u080" / "vllm.log")
    sizes = {m.group(1): float(m.group(2))
             for m in re.finditer(r"Resized workspace from '([^']+)': [0-9.]+ MB -> ([0-9.]+) MB", log)}
    mib = 2**20
    assert sizes["modular_kernel.py:1141:_allocate_buffers"] * mib == moe_buffer_bytes(8192, 16, 3072, 3584)
    assert sizes["triton_mla.py:90:_reserve_attn_logits_workspace"] * mib == triton_mla_logits_bytes(
        768, 8, 96, 512, 8192, (9, 0))
    rank = recorded.read_text(day / "r23-s3-pp4-dspark-b16384-s64" / "vllm.log")
    assert "0.00 MB -> 3584.00 MB" in rank and moe_buffer_bytes(16384, 16, 384, 3584) == 3584 * mib


FLASHKDA_GROWTH = re.compile(r"Resized workspace from 'kda\.py:\d+:_forward': [0-9.]+ MB -> ([0-9.]+) MB "
                             r"\(ubatch 0, lane 0\)")


def test_flashkda_workspace_is_the_librarys_on_every_shape_read() -> None:
    """torch.ops._flashkda_C.get_workspace_size, read on the GPU host over 1,056 shapes (round 25), is the plan's
    formula on every one."""
    from kimi_k3_serve.planning.optimisations import flashkda_workspace_bytes

    read = json.loads((REPO_ROOT / "tests" / "fixtures" / "gpu" / "2026-12-06-round25" / "flashkda-workspace.json")
                      .read_text())
    assert len(read["rows"]) == 1056
    assert all(flashkda_workspace_bytes(r["T"], r["H"], r["N"]) == r["bytes"] for r in read["rows"])


def test_flashkdas_buffers_are_what_vllm_logged_and_land_where_it_took_them() -> None:
    """Every run whose log shows FlashKDA growing vLLM's shared workspace: the plan's buffers are the logged size (to
    the log's 0.01 MB), and the growth sits where vLLM took it: inside the CUDA-graph estimate when it grew before
    vLLM sized the KV cache, else after it, outside the budget."""
    seen = {}
    for log in recorded.glob(REPO_ROOT / "tests" / "fixtures" / "gpu", "*/*/vllm.log"):
        text = recorded.read_text(log, errors="replace")
        grown = FLASHKDA_GROWTH.search(text)
        kv = text.find("Available KV cache memory")
        if grown and kv > 0:
            seen[log.parent] = (float(grown.group(1)) * 2**20, grown.start() < kv)
    assert {d.name for d in seen} >= {"k8-tp1-b8192-s512-nodraft", "r49-s0-b2048-s512", "k4-tp1-b2048-s96-nodraft-h100"}
    assert {before for _, before in seen.values()} == {True, False}
    for run_dir, (logged, before_kv) in seen.items():
        report, _ = accuracy.predict_run(run_dir)
        flashkda = next(e for e in report.estimates if e.name == "workspace:flashkda")
        assert abs(flashkda.bytes - logged) <= 0.01 * 2**20, (run_dir.name, flashkda.bytes / 2**20, logged / 2**20)
        graphs = next(e for e in report.estimates if e.name == "cuda_graph_bytes").basis
        assert ("FlashKDA's buffers, grown while it is taken" in graphs) == before_kv, run_dir.name
        unseen = next(e for e in report.estimates if e.name == "workspace:shared_unseen").bytes
        assert (unseen > 0) != before_kv, run_dir.name  # outside the budget only when it grew after the KV cache


DRAFT_LANE = re.compile(r"Resized workspace from 'triton_mla\.py:\d+:forward_mqa': [0-9.]+ MB -> ([0-9.]+) MB "
                        r"\(ubatch 0, lane 1\)")


def test_dspark_capture_workspace_is_the_lane_vllm_logged() -> None:
    """While vLLM captures DSpark's graphs to estimate their memory, TRITON_MLA's split-KV logits fill the drafter's
    workspace lane at the largest graph's rows and full context; the plan charges that lane inside the CUDA-graph
    estimate. One recorded run per logged size (15, 16, 20, 22, 64 and 71+ requests; 8,192 to 131,072 tokens; 12
    and 96 heads), to the caching allocator's 2 MiB block; round 10's two sizes at 131,072 tokens were predicted
    before they ran."""
    seen: dict[float, Path] = {}
    for log in recorded.glob(REPO_ROOT / "tests" / "fixtures" / "gpu", "*/*/vllm.log"):
        for m in DRAFT_LANE.finditer(recorded.read_text(log, errors="replace")):
            seen.setdefault(float(m.group(1)), log.parent)
    assert {168.33, 157.81, 462.9, 673.31, 746.96, 1493.91, 841.64, 2693.25} <= set(seen)
    for logged_mb, run_dir in seen.items():
        report, _ = accuracy.predict_run(run_dir)
        graphs = next(e for e in report.estimates if e.name == "cuda_graph_bytes")
        planned = re.search(r"DSpark's capture workspace ([0-9,]+) MiB", graphs.basis)
        assert planned, (run_dir.name, graphs.basis)
        assert int(planned.group(1).replace(",", "")) == math.ceil(logged_mb / 2) * 2, (run_dir.name, logged_mb)


DSPARK_GRAPHS = re.compile(r"Capturing dspark CUDA graphs \(FULL\):\s+0%\|\s+\| 0/(\d+)")


def test_dspark_graphs_are_counted_at_their_own_sizes() -> None:
    """DSpark captures its own FULL graphs, in multiples of its 7 query rows a request (not the target's 8): as many
    as vLLM's progress bar counted, on one recorded run per count (14 to 48)."""
    seen: dict[int, Path] = {}
    for log in recorded.glob(REPO_ROOT / "tests" / "fixtures" / "gpu", "*/*/vllm.log"):
        counts = DSPARK_GRAPHS.findall(recorded.read_text(log, errors="replace"))
        if counts:
            seen.setdefault(int(counts[-1]), log.parent)  # the real capture's, after the profile's
    assert {14, 15, 20, 45, 48} <= set(seen)
    for count, run_dir in seen.items():
        report, _ = accuracy.predict_run(run_dir)
        basis = next(e for e in report.estimates if e.name == "cuda_graph_bytes").basis
        assert f"+ {count} draft graphs x" in basis, (run_dir.name, count, basis)


def test_a_near_miss_gives_its_budget_and_cuda_graph_estimate_once_the_total_is_known() -> None:
    # The 8-layer slice stopped before vLLM's summary line (max_num_seqs over the state blocks), so the log never
    # printed the GPU's total; its utilization line still says 0.9200 is 0.8927 without the CUDA-graph estimate.
    log = recorded.read_text(SECOND_HOST / "k8-tp1-serve-defaults-dspark" / "vllm.log")
    alone = parse_vllm_log(log).workers[0]
    assert alone.cuda_graph_estimate_bytes is None and alone.requested_bytes is None
    total = json.loads((SECOND_HOST / "host.json").read_text())["torch_devices"][0]["total_bytes"]
    w = parse_vllm_log(log, device_total_bytes=total).workers[0]
    assert w.cuda_graph_estimate_bytes == round((0.92 - 0.8927) * total)  # 3.82 GiB, against 3.55 at 4 layers
    assert w.requested_bytes == math.ceil(0.92 * total)
    assert abs(w.profiled_non_kv_bytes - 2.19 * GiB) <= 0.01 * GiB  # requested - CUDA graphs - KV (0.92) - weights


def test_a_run_stopped_while_loading_has_no_verdict() -> None:
    r = run_log("qwen3-30b-a3b-tp1")
    assert not r.started and r.oom is None and r.last_step == "profile"
    assert measured_verdict(r) == "unknown"


def test_the_same_settings_measure_the_same_on_a_fresh_host_and_a_warm_one() -> None:
    first = run_log("k4-tp1-serve-defaults-dspark-first-start")
    warm = run_log("k4-tp1-serve-defaults-dspark")
    strip = lambda w: {k: v for k, v in w.to_json().items() if k != "pid"}  # noqa: E731
    assert strip(first.workers[0]) == strip(warm.workers[0])
    assert first.init_seconds > 3 * warm.init_seconds  # FlashInfer builds its kernels on the first start


# -- plan against measurement -----------------------------------------------------------------------------------------

accuracy = load_script("memory_accuracy")


@pytest.fixture(scope="module")
def runs():
    return {r.label: r for r in accuracy.all_runs()}  # a name recorded twice keeps its latest date's run


def test_weights_within_half_a_percent_on_every_run(runs) -> None:
    planned = [r for r in runs.values() if r.weights[0]]  # a refused run has no plan
    assert len(planned) >= 12
    for r in planned:
        err = accuracy.RunAccuracy.error(r.weights)
        assert err is not None and abs(err) <= 0.005, (r.name, r.weights)


OTHER_FAMILIES = ("llama", "qwen", "deepseek")
"""The recorded runs of models other than Kimi-K3 (their profile band is ``bands.PROFILE_OTHER_FAMILIES``)."""


UNSAFE_KV_MISSES: dict[str, float] = {"k4-tp1-b4096-s512-dspark3-u090-h100": 0.014,
                                       "k4-tp1-b4096-s512-dspark3-u0905-h100": 0.014,
                                       "k4-tp1-b8192-s512-dspark3-u090-h100": 0.013}
"""Validation runs whose KV pool the plan puts more than 1 % above vLLM's, and the error each has. Round 45 (H100, 3
speculative tokens at 4,096 over 512, 0.90, the Markov term scored out of sample): +1.36 %, 0.08 GiB of a 6.10 GiB
pool, the profile 0.03 GiB and the CUDA-graph estimate 0.06 GiB under vLLM's; inside the pool's band. Round 47, the
same shape at 0.905: +1.37 %, the same 0.08 GiB. Round 67, 8,192 tokens over 512 at 0.90: +1.26 %, 0.05 GiB of a
3.86 GiB pool, the CUDA-graph estimate 0.05 GiB under vLLM's at the same 49 FULL and 49 DSpark graphs. Round
40's 3 speculative tokens at 2,048 over 256 sequences (k4-tp1-b2048-s256-dspark3-u0945-h100) was +1.9 % until DSpark's
Markov sampling was taken from vLLM's code (memory.dspark_markov_step_bytes, thirty-ninth session); +0.6 % since.
Round 39's MLA EAGLE3 at 16,384 tokens was +3.5 % until the speculator's hidden-state buffer was counted
(memory.eagle3_mla_profile_bytes); -2.6 % since."""


def test_kv_pool_error_is_inside_the_band_the_verdict_uses(runs) -> None:
    """On every run where vLLM sized a pool, the plan's pool less its measured band (planning/bands.py) is no larger
    than vLLM's: the verdict's banded pool is on the safe side. Validation runs within 1 % above and 4 % below
    (docs/memory-accuracy.md), or 0.6 GiB on a near-miss's sliver (the 8-layer slice's 0.92 GiB)."""
    from kimi_k3_serve.planning.bands import kv_band_bytes

    sized = [r for r in runs.values() if r.kv[1] is not None and r.kv[0]]
    assert len(sized) >= 16
    for r in sized:
        band = kv_band_bytes(r.weights[0], r.profile[0], r.cuda_graph[0], kimi_k3=not r.name.startswith(OTHER_FAMILIES))
        assert r.kv[0] - band <= r.kv[1], (r.name, r.kv, band)
        if r.role == "validation":
            # The unsafe side (the plan's pool above vLLM's) within 1 % (k8-tp1-b4096-s64-dspark's pool of 0.63 GiB
            # was 8.45 % over before DSPARK_KDA_PEAK_HIDDEN_COPIES; round 40's 3 speculative tokens at 2,048 over 256
            # sequences +1.9 % before dspark_markov_step_bytes), but for UNSAFE_KV_MISSES; the safe side within 4 %
            # (r49-s0-b2048-s512, 3.6 % low: the sampler's fp32 copies at 512 sequences over the whole vocabulary,
            # 0.9 GiB more than vLLM),
            # or, on a pool under 5 GiB, within 1.3 GiB (r44-s1-dspark-u080-b16384-s256: 3.91 GiB at 0.80, where the
            # CUDA-graph estimate is 1.06 GiB over at 48 FULL graphs through 44 layers with DSpark).
            err = accuracy.RunAccuracy.error(r.kv)
            sliver = abs(r.kv[0] - r.kv[1]) <= 0.6 * GiB or (r.kv[1] < 5 * GiB and 0 < r.kv[1] - r.kv[0] <= 1.3 * GiB)
            assert err <= UNSAFE_KV_MISSES.get(r.name, 0.01), (r.name, r.kv)
            assert -0.04 <= err or sliver, (r.name, r.kv)


QUOTED_KV_ERROR = re.compile(r"([+-]\d+\.\d\d) %[^%]*?\((?:[^()]*, )?((?:b200-)?r\d+-s\d[\w-]*)\)")
"""A deploy config's quote of a rehearsed rank's KV-pool error: "-0.21 % of vLLM's on stage 0 (r49-s0)"."""


def test_deploy_configs_quote_their_ranks_kv_errors_as_the_fixtures_replay(runs) -> None:
    """The rank slices' KV errors a deploy config quotes are what the recorded runs give with today's constants: a
    refit that moves them moves the comment too."""
    quoted = {}
    for config in sorted((REPO_ROOT / "deploy").glob("config*.yaml")):
        prose = comment_prose(config.read_text())
        quoted |= {(config.name, name): error for error, name in QUOTED_KV_ERROR.findall(prose)}
    assert {name for _, name in quoted} >= {"r49-s0", "r44-s1-dspark", "b200-r50-s0", "b200-r43-s1-dspark"}
    for (config, name), error in quoted.items():
        replayed = 100 * accuracy.RunAccuracy.error(runs[name].kv)
        assert error == f"{replayed:+.2f}", f"{config} quotes {error} % for {name}; its fixture gives {replayed:+.2f} %"


VERDICT_MISSES: dict[str, str] = {}
"""Validation runs the plan called "fits" where vLLM failed: listed, so that none is added unseen. Rounds 46 and 47
(H100, 3 speculative tokens, 2,048 over 256, at the proposals of their day, 0.955 and 0.95) were two, out of sample,
until their errors set the band of the capture's stand-in (``capture.CAPTURE_AFTER_GROWTH_ERROR``); "at risk" since,
and since the capture's own moment with DSpark replaced the stand-in (``capture.CAPTURE_ROOM_DSPARK``), round 46's is
"does not fit" and round 47's, which the room was chosen on, "at risk"."""

REFUSED_WHERE_SERVED: dict[str, str] = {}
"""Validation runs the plan called "does not fit" where vLLM started (the safe side): listed, so that none is added
unseen. None since the after-KV terms are weighed inside each warmup moment's room (round 42's stage 1 at 0.97, 0.57
GiB short before, fits with 0.58 GiB to spare: tests/test_warmup.py), but round 59, round 30's failed shape with
PyTorch's expandable segments, until the plan read that setting (planning/capture.py, chosen on it: "fits" now), and
round 67 (8,192 / 512 at 0.90 with 3 speculative tokens, 1.53 GiB short by the capture's stand-in) until the
capture's own moment replaced it (``capture.CAPTURE_ROOM_DSPARK``: "at risk" now, by the pool's bands)."""


def test_verdict_right_on_every_run_that_ended(runs) -> None:
    """Every run that ended gets vLLM's outcome, or "at risk" where it fits only at the point estimates, but the
    misses VERDICT_MISSES (none: "fits" where vLLM failed) and REFUSED_WHERE_SERVED ("does not fit" where vLLM
    started) name. At most one validation run in five may be "at risk"."""
    ended = [r for r in runs.values() if r.measured_verdict != "unknown"]
    assert {r.measured_verdict for r in ended} == {"fits", "oom_at_warmup", "no_kv_space", "seqs_over_state_blocks", "refused"}
    missed = {r.name for r in ended if r.predicted_verdict not in (r.measured_verdict, "at_risk")}
    assert missed == set(VERDICT_MISSES) | set(REFUSED_WHERE_SERVED)
    assert all(runs[name].predicted_verdict == "fits" and runs[name].role == "validation" for name in VERDICT_MISSES)
    assert all(runs[name].measured_verdict == "fits" and runs[name].role == "validation"
               for name in REFUSED_WHERE_SERVED)
    # Warmup shortfalls within the allocator reserve's band: round 28's two DSpark runs 0.005 above the proposal
    # (started) and round 26's no-draft run 0.005 above it (ran out of memory); within the capture reserve's band,
    # round 35's 384-sequence run at 0.93 (started), and kernel warmup's prefill step judged with it at its own moment
    # (memory._warmup_prefill_moments): round 37's no draft at 0.87 (ran out of memory there, 1.54 times the gathered
    # states left) and round 36's at 0.86 (started, 2.04 times); and the two failures of rounds 39 and 40 the drafter
    # reserve's band and the MLA prefill path's reserve were measured with (at the low end of each); within the capture
    # stand-in's error band after FlashKDA's growth, rounds 46 and 47's failures it was measured on and five that
    # started (rounds 31, 41, 44's MLA EAGLE3 at 0.99, 47's 4,096 over 512 at 0.905 and 48's MLA EAGLE3 at 8,192 over
    # 256), and ranks-round42-h100's three just above their proposals (round 56's two failures, round 57's start);
    # and round 50's MLA EAGLE3 at 16,384 over 128 at 0.90 (started), by the pool's bands alone, as round 54's MLA
    # EAGLE3 fit run at 8,192 over 512 at 0.92 (started; 512 requests' states need the pool the bands take). Since the
    # drafter's graphs are charged as vLLM's code builds them (forty-fourth session), the plan's pool is vLLM's where
    # it was 0.11 to 0.16 GiB under with the MLA EAGLE3; round 39's failure at 16,384 over 128 (0.915) is "does not
    # fit" now. Since round 63 (the drafter reserve's fit run, started at 0.985 with 1.20 times its request left) that
    # reserve is 1.19, so round 36's start at 8,192 over 128 (0.98) fits; round 63's own start and round 58's at 8,192
    # over 256 (0.97) are "at risk".
    # Since the capture's own moment with DSpark replaced the stand-in (capture.CAPTURE_ROOM_DSPARK, forty-seventh
    # session), rounds 46's and 56's 2,048-token failures are "does not fit", five starts (rounds 31, 41, 47's 4,096
    # over 512 at 0.905, 57's and 67's 8,192 over 512, the last by the pool's bands) leave the stand-in's band, and
    # round 53's start after the allocator's retry is "at risk", within the room's band.
    assert sorted(r.name for r in ended if r.predicted_verdict == "at_risk") == [
        "k4-tp1-b12288-s64-nodraft-u0985-h100", "k4-tp1-b16384-s128-eagle3mla-u090-h100",
        "k4-tp1-b2048-s128-dspark3-u0965-h100", "k4-tp1-b2048-s256-dspark3-u095-h100",
        "k4-tp1-b3072-s384-dspark3-u0935-h100", "k4-tp1-b4096-s128-eagle3mla-u099-h100",
        "k4-tp1-b4096-s512-nodraft-u086-h100", "k4-tp1-b4096-s512-nodraft-u087-h100",
        "k4-tp1-b6144-s384-nodraft-u093-h100",
        "k4-tp1-b8192-s128-dspark-u095-h100",
        "k4-tp1-b8192-s128-eagle3mla-u0985-h100", "k4-tp1-b8192-s128-nodraft-u095-h100",
        "k4-tp1-b8192-s256-dspark-u088-h100", "k4-tp1-b8192-s256-dspark-u091-h100",
        "k4-tp1-b8192-s256-eagle3mla-u097-h100",
        "k4-tp1-b8192-s256-eagle3mla-u0975-h100",
        "k4-tp1-b8192-s512-dspark3-u090-h100", "k4-tp1-b8192-s512-eagle3mla-u092-h100",
        "k7-tp1-b2048-s128-dspark-u081", "k8-tp1-b2048-s128-dspark",
        "k8-tp1-b4096-s48-dspark", "k8-tp1-b4096-s64-dspark", "k8-tp1-b8192-s512-nodraft",
        "k8-tp1-b8192-s512-nodraft-samples"]
    validation = [r for r in ended if r.role == "validation"]
    assert 5 * sum(r.predicted_verdict == "at_risk" for r in validation) <= len(validation)


def test_no_recorded_run_failed_for_memory_at_or_below_todays_proposal(runs) -> None:
    """Where vLLM ran out of memory at a utilization, today's plan proposes less for the same settings on the same
    GPU (docs/memory-accuracy.md "Today's proposal"): a proposal a recorded run already refutes is never shipped.
    Rounds 44, 46 and 47 (H100) failed at the proposals of their day, 0.925, 0.955 and 0.95; today's are 0.915 and
    0.945 (vLLM started at 0.905 and at 0.945, rounds 47 and 40)."""
    failures = [r for r in runs.values() if r.rank == 0 and r.shape and r.measured_verdict in accuracy.MEMORY_FAILURES]
    assert len(failures) >= 20
    for failure in failures:
        assert failure.proposal is None or failure.proposal < failure.utilization, (failure.name, failure.proposal)
    proposals = {r.shape: r.proposal for r in runs.values() if r.shape}
    assert proposals[runs["k4-tp1-b4096-s512-dspark3-u0925-h100"].shape] == 0.915
    assert proposals[runs["k4-tp1-b2048-s256-dspark3-u0955-h100"].shape] == 0.945


@pytest.mark.parametrize("name, proposal", [
    ("k4-tp1-b2048-s64-eagle3mla-u099-h100", 0.99), ("k4-tp1-b12288-s192-eagle3mla-u094-h100", 0.945),
    ("k4-tp1-b4096-s512-eagle3mla-u0945-h100", 0.945), ("k4-tp1-b3072-s160-dspark-u0955-h100", 0.955),
    ("k4-tp1-b12288-s96-nodraft-u0915-h100", 0.915),
    ("k4-tp1-b16384-s96-eagle3mla-u099-h100", 0.99), ("k4-tp1-b12288-s96-eagle3mla-u0935-h100", 0.94),
    ("k4-tp1-b4096-s64-dspark-u0975-h100", 0.975), ("k4-tp1-b12288-s96-dspark-u0925-h100", 0.925),
    ("k4-tp1-b16384-s32-dspark-u0985-h100", 0.985),
])
def test_the_proposal_started_vllm_at_shapes_no_run_had(runs, name, proposal) -> None:
    """Rounds 61, 64 and 66 (ranks-round44-h100, -round46-h100 and -round48-h100, H100, validation, each fixed before
    it ran at the plan's proposal of its day): at each shape vLLM started at the utilization the plan proposed for
    it, the plan called it "fits", and its KV pool was within 1.5 % of vLLM's. Round 64's MLA EAGLE3 pair sits either
    side of FlashMLA's decode path at 96 requests: 12,288 tokens (128 a request, decoded) and 16,384 (170, prefilled:
    the proposal is the cap)."""
    run = runs[name]
    assert run.role == "validation"
    assert (run.predicted_verdict, run.measured_verdict) == ("fits", "fits")
    assert run.proposal == proposal and 0 <= round(proposal - run.utilization, 3) <= 0.005
    assert abs(accuracy.RunAccuracy.error(run.kv)) <= 0.015, run.kv


@pytest.mark.parametrize("name, started_below, failed_above", [
    ("k4-tp1-b16384-s128-eagle3mla-u091-h100", 0.90, 0.915),
    ("k4-tp1-b12288-s192-eagle3mla-u0945-h100", 0.94, None),
    ("k4-tp1-b12288-s96-eagle3mla-u094-h100", 0.935, None),
])
def test_the_proposal_started_vllm_where_it_rose_above_the_last_start(runs, name, started_below, failed_above) -> None:
    """Round 65 (ranks-round47-h100, H100, validation, fixed before it ran): when the MLA EAGLE3 drafter's warmup
    reserve came down on round 63, three proposals rose above where vLLM had started. At each, vLLM started at the
    proposal and the plan called it "fits", its KV pool within 1 % of vLLM's; at 16,384 tokens over 128 requests the
    proposal sits between a start (0.90) and a failure (0.915)."""
    run = runs[name]
    assert run.role == "validation"
    assert (run.predicted_verdict, run.measured_verdict) == ("fits", "fits")
    assert run.proposal == run.utilization and run.utilization > started_below
    same_shape = [r for r in runs.values() if r.shape == run.shape and r.name != name]
    assert max(r.utilization for r in same_shape if r.measured_verdict == "fits") == started_below
    failed = [r.utilization for r in same_shape if r.measured_verdict in accuracy.MEMORY_FAILURES]
    assert min(failed, default=None) == failed_above
    assert abs(accuracy.RunAccuracy.error(run.kv)) <= 0.01, run.kv


def test_the_proposal_table_names_the_shapes_whose_one_start_was_below_the_proposal() -> None:
    """A shape with one start, below today's proposal, says nothing of the proposal: it stays out of the table, but
    the report names it as not tried there instead of leaving it out silently."""
    def run(name, shape, util, verdict="fits", proposal=0.95):
        none = (0, None)
        return accuracy.RunAccuracy(name, "validation", verdict == "fits", verdict, "fits", none, none, none, none,
                                    utilization=util, proposal=proposal, shape=shape)

    lines = accuracy._proposal_lines([run("a-u095", "a", 0.95), run("b-u094", "b", 0.94),
                                      run("c-u090", "c", 0.90, "oom_at_warmup")])
    table = [line for line in lines if line.startswith("| ") and not line.startswith(("| shape", "| ---"))]
    assert [row.split(" | ")[0] for row in table] == ["| a-u095", "| c-u090"]
    assert "started at the proposal" in table[0] and "**vLLM failed at 0.9, at or below the proposal**" in table[1]
    assert "- 1 more shape ran once, started below today's proposal, and are not in the table: the proposal is not " \
           "tried there (b-u094 (0.94 < 0.95))." in lines


def test_estimates_are_pinned_to_the_h200_measurements(runs) -> None:
    r = runs["k4-tp1-serve-defaults-dspark"]
    assert abs(r.cuda_graph[0] - r.cuda_graph[1]) <= 0.1 * GiB  # vLLM's estimate: 3.55 GiB
    assert abs(r.profile[0] - r.profile[1]) <= 0.3 * GiB  # activation + non-torch in the profile: 2.16 GiB
    llama = runs["llama-3.1-8b-tp1"]
    assert abs(llama.cuda_graph[0] - llama.cuda_graph[1]) <= 0.05 * GiB
    # Not fitted on: 0.77 vs 1.39 GiB (the Kimi-K3 fit's non-torch and held max_num_seqs x vocab buffers over a generic
    # forward), inside the other families' profile band (0.65 GiB floor); Kimi-K3's own band is 0.45 GiB.
    assert abs(llama.profile[0] - llama.profile[1]) <= bands.PROFILE_OTHER_FAMILIES.floor_bytes


def test_dspark_graphs_grow_with_depth_at_the_ranks_width(runs) -> None:
    """With DSpark, vLLM's CUDA-graph estimate grows with the stage's depth in proportion to the target heads on the
    rank (``memory.CUDA_GRAPH_DRAFT_PER_LAYER_HEAD``): on full-width slices (96 heads) 3.55 GiB at 4 layers and
    3.82 at 8. Charged per layer alone, at the TP8 ranks' scale, the plan grew 0.04 GiB of those 0.27 and was
    0.18 GiB under at 8. k8 was read before this structure was chosen; ranks-round11's 7-layer validation run (read
    after) was within 0.01 GiB, and is 0.06 GiB over (+1.6 %, the safe side) since the FULL graphs are charged as
    vLLM samples them (twenty-second session)."""
    shallow, deep = runs["k4-tp1-serve-defaults-dspark"], runs["k8-tp1-serve-defaults-dspark"]
    assert deep.cuda_graph[1] - shallow.cuda_graph[1] > 0.25 * GiB  # vLLM's growth
    assert deep.cuda_graph[0] - shallow.cuda_graph[0] > 0.15 * GiB  # the plan's
    assert abs(deep.cuda_graph[0] - deep.cuda_graph[1]) <= 0.1 * GiB
    seven = runs["k7-tp1-serve-defaults-dspark"]  # out of sample: its role was fixed before it ran
    assert seven.role == "validation" and abs(seven.cuda_graph[0] - seven.cuda_graph[1]) <= 0.02 * seven.cuda_graph[1]


def test_the_mla_eagle3_draft_meets_vllm_at_full_width_and_on_a_tp8_rank(runs) -> None:
    """Every recorded run with an EAGLE3 draft that vLLM sized a pool for (the 4-layer slice at full width through
    Serve, the TP8 rank slice of deploy/config.yaml's stage 1): the draft's profile-run step (its generic MLA's
    stand-in for the chunked-context kv_b_proj output, memory.eagle3_mla_profile_bytes), its RoPE table and its own
    CUDA graphs bring plan and vLLM together. Before: profile -40.7 % / +5.9 %, CUDA graphs -35 % / -46 %, KV pool
    +6.9 % / +1.5 % (the plan over: the unsafe direction)."""
    eagle = {k: r for k, r in runs.items() if "eagle3" in r.name and r.kv[1] is not None and r.kv[0]}
    assert {"serve-one-gpu-eagle3-mla", "r44-s1-eagle3-mla"} <= set(eagle)
    for r in eagle.values():
        # No target or profile constant is fitted on an EAGLE3 run: round 54's two fit runs (ranks-round41-h100) fit
        # the drafter's own graph group alone (memory.EAGLE3_GRAPH_FIT_RUNS).
        assert r.name not in memory.CUDA_GRAPH_FIT_RUNS + memory.PROFILE_FIT_RUNS, r.name
        assert abs(accuracy.RunAccuracy.error(r.weights)) <= 0.001, (r.name, r.weights)
        assert -0.07 <= accuracy.RunAccuracy.error(r.profile) <= 0.1, (r.name, r.profile)  # over: the safe side
        # The drafter's graphs cost each capture manager's largest graph (memory.eagle3_drafter_graphs_bytes, fitted
        # on round 54's two fit runs): every validation run within 2.6 % (the TP8 rank +2 %, 64 requests -1 %, round
        # 64's two at 96 requests +2.6 %, 0.05 GiB over: the safe side). Each graph charged the target's per-graph
        # cost, as until the forty-fourth session, was 5 % to 34 % over.
        assert -0.02 <= accuracy.RunAccuracy.error(r.cuda_graph) <= 0.027, (r.name, r.cuda_graph)
        # The pool over vLLM's at most 1 % (the unsafe side, inside the KV band; 0.5 % the most, round 54's 512
        # requests), under it within issue 23's 3 %:
        # r44-s1-eagle3-mla is -1.2 % since the allocator's rounding put its weights exact (its profile is over).
        # Round 50's 16,384 tokens at 0.90 was -4.2 % of a 2.40 GiB pool while the drafter's graphs were 0.11 GiB
        # over: +0.3 % now.
        assert -0.03 <= accuracy.RunAccuracy.error(r.kv) <= 0.01, (r.name, r.kv)
    full = eagle["serve-one-gpu-eagle3-mla"]
    assert abs(full.profile[0] - full.profile[1]) <= 0.15 * GiB  # 7.58 / 7.61 GiB (7.47 before the speculator buffer)


def test_dspark_profile_run_draft_logits_follow_vllms_dummy_batch(runs) -> None:
    """vLLM 0.32's profile run drafts on its dummy batch: ``min(max_num_seqs, max_num_batched_tokens //
    num_query_per_req)`` requests, each with ``num_speculative_tokens`` logit rows (DSpark samples from the anchor).
    Without that term the full-width DSpark slices at 768 sequences ran -9.6 % on the profile (the unsafe side) and
    the 1024-sequence run without a draft +16 %: one sampler factor cannot serve both."""
    from kimi_k3_serve.planning.memory import dspark_markov_step_bytes, dspark_profile_logit_rows

    assert dspark_profile_logit_rows(8192, 768, 7) == 768 * 7
    assert dspark_profile_logit_rows(2048, 1024, 7) == (2048 // 7) * 7  # the token budget caps the requests
    # _sample_sequential's Markov loop: step i-1's bias and logits beside step i's (three requests x vocab bf16
    # tensors, two with one position), and head_hidden and sample_hidden (rows x the draft's hidden size each).
    assert dspark_markov_step_bytes(256, 3, 163840, 7168) == 3 * 256 * 163840 * 2 + 2 * 768 * 7168 * 2
    assert dspark_markov_step_bytes(256, 1, 163840, 7168) == 2 * 256 * 163840 * 2 + 2 * 256 * 7168 * 2
    # 3 speculative tokens, where the Markov loop is as large as the base logits (round 40): 1.62 / 1.77 GiB (-8.2 %)
    # while the fitted copies stood for it.
    dspark3 = runs["k4-tp1-b2048-s256-dspark3-u0945-h100"]
    assert abs(accuracy.RunAccuracy.error(dspark3.profile)) <= 0.02, dspark3.profile
    for name in ("k6-tp1-b8192-s768-dspark-u088", "k6-tp1-b8192-s768-dspark-u0905", "k6-tp1-b8192-s768-dspark-u092"):
        assert runs[name].role == "validation"
        assert abs(accuracy.RunAccuracy.error(runs[name].profile)) <= 0.05, (name, runs[name].profile)
        assert abs(accuracy.RunAccuracy.error(runs[name].kv)) <= 0.015, (name, runs[name].kv)


KDA_PEAK_DSPARK_RUNS = {"k4-tp1-b4096-s128-dspark": "fit", "k6-tp1-b4096-s128-dspark": "fit",
                        "k8-tp1-b4096-s32-dspark": "fit", "k4-tp1-b8192-s256-u080": "fit",
                        "k5-tp1-b2048-s64-dspark": "validation", "k6-tp1-b2048-s32-dspark": "validation",
                        "k7-tp1-b3072-s64-dspark": "validation", "k5-tp1-b4096-s128-dspark": "validation",
                        "k6-tp1-b4096-s96-dspark-u090": "validation", "k8-tp1-b4096-s48-dspark": "validation",
                        "k8-tp1-b4096-s64-dspark": "validation", "serve-one-gpu": "validation",
                        "k4-tp1-b3072-s32-dspark-h100": "validation", "k4-tp1-b6144-s16-dspark-h100": "validation",
                        "k4-tp1-b12288-s16-dspark-h100": "validation", "k4-tp1-b8192-s32-dspark-h100": "validation",
                        "k4-tp1-b8192-s256-dspark-u0945-h100": "validation",
                        "k4-tp1-b8192-s256-dspark-u095-h100": "validation"}
"""Full-width slices with DSpark whose profile peak the plan puts in a KDA layer's forward (the ``-h100`` runs: on an
H100 80GB, scored out of sample, the term chosen before they were defined). The profile's allocated and requested
peaks, logged on the round-25 runs, differ by 19 MiB with DSpark and 12 MiB without: the hidden states the term counts
are requested memory, not the allocator's rounding."""


@pytest.mark.parametrize("name", sorted(KDA_PEAK_DSPARK_RUNS))
def test_a_dspark_draft_adds_hidden_states_to_a_kda_layers_peak(runs, name) -> None:
    """Where a KDA layer's forward sets the profile's peak, DSpark adds about one hidden state of
    max_num_batched_tokens rows there beyond the aux hidden states (``DSPARK_KDA_PEAK_HIDDEN_COPIES``, fitted): without
    it the plan was under vLLM's by 0.011 to 0.131 GiB at 2,048 to 8,192 tokens on every such run (fit and validation
    alike; docs/gpu-runs.md, round 23), and k8-tp1-b4096-s64-dspark's pool of 0.63 GiB 8.45 % over vLLM's."""
    run = runs[name]
    assert run.role == KDA_PEAK_DSPARK_RUNS[name]
    report, _ = accuracy.predict_run(next(d for d in accuracy.run_dirs() if d.name == name))
    activation = next(e for e in report.estimates if e.name == "activation_bytes")
    assert activation.basis.startswith("a KDA layer's forward"), activation.basis
    assert "hidden states the draft adds there" in activation.basis, activation.basis
    assert abs(accuracy.RunAccuracy.error(run.profile)) <= 0.01, run.profile


def test_dspark_draft_logits_peak_apart_from_the_targets_forward(runs) -> None:
    """DSpark's propose runs once the target's forward has returned: its draft logits peak beside what the forward
    leaves held, not on top of its peak. Stage 1's TP8 rank at 16,384 tokens profiled 7.74 GiB at 16 sequences and
    7.91 GiB at 256 (H200): the 1,680 more logit rows hide under the forward's peak, and only the held
    max_num_seqs x vocab buffers grow. At 4,096 tokens and 512 sequences the logits set the peak. Added on top (before
    2026-12-03) the 256-sequence run was planned 0.46 GiB over and its KV pool 18 % under vLLM's."""
    small, large = runs["r44-s1-dspark-b16384-s16"], runs["r44-s1-dspark-u080-b16384-s256"]
    assert (small.role, large.role) == ("fit", "validation")
    assert abs(large.profile[0] - large.profile[1]) <= 0.1 * GiB, large.profile
    assert large.profile[0] - small.profile[0] <= 0.2 * GiB  # the held buffers alone: 240 x 163,840 x 4 B x 1.15
    assert abs(accuracy.RunAccuracy.error(large.kv)) <= 0.07, large.kv  # -17.8 % before; what is left: CUDA graphs
    step_bound = runs["r44-s1-dspark-b4096-s512"]
    assert step_bound.role == "validation"
    assert abs(step_bound.profile[0] - step_bound.profile[1]) <= 0.15 * GiB, step_bound.profile
    assert abs(accuracy.RunAccuracy.error(step_bound.kv)) <= 0.01, step_bound.kv


def test_the_mla_eagle3_profile_step_is_vllms_shapes() -> None:
    """The shapes, by hand from vLLM 0.32's code (memory.eagle3_mla_profile_bytes): at full width, 8,192 tokens, 64
    sequences, max_model_len 8,192 and the hybrid block of 5,888 tokens vLLM logged, the stand-in is
    round_up(min(max(8 x 8192, 4 x 64 x 5888), 65536), 5888) = 70,656 rows x 96 heads x (128 + 128) x 2 B; held:
    8,192 tokens x (7,168 x (1 + 3 aux + 4) + 2 x 7,168 + 2,112 + 2,048 + 96 x 192 + 96 x 128) x 2 B. Their sum less
    the speculator's hidden-state buffer (held from the runner's start, before the step), 4.75 GiB, is vLLM's
    transient peak of that run (6.27 - 1.51 GiB in its log); the drafter's graphs are the 51 + 33 + 11 and 19 + 9 + 5
    the H200 logged."""
    from kimi_k3_serve.planning.memory import (
        cuda_graph_capture_sizes, eagle3_draft_graphs, eagle3_mla_profile_bytes, mla_chunked_prefill_rows,
        uniform_decode_graph_tokens,
    )

    assert mla_chunked_prefill_rows(8192, 64, 5888) == 70656
    assert mla_chunked_prefill_rows(32768, 16, 768) == 66048
    assert mla_chunked_prefill_rows(1024, 1, 16) == 8192
    model = inventory_from_config(slice_text_config(read_config("kimi-k3")[0], 4), name="kimi-k3-slice")
    draft = inventory_from_config(slice_draft_config(read_config("kimi-k3-eagle3-mla")[0], 4), name="eagle3-mla")
    held, stand_in = eagle3_mla_profile_bytes(model, draft, 1, 8192, 64, 8192, 5888)
    assert stand_in == 70656 * 96 * 256 * 2
    assert held == 8192 * (7168 * 8 + 2 * 7168 + 2112 + 2048 + 96 * 192 + 96 * 128) * 2
    buffer = 8192 * 7168 * 2
    assert abs((held - buffer + stand_in) / GiB - (6.27 - 1.51)) <= 0.02
    _, tp8 = eagle3_mla_profile_bytes(model, draft, 8, 8192, 16, 32768, 768)  # 12 heads a rank
    assert tp8 == 66048 * 12 * 256 * 2
    up_to_512 = cuda_graph_capture_sizes(64, 4, 8192, (9, 0))  # 64 sequences, k = 3
    up_to_128 = cuda_graph_capture_sizes(16, 4, 8192, (9, 0))  # 16 sequences, k = 3
    assert (len(up_to_512), up_to_512[-1], len(up_to_128), up_to_128[-1]) == (51, 512, 19, 128)
    full_512, full_128 = uniform_decode_graph_tokens(up_to_512, 64, 4), uniform_decode_graph_tokens(up_to_128, 16, 4)
    assert eagle3_draft_graphs(up_to_512, 64, 3, full_512) == 51 + 33 + 11
    assert eagle3_draft_graphs(up_to_128, 16, 3, full_128) == 19 + 9 + 5
    # One step: FULL prefill graphs at 2, 4, 8, 16, 24 and 32 tokens, and no decode manager.
    assert eagle3_draft_graphs(up_to_128, 16, 1, uniform_decode_graph_tokens(up_to_128, 16, 2)) == 19 + 6
    assert eagle3_draft_graphs(up_to_128, 16, 3, []) == 19  # PIECEWISE only


def test_the_eagle3_drafters_graphs_cost_each_capture_managers_largest_graph() -> None:
    """vLLM 0.32 captures the drafter's prefill manager (k + 1 tokens a request) and decode manager (one) each on a
    stream of its own, and a drafter graph keeps no tensor: the estimate grows with each manager's largest graph's
    requests, not with the number of graphs (64 -> 128 requests doubled the drafter's share, 256 -> 512 added 0.2 GiB
    over 16 more graphs). The prefill manager's largest FULL graph stops at 512 tokens (128 requests of 4)."""
    from kimi_k3_serve.planning.memory import (
        EAGLE3_DRAFTER_DECODE_PER_REQUEST, EAGLE3_DRAFTER_GRAPHS_BASE, EAGLE3_DRAFTER_PER_PREFILL_REQUEST,
        cuda_graph_capture_sizes, eagle3_drafter_graphs_bytes, uniform_decode_graph_tokens,
    )

    def cost(seqs: int, num_spec: int = 3, full: bool = True) -> int:
        sizes = cuda_graph_capture_sizes(seqs, num_spec + 1, 8192, (9, 0))
        full_tokens = uniform_decode_graph_tokens(sizes, seqs, num_spec + 1) if full else []
        return eagle3_drafter_graphs_bytes(sizes, seqs, num_spec, full_tokens)[0]

    def expected(prefill: int, decode: int) -> int:
        return (EAGLE3_DRAFTER_GRAPHS_BASE + prefill * EAGLE3_DRAFTER_PER_PREFILL_REQUEST
                + decode * EAGLE3_DRAFTER_DECODE_PER_REQUEST)

    assert cost(32) == expected(32, 32)
    assert cost(128) == expected(128, 128)
    assert cost(512) == expected(128, 512)
    assert cost(1024) == expected(128, 512)  # the decode manager's sizes stop at the largest capture, 512
    assert cost(64, num_spec=1) == expected(64, 0)  # one speculative token: no decode manager
    assert cost(64, full=False) == expected(0, 0)  # PIECEWISE only


def two_gpu_run(name: str):
    """(plan, vLLM's reading) of a 2 x H200 run of the 4-layer slice + DSpark, with the run's own engine kwargs."""
    run = TWO_GPUS / name
    kwargs = json.loads((run / "spec.json").read_text())["engine_kwargs"]
    reading = parse_vllm_log(recorded.read_text(run / "vllm.log"))
    host = json.loads((TWO_GPUS / "host.json").read_text())["torch_devices"][0]["total_bytes"]
    slice4 = inventory_from_config(slice_text_config(read_config("kimi-k3")[0], 4), name="slice")
    dspark = inventory_from_config(slice_draft_config(read_config("kimi-k3-dspark")[0], 4), name="dspark")
    draft = kwargs["speculative_config"]
    engine = EngineSettings(max_model_len=kwargs["max_model_len"], max_num_seqs=kwargs["max_num_seqs"],
                            max_num_batched_tokens=kwargs["max_num_batched_tokens"],
                            gpu_memory_utilization=kwargs["gpu_memory_utilization"],
                            speculative=SpeculativeSettings(draft["method"], draft["num_speculative_tokens"], draft=dspark))
    layout = Layout(tp=kwargs["tensor_parallel_size"], pp=kwargs["pipeline_parallel_size"],
                    dp=kwargs.get("data_parallel_size", 1), ep=kwargs.get("enable_expert_parallel", False))
    free = reading.workers[0].free_at_start_bytes
    return estimate_memory(slice4, layout, engine, RankDevice(host, (9, 0), free_bytes=free, name="NVIDIA H200")), reading


def test_tp2_weights_per_rank_are_what_vllm_loaded_on_each_h200() -> None:
    # The 4-layer slice with its DSpark draft at TP2 (vLLM 0.32, 2 x H200): each rank loaded 30.03 GiB. The plan once
    # missed 0.21 GiB a rank: the draft's fp32 RoPE table (whole on every rank) and counted W_UK_T/W_UV, views of
    # kv_b_proj, as copies.
    report, reading = two_gpu_run("rehearse-tp2")
    assert len(report.ranks) == 2
    for rank in report.ranks:
        measured = reading.worker_of_rank(rank.rank).model_load_bytes  # printed to 2 decimals: +-0.005 GiB
        assert abs(rank.weights_bytes + rank.draft_bytes - measured) <= 0.005 * GiB + 0.005 * measured, (rank.rank, measured)


def test_dp2_ep2_pool_is_not_over_predicted() -> None:
    # DP2 x EP2 on one node, one engine per GPU: the experts run on both DP ranks' tokens (all-gathered), which the
    # profile saw (2.56 GiB besides weights against 2.16 GiB at TP1 with the same settings). The plan's pool lies
    # within 1 % of vLLM's, and with the measured bands against it (what the verdict proves) below it.
    from kimi_k3_serve.planning.bands import kv_band_bytes

    report, reading = two_gpu_run("k4-dp2-ep2-serve-defaults-dspark")
    w = reading.workers[0]
    plan = report.ranks[w.rank]
    band = kv_band_bytes(plan.weights_bytes, plan.activation_bytes + plan.non_torch_bytes, plan.cuda_graph_bytes)
    assert plan.kv_cache_bytes - band <= w.available_kv_bytes
    assert abs(plan.kv_cache_bytes - w.available_kv_bytes) <= 0.01 * w.available_kv_bytes


def test_tp2_pool_within_3_percent_and_not_over_with_its_bands() -> None:
    # TP2 on one node: vLLM's split shows no TP-group non-torch beyond TP1's (NON_TORCH_TP1 holds at TP2). The
    # refitted CUDA-graph estimate is near vLLM's (2.52 GiB) on either side, so the pool is within 3 % of vLLM's, and
    # below it with the measured bands against it (what the verdict proves).
    from kimi_k3_serve.planning.bands import kv_band_bytes

    report, reading = two_gpu_run("rehearse-tp2")
    for rank in report.ranks:
        w = reading.worker_of_rank(rank.rank)
        if w.available_kv_bytes is None:  # only rank 0 prints it
            continue
        band = kv_band_bytes(rank.weights_bytes, rank.activation_bytes + rank.non_torch_bytes, rank.cuda_graph_bytes)
        assert rank.kv_cache_bytes - band <= w.available_kv_bytes
        assert abs(w.available_kv_bytes - rank.kv_cache_bytes) <= 0.03 * w.available_kv_bytes


def test_plan_names_the_warmup_oom_and_a_safe_utilization() -> None:
    slice4 = inventory_from_config(slice_text_config(read_config("kimi-k3")[0], 4), name="slice")
    dspark = inventory_from_config(slice_draft_config(read_config("kimi-k3-dspark")[0], 4), name="dspark")
    spec = SpeculativeSettings("dspark", 7, draft=dspark)
    offline = EngineSettings(max_model_len=8192, max_num_seqs=1024, max_num_batched_tokens=16384, speculative=spec)
    r = estimate_memory(slice4, Layout(), offline, H200)
    assert r.verdict == "oom_at_warmup" and not r.fits
    assert r.ranks[0].warmup_shortfall_bytes > GiB
    assert any("would OOM allocating the KV cache or in warmup on rank 0" in n for n in r.notes)
    assert r.safe_gpu_memory_utilization is not None and r.safe_gpu_memory_utilization < 0.92
    safe = estimate_memory(slice4, Layout(), EngineSettings(
        max_model_len=8192, max_num_seqs=1024, max_num_batched_tokens=16384, speculative=spec,
        gpu_memory_utilization=r.safe_gpu_memory_utilization), H200)
    assert safe.verdict == "fits"


def test_table_sets_plan_beside_vllm_per_gpu() -> None:
    result = json.loads((RUNS / "k4-tp1-serve-defaults-dspark" / "result.json").read_text())
    report, reading = accuracy.predict_run(RUNS / "k4-tp1-serve-defaults-dspark")
    comparison = compare(report, reading)
    table = render_table(comparison, ["GPU 0"])
    assert "GPU 0" in table and "kv_cache" in table and "64.22" in table
    assert "verdict: plan fits, vLLM fits (agree)" in table
    assert result["engine"]["max_num_batched_tokens"] == 2048 and result["generated"]["tokens"] == 64


# -- the command ----------------------------------------------------------------------------------------------------

def test_cuda_visible_devices_picks_the_gpus_nvml_lists() -> None:
    gpus = [GpuInfo(i, f"GPU-{i}aa", "NVIDIA H200", 1, 1, (9, 0), "node") for i in range(2)]
    assert [g.index for g in visible_gpus(gpus, None)] == [0, 1]
    assert [g.index for g in visible_gpus(gpus, "1")] == [1]
    assert [g.index for g in visible_gpus(gpus, "1,0")] == [1, 0]
    assert [g.index for g in visible_gpus(gpus, "GPU-1")] == [1]
    assert visible_gpus(gpus, "7") == [] and visible_gpus(gpus, "") == []


def test_rehearse_without_a_gpu_is_one_clear_line(capsys) -> None:
    assert main(["rehearse", "--config", str(REPO_ROOT / "deploy" / "config.yaml"), "--layers", "4", "--tp", "1",
                 "--pp", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "NVIDIA GPU" in err and "Traceback" not in err


def test_rehearse_layers_too_few_names_the_flag(capsys) -> None:
    assert main(["rehearse", "--config", str(REPO_ROOT / "deploy" / "config.yaml"), "--layers", "3", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --layers: got 3") and "every layer kind" in err


def test_rehearse_deploys_the_apps_engine_kwargs(capsys) -> None:
    from kimi_k3_serve.config.args_adapter import vllm_engine_args_of
    from kimi_k3_serve.config.serve_config import load_serve_app

    assert main(["rehearse", "--config", str(REPO_ROOT / "deploy" / "config.yaml"), "--layers", "4", "--tp", "1", "--pp",
                 "1", "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    args = load_serve_app(REPO_ROOT / "deploy" / "config.yaml").args
    args = args.model_copy(update={"parallel": args.parallel.model_copy(update={
        "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "layer_partition": None}), "speculative":
        args.speculative.model_copy(update={"model": out["engine_kwargs"]["speculative_config"]["model"]})})
    deployed = vllm_engine_args_of(args)
    rehearsed = dict(out["engine_kwargs"])
    assert {rehearsed.pop(k) for k in ("load_format", "skip_tokenizer_init", "distributed_executor_backend")} == {
        "dummy", True, "mp"}
    assert rehearsed == deployed.engine_kwargs  # every kwarg the app deploys, and the limits the app set
    assert out["env"] == deployed.env_vars
    assert out["plan"]["verdict"] == "fits"


def test_rehearse_a_gpu_config_naming_more_gpus_than_the_machine_has() -> None:
    from kimi_k3_serve.commands.rehearse import local_devices

    with pytest.raises(ConfigError, match="NVIDIA GPU"):
        local_devices(2, dry_run=False)  # no NVML here: refused before anything starts
    device, labels = local_devices(16, dry_run=True)
    assert device.name == "H200" and len(labels) == 16


def test_rehearse_refuses_more_gpus_than_the_machine_has() -> None:
    from kimi_k3_serve.commands.rehearse import choose_devices

    gpus = [GpuInfo(i, f"GPU-{i}", "NVIDIA H200", 150109880320, 149561498665, (9, 0), "node") for i in range(2)]
    with pytest.raises(ConfigError, match=r"args.parallel: got '16 GPUs \(tensor x pipeline parallel\)'; at most the 2 GPU"):
        choose_devices(gpus, None, 16, dry_run=False)
    device, labels = choose_devices(gpus, None, 2, dry_run=False)
    assert (device.total_bytes, device.free, labels) == (150109880320, 149561498665, ["GPU 0", "GPU 1"])
    with pytest.raises(ConfigError, match="hides every GPU"):
        choose_devices([], None, 1, dry_run=False)


def test_rehearse_on_a_ray_cluster_plans_the_config_gpu_type(capsys) -> None:
    # With Ray's executor the workers run on the cluster's GPUs: no local GPU is needed, the plan takes args.accelerator.
    assert main(["rehearse", "--config", str(REPO_ROOT / "deploy" / "config-b200.yaml"), "--executor", "ray", "--dry-run",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine_kwargs"]["distributed_executor_backend"] == "ray"
    assert out["gpus"] == [f"rank {r}" for r in range(16)]
    assert {r["total_bytes"] for r in out["plan"]["ranks"]} == {lookup_gpu("B200").total_bytes}


def test_rehearsal_config_is_a_valid_deploy_config(tmp_path, monkeypatch) -> None:
    make_slice = load_script("make_kimi_slice")
    made = make_slice.make_slice(tmp_path, 4)
    assert [p.name for p in made] == ["kimi-k3-slice", "kimi-k3-slice-dspark", "kimi-k3-slice-eagle3",
                                      "kimi-k3-slice-eagle3-mla"]
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(tmp_path / "kimi-k3-slice" / "tokenizer.json")).get_vocab_size() == 163840
    monkeypatch.setenv("KIMI_K3_SERVE_MODEL_CACHE", str(tmp_path))
    check = ["check", "--config", str(REPO_ROOT / "deploy" / "gpu-rehearsal.yaml"), "--cluster"]
    assert main([*check, str(REPO_ROOT / "tests" / "fixtures" / "check" / "h200-2x8.yaml")]) == 0
    # One node cannot hold it: the two pipeline stages go to two nodes, as on the GPU host's two raylets.
    assert main([*check, str(REPO_ROOT / "tests" / "fixtures" / "check" / "h200-1x8.yaml")]) == 1
    assert main(["rehearse", "--config", str(REPO_ROOT / "deploy" / "gpu-rehearsal.yaml"), "--dry-run"]) == 0


def test_nvml_readings_of_the_h200_host_map_to_the_ray_gpu_ids_of_its_two_raylets() -> None:
    # Two raylets on the host, CUDA_VISIBLE_DEVICES=0 and =1: Ray hands each bundle's probe the physical id its raylet
    # sees ("0" on one node, "1" on the other); the node's NVML reading (recorded on the host) lists both GPUs.
    from kimi_k3_serve.checks.replica import BundleProbe, _gpus_by_bundle

    reading = json.loads((RUNS / "host.json").read_text())["nvml"]
    probes = [BundleProbe(0, "node-a", "10.0.0.1", ("0",), reading, 0), BundleProbe(1, "node-b", "10.0.0.1", ("1",), reading, 0)]
    found, missing = _gpus_by_bundle(probes)
    assert missing == []
    assert found[0].uuid == "GPU-28558c17-e135-6c33-72a2-3c4812444375"
    assert found[1].uuid == "GPU-c929b5c1-f804-41a7-72c4-d1580d0a561f"
    # NVML v2's total minus its reserved part is what torch reported on that host (host.json torch_devices).
    assert found[1].total_bytes == json.loads((RUNS / "host.json").read_text())["torch_devices"][1]["total_bytes"]
    _, missing = _gpus_by_bundle([BundleProbe(1, "node-b", "10.0.0.1", ("7",), reading, 0)])
    assert missing == ["bundle 1: GPU 7 not among NVML's [0, 1]"]


def test_replica_start_comparison_on_the_h200_slice_run_compares_capacity_not_block_counts() -> None:
    # vLLM's num_gpu_blocks counts a hybrid pool's blocks per KV-cache group; a plan may count whole block sets (the
    # plan once said 3,460 for this pool). Same capacity, different counts: the comparison goes by tokens.
    from vllm.config.cache import CacheConfig

    from kimi_k3_serve.checks.kv_prediction import compare_kv_cache, comparison_of

    report, reading = accuracy.predict_run(RUNS / "k4-tp1-serve-defaults-dspark")
    engine = json.loads((RUNS / "k4-tp1-serve-defaults-dspark" / "result.json").read_text())["engine"]
    cache = CacheConfig(block_size=engine["block_size"])
    cache.num_gpu_blocks, cache.kv_cache_size_tokens = engine["num_gpu_blocks"], reading.kv_cache_tokens
    c = comparison_of(report, cache)
    assert (c.vllm_blocks, c.vllm_tokens) == (9743, 1_900_348)
    assert c.within_margin and abs(c.error) < 0.01, c.line
    in_block_sets = compare_kv_cache(3_460, report.kv_cache_tokens, 9743, 1_900_348)
    assert in_block_sets.error == c.error and in_block_sets.within_margin


def test_parser_gives_every_worker_its_rank_on_two_gpus() -> None:
    """Under the mp executor only rank 0 logs "is assigned as": the others' ranks come from parallel_state's init
    line and their Worker_TPn / Worker_PPn label (2 x H200, 2026-11-30)."""
    two = REPO_ROOT / "tests" / "fixtures" / "gpu" / "2026-11-30-two-gpus"
    tp2 = parse_vllm_log(recorded.read_text(two / "rehearse-tp2" / "vllm.log"))
    assert [(w.rank, w.pp_rank, w.tp_rank) for w in tp2.workers] == [(0, 0, 0), (1, 0, 1)]
    assert tp2.worker_of_rank(1).model_load_bytes == round(30.03 * GiB)
    pp2 = parse_vllm_log(recorded.read_text(two / "k4-pp2-serve-defaults-dspark" / "vllm.log"))
    assert [(w.rank, w.pp_rank, w.tp_rank) for w in pp2.workers] == [(0, 0, 0), (1, 1, 0)]
    assert pp2.worker_of_rank(1).model_load_bytes == round(40.68 * GiB)  # the last stage holds the draft
    two_nodes = parse_vllm_log(recorded.read_text(two / "serve-two-nodes" / "vllm.log"))  # Ray workers: both log it
    assert [(w.rank, w.pp_rank) for w in two_nodes.workers] == [(0, 0), (1, 1)] and two_nodes.started


def test_unifiable_pages_refused_by_vllm_read_as_refused() -> None:
    from kimi_k3_serve.rehearsal.vllm_log import EngineReading

    line = ("(EngineCore pid=1) ERROR 11-30 [core.py:1] NotImplementedError: Layer model.layers.9.self_attn.attn: page size "
            "is not divisible by the maximum page size and cannot be padded. Padding is only supported for non-MLA attention layers.")
    assert measured_verdict(parse_vllm_log(line)) == "refused"
    assert measured_verdict(EngineReading(workers=(), last_step="start", oom=None, errors=())) == "unknown"


def test_rehearse_start_anyway_where_the_plan_refuses(capsys) -> None:
    """The plan refuses a GQA EAGLE3 draft beside the slice's MLA pages; --start-anyway still starts vLLM (here a
    dry run: what it would start), so vLLM's own verdict is read beside the plan's."""
    flags = ["rehearse", "--model", "moonshotai/Kimi-K3", "--layers", "8", "--max-model-len", "8192",
             "--speculative-config", '{"method": "eagle3", "model": "kimi-k3-eagle3", "num_speculative_tokens": 3}',
             "--dry-run", "--json"]
    assert main(flags) == 2  # without it: one clear line, exit 2
    assert "cannot unify these page sizes" in capsys.readouterr().err
    assert main([*flags, "--start-anyway"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["verdict"] == "refused" and "page" in out["plan"]["refusal"]
    assert out["engine_kwargs"]["speculative_config"]["method"] == "eagle3"


def test_plan_sizes_the_slice_with_the_mla_eagle3_where_the_gqa_one_is_refused() -> None:
    """The 8-layer slice on an H200 with the matrix's settings: the GQA EAGLE3 draft's page cannot be unified with the
    slice's MLA page, the MLA EAGLE3 draft's layer joins the target's MLA group and the plan sizes a pool. The draft's
    profile-run stand-in (3.2 GiB at 96 heads, memory.eagle3_mla_profile_bytes) leaves fewer blocks than the 256
    sequences' KDA state blocks: vLLM would refuse to capture its graphs."""
    model = inventory_from_config(slice_text_config(read_config("kimi-k3")[0], 8), name="kimi-k3-slice")

    def engine(draft_name: str) -> EngineSettings:
        draft = inventory_from_config(slice_draft_config(read_config(draft_name)[0], 8), name=draft_name)
        return EngineSettings(max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=256, gpu_memory_utilization=0.92,
                              speculative=SpeculativeSettings("eagle3", 3, draft=draft))

    with pytest.raises(ConfigError, match="cannot unify these page sizes"):
        estimate_memory(model, Layout(tp=1), engine("kimi-k3-eagle3"), H200)
    report = estimate_memory(model, Layout(tp=1), engine("kimi-k3-eagle3-mla"), H200)
    # Never run on a GPU at these limits (scripts/gpu/matrix.py starts it anyway for vLLM's verdict).
    assert report.verdict == "seqs_over_state_blocks" and 1 < report.num_blocks < 256 and report.max_concurrency > 1
    (rank,) = report.stage_ranks()
    # Three MLA layers (two of the slice's, the draft's) in one group of three pages; no padding layer.
    assert report.num_kv_groups == 3 and rank.bytes_per_block == 3 * rank.page_bytes
    assert rank.draft_bytes > 0 and rank.num_blocks > 0


def test_rehearse_dry_run_with_the_mla_eagle3_draft(capsys) -> None:
    """No page refusal (the GQA draft's exit 2). With vLLM's defaults (8,192 batched tokens, 256 sequences) and with
    the matrix job's limits the slice's KDA state blocks run short of 256 sequences (at the job's limits by less than
    the measured bands, so "at risk", until the twenty-second session charged the drafter's graphs the target's
    per-PIECEWISE-graph cost: 0.3 GiB more on this slice, the safe side); at 64 the plan fits."""
    flags = ["rehearse", "--model", "moonshotai/Kimi-K3", "--layers", "8", "--speculative-config",
             '{"method":"eagle3","model":"kimi-k3-eagle3-mla","num_speculative_tokens":3}', "--dry-run", "--json"]
    assert main(flags) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["verdict"] == "seqs_over_state_blocks" and "refusal" not in out["plan"]
    assert out["engine_kwargs"]["speculative_config"]["method"] == "eagle3"
    assert main([*flags, "--max-num-batched-tokens", "2048", "--max-num-seqs", "256", "--gpu-memory-utilization", "0.92",
                 "--max-model-len", "8192"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["verdict"] == "seqs_over_state_blocks"
    assert main([*flags, "--max-num-batched-tokens", "2048", "--max-num-seqs", "64", "--gpu-memory-utilization", "0.92",
                 "--max-model-len", "8192"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["verdict"] == "fits"


@pytest.mark.parametrize("job", accuracy.matrix.SETS["tp8"], ids=lambda j: j.name)
def test_the_eight_gpu_matrix_fits_eight_h200s_in_the_layout_it_names(job, capsys) -> None:
    """Each job of the 8-GPU set, dry-run as the host will start it: vLLM's kwargs name its TP x PP, it takes all
    eight GPUs, and the plan fits (a job the plan refused would measure nothing of the per-rank layout)."""
    assert main(["rehearse", *job.args, "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    kwargs = out["engine_kwargs"]
    assert kwargs["tensor_parallel_size"] * kwargs["pipeline_parallel_size"] == job.gpus == len(out["gpus"]) == 8
    assert out["plan"]["verdict"] == "fits", out["plan"]
    ranks = out["plan"]["ranks"]
    assert len(ranks) == 8 and {r["pp_stage"] for r in ranks} == set(range(kwargs["pipeline_parallel_size"]))


@pytest.mark.parametrize("job", accuracy.matrix.SETS["stages-tp8"], ids=lambda j: j.name)
def test_each_stage_job_is_its_stage_at_tp8_with_nvls_as_it_names(job, capsys) -> None:
    """Each job of the stage set, dry-run as the 8-GPU host will start it: the stage of deploy/config.yaml at TP8 and
    PP 1 on all eight GPUs, the draft on stage 1 only, the plan fitting, NCCL's NVLS set in the engine's env as the job
    names it, and the plan counting NVLS buffers (256 MiB per GPU) exactly when it is on."""
    from kimi_k3_serve.planning.memory import NON_TORCH_TP_MULTI

    assert main(["rehearse", *job.args, "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    kwargs, section = out["engine_kwargs"], out["stage_of"]
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"], len(out["gpus"])) == (8, 1, 8)
    assert section["layers"] == ([0, 49] if section["stage"] == 0 else [49, 93]) and section["tp"] == 8
    assert ("speculative_config" in kwargs) == (section["stage"] == 1)
    assert out["plan"]["verdict"] == "fits", out["plan"]
    on = job.name.endswith("nvls-on")
    assert out["env"]["NCCL_NVLS_ENABLE"] == ("2" if on else "0")
    assert {r["non_torch_bytes"] for r in out["plan"]["ranks"]} == {NON_TORCH_TP_MULTI + (256 * 2**20 if on else 0)}


def test_engine_processes_that_outlive_the_run_are_stopped(tmp_path) -> None:
    """A DP rank leaves with os._exit and its engine core is orphaned with the GPU: the rehearsal remembers every
    process the run started and stops those still alive when it ends."""
    import subprocess
    import sys
    import time

    import psutil

    from kimi_k3_serve.commands.rehearse import _Descendants

    orphan_pid = tmp_path / "orphan.pid"
    script = ("import os, subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              f"open({str(orphan_pid)!r}, 'w').write(str(p.pid))\n"
              "time.sleep(3)\nos._exit(0)\n")
    run = subprocess.Popen([sys.executable, "-c", script])
    seen = _Descendants(run.pid)
    while run.poll() is None:
        seen.update()
        time.sleep(0.2)
    orphan = psutil.Process(int(orphan_pid.read_text()))
    assert orphan.is_running()  # outlived the run
    assert seen.kill_survivors() == 1
    assert not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE


def test_the_fitted_memory_constants_are_the_fit_of_their_fit_runs_alone() -> None:
    """planning/memory.py's fitted constants (the CUDA-graph group, the profile's non-torch and sampler factor) are
    what scripts/fit_memory_constants.py fits on the runs each group names, all of them fit runs of the matrix, to the
    precision the file keeps: no constant is tuned by hand, and no validation run enters a fit."""
    fitter = load_script("fit_memory_constants")
    for group in fitter.GROUPS:
        rows = fitter.design(group)
        fits = [r for r in rows if r.role == "fit"]
        assert {r.name for r in fits} == set(group.fit_runs), group.name
        assert all(r.role != "validation" for r in fits)
        kept = fitter.shipped(group, fitter.fit(fits))
        for i, ((name, key), value) in enumerate(zip(group.constants, kept)):
            shipped = getattr(memory, name) if key is None else getattr(memory, name)[key]
            precision = 0.006 if i in group.integer_scale else 0.011 * 2**20  # a factor to 0.01, bytes to 0.01 MiB
            assert abs(shipped - value) <= precision, (name, key, shipped, value)


def test_each_band_covers_its_terms_errors_on_every_validation_run(runs) -> None:
    """planning/bands.py: each estimated term's band is at least the largest error in the unsafe direction (the plan
    below vLLM) that a validation run showed for that term; a fit run's residual does not count."""
    from kimi_k3_serve.planning.bands import CUDA_GRAPHS, PROFILE, PROFILE_OTHER_FAMILIES, WEIGHTS

    checked = 0
    for r in runs.values():
        if r.role != "validation":
            continue
        profile = PROFILE_OTHER_FAMILIES if r.name.startswith(OTHER_FAMILIES) else PROFILE
        for band, (plan, measured) in ((WEIGHTS, r.weights), (profile, r.profile), (CUDA_GRAPHS, r.cuda_graph)):
            if plan and measured:
                assert measured - plan <= band.of(plan), (r.name, band.name, plan, measured)
                checked += 1
    assert checked >= 40


def test_the_fitters_non_torch_probe_reaches_every_profile_run() -> None:
    """Every profile run's plan counts ``NON_TORCH_TP1`` once, the TP2 run's too: a byte more of it is a byte more
    of the plan. An alias bound at import (``NON_TORCH_TP2 = NON_TORCH_TP1``) once hid the TP2 fit run from the
    probe, and the fitter needed a second ``--write`` to reach its own fit."""
    from conftest import load_script

    fitter = load_script("fit_memory_constants")
    group = next(g for g in fitter.GROUPS if g.name == "profile")
    i = group.constants.index(("NON_TORCH_TP1", None))
    rows = fitter.design(group)
    assert "rehearse-tp2" in {r.name for r in rows}
    assert {r.name: r.per_constant[i] for r in rows} == {r.name: 1 for r in rows}


def test_every_recorded_real_capture_stayed_within_vllms_estimate() -> None:
    """The plan budgets vLLM's CUDA-graph estimate; vLLM sizes the KV cache after deducting it and captures the real
    graphs later, into what it left. On every GPU a recorded run captured on, the real capture took no more than the
    estimate, so the estimate the plan predicts bounds it (42 GPUs on 2026-12-02, the least room 0.13 GiB). A new
    fixture that breaks this means the plan needs a capture term of its own."""
    captures = accuracy.captures_against_estimates()
    assert len(captures) >= 42
    over = [(run, estimate, actual) for run, estimate, actual in captures if actual > estimate]
    assert not over, over


FORWARD_PEAK_RUNS = ("r23-s0-pp4", "r31-s1-pp3", "r44-s1-nodraft", "r49-s0", "b200-r50-s0", "r49-s0-b2048-s512",
                     "r49-s0-b16384-s64-u090", "r49-s0-b16384-s16", "r31-s1-pp3-b16384", "r49-s0-b12288-s128-u090")
"""TP8 rank slices without a draft whose vLLM log splits the profile: 23 to 50 layers at 2,048 to 16,384 tokens. The
last three ran after the forward's peak was read from vLLM's code (2026-12-02, round 5)."""


@pytest.mark.parametrize("name", FORWARD_PEAK_RUNS)
def test_the_kimi_forward_peak_read_from_vllms_code_is_vllms_measured_torch_peak(name, tmp_path) -> None:
    """vLLM's profile reports the torch peak with its CUDA-graph estimate in it; less that estimate it is the
    forward's transient peak (the Marlin workspace is counted apart, as non-torch). The plan's per-token bytes
    (``memory.kimi_forward_peak_bytes_per_token``) times the token budget meet it to vLLM's 0.01 GiB printing; the
    stream count before (6 + blocks + 1) was 0.14 GiB short at 8,192 tokens and 0.27 GiB at 16,384."""
    from kimi_k3_serve.cli import build_parser
    from kimi_k3_serve.commands import rehearse
    from kimi_k3_serve.config.args_adapter import planner_inputs
    from kimi_k3_serve.planning.memory import kimi_forward_peak_bytes_per_token

    run_dir = next(d for d in accuracy.run_dirs() if d.name == name)
    ns = build_parser().parse_args(["rehearse", *accuracy._recorded_flags(run_dir)])
    with accuracy._host_model_cache(tmp_path / "cache"):
        args = rehearse.materialize_rank_slice(rehearse.serve_args_of(ns), tmp_path, ns.rank_of)[0]
        model, engine, _ = planner_inputs(args)
    total = json.loads((run_dir.parent / "host.json").read_text())["torch_devices"][0]["total_bytes"]
    log = recorded.read_text(run_dir / "vllm.log", errors="replace")
    worker = parse_vllm_log(log, device_total_bytes=total).workers[0]
    measured = worker.peak_activation_bytes - worker.cuda_graph_estimate_bytes
    planned = engine.max_num_batched_tokens * kimi_forward_peak_bytes_per_token(model, 0, len(model.layers))
    assert abs(planned - measured) <= 0.01 * GiB, (name, planned / GiB, measured / GiB)
