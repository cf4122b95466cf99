#!/usr/bin/env bash
# Re-cut the staging bundles into pieces that fit one device call beside the tree.
#
#   bash tools/gpu/split_bundles.sh [MAX_MIB]
#
# A device call carries the tree (tracked files and untracked ones git does not
# ignore) plus its carry paths, 64 MiB in all; the bundles' own chunks are 58 MiB.
# The default MAX_MIB is what the tree leaves, less 3 MiB (the in-tree kit rides
# with the last call), at most 48. From .device/cutedsl/*/part.* (+ the wheels in
# .device/cute-core and .device/cute-extra) and .device/offline-vllm/*/part.* this
# writes .device/r3/c1, c2, ... and .device/r3/v1, v2, ..., each at most MAX_MIB,
# whose part.NN files concatenate (in `cat part.*` order) to the original payloads;
# install_cutedsl.sh goes with c1, install.sh with v1, the extra wheels with the
# last c folder. docs/gpu_runbook.md ("Staging in smaller chunks") says what each
# call does with them.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
if (($# == 0)); then
  tree_bytes=0
  if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    tree_bytes=$(git -C "$root" ls-files -z --cached --others --exclude-standard |
      (cd "$root" && xargs -0 -r stat -c %s 2>/dev/null || true) |
      awk '{ s += $1 } END { printf "%d", s }')
  fi
  room=$((64 - (tree_bytes + 1048575) / 1048576 - 3))
  max_mib=$((room < 48 ? room : 48))
  if ((max_mib < 8)); then
    echo "split_bundles.sh: the tree takes $((tree_bytes / 1048576)) MiB of a call's 64," \
      "leaving under 8 MiB a chunk: commit run records smaller" >&2
    exit 2
  fi
  echo "chunks of at most $max_mib MiB (the tree: $((tree_bytes / 1048576)) MiB" \
    "of files git does not ignore)"
else
  max_mib=$1
  if ! [[ $max_mib =~ ^[0-9]+$ ]] || ((max_mib < 8 || max_mib > 60)); then
    echo "split_bundles.sh: MAX_MIB must be a whole number from 8 to 60, got '$max_mib'" >&2
    exit 2
  fi
fi
dev=$root/.device
# Written beside .device/r3 and moved over it at the end: a run that stops
# half-way leaves the last whole cut.
out=$dev/r3.partial
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$out"' EXIT

cut_payload() { # name prefix script extra_dir...
  local name=$1 prefix=$2 script=$3
  shift 3
  local parts=("$dev/$name"/*/part.*)
  # Sort by the part's own name (part.0, part.1, ...), as install.sh's cat does.
  mapfile -t parts < <(for p in "${parts[@]}"; do echo "$(basename "$p") $p"; done | sort | cut -d' ' -f2-)
  cat "${parts[@]}" >"$tmp/$name"
  # Room for the extra wheels and the script in the folders that take them.
  local extra_bytes=65536 extra wheel
  for extra in "$@"; do
    for wheel in "$extra"/*.whl; do
      [[ -e $wheel ]] && extra_bytes=$((extra_bytes + $(stat -c %s "$wheel")))
    done
  done
  split -b "$((max_mib * 1024 * 1024 - extra_bytes))" -d -a 2 "$tmp/$name" "$tmp/$name.part."
  local i=0 piece
  for piece in "$tmp/$name".part.*; do
    i=$((i + 1))
    mkdir -p "$out/$prefix$i"
    mv "$piece" "$out/$prefix$i/part.${piece##*.part.}"
  done
  cp "$(ls "$dev/$name"/*/"$script" | head -1)" "$out/${prefix}1/"
  for extra in "$@"; do
    if compgen -G "$extra/*.whl" >/dev/null; then cp "$extra"/*.whl "$out/$prefix$i/"; fi
  done
  echo "$name: $i folders ($prefix""1 .. $prefix$i)"
}

# Every bundle first, so that a missing one leaves nothing half-written.
for name in cutedsl offline-vllm; do
  if ! compgen -G "$dev/$name/*/part.*" >/dev/null; then
    echo "split_bundles.sh: no $dev/$name/*/part.*: run its bundle script first" >&2
    exit 1
  fi
done
rm -rf "$out"
mkdir -p "$out"
cut_payload cutedsl c install_cutedsl.sh "$dev/cute-core" "$dev/cute-extra"
cut_payload offline-vllm v install.sh
du -sb "$out"/* | awk -v max="$max_mib" '{ if ($1 > max * 1048576) { print "over the limit:", $2; bad = 1 } } END { exit bad }'
rm -rf "$dev/r3"
mv "$out" "$dev/r3"
