#!/usr/bin/env bash
# Repair what the offline bundle resolved wrong, with wheels carried in .gpu-cache/whl (after host_setup.sh; run_all.sh
# calls it first). 2026-12-02: the bundle's grpcio-reflection 1.85.1 refuses the host's grpcio 1.84.0, so
# `from ray import serve` raised and no Serve side of the bench started; grpcio-reflection 1.84.0 matches it.
#   pip download --no-deps -d .gpu-cache/whl grpcio-reflection==1.84.0   # on the dev machine, before the first call
# (carry .gpu-cache/whl in the first device call, beside the bundle's part). Does nothing when Serve imports.
set -uo pipefail
site="${KIMI_K3_SERVE_SITE:-/var/tmp/kk3-site}"
python3 -c "from ray import serve" 2>/dev/null && exit 0
wheel="$(ls .gpu-cache/whl/grpcio_reflection-*.whl /var/tmp/stash/grpcio_reflection-*.whl 2>/dev/null | head -1)"
[ -n "$wheel" ] || { echo "fix_bundle: ray.serve does not import and no grpcio_reflection wheel was carried"; exit 0; }
rm -rf "$site"/grpc_reflection "$site"/grpcio_reflection-*.dist-info
python3 -m pip install --quiet --no-deps --no-index --target "$site" "$wheel" 2>&1 | tail -2
python3 -c "from ray import serve" && echo "fix_bundle: $(basename "$wheel") installed; ray.serve imports"
