"""The rehearsal's engines for a data-parallel layout: ``vllm.LLM`` refuses ``data_parallel_size > 1`` in one
process ("not supported for single-process usage"), so, as vLLM's own offline data-parallel example does, one
process per DP rank runs ``vllm.LLM`` with ``VLLM_DP_RANK`` / ``VLLM_DP_RANK_LOCAL`` / ``VLLM_DP_SIZE`` /
``VLLM_DP_MASTER_IP`` / ``VLLM_DP_MASTER_PORT`` set (``ParallelConfig`` reads them when ``data_parallel_size`` is
not passed) and the rest of the engine kwargs unchanged (``enable_expert_parallel`` splits the experts over the
TP x DP ranks). vLLM places DP rank r on local GPUs ``r x TP x PP ..``.

Rank 0 prints the runner's usual markers; rank r > 0 prints them with ``_DP<r>`` appended. Exit code 0 only when
every rank started and generated.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _rank(spec: dict, rank: int, size: int, port: int) -> None:
    from kimi_k3_serve.rehearsal.runner import FAILED_MARKER, run

    os.environ.update(VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank), VLLM_DP_SIZE=str(size),
                      VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port))
    kwargs = {k: v for k, v in spec["engine_kwargs"].items() if k != "data_parallel_size"}
    suffix = f"_DP{rank}" if rank else ""
    try:
        code = run({**spec, "engine_kwargs": kwargs}, marker_suffix=suffix)
    except BaseException as exc:
        traceback.print_exc()
        print(f"{FAILED_MARKER}{suffix} {json.dumps({'type': type(exc).__name__, 'message': str(exc)[-2000:]})}",
              flush=True)
        code = 3
    sys.stdout.flush()
    os._exit(code)


def run_dp(spec: dict) -> int:
    import multiprocessing

    from kimi_k3_serve.serving.ports import free_loopback_port

    size = int(spec["engine_kwargs"]["data_parallel_size"])
    port = free_loopback_port()  # the DP master's, bound once the ranks have started
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_rank, args=(spec, rank, size, port), name=f"kimi_k3_rehearsal_dp{rank}")
             for rank in range(size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    codes = [proc.exitcode for proc in procs]
    print(f"DP ranks' exit codes: {codes}", flush=True)
    return 0 if all(code == 0 for code in codes) else 3


def main(argv: list[str]) -> int:
    with open(argv[1]) as f:
        return run_dp(json.load(f))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
