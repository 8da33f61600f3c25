"""Tests of the stage solver (rpcompile.passes.partition): the exact DP against an
exhaustive enumeration, the infeasibility report, and a few hand-checked plans."""

import math
import random
import re
import time

import pytest

from rpcompile.passes.partition import (
    PlanningError,
    Segment,
    StagePlan,
    brute_force_stages,
    solve_stages,
)

GiB = 1 << 30


# ----------------------------------------------------------------------------- helpers


def _expected_job(kind, i, j, segs, cut_bytes, M, bw, ovh, N=2):
    """Job time and memory straight from the documented formulas (independent of the
    module's cost tables)."""
    P = sum(s.param_bytes for s in segs[i:j])
    G = sum(s.grad_bytes for s in segs[i:j])
    S = sum(s.saved_bytes for s in segs[i:j])
    secs = sum((s.fwd_s if kind == "fwd" else s.bwd_s) for s in segs[i:j])
    t = max(M * secs, (P + M * (cut_bytes[i] + cut_bytes[j])) / bw) + ovh
    X = max(s.peak_bytes for s in segs[i:j])
    mem = 2 * P + (max(2, M) if N == 1 else 2) * (cut_bytes[i] + cut_bytes[j]) + X
    if kind != "fwd":
        mem += G + S + X
    return t, mem


def check_plan(plan: StagePlan, segs, cut_bytes, *, num_devices, num_microbatches,
               memory_budget=None, upload_bw=math.inf, job_overhead_s=0.0, max_jobs=None):
    """Structure, costs and est_time of a plan, recomputed from scratch."""
    n = len(segs)
    c, end = plan.fused
    assert end == n and 0 <= c < n
    if c == 0:
        assert plan.fwd_bounds == () and plan.bwd_bounds == ()
    # forward stages tile [0, c) in order; backward stages tile it in reverse order
    pos = 0
    for i, j in plan.fwd_bounds:
        assert i == pos and j > i
        pos = j
    assert pos == c
    pos = c
    for i, j in plan.bwd_bounds:
        assert j == pos and i < j
        pos = i
    assert pos == 0
    jobs = list(plan.jobs())
    assert [k for k, _ in jobs] == (["fwd"] * len(plan.fwd_bounds) + ["fused"]
                                     + ["bwd"] * len(plan.bwd_bounds))
    assert len(jobs) == plan.num_jobs == len(plan.job_times) == len(plan.job_memory)
    if max_jobs is not None:
        assert plan.num_jobs <= max_jobs
    for (kind, (i, j)), t, m in zip(jobs, plan.job_times, plan.job_memory):
        et, em = _expected_job(kind, i, j, segs, cut_bytes, num_microbatches, upload_bw,
                               job_overhead_s, num_devices)
        assert t == pytest.approx(et, rel=1e-12, abs=1e-300)
        assert m == em
        if memory_budget is not None:
            assert m <= memory_budget
    J = plan.num_jobs
    est = max(plan.job_times) * max(math.ceil(J / num_devices), 1 + (J - 1) / num_microbatches)
    if num_devices == 1:   # Note [one device sums]
        est = sum(plan.job_times)
    assert plan.est_time == pytest.approx(est, rel=1e-12, abs=1e-300)


def same_plan(dp, bf, kw, seed):
    """The DP's plan against the brute force's. With several devices: the same cost tables and
    tie-break rule give the identical plan. On one device the step is a sum of job times,
    whose last bits depend on the grouping, so near ties may pick other cuts: the same step
    time and number of jobs (Note [one device sums])."""
    if kw["num_devices"] > 1:
        assert dp == bf, seed
    else:
        assert dp.est_time == pytest.approx(bf.est_time, rel=1e-9, abs=1e-300), seed
        assert dp.num_jobs == bf.num_jobs, seed


def random_case(seed):
    """A small random table; some cases with integer costs (many exact ties), spiky
    cut_bytes, a budget that rules out some plans (or all), finite bandwidth, max_jobs."""
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    ints = rng.random() < 0.4
    segs = []
    for _ in range(n):
        f = rng.randint(0, 3) if ints else rng.uniform(0.01, 2.0)
        b = (rng.choice([1, 2, 3]) * f) if ints else f * rng.uniform(1.5, 4.0)
        p = rng.choice([0, 1, 2, 4]) * 1000 if ints else rng.randint(0, 5000)
        segs.append(Segment(float(f), float(b), p, rng.randint(0, p) if p else 0,
                            rng.randint(0, 3000), rng.choice([0, rng.randint(0, 4000)])))
    cut_bytes = [rng.choice([0, 10, 100, 5000]) if rng.random() < 0.5 else rng.randint(0, 500)
                 for _ in range(n + 1)]
    kw = dict(num_devices=rng.randint(1, 4), num_microbatches=rng.randint(1, 5))
    r = rng.random()
    if r < 0.45:
        # A budget among the memory values of actual jobs: some plans fit, some do not,
        # and sometimes none does.
        mems = [_expected_job(k, i, j, segs, cut_bytes, 1, math.inf, 0.0)[1]
                for k in ("fwd", "bwd") for i in range(n) for j in range(i + 1, n + 1)]
        kw["memory_budget"] = rng.choice(mems) + rng.choice([0, 0, -1, 0.5])
    if rng.random() < 0.3:
        total_p = sum(s.param_bytes for s in segs) or 1
        kw["upload_bw"] = total_p / rng.uniform(0.5, 6.0)
    if rng.random() < 0.3:
        kw["job_overhead_s"] = rng.choice([0.1, 0.5, 1.0])
    if rng.random() < 0.2:
        kw["max_jobs"] = rng.randint(1, 7)
    return segs, cut_bytes, kw


def _outcome(fn, segs, cut_bytes, kw):
    try:
        return fn(segs, cut_bytes, **kw), None
    except PlanningError as e:
        return None, e


# ------------------------------------------------------------------------- property test

SEEDS = list(range(400))
CHUNK = 50


@pytest.mark.parametrize("first", SEEDS[::CHUNK])
def test_dp_matches_brute_force(first):
    counts = {"ok": 0, "infeasible": 0}
    for seed in range(first, first + CHUNK):
        segs, cut_bytes, kw = random_case(seed)
        dp, dp_err = _outcome(solve_stages, segs, cut_bytes, kw)
        bf, bf_err = _outcome(brute_force_stages, segs, cut_bytes, kw)
        assert (dp_err is None) == (bf_err is None), (seed, dp_err, bf_err)
        if dp_err is not None:
            counts["infeasible"] += 1
            assert dp_err.min_budget == bf_err.min_budget, seed
            assert dp_err.min_budget > kw["memory_budget"], seed
            continue
        counts["ok"] += 1
        same_plan(dp, bf, kw, seed)
        check_plan(dp, segs, cut_bytes, **kw)
        check_plan(bf, segs, cut_bytes, **kw)
    assert counts["ok"] > CHUNK // 2, counts


def test_random_cases_cover_interesting_shapes():
    """Guard against the generator drifting into trivial cases."""
    stats = {"c0": 0, "c>0": 0, "infeasible": 0, "budget_binds": 0, "multi_bwd": 0}
    for seed in SEEDS:
        segs, cut_bytes, kw = random_case(seed)
        plan, err = _outcome(solve_stages, segs, cut_bytes, kw)
        if err is not None:
            stats["infeasible"] += 1
            continue
        stats["c0" if plan.split == 0 else "c>0"] += 1
        stats["multi_bwd"] += len(plan.bwd_bounds) > 1
        if kw.get("memory_budget") is not None:
            free = solve_stages(segs, cut_bytes, **{**kw, "memory_budget": None})
            stats["budget_binds"] += free.est_time < plan.est_time
    assert all(v >= 10 for v in stats.values()), stats


def test_small_tensor_blocks_do_not_change_results(monkeypatch):
    """The solver works in row/column blocks of at most _CHUNK elements (to stay off the
    intra-op thread pool); with tiny blocks every block boundary is exercised."""
    from rpcompile.passes import partition

    monkeypatch.setattr(partition, "_CHUNK", 5)
    for seed in range(0, 400, 5):
        segs, cut_bytes, kw = random_case(seed)
        dp, dp_err = _outcome(solve_stages, segs, cut_bytes, kw)
        bf, bf_err = _outcome(brute_force_stages, segs, cut_bytes, kw)
        assert (dp_err is None) == (bf_err is None), seed
        if dp_err is None:
            same_plan(dp, bf, kw, seed)
        else:
            assert dp_err.min_budget == bf_err.min_budget, seed


def test_dp_matches_brute_force_n8():
    for seed in range(6):
        rng = random.Random(1000 + seed)
        segs = [Segment(rng.uniform(0.1, 1), rng.uniform(0.3, 3), rng.randint(0, 1000),
                        rng.randint(0, 500), rng.randint(0, 500)) for _ in range(8)]
        cut_bytes = [rng.randint(0, 300) for _ in range(9)]
        kw = dict(num_devices=rng.randint(2, 4), num_microbatches=rng.randint(3, 8),
                  memory_budget=rng.choice([None, 2600, 3200]))
        dp, dp_err = _outcome(solve_stages, segs, cut_bytes, kw)
        bf, bf_err = _outcome(brute_force_stages, segs, cut_bytes, kw)
        assert (dp_err is None) == (bf_err is None)
        if dp_err is None:
            same_plan(dp, bf, kw, seed)
            check_plan(dp, segs, cut_bytes, **kw)
        else:
            assert dp_err.min_budget == bf_err.min_budget


# ----------------------------------------------------------------------- infeasibility


def _gib_in_message(msg):
    m = re.search(r"Raise Config\.memory_budget to at least (\d+\.\d\d) GiB", msg)
    assert m, msg
    return float(m.group(1))


def test_infeasible_budget_reports_smallest_fitting_budget():
    # 8 transformer-ish blocks of 0.25 GiB weights and a 1 GiB LM head as its own segment.
    blk = Segment(1.0, 3.0, GiB // 4, GiB // 4, GiB // 8)
    head = Segment(0.5, 1.5, GiB, GiB, GiB // 2)
    segs = [blk] * 8 + [head]
    cut_bytes = [GiB // 64] * 10
    kw = dict(num_devices=2, num_microbatches=4)
    need = 2 * GiB + GiB + GiB // 2 + 2 * (2 * GiB // 64)  # the head as fused stage alone
    with pytest.raises(PlanningError) as ei:
        solve_stages(segs, cut_bytes, memory_budget=3 * GiB, **kw)
    err = ei.value
    assert isinstance(err, ValueError)
    assert err.min_budget == need
    assert err.stage == ("fused", (8, 9))
    msg = str(err)
    assert "segments [8, 9)" in msg and "Config.memory_budget" in msg
    assert "more microbatches" in msg and "lower-precision" in msg
    # The exact number works, one byte less does not.
    plan = solve_stages(segs, cut_bytes, memory_budget=err.min_budget, **kw)
    check_plan(plan, segs, cut_bytes, memory_budget=err.min_budget, **kw)
    assert plan.max_job_memory == need
    with pytest.raises(PlanningError):
        solve_stages(segs, cut_bytes, memory_budget=err.min_budget - 1, **kw)
    # The rounded-up GiB figure in the message works too.
    gib = _gib_in_message(msg)
    assert gib == math.ceil(need / GiB * 100) / 100
    solve_stages(segs, cut_bytes, memory_budget=gib * GiB, **kw)
    with pytest.raises(PlanningError):
        solve_stages(segs, cut_bytes, memory_budget=(gib - 0.01) * GiB, **kw)


def test_min_budget_is_not_just_the_finest_cuts():
    # Position 2 carries huge live values: any stage ending or starting there pays for
    # them, so the cheapest plan keeps [1, 3) together. Finest cuts would overstate it.
    segs = [Segment(1.0, 3.0, 100, 100, 0)] * 4
    cut_bytes = [0, 0, 10_000, 0, 0]
    kw = dict(num_devices=2, num_microbatches=4)
    with pytest.raises(PlanningError) as ei:
        solve_stages(segs, cut_bytes, memory_budget=100, **kw)
    with pytest.raises(PlanningError) as eb:
        brute_force_stages(segs, cut_bytes, memory_budget=100, **kw)
    # e.g. forward [0, 3), fused [3, 4), backward [1, 3) then [0, 1): 2*200 + 200 = 600,
    # where the finest cuts need 2*100 + 100 + 2*10_000 for the jobs touching position 2.
    assert ei.value.min_budget == eb.value.min_budget == 600
    plan = solve_stages(segs, cut_bytes, memory_budget=ei.value.min_budget, **kw)
    assert 2 not in plan.fwd_cuts + plan.bwd_cuts + (plan.split,)


def test_random_infeasible_min_budget_is_tight():
    checked = 0
    for seed in SEEDS:
        segs, cut_bytes, kw = random_case(seed)
        _, err = _outcome(solve_stages, segs, cut_bytes, kw)
        if err is None:
            continue
        checked += 1
        b = err.min_budget
        plan = solve_stages(segs, cut_bytes, **{**kw, "memory_budget": b})
        assert plan.max_job_memory == b
        kind, (i, j) = err.stage
        assert f"[{i}, {j})" in str(err)
        with pytest.raises(PlanningError):
            solve_stages(segs, cut_bytes, **{**kw, "memory_budget": b - 1})
    assert checked >= 10


def test_max_jobs_cap_is_mentioned_when_it_binds():
    segs = [Segment(1.0, 3.0, 100, 100, 0)] * 4
    cut_bytes = [0] * 5
    with pytest.raises(PlanningError) as ei:
        solve_stages(segs, cut_bytes, num_devices=2, num_microbatches=4, memory_budget=400,
                     max_jobs=2)
    assert ei.value.min_budget == 3 * 400  # only the single fused job is allowed
    assert "max_jobs=2" in str(ei.value)


# ----------------------------------------------------------------------- hand-checked


def test_uniform_segments_balanced():
    # 8 segments, fwd 1 s, bwd 3 s, N=2, M=4. f(J) = ceil(J/2) for J >= 3 (the busiest
    # device runs ceil(J/2) jobs). J = 5 or 6 reach T = 24 s (6 s/mb) but f = 3: est 72;
    # J = 4 reaches T = 36 s (9 s/mb) with f = 2: est 72 too, and ties go to fewer jobs.
    # Lexicographically first: forward [0, 5), fused [5, 8) (9 s/mb), backward [2, 5), [0, 2).
    segs = [Segment(1.0, 3.0, 0, 0, 0)] * 8
    plan = solve_stages(segs, [0] * 9, num_devices=2, num_microbatches=4)
    assert plan.fwd_bounds == ((0, 5),)
    assert plan.fused == (5, 8)
    assert plan.bwd_bounds == ((2, 5), (0, 2))
    assert plan.job_times == (20.0, 36.0, 36.0, 24.0)
    assert plan.est_time == 72.0
    assert list(plan.jobs()) == [("fwd", (0, 5)), ("fused", (5, 8)), ("bwd", (2, 5)), ("bwd", (0, 2))]
    assert plan == brute_force_stages(segs, [0] * 9, num_devices=2, num_microbatches=4)


@pytest.mark.parametrize("N,M,max_jobs", [(1, 4, None), (4, 1, None), (4, 8, 2), (4, 8, 1)])
def test_single_fused_job(N, M, max_jobs):
    # N=1 or M=1: f(J) >= J, and est >= sum of job times, which a c > 0 plan only raises
    # (it adds the forward jobs). max_jobs < 3 leaves only c = 0.
    segs = [Segment(1.0, 3.0, 10, 10, 10)] * 5
    plan = solve_stages(segs, [1] * 6, num_devices=N, num_microbatches=M, max_jobs=max_jobs)
    assert plan.fwd_bounds == () and plan.bwd_bounds == ()
    assert plan.fused == (0, 5) and plan.split == 0
    assert list(plan.jobs()) == [("fused", (0, 5))]
    assert plan.est_time == M * 15.0 * max(1 / N, 1.0)


def test_one_device_fused_stage_as_long_as_memory_allows():
    # Note [one device sums]: on one device a step is the sum of its job times, so the fused
    # stage (no recompute) takes every segment the budget lets it hold. Here it holds 5 of 8
    # (10 bytes saved each, budget 50): 3 segments are left to recompute, 27 s per microbatch.
    # The balanced-chain formula (T * J) chose 11 jobs of 3 s per microbatch: 33 s.
    segs = [Segment(1.0, 3.0, 0, 0, 10)] * 8
    kw = dict(num_devices=1, num_microbatches=4, memory_budget=50)
    plan = solve_stages(segs, [0] * 9, **kw)
    assert list(plan.jobs()) == [("fwd", (0, 3)), ("fused", (3, 8)), ("bwd", (0, 3))]
    assert plan.est_time == sum(plan.job_times) == 4 * 27.0
    same_plan(plan, brute_force_stages(segs, [0] * 9, **kw), kw, None)
    check_plan(plan, segs, [0] * 9, **kw)


def test_backward_stages_hold_fewer_segments():
    segs = [Segment(1.0, 3.0, 0, 0, 0)] * 24
    plan = solve_stages(segs, [0] * 25, num_devices=4, num_microbatches=8)
    fw = [j - i for i, j in plan.fwd_bounds]
    bw = [j - i for i, j in plan.bwd_bounds]
    assert len(bw) > len(fw) >= 1
    assert min(fw) > max(bw)
    # and the solution is a real optimum, not just plausible
    assert plan.est_time <= min(
        solve_stages(segs, [0] * 25, num_devices=4, num_microbatches=8,
                     max_jobs=j).est_time for j in range(1, 20))


def test_tie_break_prefers_fewer_jobs_then_smallest_cuts():
    # Identical segments with zero cost: every plan has est 0; the single job wins.
    segs = [Segment(0.0, 0.0, 0, 0, 0)] * 4
    plan = solve_stages(segs, [0] * 5, num_devices=2, num_microbatches=2)
    assert plan.num_jobs == 1
    # A heavy last segment dominates T: forward/backward cuts are free to move, and the
    # lexicographically smallest ones are chosen (both solvers agree).
    # M=8, N=4: fused [4, 5) takes 80 s; J=4 gives est 80 * 1.375 = 110 (J=3: 96 * 1.25,
    # c=0: 176). Backward [0, 4) (12 s/mb) must split in two stages of <= 10 s/mb, at 1, 2
    # or 3: all tie, and the smallest cut wins.
    segs = [Segment(1.0, 3.0, 0, 0, 0)] * 4 + [Segment(1.0, 10.0, 0, 0, 0)]
    kw = dict(num_devices=4, num_microbatches=8)
    plan = solve_stages(segs, [0] * 6, **kw)
    assert plan == brute_force_stages(segs, [0] * 6, **kw)
    assert plan.fwd_bounds == ((0, 4),) and plan.fused == (4, 5)
    assert plan.bwd_bounds == ((1, 4), (0, 1)) and plan.bwd_cuts == (1,)
    assert plan.est_time == 110.0


def test_upload_bound_and_overhead():
    # Uploading 1e9 bytes at 1e9 B/s takes 1 s > 4 x 0.1 s of compute: stages are
    # upload-bound, and overhead is added per job.
    segs = [Segment(0.1, 0.3, 10**9, 0, 0)] * 2
    plan = solve_stages(segs, [0] * 3, num_devices=1, num_microbatches=4, upload_bw=1e9,
                        job_overhead_s=0.5)
    assert plan.num_jobs == 1
    assert plan.job_times == (max(4 * 0.6, 2.0) + 0.5,)


def test_input_validation():
    segs = [Segment(1.0, 3.0, 0, 0, 0)]
    with pytest.raises(ValueError):
        solve_stages(segs, [0], num_devices=1, num_microbatches=1)  # cut_bytes too short
    with pytest.raises(ValueError):
        solve_stages([], [0], num_devices=1, num_microbatches=1)
    with pytest.raises(ValueError):
        solve_stages(segs, [0, 0], num_devices=0, num_microbatches=1)
    with pytest.raises(ValueError):
        solve_stages(segs, [0, 0], num_devices=1, num_microbatches=1, max_jobs=0)
    with pytest.raises(ValueError):
        solve_stages([Segment(-1.0, 3.0, 0, 0, 0)], [0, 0], num_devices=1, num_microbatches=1)
    with pytest.raises(ValueError):
        solve_stages(segs, [0, 0], num_devices=1, num_microbatches=1, memory_budget=-1)
    with pytest.raises(ValueError):
        solve_stages(segs, [0, 0], num_devices=1, num_microbatches=1, upload_bw=0)
    # an infinite budget means no budget
    plan = solve_stages(segs, [0, 0], num_devices=1, num_microbatches=1,
                        memory_budget=math.inf)
    assert plan.fused == (0, 1)


# ------------------------------------------------------------------------- performance


def test_n300_solves():
    rng = random.Random(7)
    n = 300
    segs = [Segment(rng.uniform(0.5, 1.5), rng.uniform(1.5, 4.5), rng.randint(1, 50) << 20,
                    rng.randint(1, 50) << 20, rng.randint(1, 100) << 20) for _ in range(n)]
    cut_bytes = [rng.randint(1, 20) << 20 for _ in range(n + 1)]
    kw = dict(num_devices=4, num_microbatches=8, memory_budget=2 * GiB, upload_bw=20e9,
              job_overhead_s=0.01)
    t0 = time.perf_counter()
    plan = solve_stages(segs, cut_bytes, **kw)
    elapsed = time.perf_counter() - t0
    check_plan(plan, segs, cut_bytes, **kw)
    assert plan.num_jobs > 3
    print(f"n=300: {elapsed:.3f} s, {plan.num_jobs} jobs, est {plan.est_time:.1f} s")
    # no budget, no max_jobs: the largest search
    t0 = time.perf_counter()
    plan = solve_stages(segs, cut_bytes, num_devices=4, num_microbatches=8)
    print(f"n=300 unconstrained: {time.perf_counter() - t0:.3f} s, {plan.num_jobs} jobs")
    check_plan(plan, segs, cut_bytes, num_devices=4, num_microbatches=8)
