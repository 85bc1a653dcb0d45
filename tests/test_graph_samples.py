"""The rehearsal's vLLM plugin that logs how vLLM built its CUDA-graph estimate (kimi_k3_serve/rehearsal/graph_samples.py),
on the real vLLM: its plugin loader finds the entry point, and vLLM's own function is wrapped once vLLM imports it."""

from __future__ import annotations

import os
import subprocess
import sys

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
