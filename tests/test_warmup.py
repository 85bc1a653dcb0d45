"""Kernel warmup's forward (kimi_k3_serve/planning/warmup.py): how vLLM 0.32 splits its dummy batch for FlashMLA, what
the MLA decode path holds, and the verdict and proposed utilization that follow, against round 25's H100 runs."""

from __future__ import annotations

import re

import pytest

from conftest import load_script
from kimi_k3_serve import recorded
from kimi_k3_serve.models.inventory import MlaProjections
from kimi_k3_serve.planning.warmup import (
    mla_base_bytes_per_token,
    mla_decode_bytes,
    mla_prefill_bytes,
    mla_warmup,
    warmup_batch,
)
from kimi_k3_serve.units import GiB, MiB

KIMI_MLA = MlaProjections(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                          v_head_dim=128, output_gate=True)
"""Kimi-K3's MLA (kimi_k3_serve/models/data/kimi-k3.json, text_config), as the inventory reads it."""


@pytest.mark.parametrize("tokens, seqs, query_per_request, requests, decodes, query_len", [
    (8192, 256, 7, 256, 256, 32),  # round 25's DSpark slice: every request a 32-token decode
    (8192, 768, 7, 768, 256, 10),  # 8,192 % 768 = 512 requests of 11 tokens come last: prefills (uniform decodes)
    (8192, 2048, 7, 1170, 1170 - 8192 % 1170, 7),  # DSpark caps the requests at tokens // its 7 queries a request
    (8192, 16, 0, 16, 0, 512),  # 512 tokens a request: past FlashMLA's 128, all prefill
    (8192, 128, 0, 128, 128, 64),
])
def test_the_dummy_batch_is_split_as_flashmla_splits_it(tokens, seqs, query_per_request, requests, decodes,
                                                        query_len) -> None:
    batch = warmup_batch(tokens, seqs, query_per_request)
    assert (batch.requests, batch.decode_requests, batch.decode_query_len) == (requests, decodes, query_len)
    assert batch.decode_tokens <= tokens


def test_the_decode_path_holds_the_query_that_ran_out_of_memory() -> None:
    """Round 25: "Tried to allocate 864.00 MiB" in fused_mla_decode_q_concat_kv_cache_insert, at 8,192 tokens and 96
    heads: the concatenated query, heads x (kv_lora + rope) in bf16 a token."""
    batch = warmup_batch(8192, 256, 7)
    mqa_q = batch.decode_tokens * 96 * (KIMI_MLA.kv_lora_rank + KIMI_MLA.qk_rope_head_dim) * 2
    assert mqa_q == 905_969_664 == 864 * MiB
    decode = mla_decode_bytes(batch, KIMI_MLA, 96, 2, (9, 0))
    # ql_nope, mqa_q and the output in bf16, the log-sum-exp in fp32, and FlashMLA's fp32 accumulators for
    # 256 requests + 132 // cdiv(32 x 96, 64) = 2 SM parts.
    assert decode == 8192 * 96 * (2 * (512 + 576 + 512) + 4) + (256 + 2) * 32 * 96 * 513 * 4
    assert 3.8 * GiB < decode < 3.9 * GiB
    assert mla_decode_bytes(warmup_batch(8192, 16, 0), KIMI_MLA, 96, 2, (9, 0)) == 0  # no decodes, no decode path


def test_the_larger_of_the_prefill_and_the_decode_part_is_what_the_layer_adds() -> None:
    layer = mla_warmup(8192, 768, 7, KIMI_MLA, 96, 2, (9, 0))
    prefill = mla_prefill_bytes(8192 - layer.batch.decode_tokens, KIMI_MLA, 96, 2)
    assert layer.extra_bytes == max(layer.decode_bytes, prefill) and layer.decode_bytes and prefill
    assert mla_prefill_bytes(1, KIMI_MLA, 96, 2) == 96 * 2 * (128 + 128 + 128 + 64)  # kv_b_proj's output + the key


def test_the_largest_request_is_flashmlas_output_accumulator_as_the_allocator_logged_it() -> None:
    """Round 26: each failed warmup's allocator line names the request it could not serve: (requests + SM parts) x
    query_len x heads x kv_lora in fp32, 1,623,195,648 B for 256 x 32 tokens (2 parts) and 128 x 64 (1 part), and
    1,222,639,616 B (the 2 MiB blocks of 1,222,115,328) for 256 x 24 (3 parts)."""
    assert mla_warmup(8192, 256, 7, KIMI_MLA, 96, 2, (9, 0)).largest_request_bytes == 1_623_195_648
    assert mla_warmup(8192, 128, 0, KIMI_MLA, 96, 2, (9, 0)).largest_request_bytes == 1_623_195_648
    assert mla_warmup(6144, 256, 7, KIMI_MLA, 96, 2, (9, 0)).largest_request_bytes == 1_222_115_328
    no_decode = mla_warmup(8192, 16, 0, KIMI_MLA, 96, 2, (9, 0))
    assert no_decode.largest_request_bytes == 8192 * 96 * 256 * 2  # kv_b_proj's output, prefill only
    # Held in any forward, the profile's too: the fused q/kv/gate latent, the normed latents, the query, the output.
    assert mla_base_bytes_per_token(KIMI_MLA, 96, 2) == 2 * ((1536 + 512 + 64 + 96 * 128) + (1536 + 512)
                                                             + 96 * 192 + 96 * 128)


FIXTURES = load_script("memory_accuracy").FIXTURES


@pytest.fixture(scope="module")
def accuracy():
    return load_script("memory_accuracy")


@pytest.fixture(scope="module")
def round25(accuracy):
    from kimi_k3_serve.planning.memory import GiB as _  # noqa: F401  (the planner imports)
    return {name: accuracy.predict_run(accuracy.FIXTURES / "2026-12-06-round25" / name)
            for name in ("k4-tp1-b8192-s256-dspark-u0945-h100", "k4-tp1-b8192-s256-dspark-u095-h100")}


def test_round_25s_warmup_failure_is_predicted_and_the_proposal_leaves_room(round25) -> None:
    """At 0.945 (the utilization proposed before this term) vLLM ran out of memory in warmup: the plan now says so,
    and proposes a utilization whose room outside the budget holds what warmup needs there."""
    report, reading = round25["k4-tp1-b8192-s256-dspark-u0945-h100"]
    assert reading.oom is not None and reading.oom.step == "warmup"
    assert report.verdict == "oom_at_warmup"
    (rank,) = report.ranks
    assert rank.after_kv_bytes > rank.headroom_bytes
    safe = report.safe_gpu_memory_utilization
    assert safe == 0.905
    room = rank.total_bytes * (1 - safe) - 0.5 * GiB  # outside the budget, less the CUDA context
    assert rank.after_kv_bytes <= room
    warmup = next(e for e in report.estimates if e.name == "warmup_mla_decode")
    assert "256 decodes of 32 tokens" in warmup.basis and "allocated since the profile" in warmup.basis
    assert round25["k4-tp1-b8192-s256-dspark-u095-h100"][0].verdict == "oom_at_warmup"


LANE = re.compile(r"Resized workspace from '[^']+': [0-9.]+ MB -> ([0-9.]+) MB \(ubatch 0, lane (\d)\)")
WARMUP_READ = (
    *(("2026-12-06-round26", name) for name in (
        "k4-tp1-b8192-s256-dspark-u088-h100", "k4-tp1-b8192-s256-dspark-u0915-h100",
        "k4-tp1-b8192-s256-dspark-u092-h100", "k4-tp1-b6144-s256-dspark-u0925-h100",
        "k4-tp1-b8192-s128-nodraft-u0945-h100", "k4-tp1-b8192-s128-nodraft-u095-h100")),
    # Validation (ranks-round24-h100, after the fit): DSpark at 128 sequences and no draft at 256, shapes it never saw.
    *(("2026-12-06-round27", name) for name in (
        "k4-tp1-b8192-s256-dspark-u0905-h100", "k4-tp1-b8192-s128-dspark-u0945-h100",
        "k4-tp1-b8192-s256-nodraft-u095-h100")),
    # Validation: 0.005 above round 27's proposals (ranks-round24-h100), and 3 speculative tokens at 12,288 tokens
    # (ranks-round26-h100).
    *(("2026-12-06-round28", name) for name in (
        "k4-tp1-b8192-s128-dspark-u095-h100", "k4-tp1-b8192-s256-nodraft-u0955-h100",
        "k4-tp1-b8192-s256-dspark-u091-h100")),
    ("2026-12-06-round29", "k4-tp1-b12288-s192-dspark3-u0925-h100"),
    # Validation: no draft at 16,384 tokens and at 384 sequences (ranks-round27-h100), 3 speculative tokens at 8,192
    # (ranks-round26-h100), and round 30's 384-sequence shape at the proposal with the capture term (ranks-round28-h100).
    *(("2026-12-06-round30", name) for name in (
        "k4-tp1-b16384-s128-nodraft-u089-h100", "k4-tp1-b16384-s128-nodraft-u0905-h100",
        "k4-tp1-b6144-s384-nodraft-u096-h100")),
    ("2026-12-06-round31", "k4-tp1-b8192-s256-dspark3-u093-h100"),
    ("2026-12-06-round32", "k4-tp1-b6144-s384-nodraft-u0905-h100"),
    # The MLA EAGLE3 drafter's own term was read on this run (round 33); round 36 scores it (validation).
    ("2026-12-06-round33", "k4-tp1-b8192-s128-eagle3mla-u099-h100"),
    ("2026-12-06-round36", "k4-tp1-b8192-s128-eagle3mla-u0975-h100"),
    ("2026-12-06-round36", "k4-tp1-b8192-s128-eagle3mla-u098-h100"),
    # Validation (ranks-round31-h100 and ranks-round32-h100): the MLA EAGLE3 at 16,384 and 4,096 tokens, 3
    # speculative tokens at 2,048 over 256, and no draft at 12,288 over 64.
    *(("2026-12-06-round39", name) for name in (
        "k4-tp1-b16384-s128-eagle3mla-u0915-h100", "k4-tp1-b4096-s128-eagle3mla-u097-h100")),
    *(("2026-12-06-round40", name) for name in (
        "k4-tp1-b12288-s64-nodraft-u0985-h100", "k4-tp1-b2048-s256-dspark3-u0945-h100")),
)
"""Every run whose warmup the plugin logged: round 26's fitted ``PERSISTENT_AFTER_PROFILE``, rounds 27 to 32 score
it; round 33's MLA EAGLE3 run fitted that drafter's."""


@pytest.mark.parametrize("folder, name", WARMUP_READ)
def test_what_warmup_began_with_is_the_fitted_term_on_every_run_read(folder, name) -> None:
    """rehearse's plugin logged what each warmup began with; less the weights and the KV cache vLLM logged, the
    workspace lanes as they stood before warmup (the largest size each logged before it) and the profile's held
    sampler buffers, the rest is ``persistent_after_profile_bytes`` to 0.02 GiB over and 0.03 GiB under (out of
    sample: round 27 0.002 to 0.018 GiB over, round 28 within 0.02; round 29, 12,288 tokens and 3 speculative tokens,
    0.024 GiB under; rounds 30 to 32, 0.021 to 0.026 GiB under at 384 sequences with no draft and at 3 speculative
    tokens, and 0.11 GiB over, the safe side, with no draft at 16,384 tokens)."""
    from kimi_k3_serve.planning.memory import SAMPLER_FP32_VOCAB_COPIES
    from kimi_k3_serve.planning.warmup import persistent_after_profile_bytes
    from kimi_k3_serve.rehearsal.vllm_log import parse_vllm_log

    text = recorded.read_text(FIXTURES / folder / name / "vllm.log")
    (worker,) = parse_vllm_log(text).workers
    autotune = next(p for p in worker.warmup_peaks if p.scope == "flashinfer_autotune")
    before = text[:text.index("Running FlashInfer autotune")]
    lanes: dict[str, float] = {}
    for size, lane in LANE.findall(before):
        lanes[lane] = max(lanes.get(lane, 0.0), float(size))
    seqs = int(re.search(r"-s(\d+)-", name)[1])
    tokens = int(re.search(r"-b(\d+)-", name)[1])
    held = SAMPLER_FP32_VOCAB_COPIES * seqs * 163840 * 4
    rest = (autotune.allocated_at_entry_bytes - worker.model_load_bytes - worker.available_kv_bytes
            - sum(lanes.values()) * MiB - held)
    kind = "dspark" if "dspark" in name else "eagle3_mla" if "eagle3mla" in name else None
    fitted = persistent_after_profile_bytes(tokens, 7168, 2, kind, True)
    # Round 30: one hidden state of 16,384 tokens is not all held; round 40: 0.05 GiB over with no draft at 12,288
    # tokens over 64 requests.
    over = 0.12 if tokens >= 12288 else 0.02
    assert -0.03 * GiB <= fitted - rest <= over * GiB, (rest / GiB, fitted / GiB)


def test_the_proposals_started_and_warmup_held_what_the_plan_says(accuracy) -> None:
    """Round 27: the three utilizations the refitted plan proposed started vLLM, and each warmup forward's peak over
    what it began with is the plan's to 0.01 GiB (with no draft 7.7 KB apart; with DSpark, since the forward no longer
    counts the copies the profile's KDA peak adds, 3 MiB over); the rehearsal's table prints the two side by side."""
    from kimi_k3_serve.rehearsal.compare import compare, measured_verdict, render_table

    for name in ("k4-tp1-b8192-s256-dspark-u0905-h100", "k4-tp1-b8192-s128-dspark-u0945-h100",
                 "k4-tp1-b8192-s256-nodraft-u095-h100"):
        report, reading = accuracy.predict_run(FIXTURES / "2026-12-06-round27" / name)
        util = report.engine.gpu_memory_utilization
        assert report.verdict == "fits" and report.safe_gpu_memory_utilization == util
        assert measured_verdict(reading) == "fits"
        autotune = next(p for p in reading.workers[0].warmup_peaks if p.scope == "flashinfer_autotune")
        planned = report.ranks[0].warmup_forward_bytes
        assert abs(planned - autotune.transient_bytes) <= 0.01 * GiB, (name, planned / GiB,
                                                                      autotune.transient_bytes / GiB)
        table = render_table(compare(report, reading))
        assert f"peaked {autotune.transient_bytes / GiB:.2f} GiB above that (plan {planned / GiB:.2f} GiB)" in table


def test_just_above_the_proposals_warmup_fails_beyond_the_reserves_band_and_may_start_within_it(accuracy) -> None:
    """Round 28, 0.005 above round 27's proposals (validation): with no draft, the plan's shortfall (0.34 GiB) passes
    the allocator reserve's band (0.30 GiB) and vLLM ran out of memory in warmup, at FlashMLA's accumulator; with
    DSpark the shortfalls (0.19 and 0.02 GiB) sit inside the band, the plan says "at risk" and vLLM started (its
    allocator freed cached blocks and retried the same 1,623,195,648 B request)."""
    from kimi_k3_serve.rehearsal.compare import measured_verdict

    outcomes = {}
    for name in ("k4-tp1-b8192-s256-nodraft-u0955-h100", "k4-tp1-b8192-s128-dspark-u095-h100",
                 "k4-tp1-b8192-s256-dspark-u091-h100"):
        report, reading = accuracy.predict_run(FIXTURES / "2026-12-06-round28" / name)
        (rank,) = report.ranks
        band = 0.2 * 1_623_195_648
        warmup = next(e.bytes for e in report.estimates if e.name == "warmup_mla_decode")
        capture = next((e.bytes for e in report.estimates if e.name == "capture_kda_gather"), 0)
        # With no draft the capture's KDA gather (planning/capture.py) needs more, inside its own wider band: what
        # lies beyond the bands is still the warmup's.
        assert rank.warmup_shortfall_bytes - rank.warmup_band_bytes == pytest.approx(
            rank.warmup_shortfall_bytes - max(warmup, capture) + warmup - band, abs=1)
        beyond = rank.warmup_shortfall_bytes > rank.warmup_band_bytes
        outcomes[name] = (report.verdict, measured_verdict(reading), beyond)
        note = next(n for n in report.notes if "warmup" in n)
        assert note.startswith("vLLM would OOM" if outcomes[name][2] else "at risk: vLLM may OOM in warmup"), note
    assert outcomes == {"k4-tp1-b8192-s256-nodraft-u0955-h100": ("oom_at_warmup", "oom_at_warmup", True),
                        "k4-tp1-b8192-s128-dspark-u095-h100": ("at_risk", "fits", False),
                        "k4-tp1-b8192-s256-dspark-u091-h100": ("at_risk", "fits", False)}


def test_twelve_thousand_tokens_with_three_speculative_tokens_warm_up_as_planned(accuracy) -> None:
    """Round 29 (ranks-round26-h100, validation, H100): 12,288 tokens over 192 requests of 64 tokens with DSpark's 3
    speculative tokens, at the plan's proposal (0.925). vLLM's KV pool was the plan's to 0.4 %, and the warmup forward
    peaked 8.01 GiB above what it began with, the plan's to 0.01 GiB; the engine went through warmup and CUDA-graph
    capture, and the call's deadline stopped it before it reported ready; warmup's prefill never went above the
    autotune forward's peak. With that prefill weighed at its own moment (planning/memory.py
    ``_warmup_prefill_moments``) the plan called 0.925 "fits" and proposed it (added beside the other after-KV terms,
    it was "at risk", 0.02 GiB short). The capture's stand-in after FlashKDA's growth (the autotune's 12,288-token
    forward with the growth beside it, and its error band) made it "at risk" again and proposed 0.915; the capture's own
    moment (``capture.CAPTURE_ROOM_DSPARK``: what it starts on and its measured room beyond) needs nothing outside the
    budget here, where the profile's transient peak leaves the capture's eager forwards of at most 512 tokens far more
    than they use: "fits" at 0.925, proposed, where vLLM went through the capture."""
    report, reading = accuracy.predict_run(FIXTURES / "2026-12-06-round29" / "k4-tp1-b12288-s192-dspark3-u0925-h100")
    (rank,) = report.ranks
    assert report.verdict == "fits" and report.safe_gpu_memory_utilization == 0.925
    moment = next(e for e in report.estimates if e.name == "capture_moment")
    assert moment.bytes < rank.after_kv_bytes < rank.headroom_bytes
    kernels = next(p for p in reading.workers[0].warmup_peaks if p.scope == "warmup_kernels")
    assert kernels.allocated_peak_bytes == kernels.peak_at_entry_bytes  # the prefill stayed below the autotune's peak
    (worker,) = reading.workers
    autotune = next(p for p in worker.warmup_peaks if p.scope == "flashinfer_autotune")
    assert not autotune.failed and reading.oom is None
    assert abs(report.ranks[0].warmup_forward_bytes - autotune.transient_bytes) <= 0.01 * GiB
    assert abs(report.ranks[0].kv_cache_bytes - worker.available_kv_bytes) <= 0.01 * worker.available_kv_bytes


def test_a_pool_short_of_state_blocks_is_not_at_risk_where_warmup_fails_beyond_its_band(accuracy) -> None:
    """The state-block boundary within the bands reads "at risk" (it may as well fit), but not where warmup would
    then run out of memory beyond the reserve's band: a 4-layer slice with DSpark at 16,384 tokens on an H100 at
    0.92 (a warmup forward of 10.68 GiB, 2.6 GiB short) stays "seqs_over_state_blocks"."""
    from kimi_k3_serve.planning.layout import RankDevice

    flags = ["--model", "moonshotai/Kimi-K3", "--engine-kwargs",
             '{"moe_backend": "marlin", "attention_backend": "FLASHMLA"}', "--layers", "4",
             "--max-num-batched-tokens", "16384", "--max-num-seqs", "256", "--max-model-len", "8192",
             "--gpu-memory-utilization", "0.92", "--speculative-config",
             '{"method": "dspark", "model": "kimi-k3-dspark", "num_speculative_tokens": 7}']
    total = 85_017_493_504  # the H100 80GB of rounds 24 to 29
    report = accuracy.predict_flags(flags, RankDevice(total, (9, 0), free_bytes=total - 600 * MiB, name="H100"))
    (rank,) = report.ranks
    assert report.max_num_seqs > report.num_blocks and rank.warmup_shortfall_bytes > rank.warmup_band_bytes
    assert report.verdict == "seqs_over_state_blocks"


@pytest.mark.parametrize("util, verdict", [(0.9, "oom_at_warmup"), (0.84, "seqs_over_state_blocks")])
def test_no_utilization_is_proposed_where_warmup_and_the_state_blocks_cross(accuracy, util, verdict) -> None:
    """A 4-layer slice with DSpark at 2,048 tokens and 576 sequences on an H100: warmup leaves room up to 0.84, where
    the KV pool holds fewer state blocks than sequences. No utilization fits, so none is proposed, and neither
    verdict sends the user to the other ("set gpu_memory_utilization to 0.84", "raise gpu_memory_utilization");
    the advice is max_num_seqs, at most the blocks the pool holds at 0.84."""
    from kimi_k3_serve.planning.layout import RankDevice
    from kimi_k3_serve.planning.report import build_report

    flags = ["--model", "moonshotai/Kimi-K3", "--engine-kwargs",
             '{"moe_backend": "marlin", "attention_backend": "FLASHMLA"}', "--layers", "4",
             "--max-num-batched-tokens", "2048", "--max-num-seqs", "576", "--max-model-len", "8192",
             "--gpu-memory-utilization", str(util), "--speculative-config",
             '{"method": "dspark", "model": "kimi-k3-dspark", "num_speculative_tokens": 7}']
    total = 85_017_493_504  # the H100 80GB of rounds 24 to 32
    report = accuracy.predict_flags(flags, RankDevice(total, (9, 0), free_bytes=total - 600 * MiB, name="H100"))
    assert report.verdict == verdict and report.safe_gpu_memory_utilization is None
    blocks = int(re.search(r"holds ([\d,]+) blocks", report.no_safe_utilization).group(1).replace(",", ""))
    assert report.no_safe_utilization.startswith("at 0.84, the largest that leaves room") and 0 < blocks < 576
    assert f"lower max_num_seqs to at most {blocks:,}" in report.no_safe_utilization
    notes = " ".join(report.notes)
    assert "raise gpu_memory_utilization" not in notes and "or lower leaves room" not in notes
    assert "no gpu_memory_utilization fits: at 0.84," in notes
    check = build_report(model_name="kimi-k3", cluster_source="test", gpu_name="H100", memory=report,
                         placements=None, optimisations=report.optimisations, seconds=0.0)
    assert check.verdict.startswith("does not fit") and "raise gpu_memory_utilization" not in check.verdict
    assert "set gpu_memory_utilization to" not in check.verdict and "max_num_seqs" in check.verdict


def test_the_mla_eagle3_drafters_warmup_step_is_where_the_plan_says_vllm_runs_out(accuracy) -> None:
    """Round 33 (H100, at the proposal 0.99 of the plan before it): vLLM ran out of memory in FlashInfer's autotune, in
    the MLA EAGLE3 drafter's FlashMLA decode accumulators, (128 + 1) split slots x 64 tokens x 96 heads x 512 x 4 B.
    The target's forward held 5.35 GiB beyond what warmup began with, the plan's with the 3 hidden states the drafter
    fuses; the drafter's step (on the target's metadata) is what the warmup term judges, and by itself it is short
    beyond its reserve there (the fit: ``DRAFT_STEP_RESERVE_FRACTION``), so the verdict needs no other term."""
    from kimi_k3_serve.planning.warmup import DRAFT_STEP_RESERVE_FRACTION, persistent_after_profile_bytes

    report, reading = accuracy.predict_run(FIXTURES / "2026-12-06-round33" / "k4-tp1-b8192-s128-eagle3mla-u099-h100")
    assert reading.oom is not None and reading.oom.tried_bytes == 129 * 64 * 96 * 512 * 4 == 1_623_195_648
    assert report.verdict == "oom_at_warmup"
    (rank,) = report.ranks
    autotune = next(p for p in reading.workers[0].warmup_peaks if p.scope == "flashinfer_autotune")
    warmup = next(e for e in report.estimates if e.name == "warmup_mla_decode")
    assert warmup.basis.startswith("the MLA EAGLE3 drafter's step in kernel warmup")
    target = float(re.search(r"over the target's forward \([\d.]+ GiB, ([\d.]+) GiB of it allocated", warmup.basis)[1])
    assert autotune.transient_bytes == pytest.approx(5.35 * GiB, abs=0.01 * GiB)
    assert target * GiB == pytest.approx(autotune.transient_bytes, abs=0.01 * GiB)  # with the drafter's 3 states
    assert rank.warmup_forward_bytes >= autotune.transient_bytes  # the step peaks above the target's forward
    # By itself, the drafter's step is short beyond its (bandless) reserve: the prefill term is not what says so.
    assert warmup.bytes > rank.headroom_bytes and rank.warmup_shortfall_bytes > rank.warmup_band_bytes
    assert "115% to 119% measured" in warmup.basis
    assert DRAFT_STEP_RESERVE_FRACTION > 1.0
    # What warmup began with beyond the profile, with this drafter: 0.28 GiB, not DSpark's 0.95.
    assert persistent_after_profile_bytes(0, 7168, 2, "eagle3_mla", True) < 0.3 * GiB
    assert "allocated since the profile" in warmup.basis and "0.39 GiB allocated since" in warmup.basis
    dspark, _ = accuracy.predict_run(FIXTURES / "2026-12-06-round31" / "k4-tp1-b8192-s256-dspark3-u093-h100")
    assert "EAGLE3 drafter" not in next(e for e in dspark.estimates if e.name == "warmup_mla_decode").basis


def _predicted_with_outcomes(accuracy, *runs: tuple[str, str]) -> tuple[dict, dict]:
    """Each recorded run (folder, name) as the plan predicts it now, and its (plan's verdict, vLLM's) pair."""
    from kimi_k3_serve.rehearsal.compare import measured_verdict

    predicted = {name: accuracy.predict_run(FIXTURES / folder / name) for folder, name in runs}
    outcomes = {name: (report.verdict, measured_verdict(reading)) for name, (report, reading) in predicted.items()}
    return predicted, outcomes


def test_round_36s_proposals_started_and_just_above_them_the_plan_says_at_risk(accuracy) -> None:
    """Rounds 36 and 37 (ranks-round30-h100, validation, H100), round 33's shapes at the proposals of the plan with the
    MLA EAGLE3 drafter's warmup step, then just above them:
    - no draft, 4,096 tokens / 512 sequences: 0.86 started; 0.87 ran out of memory in warmup's prefill, on a later
      KDA layer's gather of its requests' states (2.75 GiB, with 2.78 GiB cached). Weighed at its own moment with the
      capture's reserve (planning/memory.py ``_warmup_prefill_moments``), 0.87 had 1.54 times the gathered states
      left in the plan's terms and 0.86 had 2.04: both within that reserve's band, "at risk" (the plan now proposes
      0.83 for the shape);
    - the MLA EAGLE3 at 8,192 / 128: 0.975 and 0.98 started, and autotune's forward peaked where the plan puts the
      drafter's step (5.38 GiB above what warmup began with, to 0.01 GiB). That step comes before FlashKDA's growth,
      and warmup's prefill needs less than it. Since the drafter's graphs are charged as vLLM's code builds them
      (forty-fourth session), the plan's pool is vLLM's to 0.1 GiB where it was 0.11 GiB under; since round 63 started
      at 0.985 with 1.20 times the drafter's request left, that reserve is 1.19, and 0.975 and 0.98 (1.46 times) both
      "fit": the plan proposes 0.98 (0.99 ran out of memory, with 0.94 times)."""
    from kimi_k3_serve.planning.capture import CAPTURE_RESERVE_FRACTION, CAPTURE_RESERVE_FRACTION_LOW

    runs, outcomes = _predicted_with_outcomes(
        accuracy, ("2026-12-06-round36", "k4-tp1-b4096-s512-nodraft-u086-h100"),
        ("2026-12-06-round36", "k4-tp1-b8192-s128-eagle3mla-u0975-h100"),
        ("2026-12-06-round36", "k4-tp1-b8192-s128-eagle3mla-u098-h100"),
        ("2026-12-06-round37", "k4-tp1-b4096-s512-nodraft-u087-h100"))
    assert outcomes == {"k4-tp1-b4096-s512-nodraft-u086-h100": ("at_risk", "fits"),
                        "k4-tp1-b8192-s128-eagle3mla-u0975-h100": ("fits", "fits"),
                        "k4-tp1-b8192-s128-eagle3mla-u098-h100": ("fits", "fits"),
                        "k4-tp1-b4096-s512-nodraft-u087-h100": ("at_risk", "oom_at_warmup")}
    for name in ("k4-tp1-b8192-s128-eagle3mla-u0975-h100", "k4-tp1-b8192-s128-eagle3mla-u098-h100"):
        report, reading = runs[name]
        assert report.safe_gpu_memory_utilization == 0.98
    report, reading = runs["k4-tp1-b8192-s128-eagle3mla-u0975-h100"]
    autotune = next(p for p in reading.workers[0].warmup_peaks if p.scope == "flashinfer_autotune")
    assert report.ranks[0].warmup_forward_bytes == pytest.approx(autotune.transient_bytes, abs=0.01 * GiB)
    lefts = {}
    for name, requests in (("k4-tp1-b4096-s512-nodraft-u086-h100", 436), ("k4-tp1-b4096-s512-nodraft-u087-h100", 468)):
        report, reading = runs[name]
        (rank,) = report.ranks
        assert 0 < rank.warmup_shortfall_bytes <= rank.warmup_band_bytes
        gather = next(e for e in report.estimates if e.name == "warmup_prefill_gather")
        assert f"{requests} requests of 2 tokens" in gather.basis and "at its own moment" in gather.basis
        gathered = requests * 96 * 128 * 128 * 4  # fp32 (heads, head_dim, head_dim) a request
        # The room beyond the states at that moment, as the capture's reserve reads it: its fits point less the
        # shortfall, in times the states.
        lefts[name] = CAPTURE_RESERVE_FRACTION - rank.warmup_shortfall_bytes / gathered
        assert report.safe_gpu_memory_utilization < report.engine.gpu_memory_utilization
    assert reading.oom.tried_bytes == 2_952_790_016  # 469 states in 2 MiB blocks: a later KDA layer's gather
    assert CAPTURE_RESERVE_FRACTION_LOW < lefts["k4-tp1-b4096-s512-nodraft-u087-h100"] < 1.6
    assert 2.0 < lefts["k4-tp1-b4096-s512-nodraft-u086-h100"] < CAPTURE_RESERVE_FRACTION


def test_warmups_prefill_is_weighed_at_its_own_moment_after_the_autotune(accuracy) -> None:
    """vLLM 0.32 asks for FlashKDA's buffers first in kernel warmup's prefill step, after FlashInfer's autotune: the
    autotune's dummy run is a profile run, which gives KDA no metadata (v1/worker/gpu/model_runner.py), and the log's
    resize from kda.py's ``_forward`` comes after the autotune's peak. Round 41 (H200, validation: 6 layers, DSpark's 3
    speculative tokens, 8,192 tokens over 256, 0.965) started, and its warmup prefill never went above the autotune's
    peak (141.44 GB at entry, 147.19 at both peaks). Added beside the other after-KV terms, the prefill's 1.49 GiB
    made the plan "does not fit", 1.48 GiB short; at its own moment the plan said "fits", its need (FlashKDA's growth
    and what was held for good, the states within the budget's room) below the autotune's. The capture's stand-in
    after that growth, with the error round 46 measured, made it "at risk" (0.50 GiB short within a 0.80 GiB band);
    the capture's own moment (``capture.CAPTURE_ROOM_DSPARK``) leaves it room: "fits"."""
    from kimi_k3_serve.rehearsal.compare import measured_verdict

    run = FIXTURES / "2026-12-06-round41" / "k6-tp1-b8192-s256-dspark3-u0965"
    report, reading = accuracy.predict_run(run)
    assert (report.verdict, measured_verdict(reading)) == ("fits", "fits")
    (worker,) = reading.workers
    autotune = next(p for p in worker.warmup_peaks if p.scope == "flashinfer_autotune")
    kernels = next(p for p in worker.warmup_peaks if p.scope == "warmup_kernels")
    assert kernels.allocated_peak_bytes == kernels.peak_at_entry_bytes == autotune.allocated_peak_bytes
    assert report.ranks[0].warmup_forward_bytes == pytest.approx(autotune.transient_bytes, abs=0.01 * GiB)
    gather = next(e for e in report.estimates if e.name == "warmup_prefill_gather")
    need = float(re.search(r"([\d.]+) GiB outside the budget", gather.basis).group(1)) * GiB
    assert "216 requests of 5 tokens" in gather.basis and 0 < need < report.ranks[0].headroom_bytes
    for folder, name in (("2026-12-06-round41", "k6-tp1-b8192-s256-dspark3-u0965"),
                         ("2026-12-06-round37", "k4-tp1-b4096-s512-nodraft-u087-h100")):
        text = recorded.read_text(FIXTURES / folder / name / "vllm.log")
        resize = text.index("Resized workspace from 'kda.py:1202:_forward'")
        assert text.index('"scope": "flashinfer_autotune"') < resize < text.index('"scope": "warmup_kernels"')


def test_the_drafters_warmup_step_started_vllm_with_120_times_its_request_left(accuracy) -> None:
    """Rounds 62 and 63 (ranks-round45-h100, a fit run fixed before it ran, H100): the MLA EAGLE3 at 8,192 / 128 and
    0.985, where the plan's pool is vLLM's to 0.1 % and the drafter's step in FlashInfer's autotune has 1.20 times its
    1.51 GiB accumulator ((128 + 1) split slots x 64 tokens x 96 heads x 512 x fp32) left in the plan's terms. In
    round 62 the autotune passed, its forward 5.38 GiB above what warmup began with, the plan's term to the MiB, and
    the run's --timeout stopped it in the rest of kernel warmup; in round 63, on a warm host, vLLM started. So the
    reserve's fits point comes down from 1.5 to just below it (``DRAFT_STEP_RESERVE_FRACTION``), above the most room a
    run failed with (round 39, 1.12). The plan still says "at risk" there: the capture stand-in's band, not the
    drafter's reserve."""
    from kimi_k3_serve.planning.warmup import DRAFT_STEP_RESERVE_FRACTION, DRAFT_STEP_RESERVE_FRACTION_LOW
    from kimi_k3_serve.rehearsal.compare import measured_verdict

    request = 129 * 64 * 96 * 512 * 4
    for folder, verdict in (("2026-12-07-round62", "unknown"), ("2026-12-07-round63", "fits")):
        report, reading = accuracy.predict_run(FIXTURES / folder / "k4-tp1-b8192-s128-eagle3mla-u0985-h100")
        (rank,) = report.ranks
        autotune = next(p for p in reading.workers[0].warmup_peaks if p.scope == "flashinfer_autotune")
        assert not autotune.failed and measured_verdict(reading) == verdict
        assert rank.warmup_forward_bytes == pytest.approx(autotune.transient_bytes, abs=MiB)
        warmup = next(e for e in report.estimates if e.name == "warmup_mla_decode")
        reserve = float(re.search(r"119% of its largest request \(([\d.]+) GiB", warmup.basis).group(1)) * GiB
        assert reserve == pytest.approx(DRAFT_STEP_RESERVE_FRACTION * request, abs=0.01 * GiB)
        left = rank.headroom_bytes - (warmup.bytes - int(DRAFT_STEP_RESERVE_FRACTION * request))
        assert DRAFT_STEP_RESERVE_FRACTION_LOW < DRAFT_STEP_RESERVE_FRACTION < left / request < 1.21
        assert report.verdict == "at_risk" and "capture" in " ".join(report.notes)
        assert report.safe_gpu_memory_utilization == 0.98  # 0.975 with the reserve at 1.5; vLLM started at 0.98


def test_rounds_39_and_40_bound_the_drafters_reserve_and_the_prefill_paths(accuracy) -> None:
    """Rounds 39 and 40 (ranks-round31-h100 and ranks-round32-h100, validation, H100), each at the proposal of the
    plan shipped with it. Two ran out of memory in FlashInfer's autotune where that plan said "fits", and the model
    was changed on them; the plan now says "at risk" or "does not fit" for both, and the two that started still fit at
    their proposal:
    - the MLA EAGLE3 at 16,384 tokens over 128 (0.915): the drafter's 3.02 GiB accumulator, with 1.16 times it left in
      the plan's terms (round 33 failed at 1.01; round 36 started at 1.53 and 1.79, round 39 at 4,096 tokens at 3.96):
      the drafter's reserve is now 1.15 to 1.19 of its request (1.5 until round 63 started at 1.20).
      Since the drafter's graphs are charged as vLLM's code builds them (forty-fourth session), the plan's pool is
      0.11 GiB larger, 0.4 % over vLLM's, and 1.12 times is left: below the band, "does not fit";
    - no draft at 12,288 over 64 (0.985): warmup's MLA takes the prefill path (192-token requests) and ran out of
      memory on the concatenated key with 0.97 times the largest request left: that path's reserve is 0.95 to 1.0;
    - the MLA EAGLE3 at 4,096 over 128 (0.97) and 3 speculative tokens at 2,048 over 256 (0.945) started."""
    from kimi_k3_serve.planning.warmup import (
        DRAFT_STEP_RESERVE_FRACTION,
        DRAFT_STEP_RESERVE_FRACTION_LOW,
        PREFILL_RESERVE_FRACTION_LOW,
    )

    runs, outcomes = _predicted_with_outcomes(
        accuracy, ("2026-12-06-round39", "k4-tp1-b16384-s128-eagle3mla-u0915-h100"),
        ("2026-12-06-round39", "k4-tp1-b4096-s128-eagle3mla-u097-h100"),
        ("2026-12-06-round40", "k4-tp1-b12288-s64-nodraft-u0985-h100"),
        ("2026-12-06-round40", "k4-tp1-b2048-s256-dspark3-u0945-h100"))
    assert outcomes == {"k4-tp1-b16384-s128-eagle3mla-u0915-h100": ("oom_at_warmup", "oom_at_warmup"),
                        "k4-tp1-b4096-s128-eagle3mla-u097-h100": ("fits", "fits"),
                        "k4-tp1-b12288-s64-nodraft-u0985-h100": ("at_risk", "oom_at_warmup"),
                        "k4-tp1-b2048-s256-dspark3-u0945-h100": ("fits", "fits")}
    # Both proposals are now at or above where they started (0.98 and 0.945): the drafter's step and the autotune's
    # forward come before FlashKDA's growth, warmup's prefill is weighed at its own moment, and what is held after the
    # KV cache takes its share of each moment's room (test_after_kv_terms_are_weighed_inside_each_warmup_moments_room),
    # less the capture stand-in's error band. Tried above them: vLLM started at 0.98 and 0.99 (rounds 51 and 44), and
    # ran out of memory in its real capture at 0.95 and 0.955 (rounds 47 and 46), where the plan now says "at risk".
    for name, proposal in (("k4-tp1-b4096-s128-eagle3mla-u097-h100", 0.98),
                           ("k4-tp1-b2048-s256-dspark3-u0945-h100", 0.945)):
        report, _ = runs[name]
        assert report.safe_gpu_memory_utilization == proposal >= report.engine.gpu_memory_utilization

    report, reading = runs["k4-tp1-b16384-s128-eagle3mla-u0915-h100"]
    (rank,) = report.ranks
    request = 129 * 128 * 96 * 512 * 4  # (128 requests + 1 split) x 128 tokens x 96 heads x 512 x fp32
    assert reading.oom.tried_bytes == request
    warmup = next(e for e in report.estimates if e.name == "warmup_mla_decode")
    left = rank.headroom_bytes - (warmup.bytes - int(DRAFT_STEP_RESERVE_FRACTION * request))
    assert 1.1 < left / request < DRAFT_STEP_RESERVE_FRACTION_LOW  # 1.12: below the band
    # Between where this shape started (0.90, round 50) and where it ran out of memory (0.915); vLLM started there
    # (round 65, validation).
    assert report.safe_gpu_memory_utilization == 0.91

    report, reading = runs["k4-tp1-b12288-s64-nodraft-u0985-h100"]
    (rank,) = report.ranks
    assert reading.oom.tried_bytes == 12288 * 96 * 192 * 2  # the concatenated key, [tokens, heads, nope + rope]
    autotune = next(p for p in reading.workers[0].warmup_peaks if p.scope == "flashinfer_autotune")
    # Autotune's forward peaked at layer 0's dense MLP (its gate_up_proj output, 12,288 x 2 x 33,792 x 2 B, the
    # allocation of the log's first OOM line, retried once the cache was released), with the MoE workspace held from
    # the profile: the plan's term to 2,560 B. Its need, with no reserve, is below the MLA's.
    assert rank.warmup_forward_bytes == pytest.approx(autotune.transient_bytes, abs=0.001 * GiB)
    assert "memory allocation failed with OOM on device 0 while trying to allocate 1660944384 bytes" in (
        recorded.read_text(FIXTURES / "2026-12-06-round40" / "k4-tp1-b12288-s64-nodraft-u0985-h100" / "vllm.log"))
    warmup = next(e for e in report.estimates if e.name == "warmup_mla_decode")
    assert "the prefill path's reserve" in warmup.basis and "95% to 100% measured" in warmup.basis
    assert "the forward peaks at layer 0's dense MLP (3.14 GiB allocated)" in warmup.basis
    assert 0 < rank.warmup_shortfall_bytes <= rank.warmup_band_bytes
    assert report.safe_gpu_memory_utilization == 0.98 and PREFILL_RESERVE_FRACTION_LOW < 1.0


def test_after_kv_terms_are_weighed_inside_each_warmup_moments_room(accuracy) -> None:
    """What vLLM holds after sizing the KV cache (TRITON_MLA's reservation of the shared workspace, FlashKDA's growth)
    sits in memory the budget gave the profile's transients and the CUDA-graph estimate, free until warmup and the
    capture: each moment of warmup is judged with it inside that room, not added beside a need clamped at zero. Round
    42's stage 1 rank at 0.97 (H200) started: the reservation grew lane 0 from 1,792 to 6,156 MB, 4.26 GiB, more than
    the 3.69 GiB outside the budget, and the additive form called it 0.57 GiB short; weighed at its moments, it fits
    with 0.58 GiB to spare. The 6-layer slice at 768 sequences and 0.92 (2026-12-01), whose KV cache could not be
    allocated beside an 18,468 MB reservation, is still short, beyond any band. Once FlashKDA has grown (warmup's
    prefill), the capture's forwards run beside the growth too: round 44 (H100, 3 speculative tokens, 4,096 over 512)
    ran out of memory capturing DSpark's graphs at 0.925, started at 0.90 (round 45), and the plan says so."""
    from kimi_k3_serve.rehearsal.compare import measured_verdict

    report, reading = accuracy.predict_run(FIXTURES / "2026-12-06-round42" / "r44-s1-dspark-b8192-s512-u097")
    (rank,) = report.ranks
    unseen = next(e for e in report.estimates if e.name == "workspace:shared_unseen")
    assert "TRITON_MLA decode logits 6,156 MiB" in unseen.basis and unseen.bytes > rank.headroom_bytes
    assert (report.verdict, measured_verdict(reading)) == ("fits", "fits")
    assert rank.headroom_bytes - rank.after_kv_bytes == pytest.approx(0.58 * GiB, abs=0.01 * GiB)

    for folder, name, verdict in (("2026-12-06-round44", "k4-tp1-b4096-s512-dspark3-u0925-h100", "oom_at_warmup"),
                                  ("2026-12-06-round45", "k4-tp1-b4096-s512-dspark3-u090-h100", "fits")):
        report, reading = accuracy.predict_run(FIXTURES / folder / name)
        assert (report.verdict, measured_verdict(reading)) == (verdict, verdict), name
    log = recorded.read_text(FIXTURES / "2026-12-06-round44" / "k4-tp1-b4096-s512-dspark3-u0925-h100" / "vllm.log")
    assert "self.speculator.capture()" in log and "Resized workspace from 'kda.py:1202:_forward'" in log

    report, reading = accuracy.predict_run(FIXTURES / "2026-12-01" / "k6-tp1-b8192-s768-dspark-u092")
    (rank,) = report.ranks
    assert "Tried to allocate" in " ".join(reading.errors) or reading.oom is not None
    assert (report.verdict, measured_verdict(reading)) == ("oom_at_warmup", "oom_at_warmup")
    assert rank.warmup_shortfall_bytes > rank.warmup_band_bytes + GiB


def test_dspark_step_is_a_moment_of_the_autotune_dummy_run(accuracy) -> None:
    """FlashInfer's autotune dummy run calls DSpark's ``propose`` after the target's forward, as the profile run does:
    on stage 1's TP8 rank slice at 512 sequences (round 42, H200, validation) autotune's peak is that step, 2.42 GiB
    over what warmup began with, where the MLA's forward is 1.85 GiB. The plan's warmup forward is now the step's,
    0.06 GiB over (the safe side), and both start (vLLM's base logits, 1,174,405,120 B, were asked for at 0.97 with
    0.68 GiB free, then went through once the allocator released its cache)."""
    verdicts = {}
    for name in ("r44-s1-dspark-b8192-s512-u0965", "r44-s1-dspark-b8192-s512-u097"):
        report, reading = accuracy.predict_run(FIXTURES / "2026-12-06-round42" / name)
        (rank,) = report.ranks
        autotune = next(p for p in reading.workers[0].warmup_peaks if p.scope == "flashinfer_autotune")
        assert 0 <= rank.warmup_forward_bytes - autotune.transient_bytes <= 0.07 * GiB
        warmup = next(e for e in report.estimates if e.name == "warmup_mla_decode")
        assert "DSpark's step in the autotune's dummy run" in warmup.basis
        verdicts[name] = report.verdict
    assert verdicts == {"r44-s1-dspark-b8192-s512-u0965": "fits", "r44-s1-dspark-b8192-s512-u097": "fits"}
    log = recorded.read_text(FIXTURES / "2026-12-06-round42" / "r44-s1-dspark-b8192-s512-u097" / "vllm.log")
    assert f"trying to allocate {3584 * 163_840 * 2} bytes" in log  # 512 requests x 7 rows x vocab, bf16
