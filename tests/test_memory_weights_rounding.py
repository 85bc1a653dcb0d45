"""The CUDA caching allocator's rounding that vLLM 0.32's "Model loading took" counts (planning/allocator.py)."""

from __future__ import annotations

import pytest

from conftest import REPO_ROOT, load_script
from kimi_k3_serve.planning.allocator import allocator_rounding_bytes
from kimi_k3_serve.units import GiB, MiB

accuracy = load_script("memory_accuracy")


@pytest.mark.parametrize("nbytes, extra", [
    (9 * MiB + 1, 0),  # below 10 MiB: its 20 MiB segment's remainder is split off
    (10 * MiB, 0),  # already a 2 MiB multiple
    (11 * MiB, MiB),  # 10-20 MiB: a 1 MiB tail is not split off
    (int(10.5 * MiB), 0),  # 10-20 MiB: a 1.5 MiB tail is split off
    (int(19.75 * MiB), MiB // 4),
    (20 * MiB, 0),
    (21 * MiB, MiB),  # >= 20 MiB: never split under max_split_size_mb=20, the whole block counts
    (int(20.5 * MiB), int(1.5 * MiB)),
    (int(85.96875 * MiB), MiB // 32),  # a KDA in_proj of the 49-layer rank slice
])
def test_rule_per_tensor(nbytes: int, extra: int) -> None:
    assert allocator_rounding_bytes(nbytes) == extra


def test_49_layer_rank_slice_weights_match_vllm() -> None:
    report, reading = accuracy.predict_run(REPO_ROOT / "tests" / "fixtures" / "gpu" / "2026-12-01" / "r49-s0")
    rank = report.ranks[0]
    assert rank.draft_bytes == 0
    assert reading.workers[0].model_load_bytes / GiB == pytest.approx(104.15, abs=0.005)
    assert rank.weights_bytes / GiB == pytest.approx(104.15, abs=0.01)
    assert round(rank.weights_by_category["allocator_rounding"] / MiB, 1) == 280.4
