"""The rehearsal's engine process: ``python -m kimi_k3_serve.rehearsal.runner SPEC.json``.

Starts vLLM's real engine (``vllm.LLM``) with the spec's engine kwargs on dummy weights, generates a few
token-id prompts, and prints two marker lines the parent reads (``vllm_log`` reads the rest of vLLM's log):

    KIMI_K3_REHEARSAL_ENGINE {"num_gpu_blocks": ..., "block_size": ..., "max_num_batched_tokens": ..., ...}
    KIMI_K3_REHEARSAL_GENERATED {"requests": ..., "tokens": ...}

The environment (the deploy config's env vars) is set by the parent. vLLM starts its engine in a new process,
hence the ``__main__`` guard. Exit code 0 when the engine started and generated, 3 when it failed.
"""

from __future__ import annotations

import json
import sys
import traceback

ENGINE_MARKER = "KIMI_K3_REHEARSAL_ENGINE"
GENERATED_MARKER = "KIMI_K3_REHEARSAL_GENERATED"
FAILED_MARKER = "KIMI_K3_REHEARSAL_FAILED"


def run(spec: dict, marker_suffix: str = "") -> int:
    """One engine. ``marker_suffix`` tells a DP rank's markers apart (``_DP1``...; rank 0 prints the plain ones)."""
    from vllm import LLM, SamplingParams

    kwargs = dict(spec["engine_kwargs"])
    llm = LLM(model=spec["model"], **kwargs)
    config = llm.llm_engine.vllm_config
    engine = {
        "num_gpu_blocks": config.cache_config.num_gpu_blocks,
        "block_size": config.cache_config.block_size,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_model_len": config.model_config.max_model_len,
        "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
        "kv_cache_dtype": str(config.cache_config.cache_dtype),
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "architecture": (config.model_config.architectures or [None])[0],
    }
    print(f"{ENGINE_MARKER}{marker_suffix} {json.dumps(engine)}", flush=True)
    vocab = config.model_config.get_vocab_size()
    num = int(spec.get("requests", 4))
    prompt_len = int(spec.get("prompt_tokens", 64))
    prompts = [{"prompt_token_ids": [(1000 + 7 * i + j) % vocab for j in range(prompt_len)]} for i in range(num)]
    params = SamplingParams(max_tokens=int(spec.get("max_tokens", 16)), temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"{GENERATED_MARKER}{marker_suffix} {json.dumps({'requests': len(outputs), 'tokens': tokens})}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        spec = json.load(f)
    try:
        return run(spec)
    except BaseException as exc:  # the parent reads the step and the message; the traceback stays in the log
        traceback.print_exc()
        print(f"{FAILED_MARKER} {json.dumps({'type': type(exc).__name__, 'message': str(exc)[-2000:]})}", flush=True)
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv))
