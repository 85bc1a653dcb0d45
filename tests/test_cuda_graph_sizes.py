"""The plan's CUDA-graph sizes are vLLM's: on every recorded engine start that logged its compilation config, the
capture sizes vLLM set, and the PIECEWISE, FULL and DSpark graphs it captured, are the ones
``planning.memory.cuda_graph_capture_sizes`` and ``uniform_decode_graph_tokens`` give for the run's own
``max_num_seqs``, ``max_num_batched_tokens`` and speculative tokens (read from the same log)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import last_logged_int
from kimi_k3_serve import recorded
from kimi_k3_serve.planning.memory import cuda_graph_capture_sizes, uniform_decode_graph_tokens

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"


def _captured(bar: str, text: str) -> int:
    """The largest total of a finished capture bar (``Capturing CUDA graphs (FULL): 100% ... 48/48``); 0 if none."""
    return max((int(n) for n in re.findall(re.escape(bar) + r": 100%[^|]*\|[^|]*\| *(\d+)/", text)), default=0)


def _logged_runs() -> list[tuple[str, str]]:
    runs = []
    for log in recorded.glob(FIXTURES, "*/*/vllm.log"):
        text = recorded.read_text(log, errors="replace")
        if re.search(r"'cudagraph_capture_sizes': \[\d", text) and "'max_num_seqs': " in text:
            runs.append((f"{log.parent.parent.name}/{log.parent.name}", text))
    return runs


LOGGED = _logged_runs()


def test_the_recorded_runs_cover_the_off_grid_sizes() -> None:
    # Enough runs, and among them the ones whose max_num_seqs is off vLLM's grid of 8s and 16s (15 and 22), which
    # vLLM adds as a size of its own (the plan counted one PIECEWISE and one FULL graph too few there until
    # 2026-12-04).
    assert len(LOGGED) >= 70
    off_grid = {name for name, text in LOGGED if last_logged_int(r"'max_num_seqs': (\d+)", text) in (15, 22)}
    assert len(off_grid) >= 3, off_grid


@pytest.mark.parametrize("name, text", LOGGED, ids=[name for name, _ in LOGGED])
def test_capture_sizes_and_graph_counts_are_vllms(name: str, text: str) -> None:
    seqs = last_logged_int(r"'max_num_seqs': (\d+)", text)
    tokens = last_logged_int(r"'max_num_batched_tokens': (\d+)", text)
    num_spec = last_logged_int(r"'num_speculative_tokens': (\d+)", text) or 0
    logged = [sizes for sizes in map(ast.literal_eval, re.findall(r"'cudagraph_capture_sizes': (\[[^\]]*\])", text))
              if sizes][-1]
    sizes = cuda_graph_capture_sizes(seqs, 1 + num_spec, tokens, (9, 0))
    assert list(sizes) == logged
    assert _captured("Capturing CUDA graphs (PIECEWISE)", text) in (0, len(sizes))
    full = len(uniform_decode_graph_tokens(sizes, seqs, 1 + num_spec))
    # 2: only the profile's two sampled FULL graphs were captured (the run stopped before the real capture).
    assert _captured("Capturing CUDA graphs (FULL)", text) in (0, 2, full)
    dspark = re.findall(r"Capturing dspark CUDA graphs \(FULL\):[^|]*\|[^|]*\| *\d+/(\d+)", text)
    if dspark:
        assert max(map(int, dspark)) == len(uniform_decode_graph_tokens(sizes, seqs, num_spec))
