#!/usr/bin/env bash
# A/B of two trees on one device machine, in one call (a ratio from one run on one host).
#
# Here, before the call: put another revision's rpcompile and benchmarks under .ab/<name>
# (git-ignored; carry it with the run):
#
#   bash benchmarks/ab.sh prepare main            # or a branch, a commit
#
# On the device (carry [".carry", ".ab"]), from the repository root: the harness runs from the
# other tree first, then from the working tree, with the same arguments; each writes its runs
# to $OUT/ab/<name>.json and $OUT/ab/tree.json and its log next to them:
#
#   bash benchmarks/ab.sh run main --model llama3.1-8b --gpus 4 --systems rpcompile-delayed \
#       --steps 8 --timeout 280 --budget 285
#
# Give each side a --timeout (and --budget) that fits both in one call's 600 s.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:?usage: ab.sh prepare REV | ab.sh run NAME HARNESS-ARGS...}
name=${2:?a revision or name}
shift 2
dir=.ab/$(echo "$name" | tr '/' '_')
case "$what" in
  prepare)
    rm -rf "$dir" && mkdir -p "$dir"
    git archive "$name" rpcompile benchmarks | tar -x -C "$dir"
    echo "ab.sh: $dir holds $(git rev-parse --short "$name") ($name)"
    ;;
  run)
    out=${OUT:-/tmp}/ab
    mkdir -p "$out"
    [ -d "$dir" ] || { echo "ab.sh: $dir is missing: run 'ab.sh prepare $name' here and carry .ab" >&2; exit 1; }
    export PYTHONPATH=$PWD
    bash benchmarks/setup_device.sh > "$out/setup.log" 2>&1 || true
    source benchmarks/side_reset.sh      # each side from its own empty caches, on a host reset alike
    side_reset "$(basename "$dir")"
    (cd "$dir" && PYTHONPATH=$PWD python -m benchmarks.harness --out '' --json "$out/$(basename "$dir").json" \
        --log-dir /tmp/ab-logs "$@" > "$out/$(basename "$dir").log" 2>&1) || true
    grep '\[harness\]' "$out/$(basename "$dir").log" | sed "s/^/$(basename "$dir"): /" || true
    side_reset tree
    python -m benchmarks.harness --out '' --json "$out/tree.json" --log-dir /tmp/ab-logs "$@" > "$out/tree.log" 2>&1 || true
    grep '\[harness\]' "$out/tree.log" | sed 's/^/tree: /' || true
    ;;
  *)
    echo "ab.sh: prepare or run, not $what" >&2; exit 2 ;;
esac
