"""Benchmarks: rpcompile side by side with its peers (resident eager, FSDP2 offload, RoundPipe).

    python -m benchmarks.harness --model qwen3-1.7b --gpus 1 --systems rpcompile,eager,roundpipe,fsdp2

See benchmarks/README.md.
"""
