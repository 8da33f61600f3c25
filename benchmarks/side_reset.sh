# Sourced (bash): `side_reset NAME` readies the host for one harness side named NAME, as alike as
# may be from side to side (ab.sh, benchmarks/runs/harness_walk/s45c.sh):
# - its own empty compile caches (/tmp/side-inductor-NAME, /tmp/side-triton-NAME): with one shared
#   cache the second side's setup seconds were the first's compiles read back (77.9 against 46.1 s,
#   2 H200s, 29 Nov);
# - the page cache dropped and memory compacted where the kernel lets it (Note [a run's start] in
#   harness.py: a second side ran 16% slower than the same tree alone), saying whether it did;
# - then the libraries imported once (the side that ran first on a fresh machine was slower in every
#   part of its setup, 41st session, 2 H200s: model built 15.0 against 10.7 s, captured 13.3 against
#   9.0 s, setup 68.4 against 51.4 s, likely the libraries read from disk at their first import).
side_reset() {
  export TORCHINDUCTOR_CACHE_DIR=/tmp/side-inductor-$1 TRITON_CACHE_DIR=/tmp/side-triton-$1
  rm -rf "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
  sync
  { echo 3 > /proc/sys/vm/drop_caches && echo 1 > /proc/sys/vm/compact_memory && echo "$1: caches dropped, memory compacted"; } 2>/dev/null \
    || echo "$1: page cache not dropped (no permission)"
  python -c "import torch, transformers, triton, torch._dynamo, torch._inductor.compile_fx" > /dev/null 2>&1 || true
}
