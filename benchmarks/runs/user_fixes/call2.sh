#!/usr/bin/env bash
# 74th session, call 2 (one H200, no carry): every gpu_check users case (moe, moe_aux, padded, the new
# num_items, tiny_qwen3 with the backend, lora, moe_lora; 1 and 2 devices; train_step and call) after the
# session's fixes (num_items_in_batch, parameters replaced, autocast, one call at a time, the model's own
# checkpointing and exceptions, dead code in bodies, bodies costed), on the GPU machine's torch 2.11.
# It ran past the call's 580 s after tiny_qwen3_2dev_step (each case compiles with Inductor twice: the
# tight budget's probe, then the run), so nothing printed; call 3 read /tmp/users.log on the warm machine
# and ran `gpu_check users --cases lora,moe_lora` (232 s). Split the cases over two calls next time.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/tests
python -m benchmarks.gpu_check users --out "$OUT/users.json" > /tmp/users.log 2>&1
echo "users rc=$? could-not-measure=$(grep -c 'could not measure' /tmp/users.log)"
grep -E '^[a-z_0-9]+_[12]dev_' /tmp/users.log | cut -c1-230
grep -h "could not measure" /tmp/users.log | head -3 | cut -c1-300
