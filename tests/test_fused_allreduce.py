"""FlashInfer's fused all-reduce residual in every Kimi-K3 MoE layer at TP > 1 (planning/fused_allreduce.py), from
vLLM 0.32's code: its size per GPU and TP degree, and whether vLLM's profile sees it."""

from __future__ import annotations

import pytest

from conftest import REPO_ROOT, load_script
from kimi_k3_serve.models import inventory_from_config, read_config
from kimi_k3_serve.planning.fused_allreduce import zero_residual
from kimi_k3_serve.planning.layout import Layout
from kimi_k3_serve.units import GiB

accuracy = load_script("memory_accuracy")
KIMI = inventory_from_config(read_config("kimi-k3")[0])


@pytest.mark.parametrize("cc, tp, tokens", [
    ((9, 0), 8, 73),  # 0.5 MiB // (3,584 x 2 B)
    ((9, 0), 4, 292),
    ((9, 0), 2, 9362),
    ((10, 0), 8, 146),
    ((10, 0), 16, 9362),
])
def test_the_budget_over_one_tokens_latent(cc, tp, tokens) -> None:
    residual = zero_residual(KIMI, Layout(tp=tp, pp=2), 0, 49, False, cc)
    assert residual.max_token_num == tokens
    assert residual.bytes_per_layer == tokens * 3584 * 2
    assert residual.layers == 48  # layers 1-48 are MoE; layer 0 is dense
    assert residual.in_profile(8192) == (tokens >= 8192)


@pytest.mark.parametrize("layout, sp, cc", [
    (Layout(tp=1, pp=8), False, (9, 0)),
    (Layout(tp=8, pp=2, ep=True), False, (9, 0)),  # expert parallelism makes the MoE's TP 1 (FusedMoEParallelConfig)
    (Layout(tp=8, dp=2, ep=True), True, (10, 0)),
    (Layout(tp=8, pp=2), True, (10, 0)),
    (Layout(tp=16, pp=1), False, (9, 0)),
    (Layout(tp=8, pp=2), False, (8, 0)),
])
def test_no_fused_path(layout, sp, cc) -> None:
    """TP1 all-reduces nothing; expert parallelism leaves the MoE no TP; sequence parallelism takes another path; a TP
    size or GPU the fusion's table does not list (TP16 on Hopper, an A100) has no budget."""
    assert zero_residual(KIMI, layout, 0, 49, sp, cc) is None


def test_data_parallelism_without_ep_widens_the_moes_tp() -> None:
    """Without EP vLLM flattens the MoE's TP across the DP ranks (``flatten_tp_across_dp_and_pcp``), and the fusion's
    budget is looked up at that size: TP2 x DP2 on an H200 takes TP4's 2 MiB, not TP2's 64 MiB."""
    residual = zero_residual(KIMI, Layout(tp=2, dp=2), 0, 49, False, (9, 0))
    assert residual.max_token_num == 292


def test_the_deploy_configs_residuals_are_in_vllms_cuda_graph_estimate(monkeypatch) -> None:
    """deploy/config.yaml at TP8 on H200s: 8,192 tokens are past the 73 the fused path takes, so the profile run
    makes no residual; the eager warmup of the small PIECEWISE sizes inside vLLM's CUDA-graph estimate does, before
    the KV cache is sized. The plan's CUDA-graph term holds them, and nothing else moves."""
    from kimi_k3_serve.commands.render import plan_replica
    from kimi_k3_serve.config.serve_config import load_serve_app
    from kimi_k3_serve.planning import memory
    from kimi_k3_serve.planning.hardware import lookup_gpu

    args = load_serve_app(str(REPO_ROOT / "deploy" / "config.yaml")).args
    gpus_per_node = lookup_gpu(args.accelerator.type).gpus_per_node
    report = plan_replica(args, gpus_per_node=gpus_per_node).report
    residuals = {e.stage: e for e in report.estimates if e.name == "fused_allreduce_residual"}
    assert {s: e.bytes for s, e in residuals.items()} == {0: 48 * 73 * 3584 * 2, 1: 44 * 73 * 3584 * 2}
    assert all("CUDA-graph estimate" in e.basis for e in residuals.values())
    monkeypatch.setattr(memory, "zero_residual", lambda *a, **k: None)
    without = plan_replica(args, gpus_per_node=gpus_per_node).report
    for r, w in zip(report.ranks, without.ranks):
        assert r.cuda_graph_bytes - w.cuda_graph_bytes == residuals[r.pp_stage].bytes
        assert (r.after_kv_bytes, r.workspace_bytes) == (w.after_kv_bytes, w.workspace_bytes)
        assert w.kv_cache_bytes - r.kv_cache_bytes == residuals[r.pp_stage].bytes  # taken from the KV pool


def test_the_tp2_slice_profiled_what_its_residuals_hold() -> None:
    """The one recorded TP > 1 run without sequence parallelism: the 4-layer slice at TP2 on two H200s (2026-11-30),
    at 8,192 tokens, within the 9,362 the fused path takes, so its profile run made the 3 MoE layers' 64 MiB
    residuals. Without them the plan was 0.40 GiB under vLLM's profile, the group's worst fit residual."""
    run = REPO_ROOT / "tests" / "fixtures" / "gpu" / "2026-11-30-two-gpus" / "rehearse-tp2"
    report, reading = accuracy.predict_run(run)
    residual = next(e for e in report.estimates if e.name == "fused_allreduce_residual")
    assert residual.bytes == 3 * 9362 * 3584 * 2 and "profile run" in residual.basis
    rank = report.ranks[0]
    planned = rank.activation_bytes + rank.non_torch_bytes + rank.workspace_bytes
    assert residual.bytes <= rank.workspace_bytes  # seen by vLLM's KV sizing
    assert abs(planned - reading.workers[0].profiled_non_kv_bytes) <= 0.3 * GiB
