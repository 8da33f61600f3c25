# One H100: Qwen3-1.7B through torch.compile(backend=rpcompile.backend(cfg), dynamic=True), seq 2048,
# 32,768 tokens a step, M=4, bf16, AdamW(fused), 2 warm-up and 8 timed steps: the ahead off, then on.
export PYTHONPATH=$PWD:$PWD/tests
python benchmarks/runs/backend_ahead/ab.py --model qwen3-1.7b --device cuda:0 --seq-len 2048 --tokens 32768 \
    --microbatches 4 --warmup 2 --steps 8 2> $OUT/ab.err | tee $OUT/ab.jsonl
tail -5 $OUT/ab.err
