"""Stage solver: cut a chain of segments into RoundPipe stage jobs, exactly.

The partition pass finds legal cut positions ``0..n`` in the topological order of the
captured graph (segment ``i`` lies between positions ``i`` and ``i + 1``) and costs each
segment. This module only decides where to cut; it sees a table of numbers, never a graph.

One training step is a chain of *stage jobs*, dispatched round-robin over N stateless
devices, each job running all M microbatches of its stage with its weights uploaded once:

    forward stages over [0, c)  ->  one fused stage over [c, n)  ->  backward stages over [0, c)

The fused stage runs forward, loss and backward without recompute; backward stages
recompute their forward from a checkpoint, so they cost about 3x a forward stage and are cut
independently of the forward stages (they hold fewer segments). ``c == 0`` means one fused
job does everything.

Cost model of a stage over segments ``[i, j)`` (P, G, S: sums of param, grad and saved bytes; S
counts a value several ops save once, Note [saved values once] in passes/cut_points.py)::

    fwd job time       = max(M * sum fwd_s, (P + M * (A_i + A_j)) / upload_bw) + job_overhead_s
    bwd/fused job time = max(M * sum bwd_s, (P + M * (A_i + A_j)) / upload_bw) + job_overhead_s
    (A_p = cut_bytes[p]: the activations, or their gradients, a job moves over the host link
    for each microbatch at its two boundaries, beside its weights)
    fwd job memory       = 2*P + H*(cut_bytes[i] + cut_bytes[j]) + max(X, W)
    bwd/fused job memory = 2*P + G + S + H*(cut_bytes[i] + cut_bytes[j]) + 2*X
    (H = 2; on one device max(2, M): the next job's inputs stay on it, every microbatch's, Note
    [hand-overs on the device] in runtime/job.py)
    (X: the largest peak_bytes of the stage's segments: the working memory of its biggest op,
    e.g. an unsplit LM head's fp32 logits; in the backward that value and its gradient. W: the
    largest work_bytes, the values a segment's forward holds at once, Note [working bytes])

(2*P because the running stage's weights and the prefetched next stage's weights are both
resident.) With J jobs and T the slowest job, a step takes about

    est_time = T * max(ceil(J / N), 1 + (J - 1) / M)

the larger of the device-capacity bound and the critical path of a chain of J jobs over M
microbatches. The best plan minimises est_time; ties go to fewer jobs, then to the
lexicographically smallest ``(fwd cuts, c, bwd cuts)``, so plans are deterministic.

On one device the jobs run one after another, so a step takes the sum of the job times
(Note [one device sums]). Where steps overlap (delayed mode) on several devices, a step takes
what the replayed schedule says (Note [overlapped step model] in passes/step_model.py), and a
local search finds the plan (Note [overlapped step search]).

Why an exact DP and not a heuristic: est_time depends on the plan only through (T, J), and
it grows with both. So for each c and each number of forward stages kf we need only the
smallest achievable max forward-job time -- the classic linear-partition ("min-max") DP,
with memory-infeasible stages priced at +inf -- and the same for the backward side. The
two sides are independent given c, so the optimum is the min over (kf, c, kb) of
``est(max(Df[kf][c], fused(c), Db[kb][c]), kf + 1 + kb)``. The tie-breaking plan is then
rebuilt greedily, cut by cut, against exact completion-feasibility tables.

Complexity for n segments and K = min(n - 1, max_jobs - 2) stages per side: cost tables
O(n^2); each DP side O(K n^2); the combination over (c, kf, kb) O(n K log K) (see
_best_combination); the reconstruction O(J n^2). So O(n^3) time and O(n^2) memory at
worst. The inner loops are tensor ops (torch, already a dependency) kept small enough to
run single-threaded (see _CHUNK): n = 300 takes about 0.05 s of CPU. Beyond K, no stage
count is pruned: with M > N the objective is nearly flat in J once J/N dominates, so a
finer plan can win by a hair and only the full search is exact. ``brute_force_stages``
enumerates every plan over the same cost tables; it exists to check the DP in tests.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from .step_model import load_bound, overlapped_step_time

__all__ = [
    "Segment",
    "StagePlan",
    "PlanningError",
    "solve_stages",
    "brute_force_stages",
]

GiB = 1 << 30
_INF = float("inf")
_F64 = torch.float64
_I64 = torch.int64
_I64_MAX = torch.iinfo(_I64).max


@dataclass(frozen=True)
class Segment:
    """Costs of the graph piece between two consecutive legal cut positions."""

    fwd_s: float  # forward compute seconds per microbatch
    bwd_s: float  # recompute + backward seconds per microbatch (includes the forward once, and adding
    # the gradients into the accumulator: Note [gradients added per microbatch] in cut_points.py)
    param_bytes: int  # device bytes of the parameters the segment reads
    grad_bytes: int  # device bytes of the gradients of those parameters (accumulated on device)
    saved_bytes: int  # bytes saved for backward by the segment, per microbatch
    peak_bytes: int = 0  # largest value the segment makes (its gradient is as large), per microbatch
    work_bytes: int = 0  # the most bytes of the values it makes that its forward holds at once, per microbatch


# Note [working bytes]: a forward job holds, beside its weights and boundary values, the values
# its ops make until their last reader has run; counting only the largest (X) under-counted
# where several of that size live together: Qwen3-1.7B at 65,536 tokens, a forward job of 14
# LM-head shards (a shard's fp32 logits, their difference with the running max and its exp
# live at once) was planned at 3.57 GiB, and the live peak of its traced graph
# (runtime.fake.live_peak) is 5.75 GiB. So a segment also carries the most bytes its own values
# hold at once in its forward (cut_points.segment_table, from the liveness sweep), and a forward
# job counts the larger of that and X. Backward jobs keep 2X + S: against their traced graphs
# that over-counts (one-layer backward jobs there: 12.95 GiB planned, 8.26 GiB traced).


class NegativeSize(ValueError, ArithmeticError):
    """A segment's or a cut's bytes below zero: the graph's sizes evaluated at a length it cannot
    run at (Note [lengths a model cannot run at] in passes/longest.py: planning_error's search
    takes it, as sympy's ZeroDivisionError, for such a length)."""


class PlanningError(ValueError):
    """No stage plan satisfies the constraints (memory budget, max_jobs).

    ``min_budget`` is the smallest memory budget in bytes for which a plan exists (under the
    same max_jobs), ``stage`` the (kind, (i, j)) job that needs it. ``max_length`` is the
    longest sequence length a plan fits the budget at, with the same rows per microbatch (Note
    [longest length] in passes/longest.py); None where the length is not symbolic (static
    shapes), where not even length 1 fits, or where the budget is not what failed (max_jobs).
    """

    def __init__(self, message: str, *, min_budget: Optional[int] = None, stage=None,
                 max_length: Optional[int] = None):
        super().__init__(message)
        self.min_budget = min_budget
        self.stage = stage
        self.max_length = max_length


@dataclass(frozen=True)
class StagePlan:
    """A solved step schedule; job_times/job_memory are in execution order."""

    fwd_bounds: tuple[tuple[int, int], ...]  # forward stages, in order
    fused: tuple[int, int]  # [c, n)
    bwd_bounds: tuple[tuple[int, int], ...]  # backward stages in execution order (last first)
    job_times: tuple[float, ...]
    job_memory: tuple[int, ...]
    est_time: float

    def jobs(self) -> Iterator[tuple[str, tuple[int, int]]]:
        """Yield (kind, (i, j)) for every job in execution order."""
        for b in self.fwd_bounds:
            yield "fwd", b
        yield "fused", self.fused
        for b in self.bwd_bounds:
            yield "bwd", b

    @property
    def num_jobs(self) -> int:
        return len(self.fwd_bounds) + 1 + len(self.bwd_bounds)

    @property
    def split(self) -> int:
        """c: where the fused last stage begins."""
        return self.fused[0]

    @property
    def fwd_cuts(self) -> tuple[int, ...]:
        return tuple(j for _, j in self.fwd_bounds[:-1])

    @property
    def bwd_cuts(self) -> tuple[int, ...]:
        return tuple(sorted(i for i, _ in self.bwd_bounds if i > 0))

    @property
    def max_job_time(self) -> float:
        return max(self.job_times)

    @property
    def max_job_memory(self) -> int:
        return max(self.job_memory)


def _est_factor(num_jobs: int, num_devices: int, num_microbatches: int) -> float:
    # Device-capacity bound vs. critical path of a chain of J jobs where job k+1 can start
    # its first microbatch once job k finished its first one. The busiest device runs
    # ceil(J / N) jobs: steps do not overlap (the first forward job reads the parameters whose
    # gradients the last backward job makes), so a remainder is not shared with the next step.
    return max(math.ceil(num_jobs / num_devices), 1 + (num_jobs - 1) / num_microbatches)


# ----------------------------------------------------------------------------- cost tables


# Elements per tensor op. ATen spreads ops over more than 32768 elements across OpenMP
# threads; at these sizes that gains little, and on a loaded machine (e.g. re-planning
# while runtime workers keep the cores busy) each parallel op can wait a scheduler time
# slice for a busy core: seconds over the thousands of ops a solve makes. Ops of at most
# _CHUNK elements keep the solver single-threaded and its time steady.
_CHUNK = 1 << 14


def _row_blocks(rows: int, width: int) -> Iterator[slice]:
    h = max(1, _CHUNK // max(width, 1))
    for i in range(0, rows, h):
        yield slice(i, min(i + h, rows))


def _fill_rows(out: torch.Tensor, fn) -> torch.Tensor:
    """out[r] = fn(r) for blocks of rows r of at most _CHUNK elements."""
    for r in _row_blocks(out.shape[0], out.shape[1]):
        out[r] = fn(r)
    return out


class _Costs:
    """Time and memory of every candidate job [i, j), as (n+1) x (n+1) tables.

    Shared by the DP and the brute force so that both compare bit-identical numbers (the
    tests check every returned job against the formulas separately). Entries with i >= j
    are meaningless and masked by ``valid``.
    """

    def __init__(self, segments, cut_bytes, *, num_devices, num_microbatches, memory_budget,
                 upload_bw, job_overhead_s, max_jobs, overlapped_steps=False, reserved=0, budget_set=None):
        segments = list(segments)
        n = len(segments)
        if n < 1:
            raise ValueError("solve_stages needs at least one segment")
        if len(cut_bytes) != n + 1:
            raise ValueError(f"cut_bytes must have n + 1 = {n + 1} entries, got {len(cut_bytes)}")
        for k, v in (("num_devices", num_devices), ("num_microbatches", num_microbatches)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{k} must be a positive int, got {v!r}")
        if max_jobs is not None and (not isinstance(max_jobs, int) or max_jobs < 1):
            raise ValueError(f"max_jobs must be None or a positive int, got {max_jobs!r}")
        if not upload_bw > 0:
            raise ValueError(f"upload_bw must be > 0, got {upload_bw!r}")
        if not (job_overhead_s >= 0 and math.isfinite(job_overhead_s)):
            raise ValueError(f"job_overhead_s must be finite and >= 0, got {job_overhead_s!r}")
        for k, s in enumerate(segments):
            for name in ("fwd_s", "bwd_s"):
                v = getattr(s, name)
                if not (math.isfinite(v) and v >= 0):
                    raise ValueError(f"segment {k}: {name} must be finite and >= 0, got {v!r}")
            for name in ("param_bytes", "grad_bytes", "saved_bytes", "peak_bytes", "work_bytes"):
                if getattr(s, name) < 0:
                    raise NegativeSize(f"segment {k}: {name} must be >= 0")
        if any(b < 0 for b in cut_bytes):
            raise NegativeSize("cut_bytes must be >= 0")
        if memory_budget is not None:
            if math.isnan(memory_budget) or memory_budget < 0:
                raise ValueError(f"memory_budget must be bytes >= 0 or None, got {memory_budget!r}")
            if memory_budget == _INF:
                memory_budget = None

        self.n = n
        self.N = num_devices
        self.M = num_microbatches
        self.overlap = bool(overlapped_steps) and num_devices > 1   # Note [overlapped step model]
        self.max_jobs = max_jobs
        self.memory_budget = memory_budget
        self.reserved, self.budget_set = int(reserved), budget_set   # (for the error's figures: solve_stages)
        self.segments = segments
        self.cut_bytes = [int(b) for b in cut_bytes]
        # boundary values a job holds: on one device every microbatch's (Note [hand-overs on the device])
        self.held = max(2, num_microbatches) if num_devices == 1 else 2

        def col(name, dtype):
            return torch.tensor([getattr(s, name) for s in segments], dtype=dtype)

        fwd_s, bwd_s = col("fwd_s", _F64), col("bwd_s", _F64)
        pb, gb, sb = col("param_bytes", _I64), col("grad_bytes", _I64), col("saved_bytes", _I64)
        xb, wb = col("peak_bytes", _I64), col("work_bytes", _I64)
        cb = torch.tensor(self.cut_bytes, dtype=_I64)
        pos = torch.arange(n + 1)
        n1, bw, ovh, M = n + 1, float(upload_bw), float(job_overhead_s), self.M
        self.valid = pos[:, None] < pos[None, :]  # a stage [i, j) needs i < j
        self.time = {k: torch.empty(n1, n1, dtype=_F64) for k in ("fwd", "bwd")}
        self.mem = {k: torch.empty(n1, n1, dtype=_I64) for k in ("fwd", "bwd")}
        for r in _row_blocks(n1, n1):
            take = pos[None, :n] >= pos[r, None]  # segment m is in [i, j) for all j > m

            def range_sums(x):
                # R[i, j] = x[i] + ... + x[j-1], summed left to right (no prefix-sum
                # differences, which lose precision on short ranges); 0 where j <= i.
                out = torch.zeros(take.shape[0], n1, dtype=x.dtype)
                out[:, 1:] = torch.where(take, x, 0).cumsum(dim=1)
                return out

            def range_max(x):
                # R[i, j] = max(x[i], ..., x[j-1]); 0 where j <= i (x >= 0).
                out = torch.zeros(take.shape[0], n1, dtype=x.dtype)
                out[:, 1:] = torch.where(take, x, 0).cummax(dim=1).values
                return out

            P = range_sums(pb)
            X, Wk = range_max(xb), range_max(wb)
            # the host link carries the weights once and the boundary values per microbatch
            upload = (P.to(_F64) + M * (cb[r, None] + cb[None, :]).to(_F64)) / bw
            ends = self.held * (cb[r, None] + cb[None, :])
            self.time["fwd"][r] = torch.maximum(M * range_sums(fwd_s), upload) + ovh
            self.time["bwd"][r] = torch.maximum(M * range_sums(bwd_s), upload) + ovh
            self.mem["fwd"][r] = 2 * P + ends + torch.maximum(X, Wk)
            self.mem["bwd"][r] = 2 * P + range_sums(gb) + range_sums(sb) + ends + 2 * X
        # Memory values are integers, so ``mem <= budget`` <=> ``mem <= floor(budget)``:
        # comparing int64 with an int keeps the test exact for any budget type.
        self._set_budget(None if memory_budget is None else math.floor(memory_budget))
        # Python-scalar look-ups for the brute force's many plans; a big table would cost
        # more to convert than the solver's few look-ups of single entries.
        self._lists = None
        if n1 * n1 <= _CHUNK:
            self._lists = {k: (self.time[k].tolist(), self.mem[k].tolist()) for k in self.time}

    def _set_budget(self, budget_int):
        """ok[kind][i, j]: [i, j) is a stage that fits; W[kind]: its time, +inf if not."""
        self.budget_int = budget_int
        self.ok, self.W = {}, {}
        for k in ("fwd", "bwd"):
            if budget_int is None:
                ok = self.valid
            else:
                ok = _fill_rows(torch.empty_like(self.valid),
                                lambda r: self.valid[r] & (self.mem[k][r] <= budget_int))
            self.ok[k] = ok
            self.W[k] = _fill_rows(torch.empty_like(self.time[k]),
                                   lambda r: self.time[k][r].masked_fill(~ok[r], _INF))

    def with_budget(self, budget_int: int) -> "_Costs":
        other = copy.copy(self)
        other._set_budget(budget_int)
        return other

    def job_time(self, kind: str, i: int, j: int) -> float:
        k = "fwd" if kind == "fwd" else "bwd"
        return self._lists[k][0][i][j] if self._lists else self.time[k][i, j].item()

    def job_mem(self, kind: str, i: int, j: int) -> int:
        k = "fwd" if kind == "fwd" else "bwd"
        return self._lists[k][1][i][j] if self._lists else int(self.mem[k][i, j])

    def fits(self, mem: int) -> bool:
        return self.budget_int is None or mem <= self.budget_int

    def factor(self, num_jobs: int) -> float:
        return _est_factor(num_jobs, self.N, self.M)

    def max_side_stages(self, max_jobs) -> int:
        # kf, kb <= c <= n - 1 (stages are non-empty, fused is non-empty), J = kf + 1 + kb.
        k = self.n - 1
        if max_jobs is not None:
            k = min(k, max_jobs - 2)
        return max(k, 0)

    def make_plan(self, fwd_cuts, c, bwd_cuts) -> StagePlan:
        fwd, fused, bwd = _bounds(fwd_cuts, c, bwd_cuts, self.n)
        jobs = [("fwd", b) for b in fwd] + [("fused", fused)] + [("bwd", b) for b in bwd]
        times = tuple(self.job_time(k, *b) for k, b in jobs)
        mems = tuple(self.job_mem(k, *b) for k, b in jobs)
        if self.overlap:
            est = _replayed(times, len(fwd), self.N, self.M)
        else:
            est = _sum(times) if self.N == 1 else max(times) * self.factor(len(jobs))
        return StagePlan(fwd, fused, bwd, times, mems, est)


def _bounds(fwd_cuts, c, bwd_cuts, n) -> tuple:
    """(forward stages, fused stage, backward stages in execution order) of a plan's cuts."""
    if c == 0:
        return (), (0, n), ()
    fpos, bpos = [0, *fwd_cuts, c], [0, *bwd_cuts, c]
    return (tuple((fpos[k], fpos[k + 1]) for k in range(len(fpos) - 1)), (c, n),
            tuple((bpos[k], bpos[k + 1]) for k in reversed(range(len(bpos) - 1))))


# ------------------------------------------------------------------------------ the DP


def _minmax_layers(W: torch.Tensor, K: int, lo, hi, combine=torch.maximum) -> torch.Tensor:
    """Linear-partition DP. W[i, j]: cost of one stage [i, j) (``hi`` where not allowed).

    Returns D with D[k, j] = min over splits of [0, j) into exactly k stages of the max
    stage cost (``hi`` if there is none), for k = 0..K. Works for float or int64 costs.
    With ``combine=torch.add`` (and lo = 0, hi = +inf) it is the sum of the stage costs.
    """
    n1 = W.shape[0]
    D = _fill_rows(torch.empty(K + 1, n1, dtype=W.dtype), lambda r: hi)
    D[0, 0] = lo
    for k in range(1, K + 1):
        # The k-th stage starts at i >= k-1 and ends at j >= k.
        prev = D[k - 1, k - 1:, None]
        w = max(1, _CHUNK // prev.shape[0])
        for j in range(k, n1, w):
            D[k, j:j + w] = combine(prev, W[k - 1:, j:j + w]).amin(dim=0)
        if not bool((D[k] < hi).any()):
            break  # no prefix splits into k stages, so none into more either
    return D


def _sum(times) -> float:
    return math.fsum(times)   # exactly rounded: the same for any order of the jobs


# Note [one device sums]: on one device the jobs of a step run one after another, so the
# step takes the sum of the job times, not T * J, the balanced-chain formula (f(J) = J at
# N = 1). Minimising T * J balanced the jobs and so kept the fused stage, the only one
# without recompute, as short as the others: Llama-3.1-8B on one H200 (125 GiB budget) ran a
# 6-layer fused stage and recomputed the forward of the other 26 layers. Minimising the sum
# makes the fused stage as long as the memory budget allows, and recomputes only the rest.
# The sum is separable, so each side is a min-sum linear-partition DP (the one above with
# add for max) and the step is min over (c, kf, kb) of Sf[kf, c] + fused(c) + Sb[kb, c].
# Ties go to fewer jobs, then to a smaller c; within a side, to the first minimising cut.
# Measured (seventeenth session, RESULTS.md): Llama-3.1-8B on one H200 (x2 host), 5 jobs
# (est 6.16 s) against 3 (est 5.24 s), one host, benchmarks.diagnose (no memory sampling):
# compute 6.22 against 5.47 s a step, 9,970 against 11,070 tokens/s; the 21-layer fused job
# 3.35 s against its 3.23. The sixteenth session's "long jobs run 41-45% over their cost" was
# the benchmark harness reading /proc/PID/smaps_rollup every 0.5 s (fixed there).


def _solve_one_device(costs: _Costs) -> StagePlan:
    n, K, max_jobs = costs.n, costs.max_side_stages(costs.max_jobs), costs.max_jobs
    fused = costs.W["bwd"][:, n]
    best = None   # (step seconds, J, c, kf, kb)
    if fused[0] < _INF:
        best = (fused[0].item(), 1, 0, 0, 0)
    if K >= 1:
        Sf = _minmax_layers(costs.W["fwd"], K, 0.0, _INF, torch.add)
        Sb = _minmax_layers(costs.W["bwd"], K, 0.0, _INF, torch.add)
        k = torch.arange(1, K + 1)
        J = k[:, None] + k[None, :] + 1   # kf forward + fused + kb backward stages
        for c in range(1, n):
            if not fused[c] < _INF:
                continue
            if max_jobs is None:   # each side on its own: its first minimum has the fewest stages
                kf, kb = _first_min(Sf[1:, c]), _first_min(Sb[1:, c])
                v = (Sf[kf + 1, c] + Sb[kb + 1, c] + fused[c]).item()
            else:
                tot = (Sf[1:, c, None] + Sb[None, 1:, c] + fused[c]).masked_fill(J > max_jobs, _INF)
                v = tot.min().item()
                kf, kb = min(_near(tot, v).nonzero().tolist(), key=lambda p: (p[0] + p[1], p[0]))
            if not v < _INF:
                continue
            cand = (v, kf + kb + 3, c, kf + 1, kb + 1)
            if best is None or _one_device_better(cand[:3], best[:3]):
                best = cand
    if best is None:
        _raise_infeasible(costs)
    _, _, c, kf, kb = best
    if c == 0:
        return costs.make_plan((), 0, ())
    return costs.make_plan(_sum_cuts(Sf, costs.W["fwd"], kf, c), c, _sum_cuts(Sb, costs.W["bwd"], kb, c))


# Sums of the same job times in another grouping differ in the last bits (M * (a + b) for one
# job against M * a + M * b for two), so step times this close count as a tie.
_TIE = 1e-9


def _near(x: torch.Tensor, v: float) -> torch.Tensor:
    return x <= v + _TIE * abs(v)


def _first_min(x: torch.Tensor) -> int:
    return _first(_near(x, x.min().item()))


def _one_device_better(a: tuple, b: tuple) -> bool:
    """Order of one-device plans as (step time, J, ...): a near tie (_TIE) of the step times
    goes to the rest of the tuple, fewer jobs first."""
    if abs(a[0] - b[0]) > _TIE * max(abs(a[0]), abs(b[0])):
        return a[0] < b[0]
    return a[1:] < b[1:]


def _sum_cuts(D: torch.Tensor, W: torch.Tensor, k: int, j: int) -> tuple:
    """The cuts of a min-sum split of [0, j) into k stages (D from _minmax_layers with add),
    each stage's start the first one that attains the minimum."""
    cuts = []
    for r in range(k, 1, -1):
        j = _first(D[r - 1, :j] + W[:j, j] <= D[r, j])
        cuts.append(j)
    return tuple(reversed(cuts))


def _any_and(mat: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """out[i] = any_j (mat[i, j] and v[j]), in ops of at most _CHUNK elements."""
    out = torch.empty(mat.shape[0], dtype=torch.bool)
    h = max(1, _CHUNK // mat.shape[1])
    for i in range(0, mat.shape[0], h):
        out[i:i + h] = (mat[i:i + h] & v).any(dim=1)
    return out


def _best_combination(costs: _Costs, Df, Db, fused, hi, value_fn, max_jobs):
    """min over (c, kf, kb) of value_fn(max(Df[kf,c], fused[c], Db[kb,c]), J), ties -> fewer J.

    Returns (value, J) or None. ``value_fn(T, J)`` maps tensors of T and J to values and
    must grow with both. Rather than all O(n K^2) triples, use "at most a stages" tables
    A[c, a] = min_{kf <= a} Df[kf, c] (B likewise): they give the same optimum, since a
    plan with fewer stages is also counted with its own, smaller J. A and B fall with a, so
    for each candidate bottleneck t (a value of A, B or fused(c)) the fewest stages with
    T <= t are found by binary search: O(n K log K) in all.
    """
    n, K = costs.n, Df.shape[0] - 1
    best = None
    if fused[0] < hi:  # c = 0: one fused job
        best = (value_fn(fused[0:1], torch.ones(1, dtype=_I64)).item(), 1)
    if K < 1:
        return best
    for cs in _row_blocks(n - 1, 2 * K):  # c = 1..n-1, in blocks
        cs = slice(cs.start + 1, cs.stop + 1)
        A = Df[1:, cs].cummin(dim=0).values.T.contiguous()  # A[c, a-1]
        B = Db[1:, cs].cummin(dim=0).values.T.contiguous()
        u = fused[cs, None]
        thr = torch.maximum(torch.cat([A, B], dim=1), u)  # candidate bottlenecks >= fused(c)

        a, b = _count_greater(A, thr), _count_greater(B, thr)  # 0-based a, b; K: none
        ok = (a < K) & (b < K)
        a, b = a.clamp(max=K - 1), b.clamp(max=K - 1)
        T = torch.maximum(torch.maximum(A.gather(1, a), B.gather(1, b)), u)
        J = a + b + 3  # (a + 1) forward + fused + (b + 1) backward
        ok &= T < hi
        if max_jobs is not None:
            ok &= J <= max_jobs
        if not bool(ok.any()):
            continue
        vals = value_fn(T, J).masked_fill(~ok, hi)
        v = vals.min()
        cand = (v.item(), int(J[ok & (vals == v)].min()))
        if best is None or cand < best:
            best = cand
    return best


def _count_greater(X: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Per row, how many entries of X (rows non-increasing, K columns) exceed each t: the
    index of the first entry <= t. A vectorised binary search (torch.searchsorted would do,
    but it splits even small inputs over threads; see _CHUNK)."""
    K = X.shape[1]
    lo = torch.zeros(t.shape, dtype=_I64)
    hi = torch.full(t.shape, K, dtype=_I64)
    for _ in range(K.bit_length()):  # invariant: X[:lo] > t >= X[hi:]
        active = lo < hi
        mid = (lo + hi) >> 1
        gt = X.gather(1, mid.clamp(max=K - 1)) > t
        lo = torch.where(active & gt, mid + 1, lo)
        hi = torch.where(active & ~gt, mid, hi)
    return lo


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def _reconstruct(costs: _Costs, Db, est_best: float, J: int) -> StagePlan:
    """The lexicographically smallest (fwd cuts, c, bwd cuts) among plans of J jobs whose
    est_time is <= est_best (i.e. == est_best, since est_best is optimal)."""
    n = costs.n
    if J == 1:
        return costs.make_plan((), 0, ())
    f = costs.factor(J)
    # fl(t * f) is monotone in t, so "plan est <= est_best" <=> "every job's t*f <= est_best".
    okF, okB = (_fill_rows(torch.empty_like(costs.valid),
                           lambda r: costs.W[k][r] * f <= est_best) for k in ("fwd", "bwd"))
    okU = okB[:, n].clone()
    okU[n] = False  # the fused stage is never empty
    K = Db.shape[0] - 1
    S = min(J - 2, K)  # the most forward stages (kb >= 1, and the DP's own cap)
    # G[kf, c]: with kf forward stages ending at c, the fused stage and kb = J-1-kf
    # backward stages over [0, c) all fit the threshold.
    G = torch.zeros(S + 1, n + 1, dtype=torch.bool)
    # Db holds +inf where infeasible, so this test is exact.
    bwd_fits = _fill_rows(torch.empty(Db.shape, dtype=torch.bool), lambda r: Db[r] * f <= est_best)
    for kf in range(1, S + 1):
        kb = J - 1 - kf
        if 1 <= kb <= K:
            G[kf] = okU & bwd_fits[kb]
    # Q[s, e]: having placed s forward stages, the next starting at e, a completion exists.
    # Tm[s, e]: ... and one exists where stage s+1 is the last forward stage.
    Q = torch.zeros(S + 1, n + 1, dtype=torch.bool)
    Tm = torch.zeros(S + 1, n + 1, dtype=torch.bool)
    for s in range(S - 1, -1, -1):
        Tm[s] = _any_and(okF, G[s + 1])
        Q[s] = Tm[s] | _any_and(okF, Q[s + 1])
    assert bool(Q[0, 0]), "internal error: optimal plan not reconstructible"
    # Greedy: ending the forward cut list now beats any longer list, and smaller next
    # cuts beat larger ones (tuple order).
    s, e, fcuts = 0, 0, []
    while True:
        if Tm[s, e]:
            c = _first(okF[e] & G[s + 1])
            kf = s + 1
            break
        e = _first(okF[e] & Q[s + 1])
        fcuts.append(e)
        s += 1
    kb = J - 1 - kf
    # R[r, b]: [b, c) splits into exactly r backward stages within the threshold.
    R = torch.zeros(kb + 1, n + 1, dtype=torch.bool)
    R[0, c] = True
    for r in range(1, kb + 1):
        R[r] = _any_and(okB, R[r - 1])
    b, bcuts = 0, []
    for r in range(kb, 1, -1):
        b = _first(okB[b] & R[r - 1])
        bcuts.append(b)
    return costs.make_plan(tuple(fcuts), c, tuple(bcuts))


def solve_stages(segments: Sequence[Segment], cut_bytes: Sequence[int], *, num_devices: int,
                 num_microbatches: int, memory_budget=None, upload_bw: float = _INF,
                 job_overhead_s: float = 0.0, max_jobs: Optional[int] = None,
                 overlapped_steps: bool = False, reserved: int = 0,
                 budget_set: Optional[int] = None) -> StagePlan:
    """Minimum-est_time stage plan (see the module docstring for the model): exact, except
    where steps overlap on several devices (overlapped_steps: delayed mode), which a local
    search over the cuts decides (Note [overlapped step model]). reserved: bytes of each
    device that Config.memory_budget (budget_set) holds besides the jobs' memory_budget (the
    devices' share of the optimizer), for the error's figures."""
    costs = _Costs(segments, cut_bytes, num_devices=num_devices,
                   num_microbatches=num_microbatches, memory_budget=memory_budget,
                   upload_bw=upload_bw, job_overhead_s=job_overhead_s, max_jobs=max_jobs,
                   overlapped_steps=overlapped_steps, reserved=reserved, budget_set=budget_set)
    return _solve(costs)


def _solve(costs: _Costs) -> StagePlan:
    if costs.N == 1:
        return _solve_one_device(costs)
    if costs.overlap:
        return _solve_overlapped(costs)
    return _solve_chain(costs)


def _solve_chain(costs: _Costs) -> StagePlan:
    n, K = costs.n, costs.max_side_stages(costs.max_jobs)
    Df = _minmax_layers(costs.W["fwd"], K, -_INF, _INF)
    Db = _minmax_layers(costs.W["bwd"], K, -_INF, _INF)
    fused = costs.W["bwd"][:, n]  # the fused job over [c, n) has the backward cost formula
    # Python-float factors, indexed by J, so est values match StagePlan.est_time bit for bit.
    fac = torch.tensor([0.0] + [costs.factor(j) for j in range(1, 2 * K + 2)], dtype=_F64)
    best = _best_combination(costs, Df, Db, fused, _INF, lambda T, J: T * fac[J],
                             costs.max_jobs)
    if best is None:
        _raise_infeasible(costs)
    est_best, J = best
    plan = _reconstruct(costs, Db, est_best, J)
    assert plan.est_time == est_best and plan.num_jobs == J, "internal error: plan mismatch"
    return plan


# Note [overlapped step search]: where steps overlap (Note [overlapped step model] in
# passes/step_model.py) a plan costs what its replayed schedule says, which depends on which
# jobs share a device, so it does not separate into the min-max tables the chain DP uses. The
# solver searches instead: from the chain DP's plan (balanced jobs), the one-device solver's
# (least total work) and, where the chain plan has at most 2N + 2 jobs, three-job plans with
# the fused stage at 8 places, it moves one cut between its neighbours, adds or removes one, or
# moves the fused stage, taking the best neighbour while the step time falls (ties: fewer
# jobs, then the smaller (fwd cuts, c, bwd cuts)); where no such move helps, two cuts at once
# (added on a grid of at most 16 places a side, or removed one from each side). A neighbour is
# replayed only if its total work over N and its busiest device's share of the round-robin
# (load_bound, computed where J and N share a factor), bounds the replay meets, are below the
# best so far (the second skips 25-55% of the replays of Llama- and Qwen-shaped tables, the
# search 10-20% faster on the sandbox, same plans).
# Not exact: on small random tables it finds the brute force's optimum in about 97% of cases
# (tests/test_step_model.py). Llama-3.1-8B-shaped tables (67 segments) take 0.1-0.2 s at 2 and
# 4 devices, a Qwen3-1.7B-shaped one (119) 0.3-0.4 s. At 2 devices it shares the work out
# (step 3.18 -> 2.88 s replayed); at 4 the chain plan is already within 3% of total/N.
# The descents from the several starts meet the same plans, and so do the searches beside the
# optimizer's shares (the same job times where the jobs fit both): of the 37,573 replays
# Qwen3-1.7B's plan for 4 H200s asked for, 10,659 were distinct, of Llama-3.1-8B's 43,551 21,744.
# So the replays are kept by their arguments (_replayed): the whole plan (compile_graph, three in
# a row on the 2-core sandbox) took 2.01 / 1.81 / 1.49 -> 1.46 / 1.24 / 0.94 s (Qwen3-1.7B) and
# 2.44 / 2.38 / 2.03 -> 1.90 / 1.74 / 1.45 s (Llama-3.1-8B), the same plans.


def _solve_overlapped(costs: _Costs) -> StagePlan:
    chain = copy.copy(costs)
    chain.overlap = False
    seeds = [_solve_chain(chain)]          # raises PlanningError where nothing fits
    seeds.append(_solve_one_device(chain))
    starts = [(p.fwd_cuts, p.split, p.bwd_cuts) for p in seeds]
    n = costs.n
    if seeds[0].num_jobs <= 2 * costs.N + 2:
        # few jobs, where which of them share a device decides most: also three-job plans with
        # the fused stage at SEEDS positions spread over the chain (short descents)
        starts += [((), c, ()) for c in sorted({max(1, round(n * (k + 1) / (_SEEDS + 1))) for k in range(_SEEDS)})
                   if c < n]
    best = None
    W = {k: costs.W[k].tolist() for k in ("fwd", "bwd")}
    for start in dict.fromkeys(starts):
        plan = _descend(costs, start, W)
        if plan is None:
            continue
        if best is None or _one_device_better(_key(plan), _key(best)):
            best = plan
    return best


_SEEDS = 8
_PAIR_GRID = 16


@functools.lru_cache(maxsize=1 << 15)     # (about 100-200 bytes a key)
def _replayed(times: tuple, fused: int, num_devices: int, num_microbatches: int) -> float:
    """overlapped_step_time, kept by its arguments: a replay is a pure function of them (Note
    [overlapped step search])."""
    return overlapped_step_time(times, fused, num_devices, num_microbatches)


def _key(plan: StagePlan) -> tuple:
    return (plan.est_time, plan.num_jobs, plan.fwd_cuts, plan.split, plan.bwd_cuts)


def _descend(costs: _Costs, start, W: dict) -> StagePlan:
    """Best-neighbour descent from the plan `start` = (fwd cuts, c, bwd cuts), Note
    [overlapped step search]; None where `start` does not fit. W: costs.W as lists."""
    n, N, M = costs.n, costs.N, costs.M

    def key(fc, c, bc, bound=_INF):
        """(step seconds, J, fc, c, bc), or None where a job does not fit or it cannot beat bound."""
        if costs.max_jobs is not None and len(fc) + len(bc) + (3 if c else 1) > costs.max_jobs:
            return None
        fwd, (i, j), bwd = _bounds(fc, c, bc, n)   # W: +inf where a job does not fit
        times = [W["fwd"][a][b] for a, b in fwd] + [W["bwd"][i][j]] + [W["bwd"][a][b] for a, b in bwd]
        if _INF in times or _sum(times) / N > bound * (1 + _TIE):
            return None
        if bound < _INF and math.gcd(len(times), N) > 1 and load_bound(times, N) > bound * (1 + _TIE):
            # the busiest device's share, which the replay meets, is no better (with J and N
            # coprime every device runs every job once a cycle: the bound is the sum's, above)
            return None
        return (_replayed(tuple(times), len(fwd), N, M), len(times), fc, c, bc)

    def neighbours(fc, c, bc):
        for side, cuts in ((0, fc), (1, bc)):
            free = [p for p in range(1, c) if p not in cuts]
            for i in range(len(cuts)):
                rest = cuts[:i] + cuts[i + 1:]
                yield (rest, bc) if side == 0 else (fc, rest)               # remove a cut
                lo, hi = (cuts[i - 1] if i else 0), (cuts[i + 1] if i + 1 < len(cuts) else c)
                for p in range(lo + 1, hi):                                 # move it between its neighbours
                    if p != cuts[i]:
                        moved = cuts[:i] + (p,) + cuts[i + 1:]
                        yield (moved, bc) if side == 0 else (fc, moved)
            for p in free:                                                  # add one
                more = tuple(sorted(cuts + (p,)))
                yield (more, bc) if side == 0 else (fc, more)

    grid = max(1, -(-n // _PAIR_GRID))

    def pairs(fc, c, bc):
        """two cuts added (on one side or both; at positions on a grid of at most _PAIR_GRID, the
        single moves refine them), or one removed from both sides"""
        ffree = [p for p in range(grid, c, grid) if p not in fc]
        bfree = [p for p in range(grid, c, grid) if p not in bc]
        for p in ffree:
            for q in bfree:
                yield tuple(sorted(fc + (p,))), tuple(sorted(bc + (q,)))
        for p, q in itertools.combinations(ffree, 2):
            yield tuple(sorted(fc + (p, q))), bc
        for p, q in itertools.combinations(bfree, 2):
            yield fc, tuple(sorted(bc + (p, q)))
        for i in range(len(fc)):
            for j in range(len(bc)):
                yield fc[:i] + fc[i + 1:], bc[:j] + bc[j + 1:]

    fc, c, bc = start
    best = key(fc, c, bc)
    if best is None:     # (a start that does not fit)
        return None

    def best_of(cands):
        improved = None
        for cand in cands:
            k = key(*cand, bound=best[0])
            if k is not None and _one_device_better(k, improved or best):
                improved = k
        return improved

    while True:
        cands = [(f, c, b) for f, b in neighbours(fc, c, bc)]
        # the fused stage moved, dropping the cuts it passes
        cands += [(tuple(p for p in fc if p < c2), c2, tuple(p for p in bc if p < c2))
                  for c2 in range(1, n) if c2 != c]
        # two cuts at once (up to 16^2 a side) only where no single move helps
        improved = best_of(cands) or best_of((f, c, b) for f, b in pairs(fc, c, bc))
        if improved is None:
            return costs.make_plan(fc, c, bc)
        best = improved
        _, _, fc, c, bc = best


# ------------------------------------------------------------------------ infeasibility


def _min_budget(costs: _Costs, max_jobs) -> Optional[int]:
    """min over plans (J <= max_jobs) of the max job memory; a minimax DP on memory.

    Not simply "the finest cuts": a position with large live values (cut_bytes) costs every
    job that starts or ends there, so a coarser stage that skips it can need less memory.
    """
    n, K = costs.n, costs.max_side_stages(max_jobs)
    W = {k: _fill_rows(torch.empty_like(costs.mem[k]),
                       lambda r: costs.mem[k][r].masked_fill(~costs.valid[r], _I64_MAX))
         for k in ("fwd", "bwd")}
    Wf, Wb = W["fwd"], W["bwd"]
    Df = _minmax_layers(Wf, K, torch.iinfo(_I64).min, _I64_MAX)
    Db = _minmax_layers(Wb, K, torch.iinfo(_I64).min, _I64_MAX)
    fused = Wb[:, n]
    best = _best_combination(costs, Df, Db, fused, _I64_MAX, lambda T, J: T, max_jobs)
    return None if best is None else int(best[0])


def _gib(nbytes: int, up: bool = False) -> str:
    # Two decimals; rounded up where the number is a budget to set, so it really fits.
    q = -(-nbytes * 100 // GiB) if up else round(nbytes * 100 / GiB)
    return f"{q // 100}.{q % 100:02d}"


def _raise_infeasible(costs: _Costs, min_budget: Optional[int] = None,
                      plan: Optional[StagePlan] = None):
    if min_budget is None:
        min_budget = _min_budget(costs, costs.max_jobs)
    if min_budget is None:  # only max_jobs can cause this, and max_jobs >= 1 always allows J=1
        raise PlanningError(f"no stage plan with at most {costs.max_jobs} jobs exists")
    if plan is None:
        # The time-optimal plan under the smallest budget shows which job needs it.
        plan = _solve(costs.with_budget(min_budget))
    kind, (i, j) = next(job for job, m in zip(plan.jobs(), plan.job_memory) if m == min_budget)
    segs = costs.segments[i:j]
    P = sum(s.param_bytes for s in segs)
    ends = costs.cut_bytes[i] + costs.cut_bytes[j]
    what = f"2 x {_gib(P)} GiB weights (running + prefetched)"
    if kind != "fwd":
        G = sum(s.grad_bytes for s in segs)
        S = sum(s.saved_bytes for s in segs)
        what += f", {_gib(G)} GiB gradients, {_gib(S)} GiB saved for backward per microbatch"
    what += f", {costs.held} x {_gib(ends)} GiB activations across its boundaries"
    X = max(s.peak_bytes for s in segs)
    W = max(s.work_bytes for s in segs) if kind == "fwd" else 0
    if W > X:
        what += f", {_gib(W)} GiB for the values its forward holds at once"
    elif X:
        what += f", {'2 x ' if kind != 'fwd' else ''}{_gib(X)} GiB for its largest value"
    names = {"fwd": "forward", "bwd": "backward", "fused": "fused last"}
    fixes = ("use more microbatches (less activation memory per microbatch), lower-precision "
             "weights and gradients, or more legal cut points inside segments "
             f"[{i}, {j}) (e.g. more LM-head shards)")
    if costs.max_jobs is not None:
        free = _min_budget(costs, None)
        if free is not None and free < min_budget:
            fixes += f", or allow more stage jobs than max_jobs={costs.max_jobs}"
    budget, reserved = costs.memory_budget, costs.reserved
    need = _gib(min_budget + reserved, up=True)
    if reserved:   # Config.memory_budget = the jobs' budget + what the optimizer keeps there
        what_budget = (f"memory_budget={_gib(int(costs.budget_set))} GiB per device, less the {_gib(reserved)} GiB "
                       f"of fp32 masters and optimizer state that Config.optimizer_on_devices keeps there, leaves "
                       f"the stage jobs {_gib(int(budget))} GiB ({int(budget)} bytes), which")
        fixes = "lower Config.optimizer_on_devices (0 keeps the optimizer on the host), or " + fixes
    else:
        what_budget = f"memory_budget={_gib(int(budget))} GiB ({int(budget)} bytes) per device"
    fit = "the jobs of a plan fit" if reserved else "a plan fits"
    raise PlanningError(
        f"{what_budget} is too small "
        f"for any stage plan: the smallest budget {fit} is "
        f"{_gib(min_budget, up=True)} GiB ({min_budget} "
        f"bytes), needed by the {names[kind]} stage over segments [{i}, {j}) ({what}). "
        f"Raise Config.memory_budget to at least {need} GiB (memory_budget=\"{need}GiB\"), "
        f"or {fixes}.",
        min_budget=min_budget,
        stage=(kind, (i, j)),
    )


# -------------------------------------------------------------------------- brute force


def brute_force_stages(segments: Sequence[Segment], cut_bytes: Sequence[int], *,
                       num_devices: int, num_microbatches: int, memory_budget=None,
                       upload_bw: float = _INF, job_overhead_s: float = 0.0,
                       max_jobs: Optional[int] = None, overlapped_steps: bool = False) -> StagePlan:
    """Exhaustive reference for tests and tiny n: every c, every subset of forward cuts and,
    independently, every subset of backward cuts. O(n 4^n)."""
    costs = _Costs(segments, cut_bytes, num_devices=num_devices,
                   num_microbatches=num_microbatches, memory_budget=memory_budget,
                   upload_bw=upload_bw, job_overhead_s=job_overhead_s, max_jobs=max_jobs,
                   overlapped_steps=overlapped_steps)
    n = costs.n
    best_key, best = None, None
    mem_key, mem_plan = None, None  # smallest max-memory plan, for the error message
    for c in range(n):
        inner = range(1, c)
        subsets = [s for r in range(len(inner) + 1) for s in itertools.combinations(inner, r)]
        if c == 0:
            subsets = [()]
        for fc in subsets:
            for bc in subsets:
                J = (len(fc) + 1 if c else 0) + 1 + (len(bc) + 1 if c else 0)
                if max_jobs is not None and J > max_jobs:
                    continue
                plan = costs.make_plan(fc, c, bc)
                m = max(plan.job_memory)
                if mem_key is None or m < mem_key:
                    mem_key, mem_plan = m, plan
                if not all(costs.fits(x) for x in plan.job_memory):
                    continue
                key = (plan.est_time, J, fc, c, bc)
                if best_key is None or (_one_device_better(key, best_key) if num_devices == 1 or costs.overlap
                                        else key < best_key):
                    best_key, best = key, plan
    if best is None:
        if mem_plan is None:
            raise PlanningError(f"no stage plan with at most {max_jobs} jobs exists")
        _raise_infeasible(costs, mem_key, mem_plan)
    return best
