"""A delayed-mode step's gradients, handed to the optimizer chunk by chunk as they land.

Note [chunk-wise submission]: step t + 2 reads the weights optimizer step t writes (Note
[delayed optimizer]), so two periods must hold step t's chain, the landing of its last
gradients and the optimizer's work; with the whole submission stepped after the last backward
job, a step's start waited for that (Qwen3-1.7B on 4x H200: 0.065 s a step, 0.22 s at most;
Llama-3.1-8B: the optimizer works 2.0 s of a 2.4 s period). So the optimizer steps a chunk
(the parameters whose gradients a piece of the gradient buffer completes, in the buffer's
order, which is the backward's) as soon as the jobs it reads have landed, while the later
backward jobs still run. Measured on 4x H200: Llama-3.1-8B 27,295 tokens/s against 25,454
(two fresh machines); Qwen3-1.7B (one machine) starts wait 0 s, tokens/s 98.9-103.9K against
101.2K, within the runs' noise.

Note [chunks within a piece]: one job a step (one GPU's fused job) writes one piece, so its
whole submission was one chunk: every slice's gradient went up and was stepped, then every
working copy came down (one H200, Llama-3.1-8B's first 16 layers: 0.34 s up and stepping, then
0.21 s down), and only then was the piece given back and the submission done, which the step
after next's weights (9 GB up, 0.18 s) and the next job's gradient download wait for: the step
started 59-115 ms after the one before ended. So a piece's parameters are cut into chunks of
about SUBCHUNK elements (whole parameters): a chunk's working copies come down (on their own
stream, landing by the submission's end: FlatStepper.copy_down) while the next chunk's
gradients go up, the link's two directions at once. A piece goes back after its last chunk,
before its working copies are written. Measured (sixtieth session, one H200, Llama's 16 layers,
both orders, benchmarks/runs/delayed_chunks): no wait for the piece, the GPU idle 19-71 ms
between steps (59-192 before), median step 0.87-0.89 -> 0.80 s, 17,405 / 17,257 -> 18,392 /
18,266 tokens/s; Qwen3-1.7B, GPU-bound, unchanged (45,715 -> 45,279).

A chunk waits for the jobs up to the last one that reads its parameters or writes a gradient
it sums (jobs land in chain order): every upload of its working copies has then completed
before the refresh rewrites them, and a gradient read from another piece (a tied weight's
rows in the loss job's piece) has landed. A piece goes back to the next step's jobs (Note [one
gradient set]) after the last chunk that reads it.

The submission is made when the step's loss is known (runner._overlapped_step) for a plan
whose jobs have run once (their gradient keys are known); the first step of a plan is
submitted once all its jobs have ended, as before. A failure of a later backward job of a step
submitted early stops the submission at the next chunk: the chunks stepped before it keep that
step (their gradients were complete), the error says which, and the others are unchanged. For
the first step of a plan, where a bad input or too little device memory shows, no parameter
moves.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .grads import for_step, param_index, sum_param_grads


@dataclass
class GradChunks:
    """How one plan's submission is cut: per chunk, its parameters (consecutive in `order`),
    the gradient keys it sums per piece, the last job it waits for, and the pieces it gives back."""

    order: list                                        # parameter indices, in host_indices order
    lengths: list = field(default_factory=list)        # parameters per chunk
    reads: list = field(default_factory=list)          # per chunk: {stage: [gradient keys]}
    wait_upto: list = field(default_factory=list)      # per chunk: the last job whose landing it waits for
    release: list = field(default_factory=list)        # per chunk: the pieces no later chunk reads
    carry: list = field(default_factory=list)          # per chunk: (stage, rows key) it copies out for a later one

    def members(self, k: int) -> list:
        start = sum(self.lengths[:k])
        return self.order[start:start + self.lengths[k]]


def _pieces(layout) -> list:
    """The stages with a piece of the gradient buffer, in the buffer's order."""
    return sorted(layout.keys, key=lambda s: layout.stages[s][0])


def piece_of(layout) -> dict:
    """param index -> the piece whose chunk steps it: where its whole gradient lies (rows in
    order, GradLayout.whole_rows, count as whole), else, for one with row pieces only, the
    last piece holding its rows (the chunk after which its rows are all there)."""
    owner, rows = {}, {}
    for s in _pieces(layout):
        for key, _, _ in layout.keys[s]:
            i = param_index(key)
            if not isinstance(key, tuple) or i in layout.whole_rows:
                owner.setdefault(i, s)
            else:
                rows[i] = s
    return {**{i: s for i, s in rows.items() if i not in owner}, **owner}


def host_indices(plan, layout=None) -> list:
    """Parameter indices in the order the optimizer steps them: by the piece of the gradient
    buffer (GradLayout) that completes their gradient (piece_of), in the buffer's order, then
    the rest in captured order. The flat masters and working copies take this order, so a run
    contiguous in one is contiguous in the others (Note [flat host optimizer] in
    runtime/flat.py), and a chunk of the submission is a run of them."""
    layout, params = layout or plan.host_memory.grad_layout, plan.captured.params
    owner = piece_of(layout)
    order, seen = [], set()
    for s in _pieces(layout):
        for key, _, _ in layout.keys[s]:
            i = param_index(key)
            if i not in seen and owner.get(i) == s:
                seen.add(i)
                order.append(i)
    return order + [i for i in range(len(params)) if i not in seen]


# elements of a piece's parameters stepped as one chunk, at least one parameter (Note [chunks
# within a piece]): 17 chunks for Llama-3.1-8B's first 16 layers, 7 for Qwen3-1.7B
SUBCHUNK = 1 << 28


def _cut(sizes: list, limit: int) -> list:
    """Counts of consecutive items whose sizes sum to at most `limit` each (at least one item);
    [0] for none."""
    counts, total = [], limit
    for n in sizes:
        if total + n > limit or not counts:
            counts.append(0)
            total = 0
        counts[-1] += 1
        total += n
    return counts or [0]


def grad_chunks(plan, order: list, keys: dict, layout=None) -> GradChunks:
    """The chunks of a submission of parameter indices `order` (host_indices order, those with
    a gradient), whose gradients the jobs wrote under `keys` ({job: [gradient keys]}): per piece
    of the gradient buffer, in its order, the parameters that piece completes (piece_of) in
    chunks of about SUBCHUNK elements (Note [chunks within a piece]), and a last one of those
    with none (empty unless the keys differ from the plan's)."""
    layout = layout or plan.host_memory.grad_layout
    params = plan.captured.params
    owner = piece_of(layout)
    stages = _pieces(layout)
    sizes: dict = {s: [] for s in stages}
    for i in order:
        if i in owner:
            sizes[owner[i]].append(params[i].numel())
    lengths, own = [], {}         # own: piece -> its last chunk (where it carries rows out, goes back)
    for s in stages:
        lengths += _cut(sizes[s], SUBCHUNK)
        own[s] = len(lengths) - 1
    chunks = GradChunks(list(order), lengths + [sum(1 for i in order if i not in owner)])
    readers: dict = {}            # param index -> the jobs whose stage reads its weights
    for job, st in enumerate(plan.stages):
        for i in list(st.params) + [key[0] for key in st.param_slices.values()]:
            readers.setdefault(i, set()).add(job)
    last_reader = {}
    for k in range(len(chunks.lengths)):
        mine = set(chunks.members(k))
        reads = {s: [key for key in ks if param_index(key) in mine] for s, ks in keys.items()}
        reads = {s: ks for s, ks in reads.items() if ks}
        chunks.reads.append(reads)
        jobs = set(reads) | {j for i in mine for j in readers.get(i, ())}
        chunks.carry.append([])
        for s, ks in reads.items():
            if own.get(s, k) < k and all(isinstance(key, tuple) for key in ks):
                # rows read by a later chunk (a tied weight's, or a split head's other shards):
                # copied out at their piece's own chunk, so the piece goes back then
                chunks.carry[own[s]].extend((s, key) for key in ks)
            else:
                last_reader[s] = k
        chunks.wait_upto.append(max(jobs, default=-1))
    for k, carried in enumerate(chunks.carry):
        if carried:
            chunks.wait_upto[k] = max([chunks.wait_upto[k]] + [s for s, _ in carried])
    for k in range(len(chunks.lengths)):
        chunks.release.append([s for s in stages if last_reader.get(s, own[s]) == k])
    return chunks


def submission_chunks(plan, keys: dict, layout=None) -> GradChunks:
    """The chunks of a submission of the gradients the jobs wrote under `keys` ({job: [gradient
    keys]}): those parameters, in host_indices order (GradChunks.order)."""
    have = {param_index(key) for ks in keys.values() for key in ks}
    return grad_chunks(plan, [i for i in host_indices(plan, layout) if i in have], keys, layout)


def carried_rows(plan, layout) -> dict:
    """rows key -> shape: the gradient rows a submission of the plan's own gradient keys copies
    out of their piece (GradChunks.carry), each into a host buffer kept across steps."""
    keys = {s: [key for key, _, _ in ks] for s, ks in layout.keys.items()}
    chunks = submission_chunks(plan, keys, layout)
    shapes = {key: tuple(shape) for ks in layout.keys.values() for key, _, shape in ks}
    return {key: shapes[key] for items in chunks.carry for _, key in items}


class ChunkGrads:
    """The gradients of a submission, a chunk at a time, in the optimizer's thread:
    `chunk(k)` waits for the jobs chunk k needs (`landed(job)`, which raises StepAbandoned
    if the step failed) and sums its gradients; calling it gives all of them (clipping by the
    global norm needs every gradient first)."""

    def __init__(self, chunks: GradChunks, grads, landed, dtypes: dict, carried: dict):
        self.chunks, self.grads, self.landed, self.dtypes = chunks, grads, landed, dtypes
        self.carried = carried        # rows key -> a host buffer of its own, kept across submissions
        self._carried_keys = {item for items in chunks.carry for item in items}
        self._landed_upto = -1

    def chunk(self, k: int) -> list:
        chunks = self.chunks
        while self._landed_upto < chunks.wait_upto[k]:
            self._landed_upto += 1
            self.landed(self._landed_upto)
        job_grads = {}
        for s, ks in chunks.reads[k].items():
            views = self.grads.host_views(s)
            job_grads[s] = {key: self.carried[key] if (s, key) in self._carried_keys else views[key] for key in ks}
        totals = sum_param_grads(job_grads, self.grads.row_sums)
        out = [for_step(totals[i], self.dtypes[i]) for i in chunks.members(k)]
        if chunks.carry[k]:
            dst, src = [], []
            for s, key in chunks.carry[k]:
                view = self.grads.host_views(s)[key]
                buf = self.carried.get(key)
                if buf is None or buf.shape != view.shape:
                    buf = self.carried[key] = torch.empty_like(view)
                dst.append(buf)
                src.append(view)
            torch._foreach_copy_(dst, src)
        return out

    def __call__(self) -> list:
        return [g for k in range(len(self.chunks.lengths)) for g in self.chunk(k)]
