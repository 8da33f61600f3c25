# 43rd session probe 2: with RP_PROBE=dir, each process appends JSON lines to dir/<pid>.jsonl on the host clock
# (perf_counter: CLOCK_MONOTONIC, one clock for all processes): the optimizer thread's chunk waits and steps, the
# main process's receipt of "landed", and each worker's sending of "ended" and "landed"; and the recent traces'
# origin, to line them up with trace/*.recent.json.
import os
if os.environ.get("RP_PROBE"):
    import json, time, threading
    _lock = threading.Lock()
    _path = os.path.join(os.environ["RP_PROBE"], f"{os.getpid()}.jsonl")
    def _log(*row):
        line = json.dumps([time.perf_counter(), *row]) + "\n"
        with _lock, open(_path, "a") as f:
            f.write(line)
    try:
        import rpcompile.runtime.submission as sub, rpcompile.runtime.flat as flat, rpcompile.runner as runner
        import rpcompile.runtime.processes as procs, rpcompile.runtime.worker as worker
        _chunk, _step, _recent = sub.ChunkGrads.chunk, flat.FlatStepper.step, runner.GraphRunner.recent_traces
        _landed, _to_main = procs._Hub.landed, worker.Worker.to_main
        def chunk(self, k):
            a = time.perf_counter(); out = _chunk(self, k); _log("grads", k, a); return out
        def step(self, params, grads):
            a = time.perf_counter(); _step(self, params, grads); _log("step", sum(p.numel() for p in params), a)
        def recent(self):
            out = _recent(self)
            if self.recent_tracers:
                _log("t0", self.recent_tracers[0].t0)
            return out
        def landed(self, step_id, run_no, job, info):
            _log("hub_landed", step_id, run_no, job, info.get("replica"))
            return _landed(self, step_id, run_no, job, info)
        def to_main(self, msg):
            if msg[0] in ("ended", "landed"):
                _log("worker_" + msg[0], self.index, msg[1], msg[2], msg[3])
            return _to_main(self, msg)
        sub.ChunkGrads.chunk, flat.FlatStepper.step, runner.GraphRunner.recent_traces = chunk, step, recent
        procs._Hub.landed, worker.Worker.to_main = landed, to_main
    except Exception as e:
        print("probe failed", e)
