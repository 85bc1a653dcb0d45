"""FlashInfer's fused all-reduce residual in every Kimi-K3 MoE layer at TP > 1 (planning/fused_allreduce.py), from
vLLM 0.32's code: its size per GPU and TP degree, and whether vLLM's profile sees it."""

from __future__ import annotations

import pytest

from conftest import REPO_ROOT, load_script
from kimi_k3_serve.models import inventory_from_config, read_config
from kimi_k3_serve.planning.fused_allreduce import zero_residual
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
    residual = zero_residual(KIMI, tp, 0, 49, False, cc)
    assert residual.max_token_num == tokens
    assert residual.bytes_per_layer == tokens * 3584 * 2
    assert residual.layers == 48  # layers 1-48 are MoE; layer 0 is dense
    assert residual.in_profile(8192) == (tokens >= 8192)


@pytest.mark.parametrize("tp, sp, cc", [(1, False, (9, 0)), (8, True, (10, 0)), (16, False, (9, 0)),
                                         (8, False, (8, 0))])
def test_no_fused_path(tp, sp, cc) -> None:
    """TP1 all-reduces nothing; sequence parallelism takes another path; a TP size or GPU the fusion's table does
    not list (TP16 on Hopper, an A100) has no budget."""
    assert zero_residual(KIMI, tp, 0, 49, sp, cc) is None


def test_the_tp2_slice_profiled_what_its_residuals_hold() -> None:
    """The one recorded TP > 1 run without sequence parallelism: the 4-layer slice at TP2 on two H200s (2026-11-30),
    at 8,192 tokens, within the 9,362 the fused path takes, so its profile run made the 3 MoE layers' 64 MiB
    residuals. Without them the plan was 0.40 GiB under vLLM's profile, the group's worst fit residual."""
    run = REPO_ROOT / "tests" / "fixtures" / "gpu" / "2026-11-30-two-gpus" / "rehearse-tp2"
    report, reading = accuracy.predict_run(run)
    residual = next(e for e in report.estimates if e.name == "workspace:fused_allreduce_residual")
    assert residual.bytes == 3 * 9362 * 3584 * 2 and "profile run" in residual.basis
    rank = report.ranks[0]
    planned = rank.activation_bytes + rank.non_torch_bytes + rank.workspace_bytes
    assert residual.bytes <= rank.workspace_bytes  # seen by vLLM's KV sizing
    assert abs(planned - reading.workers[0].profiled_non_kv_bytes) <= 0.3 * GiB
