"""``kimi-k3-serve memory``: JSON shape, exit codes, flag-naming errors, printed timing, all families."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kimi_k3_serve.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
RANK_KEYS = {"rank", "pp_stage", "tp_rank", "weights_bytes", "kv_bytes_per_token", "block_size", "page_bytes",
             "state_bytes_per_seq", "activation_bytes", "cuda_graph_bytes", "non_torch_bytes", "workspace_bytes",
             "draft_bytes", "budget_bytes", "kv_cache_bytes", "num_blocks"}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["memory", *argv])
    except SystemExit as exc:  # argparse's own bad-input exit
        code = int(exc.code)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_the_stable_keys(capsys) -> None:
    code, out, _ = run_cli(capsys, "--gpu", "H200", "--tp", "8", "--pp", "2", "--max-model-len", "32768", "--json")
    assert code == 0
    data = json.loads(out)
    assert {"layout", "ranks", "engine", "fits", "shortfall_bytes"} <= set(data)
    assert set(data["layout"]) >= {"tp", "pp", "ep", "dp", "layer_partition"}
    assert data["layout"]["layer_partition"] == [47, 46]
    assert len(data["ranks"]) == 16 and all(RANK_KEYS <= set(r) for r in data["ranks"])
    assert set(data["engine"]) >= {"num_blocks", "block_size", "kv_cache_tokens", "max_concurrency"}
    assert data["fits"] is True and data["shortfall_bytes"] == 0 and data["engine"]["block_size"] == 768
    assert data["elapsed_ms"]["estimate"] > 0
    assert any(e["name"] == "activation_bytes" and e["margin_bytes"] > 0 for e in data["estimates"])


def test_does_not_fit_exits_1_with_shortfall_per_rank(capsys) -> None:
    code, out, _ = run_cli(capsys, "--gpu", "H200", "--tp", "8", "--max-model-len", "32768")
    assert code == 1
    assert "DOES NOT FIT" in out
    assert sum(1 for line in out.splitlines() if line.strip().startswith("rank ") and "short" in line) == 8
    assert "computed in" in out and " ms" in out


def test_fits_table_and_time(capsys) -> None:
    # 64 sequences: at vLLM's default 1,024 with DSpark at 256K tokens, TRITON_MLA's decode logits alone would take
    # 56 GiB outside the KV sizing (planning/workspace.py) and the plan says vLLM would OOM.
    code, out, _ = run_cli(capsys, "--gpu", "B200", "--tp", "8", "--pp", "2", "--max-model-len", "262144",
                           "--max-num-seqs", "64", "--speculative-config", '{"method": "dspark", "num_speculative_tokens": 7}')
    assert code == 0
    assert "FITS" in out and "GiB" in out and "max concurrency" in out and "*" in out
    assert "gemm_ar: on" in out and "VLLM_KIMI_K3_GEMM_AR=1" in out
    assert "computed in" in out


@pytest.mark.parametrize("argv,flag", [
    (["--gpu", "H200", "--tp", "x"], "--tp"),
    (["--gpu", "H200", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--gpu", "H900"], "--gpu"),
    (["--gpu", "H200", "--tp", "7"], "--tp"),
    (["--gpu", "H200", "--tp", "8", "--pp", "2", "--layer-partition", "40,40"], "--layer-partition"),
    (["--gpu", "H200", "--speculative-config", "{nope"], "--speculative-config"),
    (["--gpu", "H200", "--speculative-config", '{"method": "medusa"}'], "--speculative-config.method"),
    (["--gpu", "H200", "--model", "no-such-model"], "--model"),
    (["--tp", "8"], "--gpu"),
])
def test_bad_input_exits_2_and_names_the_flag(capsys, argv, flag) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert flag in err and "Traceback" not in err


@pytest.mark.parametrize("fixture,args", [
    ("deepseek-v3.json", ["--tp", "8", "--pp", "2"]), ("mixtral-8x7b.json", ["--tp", "2"]),
    ("qwen3-30b-a3b.json", ["--tp", "4", "--ep"]), ("llama-3.1-8b.json", []), ("qwen2-7b.json", ["--tp", "2"]),
    ("tiny-llama.json", []),
])
def test_every_family_answers(capsys, fixture, args) -> None:
    """Every family plans and fits; how long it took is printed, not timed (a timed bound fails on a busy CI runner)."""
    start = time.perf_counter()
    # 2048: within every fixture's positions (tiny-llama has 2048; a longer length is bad input)
    code, out, _ = run_cli(capsys, "--gpu", "H200", "--model", str(FIXTURES / fixture), "--max-model-len", "2048", *args, "--json")
    took = time.perf_counter() - start
    print(f"\n{fixture}: {took * 1e3:.1f} ms in-process")
    assert code == 0 and json.loads(out)["fits"] is True


def test_console_script_wall_time() -> None:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kimi_k3_serve.cli", "memory", "--gpu", "H200", "--tp", "8", "--pp", "2",
                           "--max-model-len", "32768", "--json"], capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - start
    print(f"\nkimi-k3-serve memory (fresh process): {took:.2f} s wall")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["fits"] is True


def test_core_imports_no_torch_vllm_or_ray() -> None:
    code = ("import sys, kimi_k3_serve.planning.memory, kimi_k3_serve.planning.kvcache, kimi_k3_serve.planning.optimisations, "
            "kimi_k3_serve.models, kimi_k3_serve.commands.memory; "
            "print([m for m in ('torch', 'vllm', 'ray', 'transformers') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# --- no --max-model-len: the model config's length, capped at the longest that fits this layout ---------------


def _kimi_length() -> int:
    from kimi_k3_serve.models import load_model

    return load_model("kimi-k3").max_position_embeddings


def test_without_max_model_len_the_model_config_length_is_used_when_it_fits(capsys) -> None:
    code, out, _ = run_cli(capsys, "--gpu", "H200", "--tp", "8", "--pp", "2")
    assert code == 0
    assert out.splitlines()[0] == f"max_model_len: {_kimi_length():,} (model config)"
    assert f"engine: max_model_len {_kimi_length():,}," in out


def test_without_max_model_len_the_length_is_capped_at_the_longest_that_fits(capsys) -> None:
    # max_num_seqs pinned: vLLM's unset default (1,024 on an H200) exceeds the pool's blocks at every length.
    layout = ("--gpu", "H200", "--tp", "8", "--pp", "2", "--gpu-memory-utilization", "0.8", "--max-num-seqs", "64")
    code, out, _ = run_cli(capsys, *layout, "--json")
    assert code == 0
    data = json.loads(out)
    choice = data["max_model_len_choice"]
    length = choice["max_model_len"]
    assert choice["source"] == "longest that fits" and 0 < length < _kimi_length() and length % 1024 == 0
    assert data["engine"]["max_model_len"] == length and data["fits"] is True
    code, out, _ = run_cli(capsys, *layout)
    assert code == 0
    assert out.splitlines()[0] == (f"max_model_len: {_kimi_length():,} (model config) does not fit; using {length:,}, "
                                   "the longest that fits (in steps of 1,024 tokens; pass --max-model-len to choose)")
    # One step longer does not fit: the length is the longest, not just one that fits.
    code, out, _ = run_cli(capsys, *layout, "--max-model-len", str(length + 1024))
    assert code == 1 and out.splitlines()[0] == f"max_model_len: {length + 1024:,} (--max-model-len)"


def test_without_max_model_len_a_layout_too_small_at_any_length_exits_1(capsys) -> None:
    code, out, _ = run_cli(capsys, "--gpu", "H200", "--tp", "8")
    assert code == 1
    assert out.splitlines()[0].endswith("does not fit, and neither does 1,024, the shortest tried")
    assert "DOES NOT FIT" in out


def test_unknown_gpu_lists_the_catalogue(capsys) -> None:
    from kimi_k3_serve.planning.hardware import gpu_names

    code, _, err = run_cli(capsys, "--gpu", "H2O", "--tp", "8")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: --gpu: got 'H2O'; expected one of ")
    assert all(name in err for name in gpu_names())
