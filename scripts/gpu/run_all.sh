#!/usr/bin/env bash
# Every GPU step of the project, for the H200 host (vLLM 0.32 CUDA + Ray 2.60 from the offline bundle).
#
#   bash scripts/gpu/make_bundle.sh .gpu-bundle          # on the dev machine; the parts go to /var/tmp/stash on the host
#   . /var/tmp/stash/host_setup.sh /var/tmp/stash        # once per host: installs the bundle, sets PYTHONPATH/NCCL env
#   bash scripts/gpu/run_all.sh PHASE [SECONDS] [--only JOB ...]  # from the repository root; results in $OUT (or ./gpu-out)
#   (KIMI_K3_SERVE_CALL_STARTED=$(date +%s) exported before host_setup.sh keeps SECONDS inside the call's 600 s)
#
# Phases (each fits one 10-minute call; SECONDS is its deadline, default 540):
#   matrix-tp1     rehearsals on one GPU each, side by side (Kimi-K3 slices, Llama-3.1-8B, Qwen3-30B-A3B, DeepSeek-V2-Lite)
#   tests-rehearse the GPU tests that rehearse a Kimi-K3 slice on one GPU and on two (pytest -m gpu -k rehearse)
#   matrix-tp2     rehearsals on both GPUs (TP2, and PP2 on one node)
#   matrix-tp8     rehearsals on eight GPUs (TP8, and TP4 x PP2 on one node); skipped on a host with fewer
#   matrix-stages  each stage of deploy/config.yaml at TP8 on eight GPUs (rehearse --stage-of), NVLS off and on
#   matrix-ranks   one TP rank of each stage of deploy/config.yaml at full depth, one GPU each (rehearse --rank-of),
#                  (KIMI_K3_SERVE_RANK_SET=ranks-round2, ranks-round3 or ranks-round4 for the later rounds)
#                  and the shapes where the verdict missed; each job's role (fit or validation) is in matrix.py
#   tests-serve    serve run of deploy/gpu-rehearsal.yaml across two Ray nodes, at DP2 x EP2, + the NCCL test (pytest -m gpu -k "serve or nccl")
#                  (the NCCL tests include the fabric measurement: bus bandwidth and socket detection, 2 GPUs)
#                  (KIMI_K3_SERVE_GPU_TESTS="EXPR" runs the tests that pytest -k EXPR selects instead, in either tests phase)
#   bench          serving speed, bare vLLM vs our Serve path (scripts/bench_serving.py --preset $KIMI_K3_SERVE_BENCH, default h200-llama-8b) -> $OUT/bench.tar.gz
#                  (KIMI_K3_SERVE_BENCH_SIDES="vllm direct+key" runs only those of the preset's sides,
#                  KIMI_K3_SERVE_BENCH_CONCURRENCY="64 256" only those of its concurrencies)
#   all            every phase in turn (a host without the 10-minute limit)
# Each phase writes $OUT/<phase>.log and $OUT/<phase>.tar.gz (logs, readings, results), and $OUT/host.json once.
# Work folders: $KIMI_K3_SERVE_GPU_RUNS (default /var/tmp/kk3-runs), models: $KIMI_K3_SERVE_MODEL_CACHE (/var/tmp/kk3-models).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
phase="${1:?usage: run_all.sh PHASE [SECONDS]}"
deadline="${2:-540}"
shift $(( $# < 2 ? $# : 2 ))
matrix_args=("$@")  # e.g. --only NAME ...: passed to scripts/gpu/matrix.py
out="${OUT:-$root/gpu-out}"
mkdir -p "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export KIMI_K3_SERVE_MODEL_CACHE="${KIMI_K3_SERVE_MODEL_CACHE:-/var/tmp/kk3-models}"
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 NO_COLOR=1 VLLM_LOGGING_COLOR=0
# vLLM logs each growth of its shared workspace with the caller and the size (v1/worker/workspace.py): where the
# FlashKDA prefill buffers land relative to the profile and the KV cache, in every run's log.
export VLLM_DEBUG_WORKSPACE=1
runs="${KIMI_K3_SERVE_GPU_RUNS:-/var/tmp/kk3-runs}"  # outside the working tree: kept between calls while the host stays up
mkdir -p "$runs"
started=$(date +%s)
# A device call ends at its own limit whatever the phase's deadline: with KIMI_K3_SERVE_CALL_STARTED (the call's
# `date +%s`, taken before host_setup.sh) the deadline is cut to end 10 s before KIMI_K3_SERVE_CALL_LIMIT (600 s),
# so the phase packs its results before the call is stopped.
if [ -n "${KIMI_K3_SERVE_CALL_STARTED:-}" ]; then
  call_left=$(( ${KIMI_K3_SERVE_CALL_LIMIT:-600} - 10 - (started - KIMI_K3_SERVE_CALL_STARTED) ))
  [ "$call_left" -lt "$deadline" ] && echo "deadline cut from $deadline s to $call_left s (the call's limit)" && deadline=$call_left
fi

host_info() {
  [ -f "$runs/host.json" ] && { cp "$runs/host.json" "$out/"; return; }
  python3 - "$runs/host.json" <<'PY'
import json, subprocess, sys, platform
import torch, vllm, ray
from kimi_k3_serve.cluster.nvml import take_readings
info = {"date": __import__("datetime").datetime.utcnow().isoformat() + "Z", "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "vllm": vllm.__version__, "ray": ray.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())), "nvml": take_readings(),
        "torch_devices": [{"name": torch.cuda.get_device_name(i), "total_bytes": torch.cuda.mem_get_info(i)[1]}
                          for i in range(torch.cuda.device_count())]}
info["nvidia_smi"] = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
json.dump(info, open(sys.argv[1], "w"), indent=1)
print({k: v for k, v in info.items() if k not in ("nvml", "nvidia_smi")})
PY
  cp "$runs/host.json" "$out/"
}

make_models() {
  python3 scripts/make_kimi_slice.py --layers 4 --out "$KIMI_K3_SERVE_MODEL_CACHE"
}

# Kernels built at the first engine start (FlashInfer's JIT modules, Triton's cache): about 3 minutes of a fresh
# host's device time. Each phase packs them into $OUT/jit-cache.tar.gz; a later session carries that file into the
# stash (/var/tmp/stash/jit-cache.tar.gz, or $KIMI_K3_SERVE_JIT_CACHE) and the first phase unpacks it.
# The CuTe DSL kernels vLLM 0.32 warms up for Kimi-K3 (about 2 minutes at a host's first engine start, 2026-12-01)
# go to the DSL's file cache, by default under /tmp: kept under $HOME instead, and packed apart
# ($OUT/cute-cache.tar.gz), so that neither archive passes the 16 MiB a file that comes back from the host may have.
export CUTE_DSL_CACHE_DIR="${CUTE_DSL_CACHE_DIR:-$HOME/.cache/cutlass_python_cache}"
jit_dirs=(.cache/flashinfer .triton/cache .cache/vllm/flashinfer_autotune_cache)
restore_jit_cache() {
  local archive="${KIMI_K3_SERVE_JIT_CACHE:-/var/tmp/stash/jit-cache.tar.gz}"
  [ ! -f "$runs/.jit-cache-restored" ] || return 0
  for a in "$archive" "$(dirname "$archive")/cute-cache.tar.gz"; do
    [ -f "$a" ] && tar -xzf "$a" -C "$HOME" && echo "jit cache restored from $a"
  done
  touch "$runs/.jit-cache-restored"
}
save_jit_cache() {
  local present=()
  for d in "${jit_dirs[@]}"; do [ -d "$HOME/$d" ] && present+=("$d"); done
  [ ${#present[@]} -gt 0 ] && tar -czf "$out/jit-cache.tar.gz" -C "$HOME" "${present[@]}" 2>/dev/null \
    && echo "jit cache: $(du -h "$out/jit-cache.tar.gz" | cut -f1) in $out/jit-cache.tar.gz"
  [ -d "$CUTE_DSL_CACHE_DIR" ] && tar -czf "$out/cute-cache.tar.gz" -C "$(dirname "$CUTE_DSL_CACHE_DIR")" \
    "$(basename "$CUTE_DSL_CACHE_DIR")" 2>/dev/null \
    && echo "cute dsl cache: $(du -h "$out/cute-cache.tar.gz" | cut -f1) in $out/cute-cache.tar.gz"
  return 0
}

left() { echo $(( deadline - ($(date +%s) - started) )); }

pack() {  # pack DIR into $out/$phase.tar.gz
  tar -czf "$out/$phase.tar.gz" -C "$(dirname "$1")" "$(basename "$1")" 2>/dev/null || true
}

run_phase() {
  case "$1" in
    matrix-tp1) python3 scripts/gpu/matrix.py --set tp1 --deadline "$(left)" --work "$runs/tp1" --out "$out" "${matrix_args[@]}" ;;
    matrix-tp2) python3 scripts/gpu/matrix.py --set tp2 --deadline "$(left)" --work "$runs/tp2" --out "$out" "${matrix_args[@]}" ;;
    matrix-tp8) python3 scripts/gpu/matrix.py --set tp8 --deadline "$(left)" --work "$runs/tp8" --out "$out" "${matrix_args[@]}" ;;
    matrix-stages) python3 scripts/gpu/matrix.py --set stages-tp8 --deadline "$(left)" --work "$runs/stages" --out "$out" "${matrix_args[@]}" ;;
    matrix-ranks) python3 scripts/gpu/matrix.py --set "${KIMI_K3_SERVE_RANK_SET:-ranks}" --deadline "$(left)" --work "$runs/ranks" --out "$out" "${matrix_args[@]}" ;;
    tests-rehearse|tests-serve)
      local k="rehearse"; [ "$1" = tests-serve ] && k="serve or nccl"
      k="${KIMI_K3_SERVE_GPU_TESTS:-$k}"  # a pytest -k expression: the tests of this call only
      export KIMI_K3_SERVE_GPU_OUT="$runs/$1"
      mkdir -p "$KIMI_K3_SERVE_GPU_OUT"
      timeout "$(( $(left) - 10 ))" python3 -m pytest -m gpu tests/test_gpu.py -k "$k" -v -s -p no:cacheprovider \
        --junitxml="$KIMI_K3_SERVE_GPU_OUT/junit.xml" 2>&1 | tee "$KIMI_K3_SERVE_GPU_OUT/pytest.log" | tail -80
      pack "$KIMI_K3_SERVE_GPU_OUT" ;;
    bench)  # packed and removed: a device call returns 8 files at most, and names with '+' or '@' not at all
      # KIMI_K3_SERVE_BENCH_SIDES="vllm direct+key" measures only those sides of the preset (a call is 10 minutes)
      python3 scripts/bench_serving.py --preset "${KIMI_K3_SERVE_BENCH:-h200-llama-8b}" --deadline "$(( $(left) - 20 ))" \
        ${KIMI_K3_SERVE_BENCH_SIDES:+--sides $KIMI_K3_SERVE_BENCH_SIDES} \
        ${KIMI_K3_SERVE_BENCH_CONCURRENCY:+--concurrency $KIMI_K3_SERVE_BENCH_CONCURRENCY} --out "$out/bench"
      pack "$out/bench" && [ -f "$out/$phase.tar.gz" ] && rm -rf "$out/bench" ;;
    *) echo "unknown phase $1"; return 2 ;;
  esac
}

{
  echo "== $phase on $(hostname) at $(date -u +%FT%TZ), deadline ${deadline} s"
  bash scripts/gpu/fix_bundle.sh
  host_info
  restore_jit_cache
  make_models
  if [ "$phase" = all ]; then
    for p in matrix-tp1 tests-rehearse matrix-tp2 matrix-tp8 tests-serve; do phase=$p; deadline=100000; run_phase "$p"; done
  else
    run_phase "$phase"
  fi
  save_jit_cache
  echo "== done in $(( $(date +%s) - started )) s"
} 2>&1 | tee "$out/$phase.log"
