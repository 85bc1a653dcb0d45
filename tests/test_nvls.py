"""NCCL's NVLS buffers in the plan (planning/nvls.py): the size NCCL 2.30's code gives each GPU of a TP group, where
the plan counts it, and the engine environment that turns it off."""

from __future__ import annotations

import pytest

from conftest import REPO_ROOT
from kimi_k3_serve.commands.rehearse import predict
from kimi_k3_serve.config.serve_config import load_serve_app
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.hardware import lookup_gpu
from kimi_k3_serve.planning.layout import RankDevice
from kimi_k3_serve.planning.memory import NON_TORCH_TP_MULTI
from kimi_k3_serve.planning.nvls import check_nvls_env, nvls_buffer_bytes

MiB = 2**20
H200 = lookup_gpu("H200")
DEVICE = RankDevice(H200.total_bytes, H200.compute_capability, name=H200.name)


@pytest.mark.parametrize(("tp", "cc", "spans_nodes", "mib"), [
    (8, (9, 0), False, 256),   # H200 node, TP8: 16 channels x 2 x 8 steps x 128 KiB x 8 GPUs
    (4, (9, 0), False, 128),   # the wide-EP engines' TP4
    (8, (10, 0), False, 384),  # B200 node: 24 channels
    (16, (10, 3), True, 1024),  # GB300 NVL72, TP16 over four trays: 32 channels
    (2, (9, 0), False, 64),
    (1, (9, 0), False, 0),     # no group, no NVLS
    (8, (8, 9), False, 0),     # before Hopper: no NVLink multicast
])
def test_nvls_bytes_per_gpu_are_ncclss_formula(tp, cc, spans_nodes, mib) -> None:
    assert nvls_buffer_bytes(tp, cc, None, spans_nodes) == mib * MiB


def test_the_environment_turns_nvls_off_or_resizes_its_chunks() -> None:
    assert nvls_buffer_bytes(8, (9, 0), {"NCCL_NVLS_ENABLE": "0"}) == 0
    assert nvls_buffer_bytes(8, (9, 0), {"NCCL_NVLS_ENABLE": "1"}) == 256 * MiB
    assert nvls_buffer_bytes(8, (9, 0), {"NCCL_NVLS_CHUNKSIZE": "262144"}) == 512 * MiB


@pytest.mark.parametrize(("env", "field"), [
    ({"NCCL_NVLS_ENABLE": "off"}, "args.runtime_env.env_vars.NCCL_NVLS_ENABLE"),
    ({"NCCL_NVLS_CHUNKSIZE": "-1"}, "args.runtime_env.env_vars.NCCL_NVLS_CHUNKSIZE"),
])
def test_a_setting_nccl_would_misread_is_refused_by_name(env, field) -> None:
    with pytest.raises(ConfigError) as caught:
        check_nvls_env(env)
    assert caught.value.field == field


def test_the_deploy_plan_counts_nvls_on_every_tp8_gpu_and_says_so() -> None:
    args = load_serve_app(str(REPO_ROOT / "deploy" / "config.yaml")).args
    on = predict(args, DEVICE)
    assert {r.non_torch_bytes for r in on.ranks} == {NON_TORCH_TP_MULTI + 256 * MiB}
    assert any("NVLS buffers: 256 MiB per GPU of each TP8 group, counted" in n for n in on.notes)

    env = {**args.runtime_env.env_vars, "NCCL_NVLS_ENABLE": "0"}
    off = predict(args.model_copy(update={"runtime_env": args.runtime_env.model_copy(update={"env_vars": env})}),
                  DEVICE)
    assert [b.kv_cache_bytes - a.kv_cache_bytes for a, b in zip(on.ranks, off.ranks)] == [256 * MiB] * 16
    assert any("NCCL NVLS: off" in n for n in off.notes)


def test_a_rehearsal_host_environment_applies_under_the_configs_own() -> None:
    args = load_serve_app(str(REPO_ROOT / "deploy" / "config.yaml")).args
    host_off = predict(args, DEVICE, inherited_env={"NCCL_NVLS_ENABLE": "0", "HOME": "/root"})
    assert {r.non_torch_bytes for r in host_off.ranks} == {NON_TORCH_TP_MULTI}
    env = {**args.runtime_env.env_vars, "NCCL_NVLS_ENABLE": "2"}
    config_on = args.model_copy(update={"runtime_env": args.runtime_env.model_copy(update={"env_vars": env})})
    assert {r.non_torch_bytes for r in predict(config_on, DEVICE, inherited_env={"NCCL_NVLS_ENABLE": "0"}).ranks} \
        == {NON_TORCH_TP_MULTI + 256 * MiB}
