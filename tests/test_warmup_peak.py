"""The rehearsal plugin's third entry point (kimi_k3_serve/rehearsal/warmup_peak.py), on the real vLLM: it wraps the
functions that run kernel warmup's forwards as vLLM's modules load, they still return or raise as vLLM's do, and the
line it writes on a GPU is read back per worker and said in the rehearsal's table."""

from __future__ import annotations

from conftest import run_with_rehearsal_plugin
from kimi_k3_serve.rehearsal import warmup_peak
from kimi_k3_serve.rehearsal.vllm_log import parse_vllm_log
from kimi_k3_serve.units import GiB

ENGINE_PROCESS = """
import sys
from vllm.plugins import load_general_plugins
load_general_plugins()
print("imported by the plugin:", "vllm.v1.worker.gpu_worker" in sys.modules, flush=True)
from vllm.model_executor.warmup import kernel_warmup
from vllm.v1.worker import gpu_worker
for function in (kernel_warmup.flashinfer_autotune, gpu_worker.warmup_kernels):
    print("wrapped:", function.__name__, getattr(function, "_kimi_k3_logged", False), flush=True)

try:
    kernel_warmup.flashinfer_autotune(object())
except Exception as error:  # no FlashInfer on this machine: vLLM's own error, through the wrapper
    print("raised:", type(error).__name__, flush=True)
"""


def test_the_plugin_wraps_both_warmup_functions_and_leaves_them_working(tmp_path) -> None:
    out = run_with_rehearsal_plugin(ENGINE_PROCESS, tmp_path / "plugin")
    assert "imported by the plugin: False" in out  # loading plugins imports none of vLLM's warmup code
    assert "wrapped: flashinfer_autotune True" in out and "wrapped: warmup_kernels True" in out
    assert "raised: ModuleNotFoundError" in out  # vLLM's own error passes through the wrapper
    assert warmup_peak.MARKER not in out  # no CUDA allocator here: nothing to log
    entry_points = (tmp_path / "plugin" / "kimi_k3_rehearsal_full_graphs-0.dist-info" / "entry_points.txt").read_text()
    assert f"{warmup_peak.PLUGIN_NAME} = kimi_k3_serve.rehearsal.warmup_peak:register" in entry_points


def _line(scope: str, entry: int, peak: int, before: int, failed: bool) -> str:
    return (f'(Worker pid=3196) {warmup_peak.MARKER} {{"pid": 3196, "scope": "{scope}", "allocated_at_entry": {entry}, '
            f'"peak_at_entry": {before}, "allocated_peak": {peak}, "failed": {str(failed).lower()}}}\n')


def test_each_warmup_forward_is_read_and_said_in_the_table() -> None:
    from kimi_k3_serve.rehearsal.compare import Comparison, RankComparison, render_table

    log = (_line("flashinfer_autotune", 74 * GiB, 80 * GiB, 70 * GiB, False)
           + _line("warmup_kernels", 75 * GiB, 80 * GiB, 80 * GiB, False))
    (w,) = parse_vllm_log(log).workers
    autotune, kernels = w.warmup_peaks
    assert (autotune.scope, autotune.transient_bytes, autotune.failed) == ("flashinfer_autotune", 6 * GiB, False)
    assert kernels.transient_bytes is None  # it set no new peak: its own is not known
    assert w.to_json()["warmup_peaks"][0]["transient_bytes"] == 6 * GiB
    table = render_table(Comparison((RankComparison(0, 0, 0, (), warmup_peaks=w.warmup_peaks),), "fits", "fits",
                                    1.0, 1.0, None))
    assert ("kernel warmup: flashinfer_autotune began with 74.00 GiB allocated and peaked 6.00 GiB above that; "
            "warmup_kernels began with 75.00 GiB allocated and set no new peak") in table


def test_a_warmup_that_ran_out_of_memory_says_so() -> None:
    (w,) = parse_vllm_log(_line("flashinfer_autotune", 74 * GiB, 77 * GiB, 70 * GiB, True)).workers
    (p,) = w.warmup_peaks
    assert p.failed and p.transient_bytes == 3 * GiB


def test_an_out_of_memory_the_engine_went_on_after_is_said_beside_the_verdict() -> None:
    """Round 48 (H100, 3 speculative tokens at 16,384 over 64, at the proposal 0.985) started, but FlashInfer's
    autotuner asked for 2.06 GiB with 1.54 GiB free and skipped that tactic: the table says the start was at vLLM's
    edge. Round 47's failed start keeps its one out-of-memory as the failure, not as a caught one."""
    from pathlib import Path

    from kimi_k3_serve import recorded
    from kimi_k3_serve.rehearsal.compare import Comparison, render_table

    fixtures = Path(__file__).parent / "fixtures" / "gpu"
    text = recorded.read_text(fixtures / "2026-12-07-round48" / "k4-tp1-b16384-s64-dspark3-u0985-h100" / "vllm.log")
    reading = parse_vllm_log(text)
    assert reading.started
    (caught,) = reading.caught_ooms
    assert (caught.step, caught.tried_bytes, caught.free_bytes) == ("warmup", 2214592512, 1652752384)
    table = render_table(Comparison((), "fits", "fits", 1.0, 1.0, None, (caught.to_json(),)), [])
    assert "vLLM went on after an allocation of 2.06 GiB failed with 1.54 GiB free during warmup" in table
    assert "autotuner skips a tactic it cannot fit" in table
    failed = parse_vllm_log(recorded.read_text(
        fixtures / "2026-12-07-round47" / "k4-tp1-b2048-s256-dspark3-u095-h100" / "vllm.log"))
    assert failed.oom is not None and failed.caught_ooms == ()


def test_an_out_of_memory_the_capture_went_on_after_is_not_called_the_autotuners() -> None:
    """Round 53 (H100, 3 speculative tokens at 2,048 over 128, at the proposal 0.965) started, but as DSpark's first
    graph was captured the caching allocator twice failed to allocate (40 and 38 MiB with 26 and 34 MiB free),
    released its cached blocks and went on: the table says the start was at vLLM's edge, and why it went on."""
    from pathlib import Path

    from kimi_k3_serve import recorded
    from kimi_k3_serve.rehearsal.compare import Comparison, render_table

    fixtures = Path(__file__).parent / "fixtures" / "gpu"
    text = recorded.read_text(fixtures / "2026-12-07-round53" / "k4-tp1-b2048-s128-dspark3-u0965-h100" / "vllm.log")
    reading = parse_vllm_log(text)
    assert reading.started and reading.oom is None
    assert [(o.step, o.tried_bytes, o.free_bytes) for o in reading.caught_ooms] == [
        ("cuda_graphs", 41943040, 27459584), ("cuda_graphs", 39845888, 35848192)]
    table = render_table(Comparison((), "fits", "fits", 1.0, 1.0, None,
                                    tuple(o.to_json() for o in reading.caught_ooms)), [])
    assert "GiB free during cuda_graphs (the caching allocator released its cached blocks" in table
    assert "autotuner" not in table
