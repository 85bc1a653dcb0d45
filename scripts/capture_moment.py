"""The room vLLM 0.32's real CUDA-graph capture had, replayed from every recorded DSpark run that reached it.

docs/capture-moment.md reads the capture's worst moment from ``capture_model`` (one shared graph pool, an eager
forward before each graph, DSpark's first graph last) and from these logs. Per run this prints:

- C0: what torch held as warmup began (the rehearsal plugin's ``allocated_at_entry``) plus FlashKDA's growth in
  warmup (vLLM's "Resized workspace from 'kda.py:...:_forward'" line after it, if any): what the capture starts on;
- T - C0: the room the capture had, T being the device total torch sees (``host.json``);
- the graph set: the target's PIECEWISE and FULL graphs and DSpark's, as vLLM's progress bars count them;
- how the capture ended: started, went on after the caching allocator's retry (at its edge), or out of memory;
- the room today's plan leaves the capture beyond what it starts on, where the plan weighs that moment.

The plan weighs this moment where a DSpark draft's FlashKDA buffers grow in warmup (``capture.CAPTURE_ROOM_DSPARK``,
in its own terms: what the capture starts on outside the budget, from its warmup model); elsewhere its stand-in
(``capture.CAPTURE_AFTER_GROWTH_ERROR``) stands for it.

    python scripts/capture_moment.py
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from memory_accuracy import predict_run, run_dirs  # noqa: E402
from kimi_k3_serve import recorded  # noqa: E402
from kimi_k3_serve.planning.capture import CAPTURE_ROOM_DSPARK  # noqa: E402
from kimi_k3_serve.rehearsal.vllm_log import parse_vllm_log  # noqa: E402
from kimi_k3_serve.units import GiB, MiB  # noqa: E402

_KDA_GROWTH = re.compile(r"Resized workspace from 'kda\.py:\d+:_forward': ([\d.]+) MB -> ([\d.]+) MB")
_GRAPHS = re.compile(r"Capturing (CUDA|dspark CUDA) graphs \((PIECEWISE|FULL)\):\s+\d+%\|[^|]*\|\s*\d+/(\d+)")


@dataclass(frozen=True)
class CaptureRoom:
    name: str
    total_bytes: int
    c0_bytes: int
    graphs: tuple[int, int, int]
    """The real capture's target PIECEWISE, target FULL and DSpark graphs (the last of each progress bar's counts)."""
    outcome: str
    """"started", "at its edge" (the allocator ran out, released its cache and went on) or "out of memory"."""
    plan_room_bytes: int | None
    """The room today's plan leaves the capture beyond what it starts on, in the plan's terms (``plan_room``)."""

    @property
    def room_bytes(self) -> int:
        return self.total_bytes - self.c0_bytes


def capture_room(run_dir: Path) -> CaptureRoom | None:
    """The capture's room in one recorded run, or None where the run has no DSpark draft or no warmup line, or ended
    before the capture."""
    text = recorded.read_text(run_dir / "vllm.log", errors="replace")
    if "method='dspark'" not in text or "KIMI_K3_REHEARSAL_WARMUP_PEAK" not in text:
        return None
    reading = parse_vllm_log(text)
    if len(reading.workers) != 1 or not reading.workers[0].warmup_peaks:
        return None
    if reading.oom is not None and reading.oom.step != "cuda_graphs" or reading.oom is None and not reading.started:
        return None
    # Warmup, then the real capture: the profile's own captures and FlashKDA's sizes before it are in the budget.
    after_warmup = text[text.index("KIMI_K3_REHEARSAL_WARMUP_PEAK"):]
    growth = _KDA_GROWTH.search(after_warmup)
    grown = round((float(growth.group(2)) - float(growth.group(1))) * MiB) if growth else 0
    counts = {("dspark" if kind.startswith("dspark") else "target", mode): int(n)
              for kind, mode, n in _GRAPHS.findall(after_warmup)}
    host = json.loads((run_dir.parent / "host.json").read_text())
    edge = any(o.step == "cuda_graphs" for o in reading.caught_ooms)
    return CaptureRoom(
        name=run_dir.name, total_bytes=int(host["torch_devices"][0]["total_bytes"]),
        c0_bytes=reading.workers[0].warmup_peaks[0].allocated_at_entry_bytes + grown,
        graphs=(counts.get(("target", "PIECEWISE"), 0), counts.get(("target", "FULL"), 0),
                counts.get(("dspark", "FULL"), 0)),
        outcome="out of memory" if reading.oom is not None else "at its edge" if edge else "started",
        plan_room_bytes=plan_room(run_dir))


def plan_room(run_dir: Path) -> int | None:
    """The room today's plan leaves the run's capture beyond what the capture starts on, in the plan's terms (outside
    the budget), where the plan weighs the capture's own moment (a DSpark draft whose FlashKDA buffers grow in
    warmup: ``capture.CAPTURE_ROOM_DSPARK``); None elsewhere. Where the start is so far inside the budget that the
    moment needs nothing outside it, this is a lower bound."""
    report, _ = predict_run(run_dir)
    moment = next((e for e in report.estimates if e.name == "capture_moment"), None)
    if moment is None:
        return None
    return report.ranks[0].headroom_bytes - (moment.bytes - CAPTURE_ROOM_DSPARK)


def capture_rooms() -> list[CaptureRoom]:
    return [room for d in run_dirs() if (room := capture_room(d)) is not None]


def main() -> int:
    print("| run | graphs (target PIECEWISE / FULL, DSpark) | T - C0 GiB | room beyond the start, plan GiB | capture |")
    print("| --- | --- | --- | --- | --- |")
    for room in sorted(capture_rooms(), key=lambda r: (r.graphs, r.room_bytes)):
        plan = "-" if room.plan_room_bytes is None else f"{room.plan_room_bytes / GiB:.2f}"
        print(f"| {room.name} | {' / '.join(map(str, room.graphs))} | {room.room_bytes / GiB:.2f} | {plan} | "
              f"{room.outcome} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
