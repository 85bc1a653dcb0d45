"""scripts/capture_moment.py: the room vLLM 0.32's real CUDA-graph capture had in every recorded DSpark run, replayed
from the logs (docs/capture-moment.md)."""

from __future__ import annotations

from conftest import load_script

from kimi_k3_serve.units import GiB


def test_every_capture_that_ran_out_of_memory_had_less_room_than_every_one_that_went_on() -> None:
    """With 3 speculative tokens the target's graph set is 51 PIECEWISE and 49 FULL graphs (4 layers on an H100, 6
    on an H200). The five captures that ran out of memory (rounds 44, 46 and 47, and round 56's two) had 2.83 to
    3.27 GiB above what warmup began with and FlashKDA's growth; every one that went on had 3.40 GiB or more, and the
    one at 3.40 (round 53, 42 DSpark graphs) went on only after the caching allocator released its cached blocks: the
    capture's own need (Q in docs/capture-moment.md) lies between, whatever the token budget and request count. Round
    56's two were fixed before they ran, with the room this replay gave them written beside (3.01 and 3.27 GiB)."""
    rooms = [r for r in load_script("capture_moment").capture_rooms() if r.graphs[:2] == (51, 49)]
    failed = sorted(round(r.room_bytes / GiB, 2) for r in rooms if r.outcome == "out of memory")
    went_on = sorted(round(r.room_bytes / GiB, 2) for r in rooms if r.outcome != "out of memory")
    assert failed == [2.83, 2.95, 3.0, 3.23, 3.27]
    assert len(went_on) >= 8 and went_on[0] == 3.40
    assert [r.name for r in rooms if r.outcome == "at its edge"] == ["k4-tp1-b2048-s128-dspark3-u0965-h100"]
    assert max(failed) < min(went_on)
