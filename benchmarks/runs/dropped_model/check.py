"""A compiled model dropped lets its memory go, on CUDA (94th session): Note [a backend that lets
the model go] (capture.py), Note [an optimizer thread that lets its optimizer go]
(runtime/optimizer.py), Note [runs nobody waits for] (runtime/processes.py).

tests/test_overlapped.py's dropped_model_run on ["cuda:0", "cuda:0"] for each optimizer mode and
Config.workers: an MLP, an AdamW attached (overlapped, delayed) or stepped by hand (exact), 2 train
steps, then `del cm, model, opt` with no cm.synchronize() and a collection; prints how many of the
compiled model, optimizer and parameters are alive, the rpcompile threads left, the worker
processes' exit codes and the CUDA memory the main process still has allocated. Then (95th
session, Note [compute streams outlive their model] in runtime/allocator.py) the exact mode's run
four more times: the allocated memory after each, which grew by the cuBLAS workspaces of every
dropped model's compute streams; and two DeviceRuntimes alive at once take distinct compute
streams, one made after they close takes one of theirs. From the repository root:

    PYTHONPATH=$PWD:$PWD/tests python benchmarks/runs/dropped_model/check.py
"""
import json
import threading

import torch

from rpcompile.runtime.device import DeviceRuntime
from test_overlapped import dropped_model_run

if __name__ == "__main__":
    for mode, workers in (("exact", "threads"), ("overlapped", "threads"), ("delayed", "threads"),
                          ("delayed", "processes")):
        base = torch.cuda.memory_allocated()
        try:
            alive, _, exit_codes = dropped_model_run(mode, workers, devices=("cuda:0", "cuda:0"))
            torch.cuda.synchronize()
            res = {"alive": alive, "threads_left": sorted(t.name for t in threading.enumerate()
                                                          if t.name.startswith("rpcompile-optimizer")),
                   "worker_exit_codes": exit_codes, "cuda_allocated_above_start": torch.cuda.memory_allocated() - base}
        except Exception as e:   # noqa: BLE001 - a check: say it and go on
            res = {"error": f"{type(e).__name__}: {e}"[:800]}
        print(f"{mode}_{workers}", json.dumps(res), flush=True)

    after = []
    for _ in range(4):
        dropped_model_run("exact", "threads", devices=("cuda:0", "cuda:0"))
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    a, b = DeviceRuntime(torch.device("cuda:0")), DeviceRuntime(torch.device("cuda:0"))
    distinct = a.compute is not b.compute
    pair = {a.compute, b.compute}
    a.close(), b.close()
    c = DeviceRuntime(torch.device("cuda:0"))
    print("repeated_exact", json.dumps({"allocated_after_each": after, "alive_at_once_distinct": distinct,
                                        "next_takes_a_given_back_stream": c.compute in pair}), flush=True)
    c.close()
