"""The rehearsal's vLLM plugin that logs how vLLM built its CUDA-graph estimate (kimi_k3_serve/rehearsal/graph_samples.py),
on the real vLLM: its plugin loader finds the entry point, and vLLM's own function is wrapped once vLLM imports it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import run_with_rehearsal_plugin
from kimi_k3_serve import recorded
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
    out = run_with_rehearsal_plugin(ENGINE_PROCESS, tmp_path / "plugin")
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


def _first_workers(folder: Path) -> dict:
    """Each recorded run's first worker reading, by run name."""
    return {d.name: parse_vllm_log(recorded.read_text(d / "vllm.log", errors="replace")).workers[0]
            for d in sorted(folder.iterdir()) if recorded.exists(d / "vllm.log")}


def test_vllms_full_graph_samples_are_negative_so_its_estimate_adds_the_released_cache() -> None:
    """ranks-round16 (H200, 2026-12-04), read with the plugin: on every run both sampled FULL graphs freed more
    memory than they took (``torch.cuda.graph`` empties the allocator's cache on entry), so vLLM charged the other
    FULL graphs its 1 MiB floor, and its estimate holds the second graph's release on top of what the capture
    measured. The release is not smooth in depth: 316 to 428 MiB at one width and one token count."""
    runs = _first_workers(ROUND16)
    assert len(runs) == 8 and all(w.full_graph_samples for w in runs.values())
    for name, w in runs.items():
        first, second = w.full_graph_samples
        assert first < 0 and second < 0, name
        assert w.full_graph_extrapolated_bytes == first + (w.full_graphs - 1) * MiB, name  # the floor, per graph
    released = {name: round(-runs[name].full_graph_samples[1] / MiB) for name in FULL_WIDTH_RELEASE_MIB}
    assert released == FULL_WIDTH_RELEASE_MIB
    assert round(-runs["r44-s1-dspark-b8192-s256-samples"].full_graph_samples[1] / MiB) == 130  # a TP8 rank


ROUND19 = Path(__file__).parent / "fixtures" / "gpu" / "2026-12-05-round19"


def test_the_cache_the_plugin_logged_is_what_vllms_second_sample_lost_and_each_byte_has_a_site() -> None:
    """ranks-round17's fit runs (H200, 2026-12-05), the first to log the released cache: at the second sampled FULL
    graph the empty segments the plugin found are vLLM's negative sample, less what the graph itself took (at most
    14 MiB), and the allocator's history names the code that made every one of them. The largest maker on both is
    FlashMLA's decode call (its output and split-KV buffers, which grow with the graph's tokens and heads)."""
    runs = _first_workers(ROUND19)
    second = {name: next(c for c in w.released_caches if c.capture == 2) for name, w in runs.items()}
    assert {name: round(c.releasable_bytes / MiB) for name, c in second.items()} == {
        "k6-tp1-b4096-s128-dspark": 330, "k8-tp1-b4096-s32-dspark": 186}
    for name, c in second.items():
        assert 0 <= c.releasable_bytes + runs[name].full_graph_samples[1] <= 14 * MiB, name
        assert c.untraced_bytes == 0 and sum(b for _, b, _ in c.sites) == c.releasable_bytes, name
        assert c.sites[0][0] == "flash_mla_interface.py:185 flash_mla_with_kvcache", name


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
    assert restricted["VLLM_PLUGINS"] == ("lora_resolver,kimi_k3_rehearsal_full_graphs,kimi_k3_rehearsal_profile_peak,"
                                          "kimi_k3_rehearsal_warmup_peak")


SCOPE_PROCESS = """
import sys
from types import SimpleNamespace
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1.worker.gpu import cudagraph_utils
from vllm.compilation.cudagraph_pool import _outside_cumem
from kimi_k3_serve.rehearsal import graph_samples
config = SimpleNamespace(use_cumem_cudagraph_pool=False)
print("outside profiling:", graph_samples._profiling["captures"], flush=True)
with cudagraph_utils.capture_pool((7, 1), config) as pool:
    print("pool:", pool, "counted:", graph_samples._profiling["captures"], flush=True)
with cudagraph_utils.capture_outside_cumem_pool():
    print("vLLM's own scope still set:", _outside_cumem.get(), flush=True)
    for _ in range(3):
        with cudagraph_utils.capture_pool((7, 1), config) as pool:
            pass
    print("captures in profiling:", graph_samples._profiling["captures"], "pool:", pool, flush=True)
print("after profiling:", graph_samples._profiling["active"], flush=True)
"""


def test_the_plugin_counts_vllms_sampled_full_captures_inside_its_profiling_scope_only(tmp_path) -> None:
    """On the real vLLM: the plugin wraps cudagraph_utils' ``capture_outside_cumem_pool`` (entered by
    ``profile_cudagraph_memory`` alone) and ``capture_pool`` (entered for each FULL capture), both still doing what
    vLLM's do. Without a GPU there is no allocator to log; on the H200 the first two captures log the cache."""
    out = run_with_rehearsal_plugin(SCOPE_PROCESS, tmp_path / "plugin")
    assert "outside profiling: 0" in out and "pool: (7, 1) counted: 0" in out  # the real capture: not counted
    assert "vLLM's own scope still set: True" in out
    assert "captures in profiling: 3 pool: (7, 1)" in out
    assert "after profiling: False" in out
    assert graph_samples.CACHE_MARKER not in out  # no CUDA allocator here: nothing to log


def _segment(address: int, size_mib: int, allocated_mib: int = 0, pool=(0, 0)) -> dict:
    """A segment as ``torch.cuda.memory._snapshot()`` gives it (torch/cuda/memory.py ``Segment``)."""
    return {"device": 0, "address": address, "total_size": size_mib * MiB, "allocated_size": allocated_mib * MiB,
            "active_size": allocated_mib * MiB, "segment_type": "large", "segment_pool_id": pool, "blocks": []}


def _made(address: int, size_mib: int, *paths: tuple[str, int, str]) -> dict:
    frames = [{"filename": f, "line": line, "name": name} for f, line, name in paths]
    return {"action": "segment_alloc", "addr": address, "size": size_mib * MiB, "frames": frames}


MOE = ("/venv/lib/python3.12/site-packages/vllm/model_executor/layers/fused_moe/fused_moe.py", 812, "fused_experts")
TORCH = ("/venv/lib/python3.12/site-packages/torch/nn/functional.py", 2100, "linear")
INDUCTOR = ("/tmp/torchinductor_root/ab/cabc123.py", 311, "call")


def test_the_releasable_cache_is_the_default_pools_empty_segments_by_size_and_by_what_made_them() -> None:
    segments = [_segment(0x1000, 94), _segment(0x2000, 20), _segment(0x3000, 20), _segment(0x4000, 20, 2),
                _segment(0x5000, 40, pool=(3, 0)), _segment(0x6000, 2)]
    traces = [_made(0x2000, 20, TORCH, INDUCTOR), {"action": "alloc", "addr": 0x1000, "size": MiB, "frames": []},
              _made(0x1000, 60, MOE), _made(0x1000, 94, TORCH, MOE), _made(0x3000, 20),
              {"action": "alloc", "addr": 0x3000, "size": MiB, "frames": _made(0, 0, INDUCTOR)["frames"]},
              _made(0x4000, 20, MOE)]
    summary = graph_samples.releasable_cache(segments, traces)
    # In use (0x4000) and another pool's (0x5000, a graph's) are not given back; 0x6000 predates the history.
    assert summary["releasable"] == (94 + 20 + 20 + 2) * MiB
    assert summary["segments"] == [[94 * MiB, 1], [20 * MiB, 2], [2 * MiB, 1]]
    assert summary["sites"] == [["vllm/model_executor/layers/fused_moe/fused_moe.py:812 fused_experts", 94 * MiB, 1],
                                ["cabc123.py:311 call", 40 * MiB, 2]]  # the latest trace of an address; torch's skipped,
    # and a segment_alloc without frames (0x3000) is named by the allocation that opened it
    assert summary["untraced"] == 2 * MiB


def test_the_released_cache_line_is_read_and_said_in_the_rehearsal_table() -> None:
    from kimi_k3_serve.rehearsal.compare import Comparison, RankComparison, Row, render_table
    from kimi_k3_serve.rehearsal.vllm_log import ReleasedCache

    site = "vllm/model_executor/layers/fused_moe/fused_moe.py:812 fused_experts"
    log = ("(Worker pid=2064) INFO 12-03 14:25:08 [gpu_model_runner.py:1] Model loading took 121.69 GiB memory\n"
           f'(Worker pid=2064) {graph_samples.CACHE_MARKER} {{"pid": 2064, "capture": 1, "releasable": {60 * MiB}, '
           f'"segments": [[{60 * MiB}, 1]], "sites": [], "untraced": {60 * MiB}}}\n'
           f'(Worker pid=2064) {graph_samples.CACHE_MARKER} {{"pid": 2064, "capture": 2, "releasable": {134 * MiB}, '
           f'"segments": [[{94 * MiB}, 1], [{20 * MiB}, 2]], "sites": [["{site}", {94 * MiB}, 1]], '
           f'"untraced": {40 * MiB}}}\n')
    reading = parse_vllm_log(log)
    (w,) = reading.workers
    assert [c.capture for c in w.released_caches] == [1, 2]
    # result.json holds the reading: the first H200 runs to log the line lost theirs to a TypeError (2026-12-05)
    written = json.loads(json.dumps(reading.to_json()))["workers"][0]["released_caches"]
    assert written[1]["sites"] == [[site, 94 * MiB, 1]] and written[0]["untraced_bytes"] == 60 * MiB
    second = w.released_caches[1]
    assert second == ReleasedCache(2, 134 * MiB, ((94 * MiB, 1), (20 * MiB, 2)), ((site, 94 * MiB, 1),), 40 * MiB)
    rank = RankComparison(0, 0, 0, (Row("kv_cache", 1, 1),), (-90 * MiB, -134 * MiB), 48, second)
    table = render_table(Comparison((rank,), "fits", "fits", 1.0, 1.0, None), ["GPU 0"])
    assert (f"the cache was 134 MiB in segments of MiB: 1 x 94, 2 x 20; made by {site} (94 MiB)") in table
    assert rank.to_json()["second_release"]["sites"] == [[site, 94 * MiB, 1]]


def test_the_plan_charges_the_full_graphs_as_vllms_estimate_does() -> None:
    """vLLM's estimate charges every FULL graph after the first its 1 MiB floor (the second sample is negative on every
    logged run), so the number of FULL graphs adds 1 MiB each, not a captured graph's cost: on each run the plugin
    logged, the plan's count of FULL graphs is vLLM's and its floor is what vLLM extrapolated beyond the first sample.
    What the two captures keep (the first graph and the cache released at the second) is a fitted base and a trend."""
    from conftest import last_logged_int
    from kimi_k3_serve.planning import memory

    checked = []
    for d in sorted(ROUND16.iterdir()):
        if not recorded.exists(d / "vllm.log"):
            continue
        checked.append(d.name)
        text = recorded.read_text(d / "vllm.log", errors="replace")
        (w,) = parse_vllm_log(text).workers
        seqs = last_logged_int(r"'max_num_seqs': (\d+)", text)
        tokens = last_logged_int(r"'max_num_batched_tokens': (\d+)", text)
        num_spec = last_logged_int(r"'num_speculative_tokens': (\d+)", text) or 0
        sizes = memory.cuda_graph_capture_sizes(seqs, 1 + num_spec, tokens, (9, 0))
        full_tokens = memory.uniform_decode_graph_tokens(sizes, seqs, 1 + num_spec)
        assert len(full_tokens) == w.full_graphs, d.name
        heads = 12  # any count: the sampled pair's charge is subtracted, what is left is the floor alone
        charged, _ = memory.sampled_full_graphs_bytes("kimi_k3", full_tokens, heads)
        sampled = (memory.CUDA_GRAPH_FULL_SAMPLED["kimi_k3"]
                   + memory.CUDA_GRAPH_RELEASE_PER_TOKEN_HEAD["kimi_k3"] * full_tokens[-2] * heads)
        assert charged - sampled == w.full_graph_extrapolated_bytes - w.full_graph_samples[0], d.name
    assert len(checked) == 8, checked  # round 18's eight engine starts


def test_the_plans_estimate_moves_with_vllms_floor_once_per_full_graph_after_the_first(monkeypatch) -> None:
    """The same in the planner itself, on stage 1's TP8 rank at 256 sequences (48 FULL graphs, vLLM logged them):
    one byte more of floor per graph moves the plan's CUDA-graph estimate by 47 bytes."""
    from conftest import load_script
    from kimi_k3_serve.planning import memory

    accuracy = load_script("memory_accuracy")
    run = ROUND16 / "r44-s1-dspark-b8192-s256-samples"
    before = accuracy.predict_run(run)[0].ranks[0].cuda_graph_bytes
    monkeypatch.setattr(memory, "VLLM_FULL_GRAPH_FLOOR", memory.VLLM_FULL_GRAPH_FLOOR + 1)
    assert accuracy.predict_run(run)[0].ranks[0].cuda_graph_bytes - before == 47
