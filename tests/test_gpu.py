"""GPU tests: the product's GPU path on real H200s (vLLM 0.32 CUDA, Ray 2.60). They skip, saying why, where NVML
sees no GPU (CI is CPU-only); scripts/gpu/run_all.sh runs them on the GPU host.

- rehearse a Kimi-K3 slice (every layer kind, MXFP4 experts, DSpark draft) on one GPU and on two (TP2);
- ``serve run`` of the same app on one GPU (TP1 x PP1), with the replica check and the predicted-vs-vLLM KV line;
- ``serve run deploy/gpu-rehearsal.yaml`` across two Ray nodes (two raylets, one GPU each): TP1 x PP2, DSpark on
  the last stage, the replica check on the reserved placement group (NVML -> Ray GPU ids, bundle order, NCCL across
  the nodes), the OpenAI API with the stock client, and vLLM's stage 1 on the node the plan chose; the same with
  the MLA EAGLE3 draft in place of DSpark;
- ``serve run`` of the same app at DP2 x EP2 on one node of two GPUs (Ray Serve LLM's DP builder, a replica per
  DP rank, the replica check on every rank);
- the NCCL smoke test across two nodes, and its message when the second node's GPU is gone;
- on a host of eight GPUs: a rehearsal at TP8, ``serve run`` at TP4 x PP2 across two Ray nodes of four GPUs (every
  worker on its planned node, with its stage's weights), and the NCCL smoke test over all eight ranks, passing and
  with one rank's GPU gone.

Logs and readings go to ``$KIMI_K3_SERVE_GPU_OUT`` (default: a temp folder), to be kept as dated fixtures.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import REPO_ROOT

pytestmark = pytest.mark.gpu


def _gpu_count() -> tuple[int, str]:
    from kimi_k3_serve.cluster.nvml import local_gpus

    gpus, reason, _ = local_gpus()
    return len(gpus), reason or ""


GPUS, NO_GPU_REASON = _gpu_count()
OUT = Path(os.environ.get("KIMI_K3_SERVE_GPU_OUT") or tempfile.mkdtemp(prefix="kk3-gpu-"))
MODEL_CACHE = Path(os.environ.get("KIMI_K3_SERVE_MODEL_CACHE", REPO_ROOT / ".cache" / "tiny-models"))


def need_gpus(n: int) -> None:
    if GPUS < n:
        pytest.skip(f"needs {n} NVIDIA GPU(s); this machine has {GPUS} ({NO_GPU_REASON or 'too few'})")


@pytest.fixture(scope="module")
def kimi_slice() -> Path:
    """The servable Kimi-K3 slice and its drafts in the model cache (configs and a tokenizer; weights are dummy)."""
    need_gpus(1)
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "make_kimi_slice.py"), "--layers", "4", "--out",
                    str(MODEL_CACHE)], check=True)
    os.environ["KIMI_K3_SERVE_MODEL_CACHE"] = str(MODEL_CACHE)
    return MODEL_CACHE


def rehearse(name: str, *flags: str, timeout: float = 900) -> dict:
    work = OUT / name
    cmd = [sys.executable, "-m", "kimi_k3_serve.cli", "rehearse", "--config", "deploy/gpu-rehearsal.yaml",  # cwd: the checkout
           *flags, "--json", "--work-dir", str(work), "--timeout", str(timeout)]
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.json").write_text(json.dumps({"name": name, "command": cmd}))  # scripts/memory_accuracy.py replays it
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=timeout + 120)
    (work / "stderr.txt").write_text(done.stderr)
    assert done.stdout.strip(), f"rehearse printed nothing (exit {done.returncode}): {done.stderr[-2000:]}"
    result = json.loads(done.stdout)
    result["exit_code"] = done.returncode
    return result


def assert_rehearsal_matches_plan(result: dict) -> None:
    assert result["exit_code"] == 0, (result.get("failure"), result["reading"]["oom"], result["reading"]["errors"][-3:])
    assert result["generated"]["tokens"] > 0
    comparison = result["comparison"]
    assert comparison["measured_verdict"] == "fits" and comparison["verdicts_agree"], comparison
    for rank in comparison["ranks"]:
        weights = next(r for r in rank["rows"] if r["name"] == "weights")
        # vLLM prints GiB to 2 decimals: +-0.005 GiB is its resolution.
        assert abs(weights["error_bytes"]) <= max(0.005 * weights["measured_bytes"], 0.006 * 2**30), weights


def test_rehearse_kimi_slice_on_one_gpu(kimi_slice) -> None:
    need_gpus(1)
    result = rehearse("rehearse-tp1-pp1", "--tp", "1", "--pp", "1")
    assert_rehearsal_matches_plan(result)
    # what a Serve replica's vLLM picks on an H200 when the config leaves it unset (serve-one-gpu, 2026-11-30),
    # passed explicitly since vllm.LLM would pick another
    assert result["engine"]["max_num_batched_tokens"] == 8192


def test_rehearse_kimi_slice_on_two_gpus(kimi_slice) -> None:
    need_gpus(2)
    result = rehearse("rehearse-tp2", "--tp", "2", "--pp", "1")
    assert_rehearsal_matches_plan(result)
    assert len(result["reading"]["workers"]) == 2


def test_rehearse_kimi_slice_on_eight_gpus(kimi_slice) -> None:
    """Kimi-K3's own TP degree: each rank holds 12 of the 96 KDA heads, the whole MLA cache and an eighth of every
    expert; every rank's weights against the plan's."""
    need_gpus(8)
    result = rehearse("rehearse-tp8", "--tp", "8", "--pp", "1")
    assert_rehearsal_matches_plan(result)
    assert len(result["comparison"]["ranks"]) == 8


# -- two Ray nodes on one host --------------------------------------------------------------------------------------

@contextmanager
def raylets(gpus_needed: int, gpu_groups: list[list[str]], **kwargs):
    """A raylet per GPU group on this host (``local_cluster``), so Ray sees a node per group and a placement group
    spans them as it would span machines; (cluster, its temp dir), shut down afterwards. Skips without
    ``gpus_needed`` GPUs."""
    from kimi_k3_serve.rehearsal.local_cluster import raylets_per_gpu_group

    need_gpus(gpus_needed)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    cluster = raylets_per_gpu_group(gpu_groups, **kwargs)
    try:
        yield cluster, cluster.head_node.get_temp_dir_path()
    finally:
        cluster.shutdown()


@pytest.fixture
def two_nodes():
    """Two raylets of one GPU each: the mission's two nodes."""
    with raylets(2, [["0"], ["1"]]) as cluster:
        yield cluster


def _get(url: str, timeout: float = 5, headers: dict | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as response:
            return response.status
    except Exception:
        return 0


def rehearsal_config_with(out: Path, name: str, parallel: dict, speculative: dict | None = None) -> Path:
    """deploy/gpu-rehearsal.yaml with another ``args.parallel`` (and ``args.speculative``): the same app in another
    layout (with another draft)."""
    import yaml

    config = yaml.safe_load((REPO_ROOT / "deploy" / "gpu-rehearsal.yaml").read_text())
    config["applications"][0]["args"]["parallel"] = parallel
    if speculative is not None:
        config["applications"][0]["args"]["speculative"] = speculative
    path = out / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def one_gpu_config(out: Path) -> Path:
    """One pipeline stage: the same app on the one GPU of a one-node cluster."""
    return rehearsal_config_with(out, "gpu-rehearsal-pp1.yaml", {"tensor_parallel_size": 1, "pipeline_parallel_size": 1})


def serve_and_query(config: Path, address: str, temp_dir: str, out: Path, check) -> None:
    """``serve run CONFIG`` as a user runs it, then the OpenAI API with the stock client: models, completions, chat,
    streaming with usage, 16 concurrent requests. ``check(logs)`` then asserts what the layout adds. Serve's and
    the replica's logs, and the readings, are kept under ``out``."""
    import openai

    import secrets

    import yaml

    out.mkdir(parents=True, exist_ok=True)
    # The rehearsal config requires an API key (closed by default): served with a key file of its own, which the
    # client sends.
    key_file = out / "api-key"
    key_file.write_text(secrets.token_urlsafe(24))
    key_file.chmod(0o600)
    api_key = key_file.read_text()
    served = yaml.safe_load(config.read_text())
    served["applications"][0]["args"].setdefault("security", {})["api_key_file"] = str(key_file)
    config_as_written, config = config, out / f"served-{config.name}"
    config.write_text(yaml.safe_dump(served, sort_keys=False))
    env = {**os.environ, "RAY_ADDRESS": address, "KIMI_K3_SERVE_MODEL_CACHE": str(MODEL_CACHE)}
    log = open(out / "serve-run.log", "w")
    started = time.monotonic()
    # `serve run`, Ray's own CLI (its click group, so no console script is needed on the host's PATH).
    serve = subprocess.Popen([sys.executable, "-c", "from ray.serve.scripts import cli; cli()", "run", str(config)],
                             stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, start_new_session=True)
    base = "http://127.0.0.1:8000"
    readings: dict = {"config": str(config_as_written.relative_to(REPO_ROOT) if config_as_written.is_relative_to(REPO_ROOT)
                                    else config_as_written.name)}
    try:
        while _get(f"{base}/v1/models", headers={"Authorization": f"Bearer {api_key}"}) != 200:
            assert serve.poll() is None, f"serve run exited with {serve.returncode}: {(out / 'serve-run.log').read_text()[-3000:]}"
            assert time.monotonic() - started < 900, "the application did not answer /v1/models in 900 s"
            time.sleep(5)
        readings["models_seconds"] = round(time.monotonic() - started, 1)
        assert _get(f"{base}/v1/models") == 0, "the rehearsal app answered /v1/models without the key"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=api_key)
        # Ready is a first completion answered: the ingress answers /v1/models minutes before the engine is up.
        while True:
            try:
                client.with_options(timeout=60, max_retries=0).completions.create(model="kimi-k3-slice", prompt="ready?",
                                                                                  max_tokens=1)
                break
            except openai.APIError as exc:
                assert serve.poll() is None, f"serve run exited with {serve.returncode}: {exc}"
                assert time.monotonic() - started < 1200, f"no completion answered in 1200 s: {exc}"
                time.sleep(5)
        readings["ready_seconds"] = round(time.monotonic() - started, 1)
        models = client.models.list()
        assert [m.id for m in models.data] == ["kimi-k3-slice"]
        completion = client.completions.create(model="kimi-k3-slice", prompt="Hello", max_tokens=8)
        assert completion.usage.completion_tokens == 8
        chat = client.chat.completions.create(model="kimi-k3-slice", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
        assert chat.choices[0].message.content is not None
        stream = client.chat.completions.create(model="kimi-k3-slice", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        t0 = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            done = list(pool.map(lambda i: client.completions.create(model="kimi-k3-slice", prompt=f"request {i}",
                                                                     max_tokens=16), range(16)))
        readings["sixteen_concurrent_seconds"] = round(time.monotonic() - t0, 2)
        assert all(c.usage.completion_tokens == 16 for c in done)
        logs = "\n".join(p.read_text(errors="replace") for p in Path(temp_dir).glob("session_*/logs/**/*")
                         if p.is_file() and p.suffix in (".log", ".out", ".err"))
        # What the replica's engine really chose where the config leaves a limit unset, and the replica's
        # predicted-vs-vLLM KV line.
        readings["engine_max_num_batched_tokens"] = re.findall(r"max_num_batched_tokens=(\d+)", logs)[:4]
        readings["kv_prediction"] = re.findall(r"KV cache: plan .*", logs)[:4]
        readings["replica_check"] = re.findall(r"replica check: .*", logs)[:12]
        readings.update(check(logs) or {})
        assert readings["kv_prediction"], "the replica logged no predicted-vs-vLLM KV line"
        # The KV pool, not only the weights: vLLM's within the plan's measured band (the line says when it is not).
        assert not any("beyond the plan's margin" in line for line in readings["kv_prediction"]), readings["kv_prediction"]
    finally:
        (out / "readings.json").write_text(json.dumps(readings, indent=1))
        if serve.poll() is None:  # Ctrl-C, as a user stops `serve run`
            os.killpg(serve.pid, 2)
            try:
                serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, 9)
        log.close()
        for p in Path(temp_dir).glob("session_*/logs/serve/*.log"):
            (out / p.name).write_text(p.read_text(errors="replace")[-400_000:])
        for p in Path(temp_dir).glob("session_*/logs/worker-*"):  # the engine's own log (vLLM's memory lines)
            text = p.read_text(errors="replace")
            if "Model loading took" in text or "KV cache" in text:
                (out / f"vllm-{p.name}").write_text(text[-400_000:])


@pytest.fixture
def one_node():
    with raylets(1, [["0"]]) as cluster:
        yield cluster


def test_serve_run_on_one_gpu(kimi_slice, one_node) -> None:
    """The product's serving path on a GPU: Ray Serve LLM + vLLM 0.32, the replica check on the placement group
    Serve reserved (NVML read on the GPU Ray gave the worker), and the predicted-vs-vLLM KV line."""
    cluster, temp_dir = one_node
    out = OUT / "serve-one-gpu"
    out.mkdir(parents=True, exist_ok=True)

    def check(logs: str) -> dict:
        assert "replica check passed in" in logs, "the replica check did not pass (or logged nothing)"
        return {}

    serve_and_query(one_gpu_config(out), cluster.address, temp_dir, out, check)


def test_serve_run_with_the_mla_eagle3_draft_on_one_gpu(kimi_slice, one_node) -> None:
    """The mission's named draft, served: the rehearsal app with the MLA EAGLE3 draft (Eagle3DeepseekV2ForCausalLM)
    on one GPU, through the stock OpenAI client (models, completions, chat, streaming with usage, 16 at once)."""
    cluster, temp_dir = one_node
    out = OUT / "serve-one-gpu-eagle3-mla"
    out.mkdir(parents=True, exist_ok=True)
    config = rehearsal_config_with(out, "gpu-rehearsal-pp1-eagle3-mla.yaml",
                                   {"tensor_parallel_size": 1, "pipeline_parallel_size": 1},
                                   {"method": "eagle3", "model": "cache:kimi-k3-slice-eagle3-mla", "num_speculative_tokens": 3})

    def check(logs: str) -> dict:
        assert "replica check passed in" in logs, "the replica check did not pass (or logged nothing)"
        assert "Eagle3DeepseekV2ForCausalLM" in logs or "eagle3" in logs.lower(), "the engine loaded no EAGLE3 draft"
        return {}

    serve_and_query(config, cluster.address, temp_dir, out, check)


def planned_ranks(config: Path) -> list[dict]:
    """The plan's ranks for a deploy config (``rehearse --executor ray --dry-run``: the config's GPU type, no GPU read)."""
    done = subprocess.run([sys.executable, "-m", "kimi_k3_serve.cli", "rehearse", "--config", str(config), "--executor",
                           "ray", "--dry-run", "--json"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)["plan"]["ranks"]


def check_stages_placed_as_planned(cluster, logs: str, config: Path) -> dict:
    """Every vLLM Ray worker of the last pipeline stage runs on the node the replica check chose for that stage and
    the others elsewhere; each worker loaded the weights the plan gives its stage and TP rank, so the layer split the
    plan chose is the one vLLM applied. ``logs``: the session's logs, where each worker labels its lines."""
    import ray
    from ray.util.state import list_actors

    from kimi_k3_serve.rehearsal.vllm_log import parse_vllm_log

    ray.init(address=cluster.address, ignore_reinit_error=True, log_to_driver=False)
    try:
        nodes = {a.pid: a.node_id for a in list_actors(filters=[("class_name", "=", "RayWorkerWrapper"), ("state", "=", "ALIVE")])}
    finally:
        ray.shutdown()
    chosen = re.search(r"VLLM_RAY_BUNDLE_INDICES=[\d,]+ \(last stage on node (\w+)\)", logs)
    assert chosen, "the replica check's bundle-order line is not in the logs"
    workers = {w.pid: w for w in parse_vllm_log(logs).workers if w.pid in nodes}
    assert len(workers) == len(nodes) and all(w.pp_rank is not None for w in workers.values()), (nodes, workers)
    last = max(w.pp_rank for w in workers.values())
    for pid, w in workers.items():
        assert (nodes[pid] == chosen[1]) == (w.pp_rank == last), \
            f"stage {w.pp_rank}'s worker {pid} is on {nodes[pid]}; the plan chose {chosen[1]} for the last stage"
    plan = planned_ranks(config)
    for w in workers.values():
        rank = next(r for r in plan if r["pp_stage"] == w.pp_rank and r["tp_rank"] == (w.tp_rank or 0))
        planned = rank["weights_bytes"] + rank["draft_bytes"]
        assert w.model_load_bytes is not None, f"worker {w.pid} (stage {w.pp_rank}) logged no 'Model loading took'"
        # vLLM prints GiB to 2 decimals: +-0.005 GiB is its resolution.
        assert abs(w.model_load_bytes - planned) <= max(0.005 * w.model_load_bytes, 0.006 * 2**30), \
            (w.pp_rank, w.tp_rank, planned, w.model_load_bytes)
    return {"workers": {str(pid): {"node": nodes[pid], "pp_rank": w.pp_rank, "tp_rank": w.tp_rank,
                                   "model_load_bytes": w.model_load_bytes} for pid, w in workers.items()},
            "planned_last_stage_node": chosen[1]}


def test_serve_run_across_two_ray_nodes(kimi_slice, two_nodes) -> None:
    cluster, temp_dir = two_nodes
    config = REPO_ROOT / "deploy" / "gpu-rehearsal.yaml"

    def check(logs: str) -> dict:
        assert "communication: nccl all-reduce and stage-to-stage send/recv across 2 nodes" in logs
        return check_stages_placed_as_planned(cluster, logs, config)

    serve_and_query(config, cluster.address, temp_dir, OUT / "serve-two-nodes", check)


def test_serve_run_with_the_mla_eagle3_draft_across_two_ray_nodes(kimi_slice, two_nodes) -> None:
    """The EAGLE3 alternative of deploy/gpu-rehearsal.yaml (the MLA draft, Eagle3DeepseekV2ForCausalLM): served with
    the draft on the last stage, whose workers alone load its weights (less its lm_head: on dummy weights vLLM gives
    it the target's)."""
    cluster, temp_dir = two_nodes
    out = OUT / "serve-two-nodes-eagle3-mla"
    out.mkdir(parents=True, exist_ok=True)
    config = rehearsal_config_with(out, "gpu-rehearsal-eagle3-mla.yaml", {"tensor_parallel_size": 1, "pipeline_parallel_size": 2},
                                   {"method": "eagle3", "model": "cache:kimi-k3-slice-eagle3-mla", "num_speculative_tokens": 3})

    def check(logs: str) -> dict:
        assert "communication: nccl all-reduce and stage-to-stage send/recv across 2 nodes" in logs
        return check_stages_placed_as_planned(cluster, logs, config)

    serve_and_query(config, cluster.address, temp_dir, out, check)


@pytest.fixture
def two_nodes_of_four_gpus():
    with raylets(8, [["0", "1", "2", "3"], ["4", "5", "6", "7"]], num_cpus=16) as cluster:
        yield cluster


def test_serve_run_tp4_pp2_across_two_ray_nodes_of_four_gpus(kimi_slice, two_nodes_of_four_gpus) -> None:
    """The 2-node deploy configs' shape (TP8 x PP2 on 16 GPUs) at half scale: a TP group of four per node, DSpark on
    the last stage, the replica check's NCCL test across the two nodes, every worker on its planned node with the
    planned share of the weights, and the OpenAI API answering."""
    cluster, temp_dir = two_nodes_of_four_gpus
    out = OUT / "serve-tp4-pp2-two-nodes"
    out.mkdir(parents=True, exist_ok=True)
    config = rehearsal_config_with(out, "gpu-rehearsal-tp4-pp2.yaml", {"tensor_parallel_size": 4, "pipeline_parallel_size": 2})

    def check(logs: str) -> dict:
        assert "replica check passed in" in logs, "the replica check did not pass (or logged nothing)"
        assert "communication: nccl all-reduce and stage-to-stage send/recv across 2 nodes" in logs
        return check_stages_placed_as_planned(cluster, logs, config)

    serve_and_query(config, cluster.address, temp_dir, out, check)


@pytest.fixture
def two_gpu_node():
    with raylets(2, [["0", "1"]], num_cpus=16) as cluster:
        yield cluster


def test_serve_run_at_dp2_ep2(kimi_slice, two_gpu_node) -> None:
    """Data-parallel attention with the experts over both GPUs, served: Ray Serve LLM's DP builder deploys one
    DPServer replica per DP rank (gang-scheduled), each an engine with the whole attention, its own KV cache and
    half of every MoE layer's experts; the replica check runs on every rank."""
    cluster, temp_dir = two_gpu_node
    out = OUT / "serve-dp2-ep2"
    out.mkdir(parents=True, exist_ok=True)
    config = rehearsal_config_with(out, "gpu-rehearsal-dp2-ep2.yaml", {
        "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 2, "enable_expert_parallel": True})

    def check(logs: str) -> dict:
        passed = re.findall(r"replica check passed in", logs)
        assert len(passed) >= 2, f"the replica check passed on {len(passed)} DP rank(s), not 2"
        ranks = sorted(set(re.findall(r"VLLM_RAY_BUNDLE_INDICES=([\d,]+) \(DP rank (\d)", logs)))
        assert len({r for _, r in ranks}) == 2, ranks
        return {"dp_rank_bundles": ranks, "replica_checks_passed": len(passed)}

    serve_and_query(config, cluster.address, temp_dir, out, check)


def _comm_test_on(cluster, ranks: int = 2, **kwargs) -> str:
    """The replica check's NCCL smoke test over ``ranks`` one-GPU bundles of the cluster (node by node, as pipeline
    stages are), each named by its node; ``kwargs`` go to ``comm_smoke_test`` (the fabric measurement's)."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    from kimi_k3_serve.checks.replica import comm_smoke_test

    ray.init(address=cluster.address, ignore_reinit_error=True, log_to_driver=False)
    pg = placement_group([{"CPU": 1, "GPU": 1}] * ranks, strategy="STRICT_SPREAD" if ranks == 2 else "PACK")
    ray.get(pg.ready(), timeout=60)
    try:
        table = {int(k): v for k, v in placement_group_table(pg)["bundles_to_node_id"].items()}
        names = {node: f"node-{'abcdefgh'[i]}" for i, node in enumerate(dict.fromkeys(table[b] for b in sorted(table)))}
        bundles = sorted(table, key=lambda b: (list(names).index(table[b]), b))
        return comm_smoke_test(pg, bundles, [names[table[b]] for b in bundles], backend="nccl", timeout_s=60, **kwargs)
    finally:
        remove_placement_group(pg)
        ray.shutdown()


def assert_comm_test_fails_clearly(gpus_needed: int, gpu_groups: list[list[str]], ranks: int, match: str,
                                   record: str, **kwargs) -> None:
    """The NCCL smoke test on raylets one of which claims a GPU that is not there (its CUDA_VISIBLE_DEVICES names
    the first id past this host's GPUs, no device) fails with ``match``; its time and message go to ``record``."""
    from kimi_k3_serve.checks.replica import ReplicaCheckError

    with raylets(gpus_needed, gpu_groups, **kwargs) as (cluster, _):
        started = time.monotonic()
        with pytest.raises(ReplicaCheckError, match=match) as info:
            _comm_test_on(cluster, ranks=ranks)
        (OUT / record).write_text(f"{time.monotonic() - started:.1f} s\n{info.value}\n")


def test_nccl_smoke_test_fails_clearly_without_the_second_gpu() -> None:
    """The second of two one-GPU raylets has no GPU."""
    assert_comm_test_fails_clearly(1, [["0"], [str(GPUS)]], 2, r"nccl smoke test between the nodes node-a -> node-b failed",
                                   "nccl-gpu-missing.txt")


def test_nccl_smoke_test_at_eight_ranks_across_two_nodes_of_four_gpus(two_nodes_of_four_gpus) -> None:
    """Every GPU of a TP4 x PP2 replica in one all-reduce and one send/recv chain, across the two nodes; its time."""
    cluster, _ = two_nodes_of_four_gpus
    started = time.monotonic()
    line = _comm_test_on(cluster, ranks=8)
    (OUT / "nccl-eight-ranks.txt").write_text(f"{time.monotonic() - started:.1f} s\n{line}\n")
    assert "nccl all-reduce and stage-to-stage send/recv across 8 ranks on 2 nodes" in line, line


def test_nccl_smoke_test_at_eight_ranks_fails_clearly_without_one_gpu() -> None:
    """One rank's GPU is taken away: the second raylet's fourth GPU id names no device."""
    assert_comm_test_fails_clearly(8, [["0", "1", "2", "3"], ["4", "5", "6", str(GPUS)]], 8,
                                   r"nccl smoke test between the nodes node-a -> .* -> node-b failed",
                                   "nccl-eight-ranks-gpu-missing.txt", num_cpus=16)


# --- the fabric measurement over NCCL (issue 25 part 4) ---------------------------------------------------------
# NCCL between two raylets needs two GPUs: one H200 cannot hold both ranks (NCCL refuses two ranks on one device).
# On one host the two "nodes" talk over NVLink (P2P), not a network: the run shows the measurement and NCCL's own
# transport lines; forcing NCCL onto sockets (P2P, SHM and IB off) shows the socket detection and the refusal.


def _fabric_line(line: str) -> str:
    fabric = [part for part in line.split("\n") if part.startswith("fabric: ")]
    assert len(fabric) == 1, line
    return fabric[0]


def test_nccl_fabric_measures_bus_bandwidth_between_two_raylets(two_nodes) -> None:
    from kimi_k3_serve.checks.replica import FabricExpectation
    from kimi_k3_serve.planning.hardware import interconnect_of

    cluster, _ = two_nodes
    started = time.monotonic()
    line = _comm_test_on(cluster, ranks=2, measure_bytes=256 << 20,
                         expectation=FabricExpectation("H200 nodes", interconnect_of("H200")))
    (OUT / "nccl-fabric-two-raylets.txt").write_text(f"{time.monotonic() - started:.1f} s\n{line}\n")
    fabric = _fabric_line(line)
    busbw = [float(x) for x in re.findall(r"busbw ([\d,.]+) GB/s", fabric.replace(",", ""))]
    assert len(busbw) == 2 and min(busbw) > 1.0, fabric  # NVLink between two H200s: hundreds of GB/s
    assert " over " in fabric, f"NCCL named no transport: {fabric}"


def test_nccl_fabric_on_sockets_is_found_and_refused_under_the_flag(two_nodes) -> None:
    from kimi_k3_serve.checks.replica import FabricExpectation, ReplicaCheckError
    from kimi_k3_serve.planning.hardware import INTERCONNECTS

    cluster, _ = two_nodes
    sockets = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket"}
    expectation = FabricExpectation("p5en.48xlarge", INTERCONNECTS["p5en.48xlarge"], min_fabric_fraction=0.25)
    started = time.monotonic()
    with pytest.raises(ReplicaCheckError, match=r"NCCL is using TCP sockets \(NET/Socket\), not EFAv3") as info:
        _comm_test_on(cluster, ranks=2, measure_bytes=64 << 20, expectation=expectation, env=sockets)
    (OUT / "nccl-fabric-sockets.txt").write_text(f"{time.monotonic() - started:.1f} s\n{info.value}\n")
    assert "FI_PROVIDER=efa" in str(info.value) and "Refused: args.fabric.min_fabric_fraction is 0.25" in str(info.value)
