"""``kimi-k3-serve check`` against declared clusters, run as a user runs it (a cold process), and the what-if
of ``kimi-k3-serve plan --min``: exit codes 0 fits / 1 does not fit / 2 bad input, JSON, the per-GPU table and
the picture."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kimi_k3_serve.cli import main

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
CONFIG = REPO / "deploy" / "config.yaml"
AWS_H200 = REPO / "cluster_configs" / "aws-h200-p5en.yaml"
H200_1X8 = FIXTURES / "check" / "h200-1x8.yaml"
H200_2X8 = FIXTURES / "check" / "h200-2x8.yaml"
RTX3090_1X8 = FIXTURES / "check" / "rtx3090-1x8.yaml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(*argv: str, env: dict | None = None) -> tuple[int, str, str, float]:
    """The command in a fresh interpreter, as CI runs it: (exit code, stdout, stderr, seconds)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "capacity_check.py"), *argv], capture_output=True,
                          text=True, cwd=REPO, timeout=300, env=env)
    return done.returncode, done.stdout, done.stderr, time.perf_counter() - started


def test_kimi_k3_fits_two_h200_nodes_cold_process(tmp_path):
    picture = tmp_path / "fit.png"
    code, out, err, seconds = run_cli("--config", str(CONFIG), "--cluster", str(AWS_H200), "--json", "--plot", str(picture))
    print(f"\n[offline check, cold process: {seconds:.2f} s to verdict (exit {code})]")
    assert code == 0, err
    data = json.loads(out)
    assert data["fits"] is True and data["report"]["fits"] is True
    report = data["report"]
    assert report["world_size"] == 16 and len(report["ranks"]) == 16
    # TP8 x PP2: one stage per node, every rank with its node, GPU and a KV pool.
    stage_nodes = {r["pp_stage"]: set() for r in report["ranks"]}
    for r in report["ranks"]:
        stage_nodes[r["pp_stage"]].add(r["node"])
        assert r["kv_cache_bytes"] > 0 and r["shortfall_bytes"] == 0 and r["gpu_index"] in range(8)
    assert all(len(nodes) == 1 for nodes in stage_nodes.values()) and len(set.union(*stage_nodes.values())) == 2
    assert report["max_concurrency"] >= 1 and report["max_model_len"] == 32768
    assert {item["name"] for item in report["optimisations"]} >= {"gemm_rs", "flashkda"}
    assert any(line.startswith("placement:") for line in data["checks"])
    assert data["plot"] == str(picture)
    assert picture.stat().st_size > 10_000 and picture.read_bytes()[:8] == PNG_MAGIC


def test_readable_table_with_units(capsys):
    assert main(["check", "--config", str(CONFIG), "--cluster", str(H200_2X8)]) == 0
    out = capsys.readouterr().out
    for column in ("node", "gpu", "stage", "tp", "total", "free", "weights", "KV pool", "state/req", "draft",
                   "workspaces", "activation", "CUDA graph", "headroom"):
        assert column in out
    assert "sizes in GiB" in out and "max concurrency at max_model_len 32768" in out
    assert "time to verdict" in out and "verdict: FITS" in out
    assert "flashkda" in out and "GEMM-RS needs SM100" in out  # optimisations with their reasons


@pytest.mark.parametrize("cluster, gpu", [(H200_1X8, "H200"), (RTX3090_1X8, "RTX-3090")])
def test_one_node_does_not_fit_with_the_shortfall(cluster, gpu, tmp_path, capsys):
    picture = tmp_path / "short.png"
    assert main(["check", "--config", str(CONFIG), "--cluster", str(cluster), "--json", "--plot", str(picture)]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False
    assert any("would wait forever for their placement group" in line for line in data["checks"])
    # The deploy config's 16 bundles cannot be placed on 8 GPUs; no other layout fits the node either.
    assert any("GPU: needs 16, cluster has 8 available" in line for line in data["checks"])
    assert any("no layout of kimi-k3 fits this cluster either" in line for line in data["checks"])
    report = data["report"]
    assert report["fits"] is False and report["gpu"] == gpu and report["shortfall_bytes"] > 0
    assert any(r["shortfall_bytes"] > 0 for r in report["ranks"])
    assert picture.read_bytes()[:8] == PNG_MAGIC


def test_rtx3090_text_names_the_gap(capsys):
    assert main(["check", "--config", str(CONFIG), "--cluster", str(RTX3090_1X8)]) == 1
    out = capsys.readouterr().out
    assert "SHORT" in out and "GiB" in out and "verdict: DOES NOT FIT" in out
    assert "accelerator_type:H200" in out  # the deploy config asks for H200 nodes the cluster does not have


def test_malformed_config_exits_2_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.read_text().replace("tensor_parallel_size: 8", "tensor_parallel_size: eight"))
    code, out, err, _ = run_cli("--config", str(bad), "--cluster", str(AWS_H200))
    assert code == 2
    assert "args.parallel.tensor_parallel_size" in err and "eight" in err and "Traceback" not in err


def test_malformed_cluster_file_exits_2_naming_the_field(capsys):
    assert main(["check", "--config", str(CONFIG), "--cluster", str(FIXTURES / "clusters" / "bad-launcher-gpu.yaml")]) == 2
    err = capsys.readouterr().err
    assert "available_node_types.gpu_workers.resources.GPU" in err and "eight" in err


def test_missing_files_and_bad_address_exit_2(tmp_path, capsys):
    assert main(["check", "--config", str(tmp_path / "nope.yaml"), "--cluster", str(AWS_H200)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["check", "--config", str(CONFIG), "--cluster", str(tmp_path / "nope.yaml")]) == 2
    assert "cluster" in capsys.readouterr().err
    code, _, err, seconds = run_cli("--config", str(CONFIG), "--address", "127.0.0.1:1")
    print(f"\n[unreachable address refused in {seconds:.2f} s]")
    assert code == 2 and "--address" in err


def test_plan_min_finds_the_smallest_h200_cluster(capsys):
    assert main(["plan", "--model", "kimi-k3", "--gpu", "H200", "--min", "--max-model-len", "32768", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["smallest_nodes"] == 2 and data["fits"] is True
    # One node fewer really does not fit: the planner says so on its own.
    assert main(["plan", "--model", "kimi-k3", "--gpu", "H200", "--nodes", str(data["smallest_nodes"] - 1),
                 "--max-model-len", "32768"]) == 1
    capsys.readouterr()


def test_plan_eight_rtx3090_says_no_by_how_much_and_what_would(capsys):
    argv = ["plan", "--model", "kimi-k3", "--gpu", "RTX-3090", "--nodes", "1", "--gpus-per-node", "8",
            "--max-model-len", "32768"]
    assert main(argv + ["--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    what_if = data["what_would_fit"]
    assert what_if["cluster_gpus"] == 8
    assert what_if["checkpoint_bytes"] > 5 * what_if["cluster_budget_bytes"]  # by how much: several times over
    same = what_if["same_gpu"]
    assert same["nodes"] is not None and same["nodes"] > 1
    # ... and the count it names is the smallest that fits.
    assert main(["plan", "--model", "kimi-k3", "--gpu", "RTX-3090", "--nodes", str(same["nodes"]), "--gpus-per-node", "8",
                 "--max-model-len", "32768", "--json"]) == 0
    capsys.readouterr()
    assert main(["plan", "--model", "kimi-k3", "--gpu", "RTX-3090", "--nodes", str(same["nodes"] - 1),
                 "--gpus-per-node", "8", "--max-model-len", "32768", "--json"]) == 1
    capsys.readouterr()
    others = {item["gpu"] for item in what_if["other_gpus_same_nodes"]}
    assert "RTX-3090" not in others and others  # some single node of another GPU would hold it
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "by how much" in out and "what would fit" in out


def test_plan_min_refuses_nodes(capsys):
    assert main(["plan", "--model", "kimi-k3", "--gpu", "H200", "--nodes", "2", "--min", "--max-model-len", "32768"]) == 2
    assert "--min" in capsys.readouterr().err


# --- a live cluster: does it need a token? ------------------------------------------------------------------------


@pytest.fixture(params=["disabled", "token"])
def live_head(request):
    """``ray start --head --block`` of this test's own on 127.0.0.1, with Ray's token authentication off or on (a
    token file of its own); yields (auth mode, address, the environment a client of it needs)."""
    import os
    import shutil
    import signal
    import tempfile

    from conftest import LOOPBACK, free_port

    temp_dir = tempfile.mkdtemp(prefix="kk3-auth-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_AUTH_MODE"] = request.param
    if request.param == "token":
        token = Path(temp_dir) / "auth_token"
        token.write_text(os.urandom(32).hex())
        token.chmod(0o600)
        env["RAY_AUTH_TOKEN_PATH"] = str(token)
    port = free_port()
    log_path = Path(temp_dir) / "ray-head.log"
    log = open(log_path, "w")
    head = subprocess.Popen(
        [sys.executable, "-c", "from ray.scripts.scripts import main; main()", "start", "--head", "--block", "--port",
         str(port), "--node-ip-address", LOOPBACK, "--num-cpus", "1", "--temp-dir", temp_dir, "--include-dashboard",
         "false", "--disable-usage-stats"], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        started = time.monotonic()
        while "Ray runtime started" not in log_path.read_text(errors="replace"):
            assert head.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() - started < 300, "the Ray head did not start in 300 s"
            time.sleep(1)
        yield request.param, f"{LOOPBACK}:{port}", env
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops its own processes on SIGTERM
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.ray
def test_live_check_warns_when_the_cluster_needs_no_token(live_head):
    """Against a head without token authentication, ``check --address`` says so (stderr, and ``warnings`` in the
    JSON); against one with it, nothing. Kimi-K3 on a CPU-only head does not fit (exit 1): the warning does not
    depend on the verdict."""
    mode, address, env = live_head
    code, out, err, seconds = run_cli("--config", str(CONFIG), "--address", address, "--json", env=env)
    print(f"\n[live check of a head with RAY_AUTH_MODE={mode}: exit {code} in {seconds:.2f} s]")
    assert code == 1, err[-3000:]
    document = json.loads(out)
    assert document["cluster"].startswith("live:") and document["fits"] is False
    warnings = document["warnings"]
    if mode == "disabled":
        assert len(warnings) == 1 and "runs without authentication" in warnings[0] and address in warnings[0]
        assert "RAY_AUTH_MODE=token" in warnings[0] and warnings[0] in err
    else:
        assert warnings == [] and "without authentication" not in err
    assert (env.get("RAY_AUTH_TOKEN_PATH") is None) or Path(env["RAY_AUTH_TOKEN_PATH"]).read_text() not in out + err
