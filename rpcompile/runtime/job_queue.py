"""A device's queue of stage jobs, and the prefetch of the next one's weights across runs."""
from __future__ import annotations

import queue
import threading


class JobQueue:
    """A device's jobs, run in the order they were handed in. The job running, when it is its
    run's last on the device, asks for the weights of the job after it (Note [prefetch across
    steps]): they go up at once if that job is queued, else as soon as it is."""

    def __init__(self, prefetch_of):
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._wanting = False          # the running job asked for a job that was not queued yet
        self._prefetch_of = prefetch_of   # item -> a callable starting its weights' upload, or None

    def put(self, item) -> None:
        with self._lock:
            fire = self._wanting and item is not None and not self._q.queue
            self._wanting = self._wanting and not fire
            self._q.put(item)
        if fire:
            self._start(item)

    def get(self):
        return self._q.get()

    def job_ended(self) -> None:
        """The running job ended: the next one uploads its own weights if nothing did."""
        with self._lock:
            self._wanting = False

    def prefetch_next(self) -> None:
        with self._lock:
            head = self._q.queue[0] if self._q.queue else None
            self._wanting = head is None
        if head is not None:
            self._start(head)

    def _start(self, item) -> None:
        fn = self._prefetch_of(item)
        if fn is not None:
            fn()
