"""82nd session: do a worker's CUDA streams share hardware queues (false dependencies)? A worker
makes compute, weights_in, acts_in, out, sums (DeviceRuntime) and its trace clock; with
CUDA_DEVICE_MAX_CONNECTIONS (8 by default) fewer queues than streams, work on one stream can
wait behind another's. For each stream: a ~200 ms sleep kernel on it, then an event recorded on
every other stream; after 50 ms, the events not yet done name the streams queued behind it."""
import os
import time

import torch

from rpcompile.runtime.device import DeviceRuntime

dev = torch.device("cuda:0")
torch.cuda.set_device(dev)
rt = DeviceRuntime(dev)
streams = {"compute": rt.compute, "weights_in": rt.weights_in, "acts_in": rt.acts_in, "out": rt.out,
           "sums": rt.sums, "clock": torch.cuda.Stream(dev), "default": torch.cuda.default_stream(dev)}
torch.cuda._sleep(1000)
torch.cuda.synchronize()
blocked = {}
for name, s in streams.items():
    with torch.cuda.stream(s):
        torch.cuda._sleep(400_000_000)
    events = {}
    for other, o in streams.items():
        if other != name:
            ev = torch.cuda.Event()
            ev.record(o)
            events[other] = ev
    time.sleep(0.05)
    blocked[name] = sorted(o for o, ev in events.items() if not ev.query())
    torch.cuda.synchronize()
said = "; ".join(f"{k} -> {v}" for k, v in blocked.items() if v) or "none blocked"
print(f"queues: CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}; {said}", flush=True)
