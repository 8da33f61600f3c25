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
    # each side compiles from empty caches of its own: with one shared cache the second side's
    # setup seconds were the first's compiles read back (77.9 against 46.1 s, 2 H200s, 29 Nov);
    # and starts from a host as alike as may be: page cache dropped, memory compacted (Note [a
    # run's start] in harness.py: a second side ran 16% slower than the same tree alone), the
    # call's output says whether the kernel let it; then the libraries imported once (the side that
    # ran first on a fresh machine was slower in every part of its setup, 41st session, 2 H200s:
    # model built 15.0 against 10.7 s, captured 13.3 against 9.0 s, setup 68.4 against 51.4 s,
    # likely the libraries read from disk at their first import)
    side_caches() {
      export TORCHINDUCTOR_CACHE_DIR=/tmp/ab-inductor-$1 TRITON_CACHE_DIR=/tmp/ab-triton-$1
      rm -rf "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
      sync
      { echo 3 > /proc/sys/vm/drop_caches && echo 1 > /proc/sys/vm/compact_memory && echo "$1: caches dropped, memory compacted"; } 2>/dev/null \
        || echo "$1: page cache not dropped (no permission)"
      python -c "import torch, transformers, triton, torch._dynamo, torch._inductor.compile_fx" > /dev/null 2>&1 || true
    }
    side_caches "$(basename "$dir")"
    (cd "$dir" && PYTHONPATH=$PWD python -m benchmarks.harness --out '' --json "$out/$(basename "$dir").json" \
        --log-dir /tmp/ab-logs "$@" > "$out/$(basename "$dir").log" 2>&1) || true
    grep '\[harness\]' "$out/$(basename "$dir").log" | sed "s/^/$(basename "$dir"): /" || true
    side_caches tree
    python -m benchmarks.harness --out '' --json "$out/tree.json" --log-dir /tmp/ab-logs "$@" > "$out/tree.log" 2>&1 || true
    grep '\[harness\]' "$out/tree.log" | sed 's/^/tree: /' || true
    ;;
  *)
    echo "ab.sh: prepare or run, not $what" >&2; exit 2 ;;
esac
