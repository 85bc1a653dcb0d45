#!/usr/bin/env bash
# Re-split the offline bundle into parts that each pass a device call's 64 MiB carry limit beside the working tree.
# The limit counts the tree about as a tar archive holds it (every tracked and untracked-not-ignored file, a 512-byte
# header each, padded to 512 bytes): that rule fits every refusal and every pass since 2026-12-02, where the files'
# own sizes do not (2026-12-05: 18.7 MiB of files and a 45 MiB part were refused; their tar is 19.3 MiB). With no size
# given, a part is the largest whole MiB that leaves 2 MiB beside today's tree, for the fixtures a session adds.
# host_setup.sh joins `part.*` in name order whatever their size; the manifest is rewritten for the new parts.
#   bash scripts/gpu/split_bundle.sh .gpu-bundle        # the largest part that fits beside today's tree
#   bash scripts/gpu/split_bundle.sh .gpu-bundle 40M    # a size of your own
set -euo pipefail
bundle="${1:?bundle folder}"
tree_bytes="$(cd "$(git rev-parse --show-toplevel)" && git ls-files -z -co --exclude-standard \
  | tar -cf - --null --no-recursion -T - --ignore-failed-read 2>/dev/null | wc -c)"
size="${2:-$(( (64 * 1048576 - tree_bytes) / 1048576 - 2 ))M}"
echo "working tree: $(( tree_bytes / 1048576 )) MiB as tar; parts of $size"
if ! [[ "$size" =~ ^[1-9][0-9]*[KM]?$ ]]; then
  echo "error: part size: $size: expected a positive size such as 40M (the tree leaves no room beside it?)" >&2
  exit 2
fi
ls "$bundle"/part.* > /dev/null || exit 2
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
cat "$bundle"/part.* > "$tmp/bundle.tar"
mkdir "$tmp/parts"
split -b "$size" -d -a 2 "$tmp/bundle.tar" "$tmp/parts/part."
(cd "$tmp/parts" && sha256sum part.* > MANIFEST.sha256)
# The old parts go only once the new ones are whole.
rm "$bundle"/part.*
mv "$tmp/parts"/part.* "$bundle/"
mv "$tmp/parts/MANIFEST.sha256" "$bundle/MANIFEST.sha256"
echo "$(ls "$bundle"/part.* | wc -l) parts of at most $size in $bundle"
