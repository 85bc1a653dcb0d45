#!/usr/bin/env bash
# Re-split the offline bundle into smaller parts, so that one part and the working tree pass a device call's 64 MiB
# carry limit (2026-12-02: the tree had grown to 7.3 MB, and a 58 MiB part with it did not; 2026-12-03: at 9.8 MB a
# 54 MiB part did not either; 2026-12-04: at 14.0 MB a 50 MiB part did not; 2026-12-05:
# at 18.7 MB a 45 MiB part did not, 40M does). host_setup.sh joins
# `part.*` in name order whatever their size; the manifest is
# rewritten for the new parts.
#   bash scripts/gpu/split_bundle.sh .gpu-bundle 40M
set -euo pipefail
bundle="${1:?bundle folder}"; size="${2:-40M}"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
cat "$bundle"/part.* > "$tmp/bundle.tar"
rm "$bundle"/part.*
split -b "$size" -d -a 2 "$tmp/bundle.tar" "$bundle/part."
(cd "$bundle" && sha256sum part.* > MANIFEST.sha256)
echo "$(ls "$bundle"/part.* | wc -l) parts of at most $size in $bundle"
