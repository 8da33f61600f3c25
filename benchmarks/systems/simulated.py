"""A pretend system for the harness's own tests: no model, failures on demand.

Options (harness --option KEY=VALUE):
  sleep=S        seconds each step takes
  fail=build|step   raise a RuntimeError while building / in the first step
  oom_above=N    a sequence longer than N tokens runs out of memory: raises torch.OutOfMemoryError,
                 or with exit_on_oom=1 ends the process the way RoundPipe's worker threads do
  restart_after_oom=1   ask for a new process after an OOM in a max-length probe
  new_length_s=S  more seconds for a step at a sequence length not seen before (a compile)
"""
from __future__ import annotations

import os
import sys
import time

import torch

from ..common import Trainer


class SimulatedTrainer(Trainer):
    n_params = None

    def __init__(self, spec, rank=0, world=1):
        self.o = spec.options
        self.restart_after_oom = str(self.o.get("restart_after_oom", "0")) == "1"
        self.steps, self.lengths = 0, set()
        if self.o.get("fail") == "build":
            raise RuntimeError("simulated failure while building")

    def step(self, ids):
        new = ids.shape[1] not in self.lengths
        self.lengths.add(ids.shape[1])
        time.sleep(float(self.o.get("sleep", 0)) + (float(self.o.get("new_length_s", 0)) if new else 0))
        if self.o.get("fail") == "step":
            raise RuntimeError("simulated failure in a step")
        limit = int(self.o.get("oom_above", 0))
        if limit and ids.shape[1] > limit:
            if str(self.o.get("exit_on_oom", "0")) == "1":
                print(f"simulated: CUDA out of memory at {ids.shape[1]} tokens", file=sys.stderr, flush=True)
                os._exit(1)
            raise torch.OutOfMemoryError(f"simulated: CUDA out of memory at {ids.shape[1]} tokens")
        self.steps += 1
        return 10.0 / (1 + self.steps)

    def info(self):
        return {"notes": ["simulated"]}


def make_trainer(spec, rank=0, world=1):
    return SimulatedTrainer(spec, rank, world)
