"""Host working copies of the parameters in the devices' compute dtype (pinned, for uploads)."""
from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .flat import merge_adjacent, move_into
from .host_buffers import host_empty, pinned_in_place

_marks = itertools.count()


def working_dtype(t: torch.Tensor, dtype):
    """The dtype t's working copy has: `dtype` for floating tensors (None: t's own)."""
    return dtype if (dtype is not None and t.is_floating_point()) else t.dtype


# Note [frozen weights in place]: a frozen parameter (a LoRA base, frozen layers) that is already
# in its working dtype (a bf16 model on GPUs) is its own working copy: no optimizer step writes
# it, so a copy beside it held the same values again. On GPUs its memory is page-locked where it
# lies (host_buffers.pinned_in_place: cudaHostRegister, no copy) for asynchronous uploads, where
# that fails (pages another registration covers) it is copied as before. A bf16 base's host bytes
# were 4 a parameter (the model's 2 and a copy's 2), a 32B model's 131 GB: 2 now. Worker
# processes read shared memory (Note [shared host memory]): there the parameter's data moves into
# it (into_shared: `p.data` becomes a view of a shared file, the old memory goes), a few
# parameters at a time, so that the move holds at most SHARED_CHUNK bytes twice. A user's
# in-place write (after cm.synchronize(), as for every parameter) is what the next step reads;
# in delayed mode its early uploads of the old values land unused, as for a copy rewritten.
def own_copy(p: torch.Tensor, dtype) -> bool:
    """Whether parameter p serves as its own working copy in `dtype` (Note [frozen weights in
    place]), wherever the runner places host memory."""
    return (not p.requires_grad and p.device.type == "cpu" and p.is_contiguous()
            and working_dtype(p, dtype) == p.dtype)


SHARED_CHUNK = 1 << 30      # bytes of parameters moved into one shared file (Note [frozen weights in place])


def into_shared(params, memory) -> None:
    """Move the data of the given parameters that lie outside `memory` (a SharedMemory) into new
    files of it, at most SHARED_CHUNK bytes a file (a parameter larger: a file of its own), each
    parameter's old memory let go once it is copied (Note [frozen weights in place])."""
    by_dtype: dict = {}
    for p in {id(p): p for p in params}.values():
        if memory.ref(p.detach()) is None:
            by_dtype.setdefault(p.dtype, []).append(p)
    for members in by_dtype.values():
        chunk, nbytes = [], 0
        for p in members + [None]:
            if chunk and (p is None or nbytes + p.nbytes > SHARED_CHUNK):
                _move(chunk, memory)
                chunk, nbytes = [], 0
            if p is not None:
                chunk.append(p)
                nbytes += p.nbytes


def _move(params, memory) -> None:
    move_into(host_empty((sum(p.numel() for p in params),), params[0].dtype, memory, "frozen parameters"), params)


def _in_place(p: torch.Tensor, pin):
    """p as its own working copy: (the tensor, what keeps it page-locked or shared), or None where
    it cannot be locked (the caller copies it)."""
    if pin is False:
        return p.detach(), True
    if pin is True:
        held = pinned_in_place(p.detach(), "working copies")
        return None if held is None else (p.detach(), held)
    into_shared([p], pin)           # (worker processes: a no-op where it lies there already)
    return p.detach(), pin


def upload_mark(event, stream) -> tuple:
    """What a copy from a host working copy leaves behind: (issue order, stream, end event)."""
    return (next(_marks), stream, event)


def copy_params(dsts: list, params: list, copy_down=None) -> None:
    """dsts[i] <- params[i] (working copies), one copy per run of adjacent ones (Note [flat host
    optimizer]); those whose masters are current on a device copied down from there
    (`copy_down`: FlatStepper.copy_down, Note [working copies from the devices]) while the host
    copies the rest."""
    rest, wait = (range(len(params)), None) if copy_down is None else copy_down(dsts, params)
    if rest:
        with torch.no_grad():
            torch._foreach_copy_(*merge_adjacent([dsts[i] for i in rest], [params[i].detach() for i in rest]))
    if wait is not None:
        wait()


def mark_upload(entry, event, stream=None) -> None:
    """An upload from entry's copy ([_, copy, marks, lock]) was issued on `stream`; `event` marks
    its end. It replaces the stream's older mark (a stream runs its copies in issue order, and
    wait_for_uploads waits on the newest of each): a copy no optimizer step rewrites (a frozen
    parameter's in delayed mode) keeps one mark a stream, not one for every upload."""
    if event is not None:
        entry[2][:] = [m for m in entry[2] if m[1] is not stream] + [upload_mark(event, stream)]


def wait_for_uploads(marks) -> None:
    """Block until the uploads `marks` name have read their host copies. A stream runs its
    copies in issue order, so only the newest mark of each stream is waited on: a handful of
    calls for any number of parameters (Note [few calls per step] in runtime/optimizer.py)."""
    newest: dict = {}
    for order, stream, event in marks:
        if event is not None and (stream not in newest or order > newest[stream][0]):
            newest[stream] = (order, event)
    for _, event in newest.values():
        event.synchronize()


def _stepped(optimizer, args, kwargs) -> None:
    """Note [steps through .data]: the working copies are rewritten where a parameter's
    `_version` moved, and an optimizer that writes through `p.data` (old-style code) or raw
    pointers (a C++ CPU Adam) moves none: on GPUs, with worker processes, and in delayed mode
    (its two copies) the jobs kept reading the weights as they were before its first step,
    silently (losses 0.003 off eager's from the next step on, the parameters 0.11 off after 4
    steps of SGD with momentum; an attached optimizer too). So after any optimizer's step
    (torch's global post-hook: one pass over its parameters) those with a gradient, the ones it
    stepped, count as written. A write of the user's own through `p.data` is still not seen
    (after a call made the copies, before the next optimizer step): write under torch.no_grad()."""
    params = [p for group in optimizer.param_groups for p in group["params"]
              if isinstance(p, torch.Tensor) and p.grad is not None and not p.is_inference()]
    if params:
        torch.autograd.graph.increment_version(params)


_stepped_hook = []


class HostWeights:
    """Pinned low-precision copies of host parameters, refreshed only when a parameter changed.

    A parameter's `_version` counts its in-place updates (an optimizer step is one), so a copy
    is rewritten only after the parameter moved. A copy is never rewritten while an upload
    from it is in flight: the marks of its uploads (the newest per stream) are waited on first.

    One copy per parameter, allocated once and of exactly its size (Note [exact pinned
    buffers] in runtime/host_buffers.py): rows of a parameter (the vocabulary shards of an LM
    head, a tied embedding's among them) are views of it, so a parameter that is uploaded
    whole by one job and by rows by others has one copy, not two.
    """

    snapshot = False     # CPU devices read the live parameters

    def __init__(self, pin: bool = True):
        if not _stepped_hook:      # once per process (Note [steps through .data])
            _stepped_hook.append(register_optimizer_step_post_hook(_stepped))
        # id(param) -> [version, pinned tensor, upload marks (newest per stream), lock, what keeps the
        # parameter pinned where it is its own copy (Note [frozen weights in place]), else None]
        self._copies: dict = {}
        self._lock = threading.Lock()
        self._pin = pin

    def _entry(self, param):
        with self._lock:
            entry = self._copies.get(id(param))
            if entry is None:
                entry = self._copies[id(param)] = [None, None, [], threading.Lock(), None]
            return entry

    @staticmethod
    def _stale(entry, param, dtype) -> bool:
        return entry[0] != param._version or entry[1] is None or entry[1].dtype != dtype

    def _own(self, entry, param, dtype) -> bool:
        """Whether param is (now) its own copy in entry, made so where it can be (Note [frozen weights
        in place]); a parameter unfrozen or given new memory since gets a copy again."""
        own = own_copy(param, dtype)
        if entry[4] is not None and (not own or entry[1].data_ptr() != param.data_ptr()):
            wait_for_uploads(entry[2])
            entry[:2], entry[4] = [None, None], None
            entry[2].clear()
        if own and entry[4] is None and entry[1] is None:
            got = _in_place(param, self._pin)
            if got is not None:
                entry[1], entry[4] = got
        if entry[4] is None:
            return False
        entry[0] = param._version
        return True

    def place(self, params, dtype) -> None:
        """With worker processes: move those of `params` that are their own copies into the shared
        memory at once, at most SHARED_CHUNK bytes a file, as DelayedWeights does (Note [frozen
        weights in place]); each would move into a file of its own at its first upload (a 32B
        LoRA base's ~700 files, each mapped and page-locked by every worker, against ~65)."""
        if not isinstance(self._pin, bool):
            into_shared([p for p in params if own_copy(p, dtype)], self._pin)

    def shared_copy(self, param, dtype) -> torch.Tensor:
        """The whole working copy of `param` in `dtype`, refreshed: what worker processes read
        (its file shared with them: Note [shared host memory])."""
        with self.refreshed(param, dtype) as entry:
            return entry[1]

    @contextlib.contextmanager
    def refreshed(self, param: torch.Tensor, dtype: torch.dtype, rows=None):
        """[version, pinned copy, upload marks, lock] of param (the copy a view of its rows
        [start, stop) when rows are given), up to date and held against other refreshes of it
        while the caller issues its upload."""
        entry = self._entry(param)
        # One lock per copy: the devices' uploaders and the optimizer refresh different
        # parameters at the same time.
        with entry[3]:
            if not self._own(entry, param, dtype) and self._stale(entry, param, dtype):
                if entry[1] is None or entry[1].dtype != dtype:
                    entry[1] = host_empty(param.shape, dtype, self._pin, "working copies", exact=True)
                    entry[2].clear()
                wait_for_uploads(entry[2])
                entry[2].clear()
                with torch.no_grad():
                    entry[1].copy_(param.detach())
                entry[0] = param._version
            yield entry if rows is None else [entry[0], entry[1][rows[0]:rows[1]], entry[2], entry[3]]

    mark_upload = staticmethod(mark_upload)

    def refresh_many(self, params, dtype, copy_down=None) -> None:
        """Rewrite the copies of the given (whole) parameters that changed, with one wait and one
        copy call for all of them (the optimizer thread calls this after stepping a chunk;
        copy_down: copy_params)."""
        entries = [(p, self._entry(p)) for p in params]
        stale = [(p, e) for p, e in entries if e[1] is not None and e[4] is None and self._stale(e, p, dtype)]
        if not stale:     # (a copy never made yet is made by its first upload)
            return
        locks = [e[3] for _, e in stale]
        for lock in locks:
            lock.acquire()
        try:
            wait_for_uploads([m for _, e in stale for m in e[2]])
            copy_params([e[1] for _, e in stale], [p for p, _ in stale], copy_down)
            for p, e in stale:
                e[0] = p._version
                e[2].clear()
        finally:
            for lock in locks:
                lock.release()

    def nbytes(self) -> int:
        """Bytes of the copies (a parameter that is its own copy holds none)."""
        return sum(e[1].numel() * e[1].element_size() for e in self._copies.values() if e[1] is not None and e[4] is None)

    def release(self) -> list:
        """Let every copy go, once the uploads from it have read it (delayed mode's copies take
        over: Note [calls read the newest copies] in runtime/modes.py); a later refresh of a
        parameter makes its copy again. Returns the copies let go (worker processes map their
        shared files: GraphRunner.release_call_copies has them forgotten there)."""
        with self._lock:
            entries, self._copies = list(self._copies.values()), {}
        copies = []
        for entry in entries:
            with entry[3]:
                wait_for_uploads(entry[2])
                if entry[1] is not None and entry[4] is None:
                    copies.append(entry[1])
                entry[1], entry[4] = None, None
        return copies


class DelayedWeights:
    """Two host copies of every parameter for Config(optimizer_mode="delayed").

    Note [delayed optimizer]: step t computes its gradients at the parameters after the
    optimizer steps 0 .. t-2, while the optimizer applies step t-1's gradients beside it (one
    step of delay, as RoundPipe's asynchronous step). Step t reads copy t % 2; the optimizer,
    after stepping a parameter with step k's gradients, writes it into copy k % 2, which step
    k + 2 reads, never the copy step k + 1 is reading. So every step sees one consistent set of
    parameters whatever the timing, and results are deterministic. A copy is rewritten only
    after the uploads from it have completed (their marks).

    Each copy is views of one flat buffer per dtype (frozen parameters, which never change, in
    a third one that serves both parities): a few allocations rather than one per parameter,
    each of exactly its size (Note [exact pinned buffers] in runtime/host_buffers.py), and a
    handful of shared files and registrations in worker processes.

    Note [changes between delayed steps]: what a user changes between train steps (after
    `cm.synchronize()`) keeps the recurrence:
    - a parameter frozen since the copies were made keeps its two copies, and each optimizer
      step writes its value into the copy it writes (DelayedMode's `others`), so the next step
      reads it as the step before the freeze left it and the ones after its last value. It was
      left out: its copies stayed two steps apart for ever, and the losses alternated at lr 0.
    - a parameter unfrozen since (or one the copies lack) makes the copies again, each holding
      what the old one held, its one copy now in both: the step after reads what it read.
      Before, one copy served both parities and its delay was lost.
    - a frozen parameter's shared copy written in place is copied again before the next step,
      which reads it (a trainable one's write reaches the steps after the next two: README).
      It was never written again: train steps kept reading the old value, calls the new one.
    The copies are made or written only where no step reads them: the step behind is settled
    and the next step's first weights, uploaded from the old copies, are let land unused.
    A copy whose parameter's `_version` is what it was when the copy was last written is not
    written again.
    """

    snapshot = True      # CPU devices read these copies too, never the live parameters

    def __init__(self, params, dtype, pin: bool, previous: Optional["DelayedWeights"] = None):
        """previous: the copies these replace (Note [changes between delayed steps]): what each
        parameter's copies held there, they hold here."""
        self._copies = {}            # id(param) -> [[tensor, [upload marks], lock] for slot 0 and 1]
        self._flats: list = []       # the flat buffers the copies are views of
        # id(param) -> [its _version when copy 0 was last written, copy 1's] (one list: a shared copy)
        self._versions: dict = {}
        placed: dict = {}            # (shared, dtype) -> [(param, offset)]
        sizes: dict = {}             # (shared, dtype) -> elements
        self._own: dict = {}         # id(param) -> what keeps it pinned, for those their own copy
        # A frozen parameter (a LoRA base) never changes: one copy serves both parities; one
        # frozen since the copies were last made keeps two (Note [changes between delayed steps]).
        groups = {id(p): (p, (not p.requires_grad and not (previous is not None and previous.two_copies(p)),
                              working_dtype(p, dtype))) for p in params}
        own = {i: p for i, (p, group) in groups.items() if group[0] and own_copy(p, dtype)}
        if not isinstance(pin, bool):       # (worker processes: moved into shared files a chunk at a time)
            into_shared(own.values(), pin)
        for p, group in groups.values():
            got = _in_place(p, pin) if id(p) in own else None
            if got is not None:      # (Note [frozen weights in place])
                self._own[id(p)] = got[1]
                self._copies[id(p)] = [[got[0], [], threading.Lock()]] * 2
                self._versions[id(p)] = [p._version] * 2      # (it is the parameter: current)
                continue
            placed.setdefault(group, []).append((p, sizes.get(group, 0)))
            sizes[group] = sizes.get(group, 0) + p.numel()
        for (shared, want), members in placed.items():
            views = []
            for _ in range(1 if shared else 2):
                flat = host_empty((sizes[(shared, want)],), want, pin, "working copies", exact=True)
                self._flats.append(flat)
                views.append([flat[off:off + p.numel()].view(p.shape) for p, off in members])
            with torch.no_grad():
                for slot, copy in enumerate(views):
                    torch._foreach_copy_(copy, [p.detach() if previous is None or id(p) not in previous._copies
                                                else previous._copies[id(p)][slot][0] for p, _ in members])
            for k, (p, _) in enumerate(members):
                slots = [[copy[k], [], threading.Lock()] for copy in views]
                self._copies[id(p)] = slots * 2 if shared else slots
                was = None if previous is None else previous._versions.get(id(p))
                self._versions[id(p)] = [p._version] * 2 if was is None else list(was)
        self._newest: dict = {}      # id(param) -> the slot its last write went to (0 before any)
        self._checked: dict = {}     # id(param) -> its _version when a call found that copy equal (a write forgets it)
        if previous is not None:
            self._newest.update({i: v for i, v in previous._newest.items() if i in self._copies})
            previous.wait_uploads()     # (its memory goes once nothing reads it)

    def covers(self, params) -> bool:
        return all(id(p) in self._copies for p in params)

    def two_copies(self, p) -> bool:
        """Whether p has a copy for each parity (not one shared by both)."""
        slots = self._copies.get(id(p))
        return slots is not None and slots[0] is not slots[1]

    def needs_new_copies(self, params) -> bool:
        """Note [changes between delayed steps]: a parameter without copies, or one with a shared
        copy that trains now."""
        return any(id(p) not in self._copies or (p.requires_grad and not self.two_copies(p)) for p in params)

    def written_since(self, params) -> list:
        """The parameters with one shared copy written in place since it was made (a frozen one:
        no optimizer step writes it)."""
        return [p for p in params if not self.two_copies(p) and self._versions[id(p)][0] != p._version]

    def rewrite_shared(self, params) -> None:
        """Copy the given parameters (written in place) into their shared copies; no step may be
        reading them (Note [changes between delayed steps])."""
        self.write_many(params, 0)

    def wait_uploads(self) -> None:
        """Block until no upload reads these copies."""
        wait_for_uploads([m for slots in self._copies.values() for s in slots for m in s[1]])

    @property
    def buffers(self) -> list:
        """The flat buffers the copies are views of."""
        return list(self._flats)

    def view(self, slot: int) -> "_SlotView":
        """What the jobs of a step with parity `slot` read."""
        return _SlotView(self, slot)

    def write_many(self, params, slot: int, copy_down=None) -> None:
        """Copy the given parameters (just stepped) into copy `slot`, once the uploads from
        those copies have completed: one wait per stream and one copy call for all (copy_down:
        copy_params)."""
        # a copy that holds the parameter's value already (one without a gradient this step,
        # or frozen since: Note [changes between delayed steps]) is not written again
        params = [p for p in params if self._versions[id(p)][slot] != p._version]
        for p in [p for p in params if id(p) in self._own]:     # (its own copy: written already)
            self._versions[id(p)] = [p._version] * 2
            self._newest[id(p)] = slot
            self._checked.pop(id(p), None)
        params = [p for p in params if id(p) not in self._own]
        if not params:
            return
        slots = [self._copies[id(p)][slot] for p in params]
        with _locked(slots):
            wait_for_uploads([m for s in slots for m in s[1]])
            copy_params([s[0] for s in slots], list(params), copy_down)
            for s in slots:
                s[1].clear()
            for p, s in zip(params, slots):
                self._newest[id(p)] = slot
                self._checked.pop(id(p), None)
                for k, other in enumerate(self._copies[id(p)]):    # (both parities of a shared copy)
                    if other is s:
                        self._versions[id(p)][k] = p._version

    def call_view(self, fallback) -> "_CallView":
        """What a call reads once the optimizer has stepped every submission: each parameter's
        newest copy (Note [calls read the newest copies] in runtime/modes.py), or `fallback`'s
        (the runner's HostWeights) where that copy is not the parameter's value."""
        return _CallView(self, fallback)

    def _current(self, param, dtype) -> Optional[list]:
        """The slot entry of param's newest copy where it equals the parameter in `dtype` (checked
        once per write and in-place change: a call reads every parameter), else None."""
        entry = self._copies[id(param)][self._newest.get(id(param), 0)]
        if entry[0].dtype != dtype:
            return None
        if self._checked.get(id(param)) != param._version:
            with entry[2]:
                if not torch.equal(entry[0], param.detach().to(dtype)):
                    return None
            self._checked[id(param)] = param._version
        return entry

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._flats)


class _CallView:
    """A call's weights in delayed mode: each parameter's newest copy (DelayedWeights.call_view),
    else `fallback`'s (HostWeights), with HostWeights' upload interface."""

    snapshot = True

    def __init__(self, store: DelayedWeights, fallback: HostWeights):
        self.store, self.fallback = store, fallback

    def refreshed(self, param, dtype, rows=None):
        entry = self.store._current(param, dtype)
        return self.fallback.refreshed(param, dtype, rows) if entry is None else _held_slot(entry, rows)

    shared_copy = HostWeights.shared_copy
    mark_upload = staticmethod(mark_upload)


@contextlib.contextmanager
def _held_slot(slot, rows=None):
    """[None, copy (rows [start, stop) of it where given), upload marks, lock] of a delayed-mode
    copy slot ([copy, marks, lock]), as HostWeights.refreshed yields, its lock held."""
    tensor, marks, lock = slot
    with lock:
        yield [None, tensor if rows is None else tensor[rows[0]:rows[1]], marks, lock]


@contextlib.contextmanager
def _locked(slots):
    """Hold the locks of the distinct copy slots among `slots`, taken in host address order: the
    one order every thread takes them in (a prefetch's `held`, the optimizer's `write_many`), so
    none waits on another forever."""
    held = sorted({id(s): s for s in slots}.values(), key=lambda s: s[0].data_ptr())
    for s in held:
        s[2].acquire()
    try:
        yield
    finally:
        for s in held:
            s[2].release()


class _SlotView:
    """One parity's copies, with HostWeights' upload interface."""

    snapshot = True

    def __init__(self, store: DelayedWeights, slot: int):
        self.store, self.slot = store, slot

    def refreshed(self, param, dtype, rows=None):
        return _held_slot(self.store._copies[id(param)][self.slot], rows)

    def shared_copy(self, param, dtype) -> torch.Tensor:
        """This parity's copy of `param` (made in its working dtype)."""
        return self.store._copies[id(param)][self.slot][0]

    @contextlib.contextmanager
    def held(self, params):
        """[entry per parameter] (as `refreshed` yields), sorted by the copies' host addresses, their
        locks held in that order (DelayedWeights.write_many takes them in it too): what one upload
        per run of adjacent copies needs (Note [one upload per run] in runtime/device.py)."""
        slots = sorted(((self.store._copies[id(p)][self.slot], i) for i, p in params),
                       key=lambda x: x[0][0].data_ptr())
        with _locked([s for s, _ in slots]):
            yield [(i, [None, s[0], s[1], s[2]]) for s, i in slots]

    mark_upload = staticmethod(mark_upload)
