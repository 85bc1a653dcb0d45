"""The rehearsal's vLLM plugin that logs how vLLM built its CUDA-graph estimate (kimi_k3_serve/rehearsal/graph_samples.py),
on the real vLLM: its plugin loader finds the entry point, and vLLM's own function is wrapped once vLLM imports it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kimi_k3_serve.rehearsal import graph_samples
from kimi_k3_serve.rehearsal.vllm_log import parse_vllm_log
from kimi_k3_serve.units import MiB

ENGINE_PROCESS = """
import sys
from vllm.plugins import load_general_plugins
load_general_plugins()
print("imported by the plugin:", "vllm.v1.worker.gpu.cudagraph_utils" in sys.modules, flush=True)
from vllm.v1.worker.gpu import cudagraph_utils
print("answer:", cudagraph_utils._extrapolate_full_graph_memory([412 * 2**20, 2 * 2**20], 48), flush=True)
print("floor:", cudagraph_utils._extrapolate_full_graph_memory([412 * 2**20, 0], 48), flush=True)
"""


def test_the_plugin_logs_the_full_graph_samples_and_leaves_vllms_answer_unchanged(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(graph_samples.install(tmp_path / "plugin"))}
    env.pop("VLLM_PLUGINS", None)
    run = subprocess.run([sys.executable, "-c", ENGINE_PROCESS], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "imported by the plugin: False" in out  # loading plugins does not import vLLM's worker code
    assert f"answer: {(412 + 47 * 2) * MiB}" in out  # the first sample + 47 x the second: vLLM's own answer
    assert f"floor: {(412 + 47) * MiB}" in out  # a second sample under 1 MiB is charged 1 MiB
    workers = parse_vllm_log(out).workers
    assert len(workers) == 1
    w = workers[0]
    assert (w.full_graph_samples, w.full_graphs, w.full_graph_extrapolated_bytes) == ((412 * MiB, 0), 48, 459 * MiB)


def test_a_workers_samples_are_read_from_its_prefixed_line() -> None:
    log = ("(Worker pid=2064) INFO 12-03 14:25:08 [gpu_model_runner.py:1] Model loading took 121.69 GiB memory\n"
           '(Worker pid=2064) KIMI_K3_REHEARSAL_FULL_GRAPHS {"pid": 2064, "samples": [432013312, 4194304], '
           '"full_graphs": 48, "extrapolated": 629145600}\n')
    (w,) = parse_vllm_log(log).workers
    assert w.pid == 2064 and w.model_load_bytes is not None
    assert w.full_graph_samples == (432013312, 4 * MiB) and w.full_graphs == 48
    assert w.full_graph_extrapolated_bytes == 600 * MiB


ROUND16 = Path(__file__).parent / "fixtures" / "gpu" / "2026-12-04-round18"
FULL_WIDTH_RELEASE_MIB = {"k4-tp1-serve-defaults-dspark-samples": 374, "k6-tp1-serve-defaults-dspark-samples": 316,
                          "k7-tp1-b2048-s128-dspark-u081": 318, "k8-tp1-b2048-s128-dspark": 428,
                          "k8-tp1-b4096-s64-dspark": 428, "k8-tp1-b8192-s512-nodraft-samples": 338}
"""The allocator cache released at vLLM's second sampled FULL graph (496 tokens, 96 heads), as the H200 logged it."""


def test_vllms_full_graph_samples_are_negative_so_its_estimate_adds_the_released_cache() -> None:
    """ranks-round16 (H200, 2026-12-04), read with the plugin: on every run both sampled FULL graphs freed more
    memory than they took (``torch.cuda.graph`` empties the allocator's cache on entry), so vLLM charged the other
    FULL graphs its 1 MiB floor, and its estimate holds the second graph's release on top of what the capture
    measured. The release is not smooth in depth: 316 to 428 MiB at one width and one token count."""
    runs = {d.name: parse_vllm_log((d / "vllm.log").read_text(errors="replace")).workers[0]
            for d in sorted(ROUND16.iterdir()) if (d / "vllm.log").is_file()}
    assert len(runs) == 8 and all(w.full_graph_samples for w in runs.values())
    for name, w in runs.items():
        first, second = w.full_graph_samples
        assert first < 0 and second < 0, name
        assert w.full_graph_extrapolated_bytes == first + (w.full_graphs - 1) * MiB, name  # the floor, per graph
    released = {name: round(-runs[name].full_graph_samples[1] / MiB) for name in FULL_WIDTH_RELEASE_MIB}
    assert released == FULL_WIDTH_RELEASE_MIB
    assert round(-runs["r44-s1-dspark-b8192-s256-samples"].full_graph_samples[1] / MiB) == 130  # a TP8 rank


def test_the_rehearsal_table_says_how_much_of_vllms_estimate_is_released_cache() -> None:
    from kimi_k3_serve.rehearsal.compare import Comparison, RankComparison, Row, render_table

    rank = RankComparison(0, 0, 0, (Row("kv_cache", 1, 1),), (-90 * MiB, -428 * MiB), 48)
    table = render_table(Comparison((rank,), "fits", "fits", 1.0, 1.0, None), ["GPU 0"])
    assert ("GPU 0: vLLM captured 2 of its 48 FULL graphs to estimate them (free memory changed by +0.09 / +0.42 GiB) "
            "and charged each other one 1 MiB; 0.42 GiB of its estimate is the allocator cache released") in table
    assert RankComparison(0, 0, 0, ()).full_graph_line() is None  # not logged: nothing said


def test_the_engine_finds_the_plugin_and_a_plugin_list_names_it(tmp_path, monkeypatch) -> None:
    from kimi_k3_serve.commands.rehearse import engine_env

    monkeypatch.setenv("PYTHONPATH", "/site")
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    env = engine_env({"NCCL_NVLS_ENABLE": "0"}, tmp_path)
    assert env["PYTHONPATH"] == os.pathsep.join((str(tmp_path / "vllm-plugin"), "/site"))
    assert env["NCCL_NVLS_ENABLE"] == "0" and "VLLM_PLUGINS" not in env  # vLLM loads every plugin it finds
    assert (tmp_path / "vllm-plugin" / "kimi_k3_rehearsal_full_graphs-0.dist-info" / "entry_points.txt").is_file()
    restricted = engine_env({"VLLM_PLUGINS": "lora_resolver"}, tmp_path)
    assert restricted["VLLM_PLUGINS"] == "lora_resolver,kimi_k3_rehearsal_full_graphs"
