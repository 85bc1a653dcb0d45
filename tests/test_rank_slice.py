"""The rank slice (``rehearse --rank-of STAGE``): one TP rank of one pipeline stage of a deploy config, built as a TP1
model, holds exactly the real rank's per-layer bytes, layer kinds and KV pages; what differs is listed term by term."""

from __future__ import annotations

import contextlib
import json

import pytest

from conftest import REPO_ROOT
from kimi_k3_serve.cli import main
from kimi_k3_serve.config.args_adapter import planner_inputs
from kimi_k3_serve.config.serve_config import load_serve_app
from kimi_k3_serve.commands.rehearse import (materialize_rank_slice, materialize_stage, predict, rank_section,
                                             with_dummy_weights)
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.models import inventory_from_config, read_config
from kimi_k3_serve.planning.hardware import lookup_gpu
from kimi_k3_serve.planning.layout import RankDevice
from kimi_k3_serve.planning.memory import NON_TORCH_TP1, NON_TORCH_TP_MULTI
from kimi_k3_serve.rehearsal.rank_slice import RankOf, rank_text_config

DEPLOY = REPO_ROOT / "deploy" / "config.yaml"
H200 = lookup_gpu("H200")
DEVICE = RankDevice(H200.total_bytes, H200.compute_capability, name=H200.name)


def _real_args():
    return load_serve_app(str(DEPLOY)).args


@pytest.fixture(scope="module", params=[0, 1], ids=["stage0", "stage1"])
def sliced(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"rank{request.param}")
    real = _real_args()
    slice_args, target_dir, draft_dir, rank = materialize_rank_slice(real, work, request.param)
    return real, slice_args, target_dir, draft_dir, rank


def test_the_stages_are_the_deploy_configs(sliced):
    real, _, _, draft_dir, rank = sliced
    assert (rank.start, rank.end) == ((0, 49) if rank.stage == 0 else (49, 93))
    assert rank.tp == 8 and rank.num_stages == 2
    assert (draft_dir is not None) == rank.is_last  # DSpark runs on the last stage only


def test_each_layer_keeps_its_kind_and_its_ranks_bytes(sliced):
    real, slice_args, target_dir, _, rank = sliced
    full = planner_inputs(with_dummy_weights(real))[0]
    local = inventory_from_config(json.loads((target_dir / "config.json").read_text()), name="rank slice")
    real_layers = full.layers[rank.start:rank.end]
    assert [(l.attention, l.mlp) for l in local.layers] == [(l.attention, l.mlp) for l in real_layers]
    # Every layer weighs at TP1 what the real layer weighs on one TP8 rank, tensor category by category.
    assert local.layer_bytes(1, 1, False) == full.layer_bytes(8, 8, False)[rank.start:rank.end]
    assert local.widths.num_experts == full.widths.num_experts == 896  # grouped top-k keeps every expert
    assert local.widths.experts_per_token == 16


def test_weights_differ_only_by_the_vocabulary_tables_and_final_norms(sliced):
    real, slice_args, _, _, rank = sliced
    real_report = predict(real, DEVICE)
    slice_report = predict(slice_args, DEVICE)
    section = rank_section(real_report, slice_report, rank, None)
    weight_terms = {t["name"]: t["delta_bytes"] for t in section["terms"] if t["name"].startswith("weights:")}
    # The final norms sit on the last stage: the stage-0 slice holds them as well.
    expected = {"weights:embedding", "weights:lm_head"} | ({"weights:norms"} if rank.is_first else set())
    assert set(weight_terms) == expected
    real_rank = next(r for r in real_report.ranks if r.pp_stage == rank.stage)
    assert real_rank.weights_bytes == slice_report.ranks[0].weights_bytes + sum(weight_terms.values())
    # The vocabulary tables: 1/8 on the real rank (its own stage's only), the whole table on the slice.
    table = 163840 * 7168 * 2
    if rank.is_first:
        assert weight_terms["weights:embedding"] == table // 8 - table
        assert weight_terms["weights:lm_head"] == -table
    else:
        assert weight_terms["weights:embedding"] == -table
        assert weight_terms["weights:lm_head"] == table // 8 - table


def test_kv_pages_are_the_real_ranks(sliced):
    """A layer's page is the real rank's. How the pool is cut into blocks is not: vLLM groups the layers of the whole
    engine (93 layers and the draft's) where the slice has its stage's alone, so the slice is compared in bytes of
    KV pool, and the real rank's blocks come from the plan's exact grouping (tests/test_kvcache_conformance.py)."""
    real, slice_args, _, _, rank = sliced
    real_rank = next(r for r in predict(real, DEVICE).ranks if r.pp_stage == rank.stage)
    slice_rank = predict(slice_args, DEVICE).ranks[0]
    assert slice_rank.page_bytes == real_rank.page_bytes
    assert slice_rank.local_layers == real_rank.local_layers


def test_the_pipeline_receive_buffer_is_a_term_of_the_later_stage_only(sliced):
    real, slice_args, _, _, rank = sliced
    section = rank_section(predict(real, DEVICE), predict(slice_args, DEVICE), rank, None)
    workspaces = next((t["delta_bytes"] for t in section["terms"] if t["name"] == "workspaces"), 0)
    # vLLM's make_empty_intermediate_tensors: hidden state + cdiv(49, 12) = 5 AttnRes residuals at 8192 tokens, and a
    # slot for each of DSpark's target layers stage 0 captures (2, 23 and 47 of 2, 23, 47, 71, 89:
    # reserve_aux_intermediate_tensor_slots, bisect_right of the aux layers 3, 24, 48, 72, 90 at layer 49).
    assert workspaces == (0 if rank.is_first else 8192 * 7168 * 2 * (1 + 5 + 3))
    # The real TP8 rank holds NCCL's NVLS buffers (deploy/config.yaml leaves NVLS on), the TP1 slice none: 256 MiB
    # of the non-torch difference, the rest the TP>2 all-reduce buffers.
    non_torch = next(t for t in section["terms"] if t["name"] == "non_torch")
    assert non_torch["delta_bytes"] == NON_TORCH_TP_MULTI + 256 * 2**20 - NON_TORCH_TP1 and "NVLS" in non_torch["source"]


def test_the_activation_differs_from_the_slices_by_the_aux_hidden_states_each_stage_holds(sliced):
    """Stage 0: the real stage captures DSpark's target layers 2, 23 and 47 for the draft on stage 1 and holds them
    through its forward (models/kimi_k3/nvidia/model.py ``forward``): 3 x 8192 tokens x 7168 x 2 B at its last MoE
    layer. Its rank slice runs without a draft, so this is a term only the real layout has; the slice also runs the
    sampler, which the real stage 0 does not (15 sequences x vocab 163,840 x 4 B x the fitted copies).

    Stage 1: the 3 hidden states stage 0 captured are views of the receive buffer (counted there), so the draft's
    hidden states, fitted on single-stage engines where all 5 are made in the forward, lose them rather than count
    them twice. What is left of the difference is the forward's AttnRes blocks: cdiv(93, 12) = 8 from layer 0
    against the 44-layer slice's cdiv(44, 12) = 4, at 8192 tokens."""
    from kimi_k3_serve.planning.memory import SAMPLER_FP32_VOCAB_COPIES

    real, slice_args, _, _, rank = sliced
    section = rank_section(predict(real, DEVICE), predict(slice_args, DEVICE), rank, None)
    activation = next(t for t in section["terms"] if t["name"] == "activation")
    if rank.is_first:
        sampler = int(15 * 163840 * 4 * SAMPLER_FP32_VOCAB_COPIES)
        assert activation["delta_bytes"] == 3 * 8192 * 7168 * 2 - sampler
    else:
        assert activation["delta_bytes"] == 8192 * 7168 * 2 * ((8 - 4) - 3)


def test_a_head_count_tp_does_not_divide_is_refused_by_name():
    config = read_config("kimi-k3")[0]
    with pytest.raises(ConfigError, match="num_heads: got 96; a multiple of tensor_parallel_size 7"):
        rank_text_config(config, RankOf(0, 2, 0, 49, 7))


def test_rank_of_dry_run_prints_the_real_rank_beside_the_slice(tmp_path, capsys):
    rc = main(["rehearse", "--config", str(DEPLOY), "--rank-of", "1", "--dry-run", "--json", "--work-dir", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["engine_kwargs"]["tensor_parallel_size"] == 1 and out["engine_kwargs"]["pipeline_parallel_size"] == 1
    assert out["engine_kwargs"]["speculative_config"]["method"] == "dspark"
    assert out["rank_of"]["layers"] == [49, 93] and out["rank_of"]["tp"] == 8
    assert out["rank_of"]["real_verdict"] == "fits"


@pytest.mark.parametrize("argv, field", [
    (["--rank-of", "2"], "--rank-of"),
    (["--rank-of", "0", "--layers", "8"], "--layers"),
    (["--rank-of", "-1"], "--rank-of"),
])
def test_rank_of_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, field):
    with pytest.raises(SystemExit) if argv[1] == "-1" else contextlib.nullcontext():  # argparse exits on its own types
        rc = main(["rehearse", "--config", str(DEPLOY), *argv, "--dry-run", "--work-dir", str(tmp_path / "w")])
        assert rc == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err


def test_the_ranks_matrix_names_each_runs_role_before_it_runs(capsys):
    """Every job of the one-GPU rank set has its role fixed in the matrix, dry-runs on one GPU as the host will start
    it, and a rank job's plan of the real layout fits (a rank of a layout the plan refused would score nothing)."""
    from conftest import load_script

    matrix = load_script("gpu/matrix")
    jobs = [job for name, set_jobs in matrix.SETS.items() if name.startswith("ranks") for job in set_jobs]  # every round
    assert {j.role for j in jobs} <= set(matrix.ROLES) and all(j.role for j in jobs)
    assert sum(j.role == "validation" for j in jobs) >= sum(j.role == "fit" for j in jobs)
    for job in jobs:
        if job.name in matrix.REFUSED_SINCE_THEY_RAN:  # vLLM refused it on the H200; the plan now says so first
            assert main(["rehearse", *job.args, "--dry-run", "--json"]) == 2, job.name
            err = capsys.readouterr().err
            assert matrix.REFUSED_SINCE_THEY_RAN[job.name] in err and len(err.strip().splitlines()) == 1, err
            continue
        assert main(["rehearse", *job.args, "--dry-run", "--json"]) == 0, job.name
        out = json.loads(capsys.readouterr().out)
        assert out["engine_kwargs"]["tensor_parallel_size"] == 1 and len(out["gpus"]) == 1
        if "--rank-of" in job.args and job.name not in matrix.AT_THE_SLICES_OWN_EDGE:
            assert out["rank_of"]["real_verdict"] in ("fits", "at_risk"), job.name


@pytest.mark.parametrize("stage", [0, 1])
def test_a_stage_model_at_tp8_holds_the_real_stages_layers_and_differs_by_the_vocabulary_tables(stage, tmp_path):
    """``rehearse --stage-of``: the stage's layers at full width, in their order, run at the layout's TP8 and PP 1;
    each rank then holds what the real stage's rank holds, but the vocabulary table the real stage lacks."""
    real = _real_args()
    args, target_dir, draft_dir, rank = materialize_stage(real, tmp_path, stage)
    assert (args.parallel.tensor_parallel_size, args.parallel.pipeline_parallel_size) == (8, 1)
    assert (draft_dir is not None) == rank.is_last
    full = planner_inputs(with_dummy_weights(real))[0]
    local = inventory_from_config(json.loads((target_dir / "config.json").read_text()), name="stage model")
    assert [(l.attention, l.mlp) for l in local.layers] == [(l.attention, l.mlp) for l in full.layers[rank.start:rank.end]]
    assert local.layer_bytes(8, 8, False) == full.layer_bytes(8, 8, False)[rank.start:rank.end]
    real_rank = next(r for r in predict(real, DEVICE).ranks if r.pp_stage == stage)
    stage_rank = predict(args, DEVICE).ranks[0]
    cats = set(real_rank.weights_by_category) | set(stage_rank.weights_by_category)
    differ = {c for c in cats if real_rank.weights_by_category.get(c, 0) != stage_rank.weights_by_category.get(c, 0)}
    assert differ == ({"lm_head", "norms"} if stage == 0 else {"embedding"})
    assert real_rank.non_torch_bytes == stage_rank.non_torch_bytes  # both TP8: NVLS and all-reduce buffers alike


def test_the_fused_all_reduce_residuals_are_a_term_of_the_real_ranks_cuda_graphs(sliced, monkeypatch):
    """At TP8 on an H200 every MoE layer of the real rank keeps FlashInfer's fused all-reduce residual, 73 tokens x the
    3,584-wide latent in bf16 (0.5 MiB budget), made in the eager warmups of vLLM's CUDA-graph estimate, before the
    KV cache is sized. The TP1 slice takes no fused path, so the term is the real rank's, inside the pool's budget."""
    from kimi_k3_serve.planning import memory

    real, slice_args, _, _, rank = sliced
    section = rank_section(predict(real, DEVICE), predict(slice_args, DEVICE), rank, None)
    graphs = next(t for t in section["terms"] if t["name"] == "cuda_graphs")
    assert "fused all-reduce" in graphs["source"]
    assert not any(t["name"] == "after_kv" for t in section["terms"])  # CUDA graphs on: nothing made after the KV cache
    monkeypatch.setattr(memory, "zero_residual", lambda *a, **k: None)
    without = rank_section(predict(real, DEVICE), predict(slice_args, DEVICE), rank, None)
    moe_layers = 48 if rank.is_first else 44  # stage 0's layer 0 is dense
    assert graphs["delta_bytes"] - next(t["delta_bytes"] for t in without["terms"] if t["name"] == "cuda_graphs") \
        == moe_layers * 73 * 3584 * 2
