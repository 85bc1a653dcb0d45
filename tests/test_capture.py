"""The CUDA-graph capture after warmup (kimi_k3_serve/planning/capture.py): KDA's gathered states at the largest
PIECEWISE graph, and the verdict and proposal that follow, against rounds 27, 30 and 32's H100 runs."""

from __future__ import annotations

import re

import pytest

from conftest import load_script
from kimi_k3_serve import recorded
from kimi_k3_serve.planning.capture import (
    capture_prefill_requests,
    expandable_segments,
    gathered_states_bytes,
    warmup_prefill_requests,
)

ACCURACY = load_script("memory_accuracy")
ROUND30 = ACCURACY.FIXTURES / "2026-12-06-round30"


@pytest.mark.parametrize("seqs, query_len, largest, requests", [
    (384, 1, 512, 384),  # round 30: 512 tokens over 384 requests, some of two tokens: KDA's prefill path
    (128, 1, 256, 128),
    (256, 8, 512, 0),  # DSpark's 8-token decodes fill 256 x 8 > 512: a decode batch gathers nothing
    (32, 8, 512, 32),
])
def test_the_largest_capture_gathers_a_state_per_request_once_past_the_decode_batch(seqs, query_len, largest,
                                                                                    requests) -> None:
    assert capture_prefill_requests(seqs, query_len, largest) == requests


def test_the_gathered_states_are_the_request_that_ran_out_of_memory_in_capture() -> None:
    """Round 30, no draft at 384 sequences and the proposal of the plan without this term (0.96): vLLM asked for one
    (384, 96, 128, 128) fp32 block in gather_initial_states while capturing, and ran out of memory."""
    log = recorded.read_text(ROUND30 / "k4-tp1-b6144-s384-nodraft-u096-h100" / "vllm.log", errors="replace")
    assert "gather_initial_states" in log and "capture_model" in log
    asked = {int(n) for n in re.findall(r"trying to allocate (\d+) bytes", log)}
    assert asked == {gathered_states_bytes(384, 96, 128, 4)} == {2_415_919_104}


@pytest.mark.parametrize("fixture, verdict, measured", [
    ("2026-12-06-round30/k4-tp1-b6144-s384-nodraft-u096-h100", "oom_at_warmup", "oom_at_warmup"),
    ("2026-12-06-round32/k4-tp1-b6144-s384-nodraft-u0905-h100", "fits", "fits"),  # the proposal with the term
    ("2026-12-06-round27/k4-tp1-b8192-s256-nodraft-u095-h100", "fits", "fits"),  # the capture passed at 2.89 x
    ("2026-12-06-round30/k4-tp1-b16384-s128-nodraft-u089-h100", "fits", "fits"),
])
def test_the_verdict_keeps_room_for_the_capture_and_its_reserve(fixture, verdict, measured) -> None:
    from kimi_k3_serve.rehearsal.compare import measured_verdict

    report, reading = ACCURACY.predict_run(ACCURACY.FIXTURES / fixture)
    assert (report.verdict, measured_verdict(reading)) == (verdict, measured)


def test_the_proposal_for_round_30s_shape_is_where_vllm_started() -> None:
    """Without the capture term the plan proposed 0.96, where the capture ran out of memory; with it, 0.905, where
    vLLM started (round 32)."""
    report, _ = ACCURACY.predict_run(ROUND30 / "k4-tp1-b6144-s384-nodraft-u096-h100")
    assert report.safe_gpu_memory_utilization == 0.905
    capture = next(e for e in report.estimates if e.name == "capture_kda_gather")
    assert "384 requests" in capture.basis and "2.25 GiB of gathered recurrent states" in capture.basis


def test_between_the_reserves_ends_the_capture_is_at_risk() -> None:
    """Round 30's shape at 0.93, between the proposal (0.905) and the first utilization the capture cannot take:
    short, but within the reserve's band (2.85 down to 1.1 times the request), so "at risk", and the note says so."""
    from kimi_k3_serve.planning.layout import RankDevice
    from kimi_k3_serve.units import MiB

    flags = ["--model", "moonshotai/Kimi-K3", "--engine-kwargs",
             '{"moe_backend": "marlin", "attention_backend": "FLASHMLA"}', "--layers", "4",
             "--max-num-batched-tokens", "6144", "--max-num-seqs", "384", "--max-model-len", "8192",
             "--gpu-memory-utilization", "0.93", "--speculative-config", "none"]
    total = 85_017_493_504  # the H100 80GB of rounds 30 to 32
    report = ACCURACY.predict_flags(flags, RankDevice(total, (9, 0), free_bytes=total - 600 * MiB, name="H100"))
    (rank,) = report.ranks
    assert 0 < rank.warmup_shortfall_bytes <= rank.warmup_band_bytes
    assert report.verdict == "at_risk" and report.safe_gpu_memory_utilization == 0.905
    assert any(n.startswith("at risk: vLLM may OOM in warmup") for n in report.notes)


@pytest.mark.parametrize("env, expandable", [
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512, expandable_segments:True"}, True),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, True),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:true"}, False),  # PyTorch takes only True or False
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, False),
    ({}, False),
    (None, False),
])
def test_expandable_segments_are_read_where_pytorch_reads_them(env, expandable) -> None:
    assert expandable_segments(env) is expandable


def test_round_30s_failed_shape_started_under_expandable_segments_and_the_plan_says_why() -> None:
    """Round 59 (H100, validation, fixed before it ran): round 30's shape and utilization (no draft, 6,144 tokens over
    384, 0.96) with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. vLLM captured its graphs where round 30 ran
    out of memory on the 2.25 GiB gather with 2.27 GiB cached in segments still in use. The plan reads the setting
    from the run's ``--env`` and weighs the gather with the reserve that run measured (in sample: chosen on it): it
    "fits", and the proposal is where it started; the same flags without it still do not fit."""
    from kimi_k3_serve.rehearsal.compare import measured_verdict

    expandable = ACCURACY.FIXTURES / "2026-12-07-round59" / "k4-tp1-b6144-s384-nodraft-u096-expseg-h100"
    report, reading = ACCURACY.predict_run(expandable)
    assert report.engine.env_vars["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert (report.verdict, measured_verdict(reading)) == ("fits", "fits")
    assert report.safe_gpu_memory_utilization == 0.96
    capture = next(e for e in report.estimates if e.name == "capture_kda_gather")
    assert "1.05 times it (where vLLM started under expandable segments; at risk down to 0.00)" in capture.basis
    cached, _ = ACCURACY.predict_run(ROUND30 / "k4-tp1-b6144-s384-nodraft-u096-h100")
    assert cached.verdict == "oom_at_warmup"
    assert [e.bytes for e in report.estimates if e.name != "capture_kda_gather"] == [
        e.bytes for e in cached.estimates if e.name != "capture_kda_gather"]


@pytest.mark.parametrize("name, proposal, verdict, measured", [
    ("k4-tp1-b4096-s448-nodraft-u0945-expseg-h100", 0.945, "fits", "fits"),  # 0.885 without the setting
    ("k4-tp1-b8192-s320-nodraft-u0975-expseg-h100", 0.975, "fits", "fits"),  # 0.93 without it
    ("k4-tp1-b6144-s384-nodraft-u097-expseg-h100", 0.96, "oom_at_warmup", "oom_at_warmup"),  # round 59's shape
])
def test_the_reserve_under_expandable_segments_out_of_sample(name, proposal, verdict, measured) -> None:
    """Round 60 (ranks-round43-h100, H100, validation, fixed before it ran; the reserve was chosen on round 59 alone):
    the proposals under the setting at two new shapes started, and round 59's shape 0.01 above it ran out of memory
    in kernel warmup, as the plan said. Under expandable segments PyTorch's only trace of that failure (inside
    FlashMLA, through the stable ABI) is its "memory mapping failed with OOM" line."""
    from kimi_k3_serve.rehearsal.compare import measured_verdict

    report, reading = ACCURACY.predict_run(ACCURACY.FIXTURES / "2026-12-07-round60" / name)
    assert report.engine.env_vars["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert (report.verdict, measured_verdict(reading)) == (verdict, measured)
    assert report.safe_gpu_memory_utilization == proposal
    if measured != "fits":
        assert reading.oom.step == "warmup" and reading.oom.tried_bytes == 20 * 2**20  # one 20 MiB mapping


@pytest.mark.parametrize("seqs, tokens, query_len, num_blocks, per_request, requests", [
    (512, 4096, 1, 2257, 4, 512),  # round 33: 2-token prompts, the pool's blocks hold 564 such requests
    (1024, 2048, 1, 1403, 4, 350),  # round 33: the blocks cap it, (1,403 - 1) // 4
    (256, 8192, 4, 10_000, 4, 256),
    (512, 1024, 8, 10_000, 4, 113),  # DSpark: 9-token prompts
])
def test_warmups_prefill_takes_the_requests_vllm_builds(seqs, tokens, query_len, num_blocks, per_request,
                                                        requests) -> None:
    assert warmup_prefill_requests(seqs, tokens, query_len, num_blocks, per_request) == requests


@pytest.mark.parametrize("name, requests, old_lane_mib", [
    ("k4-tp1-b4096-s512-nodraft-u090-h100", 512, 1216),
    ("k4-tp1-b2048-s1024-nodraft-u0825-h100", 350, 608),
])
def test_what_warmups_prefill_held_beside_flashkdas_request_is_the_plans(name, requests, old_lane_mib) -> None:
    """Round 33 (H100, validation runs at the proposals of the plan without this term): kernel warmup's prefill asked
    for FlashKDA's buffers while it held its requests' gathered states, and ran out of memory. What PyTorch held then
    beyond what warmup began with, plus the workspace's old buffer (freed just before the request), is the plan's
    warmup_prefill_gather to 0.06 GiB; the plan now says "does not fit" there."""
    from kimi_k3_serve.rehearsal.compare import measured_verdict
    from kimi_k3_serve.units import GiB, MiB

    report, reading = ACCURACY.predict_run(ACCURACY.FIXTURES / "2026-12-06-round33" / name)
    log = recorded.read_text(ACCURACY.FIXTURES / "2026-12-06-round33" / name / "vllm.log", errors="replace")
    allocated = float(re.search(r"Of the allocated memory ([0-9.]+) GiB is allocated by PyTorch", log)[1]) * GiB
    (worker,) = reading.workers
    began = next(p for p in worker.warmup_peaks if p.scope == "warmup_kernels").allocated_at_entry_bytes
    held = allocated - began + old_lane_mib * MiB
    term = next(e for e in report.estimates if e.name == "warmup_prefill_gather")
    assert f"{requests} requests of 2 tokens" in term.basis
    assert abs(term.bytes - held) <= 0.06 * GiB, (term.bytes / GiB, held / GiB)
    assert (report.verdict, measured_verdict(reading)) == ("oom_at_warmup", "oom_at_warmup")
    assert report.safe_gpu_memory_utilization is None or report.safe_gpu_memory_utilization < \
        report.engine.gpu_memory_utilization
