"""What ``build_app`` deploys is what the plan shows: one translation from a plan to vLLM (``vllm_args``).

On every shipped deploy config that the planner can size (the GPU ones; a CPU engine has no GPU plan), the
``LLMConfig`` the application builder makes carries exactly the plan's ``engine_kwargs`` and ``env_vars``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import load_script
from kimi_k3_serve.planning.layout import EngineSettings, Layout
from kimi_k3_serve.config.serve_config import load_serve_app
from kimi_k3_serve.planning.vllm_args import CPU_ENV_DEFAULTS, LAYER_PARTITION_ENV, engine_kwargs, env_vars

REPO = Path(__file__).resolve().parents[1]
DEPLOY = sorted((REPO / "deploy").glob("*.yaml"))


def _kind(config: Path) -> str:
    return load_serve_app(config).args.accelerator.kind


GPU_CONFIGS = [c for c in DEPLOY if _kind(c) == "gpu"]


def test_every_shipped_config_is_planned_or_runs_on_cpu():
    assert {c.name for c in DEPLOY if c not in GPU_CONFIGS} == {"dev.yaml", "dev-pp.yaml"}
    assert len(GPU_CONFIGS) >= 6


@pytest.fixture(scope="module")
def slice_cache(tmp_path_factory):
    """The model cache the GPU rehearsal and benchmark configs name (configs and a tokenizer, no weights)."""
    cache = tmp_path_factory.mktemp("cache")
    slicer = load_script("make_kimi_slice")
    slicer.make_slice(cache, 4)
    slicer.make_config_model(cache, "llama-3.1-8b", REPO / "tests" / "fixtures" / "configs" / "llama-3.1-8b.json")
    return cache


@pytest.mark.parametrize("config", GPU_CONFIGS, ids=[c.name for c in GPU_CONFIGS])
def test_build_app_deploys_what_the_plan_shows(config, slice_cache, monkeypatch):
    from kimi_k3_serve.app import llm_config_of
    from kimi_k3_serve.commands.render import plan_replica
    from kimi_k3_serve.planning.hardware import lookup_gpu

    monkeypatch.setenv("KIMI_K3_SERVE_MODEL_CACHE", str(slice_cache))
    args = load_serve_app(config).args
    # one TP group per node at most: the planner puts pipeline stages on distinct nodes (the rehearsal's two 1-GPU nodes)
    per_node = min(lookup_gpu(args.accelerator.type).gpus_per_node, args.parallel.tensor_parallel_size)
    shown = plan_replica(args, gpus_per_node=per_node)
    deployed = llm_config_of(args)
    assert shown.fits
    assert deployed.engine_kwargs == shown.engine_kwargs
    assert deployed.runtime_env["env_vars"] == shown.env_vars
    # the config's own pass-through arguments and environment are in both
    assert args.engine_kwargs.items() <= shown.engine_kwargs.items()
    assert args.runtime_env.env_vars.items() <= shown.env_vars.items()


def test_the_translation_of_a_cpu_engine():
    engine = EngineSettings(max_model_len=512, max_num_seqs=4, accelerator="cpu", env_vars={"VLLM_CPU_KVCACHE_SPACE": "2"})
    kwargs = engine_kwargs(Layout(tp=2, pp=2, layer_partition=(3, 1)), engine)
    assert "gpu_memory_utilization" not in kwargs  # vllm-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"], kwargs["max_num_seqs"]) == (2, 2, 4)
    env = env_vars(Layout(tp=2, pp=2, layer_partition=(3, 1)), engine)
    assert env == {**CPU_ENV_DEFAULTS, LAYER_PARTITION_ENV: "3,1", "VLLM_CPU_KVCACHE_SPACE": "2"}


def test_without_a_deploy_config_the_plan_proposes_its_kernel_environment():
    from kimi_k3_serve.planning.optimisations import OptimisationItem, Optimisations

    decided = Optimisations((OptimisationItem("gemm_rs", True, "why", env=(("VLLM_ENABLE_GEMM_RS", "1"),)),))
    assert env_vars(Layout(tp=8), EngineSettings(max_model_len=1024), decided) == {"VLLM_ENABLE_GEMM_RS": "1"}
    # a deploy config's environment is deployed as written
    configured = EngineSettings(max_model_len=1024, env_vars={"NCCL_DEBUG": "WARN"})
    assert env_vars(Layout(tp=8), configured, decided) == {"NCCL_DEBUG": "WARN"}


def test_breakable_cuda_graphs_are_pinned_for_every_process_of_a_kimi_engine():
    """vLLM turns VLLM_USE_BREAKABLE_CUDAGRAPH on for Kimi-K3 in whichever process builds a config first; under Ray the
    pipeline stages then disagree on the CUDA-graph mode (serve-two-nodes, 2026-11-30). The engine's environment pins it."""
    from kimi_k3_serve.planning.vllm_args import BREAKABLE_CUDAGRAPH_ENV

    gpu = EngineSettings(max_model_len=1024)
    assert env_vars(Layout(pp=2), gpu, architecture="KimiLinearForCausalLM") == {BREAKABLE_CUDAGRAPH_ENV: "1"}
    assert env_vars(Layout(pp=2), gpu, architecture="LlamaForCausalLM") == {}  # vLLM leaves it off: so do we
    eager = EngineSettings(max_model_len=1024, enforce_eager=True)
    assert BREAKABLE_CUDAGRAPH_ENV not in env_vars(Layout(pp=2), eager, architecture="KimiLinearForCausalLM")
    cpu = EngineSettings(max_model_len=1024, accelerator="cpu")
    assert BREAKABLE_CUDAGRAPH_ENV not in env_vars(Layout(), cpu, architecture="KimiLinearForCausalLM")
    opted_out = EngineSettings(max_model_len=1024, env_vars={BREAKABLE_CUDAGRAPH_ENV: "0"})  # the config's word wins
    assert env_vars(Layout(pp=2), opted_out, architecture="KimiLinearForCausalLM") == {BREAKABLE_CUDAGRAPH_ENV: "0"}


def test_the_pinned_architectures_are_vllms_own():
    # The planner cannot import vLLM; its copy of the list must stay what the installed vLLM (CUDA) auto-enables.
    from vllm.config.vllm import DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES

    from kimi_k3_serve.planning.vllm_args import BREAKABLE_CUDAGRAPH_ARCHITECTURES

    assert BREAKABLE_CUDAGRAPH_ARCHITECTURES == DEFAULT_BREAKABLE_CUDAGRAPH_ARCHITECTURES


def test_the_rehearsal_config_deploys_the_pin(slice_cache, monkeypatch):
    from kimi_k3_serve.app import llm_config_of
    from kimi_k3_serve.planning.vllm_args import BREAKABLE_CUDAGRAPH_ENV

    monkeypatch.setenv("KIMI_K3_SERVE_MODEL_CACHE", str(slice_cache))
    deployed = llm_config_of(load_serve_app(REPO / "deploy" / "gpu-rehearsal.yaml").args)
    assert deployed.runtime_env["env_vars"][BREAKABLE_CUDAGRAPH_ENV] == "1"
