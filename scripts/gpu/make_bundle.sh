#!/usr/bin/env bash
# The offline bundle for the GPU host, with the pins this project's GPU path needs on top of the shared recipe:
#   bash scripts/gpu/make_bundle.sh [OUTDIR=.gpu-bundle]        (needs ../shared/gpu/make_bundle.sh beside the project)
# - grpcio==1.84.0: the host has grpcio 1.84.0 and the bundle skips what the host has, but the resolver picked
#   grpcio-reflection 1.85.1, whose generated code refuses grpcio < 1.85.1, so `import ray.serve` failed on the host
#   (tests/fixtures/gpu/2026-11-30/serve-two-nodes-attempt). Pinning grpcio makes the resolver pick a matching
#   grpcio-reflection.
# - py-spy: the serving benchmark samples the proxy, ingress and replica processes with it (scripts/gpu/bench_serving.py).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
shared="$here/../../../shared/gpu/make_bundle.sh"
[ -f "$shared" ] || { echo "error: $shared not found (the shared GPU bundle recipe)"; exit 2; }
bash "$shared" "${1:-.gpu-bundle}" "grpcio==1.84.0" "py-spy"
