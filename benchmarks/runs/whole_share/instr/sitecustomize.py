# 43rd session probe: with RP_CHUNKS=path, the optimizer thread's chunk waits and steps (absolute perf_counter)
# and the recent traces' origin are written to path, to line them up with trace/*.recent.json.
import os
if os.environ.get("RP_CHUNKS"):
    import json, time
    _ev, _meta = [], {}
    def _dump():
        if not _ev:
            return
        try:
            with open(os.environ["RP_CHUNKS"] + f".{os.getpid()}", "w") as f:
                json.dump({"events": _ev, **_meta}, f)
        except Exception:
            pass
    try:
        import rpcompile.runtime.submission as sub, rpcompile.runtime.flat as flat, rpcompile.runner as runner
        _chunk, _step, _recent = sub.ChunkGrads.chunk, flat.FlatStepper.step, runner.GraphRunner.recent_traces
        def chunk(self, k):
            a = time.perf_counter(); out = _chunk(self, k); _ev.append(("grads", k, a, time.perf_counter())); return out
        def step(self, params, grads):
            a = time.perf_counter(); _step(self, params, grads)
            _ev.append(("step", sum(p.numel() for p in params), a, time.perf_counter()))
        def recent(self):
            out = _recent(self)
            if self.recent_tracers:
                _meta["t0"] = self.recent_tracers[0].t0
            _dump()
            return out
        sub.ChunkGrads.chunk, flat.FlatStepper.step, runner.GraphRunner.recent_traces = chunk, step, recent
        import atexit; atexit.register(_dump)
    except Exception as e:
        print("instr failed", e)
