"""Which Kimi-K3 kernels vLLM 0.32 turns on for a layout, what to set for them, and the workspace each
charges -- with the reason in words when one is off.

Rules as read in the installed vLLM 0.32:
- sequence parallelism: ``PP == 1 and enable_expert_parallel and TP > 1 and (MegaMoE or DP > 1)``
  (models/kimi_k3/nvidia/model.py ``KimiLinearModel.__init__`` and ``KimiDecoderLayer.__init__``);
- GEMM-RS (``VLLM_ENABLE_GEMM_RS=1``, off by default) when SP is on, GEMM-AR (``VLLM_KIMI_K3_GEMM_AR``,
  default 1) when SP is off; both need an SM100-family GPU, BF16, no ubatching, ``1 < TP <= 16`` with
  ``128 % TP == 0``, ``hidden % 128 == 0`` and NVLink multicast across the TP group
  (model_executor/kernels/linear/cute_dsl/gemm_rs_ar.py ``maybe_init_gemm_rs_ar``). One process-wide
  symmetric workspace of ``max_num_batched_tokens x hidden`` bf16 (rounded up to a multiple of TP);
- FlashKDA prefill (models/kimi_k3/nvidia/kda.py ``resolve_kda_prefill_backend``): SM90 / SM10x / SM12x,
  bf16 activations, fp32 or bf16 recurrent state, a bounded gate; it also adds one prefill-checkpoint
  state block per request in prefix-caching ``align`` mode (kda.py ``get_kv_cache_spec``);
- latent-MoE tail fusion: SM100 family, TP 8 or 16, latent MoE.
Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimi_k3_serve.planning.layout import EngineSettings, Layout
from kimi_k3_serve.models.inventory import KdaState, ModelInventory
from kimi_k3_serve.units import MiB, round_up

FLASHKDA_WORKSPACE_BYTES_PER_ROW = 13_824
"""FlashKDA's kernel workspace, ``torch.ops._flashkda_C.get_workspace_size(T, H, N)`` (a C++ function of the compiled
library), is 13,824 x H x (N + ceil(T / 16)) bytes: read from the library on the GPU host
(scripts/gpu/flashkda_workspace.py, tests/fixtures/gpu/2026-12-06-round25/flashkda-workspace.json), exact on each of
1,056 shapes (T 1 to 32,768, H 1 to 96, N 1 to 1,024). It replaces a share of the states fitted on one run (0.158),
which was 325 MiB short of vLLM's logged workspace at 512 sequences (k8-tp1-b8192-s512-nodraft)."""
WORKSPACE_ALIGN_BYTES = 256
"""``WorkspaceManager.get_simultaneous`` rounds each buffer it hands out to 256 bytes (v1/worker/workspace.py)."""


def flashkda_workspace_bytes(tokens: int, heads: int, seqs: int) -> int:
    """``get_workspace_size(T, H, N)`` of FlashKDA's prefill kernel, for head_dim 128."""
    return FLASHKDA_WORKSPACE_BYTES_PER_ROW * heads * (seqs - (-tokens // 16))


def flashkda_buffers_bytes(tokens: int, heads: int, seqs: int, head_dim: int, state_bytes: int) -> int:
    """What kda.py asks vLLM's shared workspace for at once: a (1, T, H, D) bf16 output, two (N, H, D, D) recurrent
    states and the kernel's workspace, each rounded to 256 bytes."""
    state = seqs * heads * head_dim * head_dim * state_bytes
    parts = (tokens * heads * head_dim * 2, state, state, flashkda_workspace_bytes(tokens, heads, seqs))
    return sum(round_up(part, WORKSPACE_ALIGN_BYTES) for part in parts)


LATENT_MOE_TAIL_BYTES = 28 * MiB
"""Symmetric Lamport buffers of the fused latent-MoE tail at TP8 (kimi-k3-facts.md 2.5; an estimate)."""


@dataclass(frozen=True)
class OptimisationItem:
    name: str
    on: bool
    reason: str
    env: tuple[tuple[str, str], ...] = ()
    workspace_bytes: int = 0
    """Bytes this item charges inside the KV budget on each rank of the TP group (0 when off)."""
    estimate: bool = False
    margin_bytes: int = 0
    after_kv: bool = False
    """Allocated after vLLM has sized the KV cache (during warmup), so vLLM's profile never saw it: it is not taken
    from the KV pool, and it must fit in what the budget leaves free on the GPU."""


@dataclass(frozen=True)
class Optimisations:
    items: tuple[OptimisationItem, ...]

    def get(self, name: str) -> OptimisationItem | None:
        for item in self.items:
            if item.name == name:
                return item
        return None

    def is_on(self, name: str) -> bool:
        item = self.get(name)
        return bool(item and item.on)

    @property
    def sequence_parallel(self) -> bool:
        return self.is_on("sequence_parallel")

    @property
    def flashkda(self) -> bool:
        return self.is_on("flashkda")

    @property
    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for item in self.items:
            out.update(dict(item.env))
        return out

    def to_json(self) -> list[dict]:
        return [
            {"name": i.name, "on": i.on, "reason": i.reason, "env": dict(i.env), "workspace_bytes": i.workspace_bytes,
             "estimate": i.estimate, "after_kv": i.after_kv}
            for i in self.items
        ]


def decide_optimisations(
    model: ModelInventory,
    layout: Layout,
    engine: EngineSettings,
    compute_capability: tuple[int, int],
    tp_group_in_one_nvlink_domain: bool,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    mega_moe: bool = False,
) -> Optimisations:
    """vLLM 0.32's decisions for ``model`` on ``layout``. ``max_num_batched_tokens`` / ``max_num_seqs`` are
    the engine's resolved limits (``memory.resolved_batch``): the workspaces scale with them."""
    if model.family != "kimi_k3":
        return Optimisations((OptimisationItem("sequence_parallel", False, f"{model.architecture}: vLLM 0.32 turns SP on only in Kimi-K3's model code"),))
    mega_moe = mega_moe or getattr(engine, "moe_backend", "auto") == "deep_gemm_mega_moe"
    mnbt, seqs = max_num_batched_tokens, max_num_seqs
    major = compute_capability[0]
    sm100 = major == 10
    arch = _arch_words(compute_capability)
    bf16 = model.dtype == "bfloat16"
    items: list[OptimisationItem] = []

    # Sequence parallelism.
    if layout.pp > 1:
        sp, sp_reason = False, "PP > 1 disables SP in vLLM 0.32"
    elif not layout.ep:
        sp, sp_reason = False, "SP needs expert parallelism (--enable-expert-parallel)"
    elif layout.tp == 1:
        sp, sp_reason = False, "SP needs TP > 1"
    elif not (mega_moe or layout.dp > 1):
        sp, sp_reason = False, "SP needs MegaMoE (--moe-backend deep_gemm_mega_moe) or DP > 1"
    else:
        sp, sp_reason = True, "PP == 1, EP on, TP > 1 and " + ("MegaMoE" if mega_moe else "DP > 1")
    if sp:
        sp_reason += "; shared experts and the dense MLP are replicated (VLLM_KIMI_K3_SHARD_SP_SHARED_EXPERT=0)"
    items.append(OptimisationItem("sequence_parallel", sp, sp_reason))

    # GEMM-RS / GEMM-AR share one symmetric workspace; the SP topology binds it to exactly one mode.
    workspace = round_up(mnbt, layout.tp) * model.hidden_size * 2
    blocker = _gemm_blocker(layout, sm100, arch, bf16, model.hidden_size, tp_group_in_one_nvlink_domain)
    if sp:
        if blocker:
            items.append(OptimisationItem("gemm_rs", False, blocker.replace("{mode}", "GEMM-RS")))
        else:
            items.append(OptimisationItem("gemm_rs", True, "SM100, TP group in one NVLink domain, SP on",
                                          env=(("VLLM_ENABLE_GEMM_RS", "1"),), workspace_bytes=workspace))
        items.append(OptimisationItem("gemm_ar", False, "SP is on: the GEMM workspace is bound to GEMM-RS",
                                      env=(("VLLM_KIMI_K3_GEMM_AR", "0"),) if blocker else ()))
    else:
        rs_reason = blocker.replace("{mode}", "GEMM-RS") if blocker else f"GEMM-RS needs sequence parallelism ({sp_reason})"
        items.append(OptimisationItem("gemm_rs", False, rs_reason))
        if blocker:
            items.append(OptimisationItem("gemm_ar", False, blocker.replace("{mode}", "GEMM-AR"),
                                          env=(("VLLM_KIMI_K3_GEMM_AR", "0"),)))
        else:
            items.append(OptimisationItem("gemm_ar", True, "SM100, TP group in one NVLink domain, SP off (vLLM default on)",
                                          env=(("VLLM_KIMI_K3_GEMM_AR", "1"),), workspace_bytes=workspace))

    # FlashKDA prefill.
    kda = next((layer.kv for layer in model.layers if isinstance(layer.kv, KdaState)), None)
    if kda is not None:
        state_dtype = engine.mamba_ssm_cache_dtype
        if major not in (9, 10, 12):
            items.append(OptimisationItem("flashkda", False, f"{arch}: FlashKDA needs SM90/SM10x/SM12x (Triton KDA prefill)"))
        elif not bf16 or kda.head_dim != 128:
            items.append(OptimisationItem("flashkda", False, "FlashKDA needs bf16 activations and head_dim 128"))
        elif state_dtype == "float16":
            items.append(OptimisationItem("flashkda", False, "FlashKDA needs an fp32 or bf16 recurrent state"))
        else:
            heads = kda.num_heads // layout.tp
            state_bytes = 2 if state_dtype == "bfloat16" else 4
            ws = flashkda_buffers_bytes(mnbt, heads, seqs, kda.head_dim, state_bytes)
            items.append(OptimisationItem(
                "flashkda", True, f"{arch}: FlashKDA prefill (output, states and the kernel's workspace for T={mnbt}, "
                f"N={seqs}, from kda.py's shapes and the library's get_workspace_size; first asked for after vLLM's "
                "memory profile: in warmup, or while it profiles CUDA graphs)", workspace_bytes=ws, estimate=True,
                after_kv=True,
            ))

    # Latent-MoE tail fusion.
    latent = model.widths.moe_hidden_size and model.widths.moe_hidden_size != model.hidden_size
    if latent:
        if sm100 and layout.tp in (8, 16):
            items.append(OptimisationItem("latent_moe_tail_fusion", True, "SM100 and TP 8 or 16",
                                          workspace_bytes=LATENT_MOE_TAIL_BYTES, estimate=True, margin_bytes=LATENT_MOE_TAIL_BYTES))
        else:
            why = f"{arch}: the fused latent-MoE tail needs SM100" if not sm100 else f"TP {layout.tp}: the fused tail needs TP 8 or 16"
            items.append(OptimisationItem("latent_moe_tail_fusion", False, why))
    return Optimisations(tuple(items))


def _gemm_blocker(layout: Layout, sm100: bool, arch: str, bf16: bool, hidden: int, one_domain: bool) -> str | None:
    if not sm100:
        return f"{arch}: {{mode}} needs SM100"
    if not 1 < layout.tp <= 16:
        return f"TP {layout.tp}: {{mode}} needs 2 <= TP <= 16"
    if 128 % layout.tp:
        return f"TP {layout.tp}: {{mode}} needs 128 % TP == 0"
    if not bf16:
        return "{mode} needs a BF16 model dtype"
    if hidden % 128:
        return f"{{mode}} needs hidden % 128 == 0 (hidden {hidden})"
    if not one_domain:
        return "TP group spans NVLink domains"
    return None


def _arch_words(cc: tuple[int, int]) -> str:
    major = cc[0]
    name = {8: "Ampere/Ada", 9: "Hopper", 10: "Blackwell", 12: "Blackwell GeForce"}.get(major, f"SM{major}x")
    return f"{name} GPUs (SM{major}{cc[1]})"
