"""``kimi-k3-serve plan``: readable summary, --json, and exit codes 0 (fits), 1 (none fits), 2 (bad input)."""

from __future__ import annotations

import json
from pathlib import Path

from kimi_k3_serve.cli import main

CLUSTERS = Path(__file__).parent / "fixtures" / "clusters"
BASE = ["plan", "--model", "kimi-k3", "--max-model-len", "32768"]


def test_fits_json(capsys):
    assert main(BASE + ["--gpu", "H200", "--nodes", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True
    assert {k: data["layout"][k] for k in ("tp", "pp", "ep", "dp")} == {"tp": 8, "pp": 2, "ep": data["layout"]["ep"], "dp": 1}
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
