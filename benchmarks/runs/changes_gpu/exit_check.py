"""A main process with CUDA worker processes ends while a delayed-mode step runs (the optimizer
slowed): `os._exit(0)` or a plain exit. Prints the seconds the exit took and whether the launcher,
the workers and the run's shared directory are gone 30 s later (tests/test_launcher.py's check,
on CUDA devices)."""
import os
import subprocess
import sys
import time

SCRIPT = """
import os, sys
import torch, rpcompile
from models import lm_batch, qwen3
from rpcompile.runtime import launcher
model = qwen3(layers=2)
cm = rpcompile.compile(model, rpcompile.Config(devices=['cuda:0', 'cuda:0'], num_microbatches=2, dtype=torch.float32,
                                               optimizer_mode='delayed', workers='processes'))
class Slow(torch.optim.SGD):
    def step(self, closure=None):
        import time; time.sleep(1)
        return super().step(closure)
cm.attach_optimizer(Slow(model.parameters(), lr=0.1), chunks=2)
for t in range(3):
    cm.train_step(**lm_batch(seed=t))
(l,) = launcher._launchers.values()
print(l.proc.pid, *[p.pid for p in cm.runner.executor.hub.procs], flush=True)
print(cm.runner.executor.memory.directory, flush=True)
"""


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


for end in ("os._exit(0)", "sys.exit(0)"):
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT + end + "\n"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    pids = [int(x) for x in proc.stdout.readline().split()]
    directory = proc.stdout.readline().strip()
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        took = None
        proc.kill()
        err = ""
    deadline = time.monotonic() + 30
    while (any(map(alive, pids)) or os.path.exists(directory)) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(end, {"pids": pids, "exit_s": took, "rc": proc.returncode, "processes_left": [p for p in pids if alive(p)],
                "directory_left": os.path.exists(directory), "stderr_tail": err[-300:]}, flush=True)
