#!/usr/bin/env bash
# 45th session, calls 3 and 4 (2 H200s, carry [".carry", ".ab"], after `ab.sh prepare 6f8bec3`): harness sides
# from the working tree ("tree") or .ab/<name>, in the order given, each from empty compile caches and a host
# with its page cache dropped (as ab.sh does).
#   call 3: OUT=$OUT bash benchmarks/runs/harness_walk/s45c.sh               (Llama-3.1-8B; tree, then 6f8bec3:
#           next_setup_ab.sh's A/B in the other order; it ran 6f8bec3 first, 20,997 against 19,959 tokens/s;
#           call 3 ran this script's first form, which wrote $OUT/tree.json and $OUT/6f8bec3.json)
#   call 4: OUT=$OUT bash benchmarks/runs/harness_walk/s45c.sh qwen3-1.7b tree 6f8bec3 tree   (the setup on the
#           bar's setup model: the warm-up's dry runs of every replica program beside the main process's copies)
# 46th session: GPUS=1 OUT=$OUT bash benchmarks/runs/harness_walk/s45c.sh llama3.1-8b 0880001 tree (call 2), then
#   OUT=$OUT bash benchmarks/runs/harness_walk/s45c.sh llama3.1-8b tree 0880001 (call 3), the tree with WIDEN 2^24.
# 47th session (benchmarks/runs/compile_phases/): call 1 ran this loop's NAME=JSON form from a copy of it,
#   OUT=$OUT bash benchmarks/runs/harness_walk/s45c.sh qwen3-1.7b tree 'tree={"triton.autotune_pointwise": false}' tree
#   (at 372d768); calls 2, 3, 5 and 6 `s45c.sh MODEL 372d768 tree` and the like, GPUS=1 for calls 5-6.
# 48th session (../autotune_clones/): GPUS=1 ... s45c.sh qwen3-1.7b 'tree={"triton.autotune_pointwise": true}' tree
#   (twice, at 4dfccea), s45c.sh qwen3-1.7b 6ca0b48 tree 6ca0b48 tree, GPUS=1 ... 6ca0b48 tree, s45c.sh llama3.1-8b tree.
# 49th session (../first_compile/): s45c.sh qwen3-1.7b 05cf505 tree 05cf505 tree, and with GPUS=1; call 4
#   s45c.sh qwen3-1.7b tree 05cf505 tree, then GPUS=1 ... tree (the tree: branch glue-pieces-eager's first form).
# 50th session (../microbatches/README.md): a side NAME:M runs with --microbatches M (4 otherwise) and TOKENS sets the
#   tokens a step (65,536 otherwise), e.g. GPUS=4 ... s45c.sh llama3.1-8b tree:4 tree:16 tree:4 tree:16.
# Calls 3 and 4 ran the side's reset inline (the same steps; caches /tmp/c-*-N); it now sources benchmarks/side_reset.sh.
set -euo pipefail
model=${1:-llama3.1-8b}; shift || true
sides=("$@"); [ ${#sides[@]} -gt 0 ] || sides=(tree 6f8bec3)
gpus=${GPUS:-2}     # (46th session: GPUS=1 for the 1-GPU rows, the workers threads there)
limit=225; [ "$model" = llama3.1-8b ] || limit=125; [ "$gpus" = 2 ] || limit=$((limit + 60))
bash benchmarks/setup_device.sh > /dev/null 2>&1 || true
source benchmarks/side_reset.sh
args=(--model "$model" --gpus $gpus --seq-len 2048 --tokens-per-step "${TOKENS:-65536}" --steps 8
      --systems rpcompile-delayed --record "$OUT/runs" --timeout $limit --budget $((limit + 5)) --out '' --log-dir /tmp/hw-logs)
n=0
for side in "${sides[@]}"; do
  # (47th session) a side NAME=JSON: the tree or .ab/NAME with those Inductor options (--option rpcompile_inductor);
  # (50th) NAME:M: with M microbatches
  n=$((n + 1)); spec=${side%%=*}; tree=${spec%%:*}; m=4; name=$tree; opts=()
  [ "$spec" = "$side" ] || { opts=(--option "rpcompile_inductor=${side#*=}"); name=$name-options; }
  [ "$spec" = "$tree" ] || { m=${spec#*:}; name=$name-m$m; }
  dir=$PWD; [ "$tree" = tree ] || dir=$PWD/.ab/$tree
  side_reset "$n-$name"
  (cd "$dir" && PYTHONPATH=$PWD python -m benchmarks.harness "${args[@]}" --microbatches "$m" "${opts[@]}" \
     --json "$OUT/$n-$name.json" 2>&1 | grep '\[harness\]' | sed "s/^/$n $name: /")
done
