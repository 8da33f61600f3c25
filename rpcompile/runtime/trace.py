"""The executed schedule: every transfer and compute span per device and stream.

On CPU devices a span is wall-clock time in the worker thread. On GPUs a span is a pair of
CUDA events recorded on the stream that did the work, turned into times after the step
against a start event of that device.

Note [issue lag]: a span of a job's work also says when its host thread began to enqueue it
("issued_s", on the host clock the GPU times are read against: the device's start event is
recorded on an idle stream as the tracer starts) and for how long ("issue_s"). Its start less
issued_s is how long the work queued behind the device's earlier work; its end less the issue's
end is how far the device ran behind the host when the host had enqueued it all. Both near zero:
the device waited for the host (launches set the pace), not the other way round.
"""
from __future__ import annotations

import json
import threading
import time

import torch


class Tracer:
    """Spans of one step. `labels`: the names spans give the devices (default str(device));
    a worker process names its cuda:0 as the user's device. `clock_stream`: the idle stream
    each device's start event is recorded on, or a function of the device that gives it."""

    def __init__(self, devices, labels=None, clock_stream=None):
        self._lock = threading.Lock()
        self._raw = []                       # (device label, stream, name, attrs, start, end)
        self._resolved = []                  # spans already turned into dicts (a worker process's)
        self.t0 = time.perf_counter()         # the host clock's origin of the spans' seconds
        self._cuda_t0 = {}
        for d, label in zip(devices, labels or [str(d) for d in devices]):
            if d.type == "cuda" and label not in self._cuda_t0:
                ev = torch.cuda.Event(enable_timing=True)
                stream = clock_stream(d) if callable(clock_stream) else clock_stream
                ev.record(stream or torch.cuda.current_stream(d))
                self._cuda_t0[label] = ev

    def now(self):
        return time.perf_counter()

    def cuda_mark(self, stream):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def add(self, device, stream: str, name: str, start, end, **attrs):
        with self._lock:
            self._raw.append((device, stream, name, attrs, start, end))

    def extend(self, spans: list) -> None:
        """Add spans that are already dicts (from a worker process)."""
        with self._lock:
            self._resolved.extend(spans)

    def detach(self) -> list:
        """The spans recorded so far, as recorded (resolve them with `resolve`), forgotten here."""
        with self._lock:
            raw, self._raw = self._raw, []
        return raw

    def resolve(self, raw: list, shift: float = 0.0) -> list:
        """Detached spans as dicts, times moved by `shift` seconds (waits for their GPU events)."""
        out = self._resolve(raw)
        for s in out:
            for k in ("start_s", "end_s", "issued_s"):
                if k in s:
                    s[k] += shift
        return out

    def spans(self) -> list:
        """The spans as dicts with start_s/end_s from the step's start (waits for GPU events)."""
        out = self._resolve(self._raw) + list(self._resolved)
        out.sort(key=lambda r: (r["start_s"], r["end_s"]))
        return out

    def _resolve(self, raw) -> list:
        out = []
        for device, stream, name, attrs, start, end in raw:
            if isinstance(start, torch.cuda.Event):
                # every event read, the device's start too: its idle stream may share a hardware
                # queue with a busy one, so it need not be done when the span's end is
                t0 = self._cuda_t0[device]
                for ev in (t0, start, end):
                    ev.synchronize()
                s, e = t0.elapsed_time(start) / 1e3, t0.elapsed_time(end) / 1e3
            else:
                s, e = start - self.t0, end - self.t0
            attrs = dict(attrs)
            if attrs.get("issued") is not None:   # Note [issue lag]
                attrs["issued_s"] = attrs.pop("issued") - self.t0
            out.append({"device": str(device), "stream": stream, "name": name, "start_s": s, "end_s": e, **attrs})
        return out


def chrome_trace(spans: list) -> dict:
    """Spans as a Chrome/Perfetto trace: one process per device, one thread per stream."""
    devices = sorted({(s.get("worker", 0), s["device"]) for s in spans})
    streams = sorted({s["stream"] for s in spans})
    events = []
    for s in spans:
        args = {k: v for k, v in s.items() if k not in ("device", "stream", "name", "start_s", "end_s")}
        events.append({"name": s["name"], "ph": "X", "ts": s["start_s"] * 1e6,
                       "dur": max(0.0, s["end_s"] - s["start_s"]) * 1e6,
                       "pid": devices.index((s.get("worker", 0), s["device"])), "tid": streams.index(s["stream"]),
                       "args": args})
    for i, (w, d) in enumerate(devices):
        events.append({"name": "process_name", "ph": "M", "pid": i, "args": {"name": f"worker {w}: {d}"}})
        for j, st in enumerate(streams):
            events.append({"name": "thread_name", "ph": "M", "pid": i, "tid": j, "args": {"name": st}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: list, path: str) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(spans), f)
