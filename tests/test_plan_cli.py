"""``kimi-k3-serve plan``: readable summary, --json, and exit codes 0 (fits), 1 (none fits), 2 (bad input)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_k3_serve.cli import main

CLUSTERS = Path(__file__).parent / "fixtures" / "clusters"
BASE = ["plan", "--model", "kimi-k3", "--max-model-len", "32768"]


def test_fits_json(capsys):
    assert main(BASE + ["--gpu", "H200", "--nodes", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True
    assert {k: data["layout"][k] for k in ("tp", "pp", "ep", "dp")} == {"tp": 8, "pp": 2, "ep": False, "dp": 1}
    # EP was weighed, not left out: the same layout with EP holds fewer requests here (the chosen one the most).
    chosen = {k: v for k, v in data["layout"].items() if k != "describe"}
    considered = [c for c in data["considered"] if c["fits"]]
    with_ep = next(c for c in considered if {k: v for k, v in c["layout"].items() if k != "describe"} == {**chosen, "ep": True})
    assert data["max_concurrency"] == max(c["max_concurrency"] for c in considered) > with_ep["max_concurrency"]
    assert "enable_expert_parallel" not in data["engine_kwargs"]
    assert "layer_partition" in data["layout"]
    assert data["optimisations"]["gemm_rs"]["on"] is False and "Hopper" in data["optimisations"]["gemm_rs"]["reason"]
    assert len(data["ranks"]) == 16 and {r["node"] for r in data["ranks"]} == {"h200-0", "h200-1"}
    assert data["engine_kwargs"]["tensor_parallel_size"] == 8
    assert isinstance(data["env_vars"], dict)
    assert data["placement_group_config"]["strategy"] == "PACK"


def test_readable_summary(capsys):
    assert main(BASE + ["--gpu", "H200", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "TP8xPP2" in out and "gemm_rs" in out and "GiB" in out and "placement_group_config" in out


def test_does_not_fit_exit_1(capsys):
    assert main(BASE + ["--gpu", "H200", "--nodes", "1"]) == 1
    out = capsys.readouterr().out
    assert "does not fit" in out and "short" in out and "TP8" in out
    assert main(BASE + ["--gpu", "RTX-3090", "--nodes", "1", "--gpus-per-node", "8", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False and data["candidates"][0]["shortfall_bytes"] > 0


def test_cluster_file_grows_to_max_workers(capsys):
    # The launcher file starts 2 p5en nodes and may grow to 4 (global max_workers).
    assert main(BASE + ["--cluster", str(CLUSTERS / "launcher-aws-p5en.yaml"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and data["gpu"] == "H200"
    assert main(BASE + ["--cluster", str(CLUSTERS / "launcher-gcp-explicit.yaml"), "--as-is"]) == 2
    assert "at least one GPU node" in capsys.readouterr().err


def test_bad_input_exit_2(capsys):
    assert main(BASE + ["--gpu", "H900", "--nodes", "2"]) == 2
    assert "gpu" in capsys.readouterr().err
    assert main(BASE + ["--gpu", "H200"]) == 2
    assert "--nodes" in capsys.readouterr().err
    assert main(BASE + ["--cluster", str(CLUSTERS / "bad-launcher-gpu.yaml")]) == 2
    assert "available_node_types.gpu_workers.resources.GPU" in capsys.readouterr().err
    assert main(BASE + ["--gpu", "H200", "--nodes", "2", "--tp", "3"]) == 2
    assert "tp" in capsys.readouterr().err
    assert main(BASE + ["--gpu", "H200", "--nodes", "2", "--layer-partition", "a,b"]) == 2
    assert "--layer-partition" in capsys.readouterr().err


# --- no --max-model-len: the model config's length, capped at the longest that fits ---------------------------

NO_LENGTH = ["plan", "--model", "kimi-k3"]


def _kimi_length() -> int:
    from kimi_k3_serve.models import load_model

    return load_model("kimi-k3").max_position_embeddings


def test_without_max_model_len_the_model_config_length_is_used_when_it_fits(capsys):
    assert main(NO_LENGTH + ["--gpu", "H200", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"max_model_len: {_kimi_length():,} (model config)"
    assert main(NO_LENGTH + ["--gpu", "H200", "--nodes", "2", "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # the choice line goes to stderr, so stdout stays JSON
    assert data["max_model_len_choice"] == {"max_model_len": _kimi_length(), "source": "model config",
                                            "reason": f"max_model_len: {_kimi_length():,} (model config)"}
    assert captured.err.strip() == f"max_model_len: {_kimi_length():,} (model config)"


def test_without_max_model_len_the_length_is_capped_at_the_longest_that_fits(capsys):
    # At gpu_memory_utilization 0.8 the 2 x 8 H200 KV pool holds less than one 1,048,576-token request.
    # max_num_seqs pinned: vLLM's unset default (1,024 on an H200) exceeds the pool's blocks at every length.
    args = NO_LENGTH + ["--gpu", "H200", "--nodes", "2", "--gpu-memory-utilization", "0.8", "--max-num-seqs", "64"]
    assert main(args + ["--json"]) == 0
    choice = json.loads(capsys.readouterr().out)["max_model_len_choice"]
    length = choice["max_model_len"]
    assert choice["source"] == "longest that fits"
    assert 0 < length < _kimi_length() and length % 1024 == 0
    assert choice["reason"].startswith(f"max_model_len: {_kimi_length():,} (model config) does not fit; "
                                       f"using {length:,}, the longest that fits")
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == choice["reason"]
    assert f"max concurrency at {length} tokens" in out
    # The longest: the same plan at the model's own length, and at one step more, does not fit.
    assert main(args + ["--max-model-len", str(length + 1024)]) == 1
    assert main(args + ["--max-model-len", str(_kimi_length())]) == 1
    capsys.readouterr()


def test_without_max_model_len_a_cluster_too_small_at_any_length_says_so_and_exits_1(capsys):
    assert main(NO_LENGTH + ["--gpu", "H200", "--nodes", "1"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (f"max_model_len: {_kimi_length():,} (model config) does not fit, and neither "
                                   "does 1,024, the shortest tried")
    assert "does not fit" in out.splitlines()[1]


def test_unknown_gpu_is_one_line_naming_the_flag_and_listing_the_catalogue(capsys):
    from kimi_k3_serve.planning.hardware import gpu_names

    assert main(NO_LENGTH + ["--gpu", "H2O", "--nodes", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("error: --gpu: got 'H2O'")
    assert all(name in err for name in gpu_names())


@pytest.mark.parametrize("command", ["plan", "memory", "check", "render"])
def test_every_command_help_shows_examples_and_exit_codes(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    examples = out.split("examples:\n", 1)[1]
    lines = [line.strip() for line in examples.splitlines() if line.strip().startswith("kimi-k3-serve")]
    assert lines and all(line.startswith(f"kimi-k3-serve {command} --") for line in lines)
    assert "exit codes: 0" in out
