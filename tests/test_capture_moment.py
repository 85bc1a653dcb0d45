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


def test_the_plans_capture_moment_replays_every_recorded_dspark_capture() -> None:
    """The plan weighs the real capture with a DSpark draft whose FlashKDA buffers grew in warmup as what it starts
    on (warmup's entry level once its forward is freed, the growth with it, outside the budget) and
    ``capture.CAPTURE_ROOM_DSPARK`` beyond it. Replayed on every recorded run whose capture this moment covers, the room
    the plan leaves it beyond the start puts every capture that ran out of memory below that room (never "fits" by
    it) and every one that went on at or above the band's low end (never "does not fit" by it). The band holds the
    two failures the room was chosen between (round 47's 2,048 / 256 at 0.95, round 56's 3,072 / 384 at 0.935) and
    round 53's start after the allocator's retry. Round 67 (8,192 / 512 at 0.90, validation), which the stand-in
    called "does not fit" by 1.53 GiB, started with 5.45 GiB beyond the start."""
    from kimi_k3_serve.planning.capture import CAPTURE_ROOM_DSPARK, CAPTURE_ROOM_DSPARK_LOW

    rooms = [r for r in load_script("capture_moment").capture_rooms() if r.plan_room_bytes is not None]
    slack = {r.name: r.plan_room_bytes for r in rooms}
    outcomes = {r.name: r.outcome for r in rooms}
    failed = [name for name, outcome in outcomes.items() if outcome == "out of memory"]
    went_on = [name for name, outcome in outcomes.items() if outcome != "out of memory"]
    assert len(failed) == 5 and len(went_on) >= 8
    assert all(slack[name] < CAPTURE_ROOM_DSPARK for name in failed)
    assert all(slack[name] >= CAPTURE_ROOM_DSPARK_LOW for name in went_on)
    assert sorted(name for name in slack if CAPTURE_ROOM_DSPARK_LOW <= slack[name] < CAPTURE_ROOM_DSPARK) == [
        "k4-tp1-b2048-s128-dspark3-u0965-h100", "k4-tp1-b2048-s256-dspark3-u095-h100",
        "k4-tp1-b3072-s384-dspark3-u0935-h100"]
    assert round(slack["k4-tp1-b8192-s512-dspark3-u090-h100"] / GiB, 2) == 5.45
