"""The longest sequence a plan fits the memory budget at, said by PlanningError (issue #12).

Note [longest length]: when no stage plan fits the memory budget at a call's sizes, the error
says the smallest budget that would fit (partition.py) and, where the sequence length is a
size symbol (Note [dynamic lengths] in lengths.py), the longest length that fits this budget
with the same rows per microbatch: `PlanningError.max_length`, and a sentence of the message.
It is found at planning time, in the caller's thread, before anything runs:

- "A plan fits at L" is what the passes would find planning at L (every length symbol bound to
  L, every other binding as in the failed call): the legal cuts and the segment table at L
  (cut_points.py, from the cost pass's symbolic costs; the cuts themselves can move with L) and
  the solver's smallest budget over all plans (partition._min_budget, the memory minimax DP the
  error's min_budget comes from) at most the budget. A plan exists exactly when that holds.
- The search keeps a bracket lo < hi with a plan at lo and none at hi: hi starts at the failed
  length (its min_budget is the error's, no solver call), lo at 1 (when not even 1 fits,
  max_length is None). Each step evaluates one length inside the bracket: where the parabola
  through the last three lengths evaluated (a line through two) meets the budget, rounded
  down (Muller's method); a bisection step where the parabola leaves the bracket, or where two
  such steps did not halve it. It stops at hi = lo + 1, so max_length = lo fits and
  max_length + 1 does not: the granularity is one token. Device memory is a polynomial of
  degree <= 2 in L per job (activations, and attention scores where a model keeps them), so
  the guess lands at once and the next step checks its neighbour: 3 solver calls, counting the
  one at 1, where memory is affine in L over the bracket, 4 to 6 where it is quadratic (tests/
  test_longest_length.py), at most about 1 + 3 log2(L) for any growth. Measured on 2 CPU
  cores: 4 calls, 0.07-0.1 s in all, on the test model (tests/models.py qwen3, 388 nodes);
  5 calls of 0.4-0.6 s (legal cuts and segment table 0.2 s, the memory DP over 463 segments
  0.33 s), 2-3 s in all, for the Qwen3-1.7B shape of tests/test_cost.py failing at 32k-200k
  tokens (a plan there takes 15-20 s).
- "Longest" is the end of the bracket: memory grows with L, but where the legal cuts move with
  L a longer length could fit again; the search does not look past the first length that fails.
- The answer is what the compiled model's next call at that length would plan. A capture
  chooses the LM head's shard count from the cost model at its sizes
  (lm_head.estimate_num_shards: head FLOPs over one layer's; attention grows faster than the
  head, so shorter lengths choose more shards, each with a smaller slice of the logits, which
  need less memory; and at least enough shards to keep each one's logits within a share of the
  budget, Note [shards by memory]), and so does a re-plan of a held capture at a new length
  (Note [plans per length] in plan_cache.py: the passes re-run from the capture with the
  length bound, split_lm_head included). So (train mode, Config.lm_head_shards None, the head
  split) each length L is planned with the shard count a plan at L would choose:
  estimate_num_shards on the graph before split_lm_head with the length symbols bound to L (its
  FLOPs substituted from the symbolic shapes, no capture), and a graph split into that many
  shards: the passes from capture to find_batch re-run on the same capture with
  Config(lm_head_shards=K), once per distinct K the search meets (_capture_shards). Memory is
  then a step function of L per shard count, so the search takes a few more solver calls, and
  each new K costs a re-split and the cost pass (most of the time). Measured on 2 CPU cores: the
  test model (vocab 2048, first call at 128 tokens) 9 calls, 3.4-4 s (0.2-0.3 s before),
  max_length 64 where the failed capture's 5 shards said 48; the Qwen3-1.7B shape (2 devices,
  24 GiB, 8 rows per microbatch, first call at 32,768 tokens, 2 shards) 8 calls, 13-16 s (2.3-2.6
  s before: 3 shard counts split at 2.3-3 s each, one of them, 6 shards, only for L = 1),
  max_length 6,639 where it said 3,330, and a fresh capture plans at 6,639 (4 shards) and not at
  6,640 (tests/test_longest_length.py checks the same on the test model). Until the twenty-first
  session a re-plan kept its capture's shard count (the search did too): Llama-3.1-8B captured
  at 8,192 tokens kept 3 shards, 10.4 GiB of fp32 logits each at 65,536, and no plan fit 24 GiB
  past 45,282 tokens; with the count following the length, 99,121 (CPU planning with the H100
  cost model). Only the shard count follows the length: anything else a capture at another
  length does differently (dynamo's specialisations) is not modelled. A plan the compiled
  model already holds may also serve a few tokens more than a new plan would (it was cut at
  other sizes).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable, Optional

from ..lengths import length_symbols
from .cut_points import legal_cuts, segment_table
from .partition import PlanningError, _Costs, _gib, _min_budget


def min_budget_at(st, bindings: dict) -> int:
    """The smallest memory budget any plan of `st` (a CompileState past cut_points) fits at
    `bindings`: the cut_points and solve_stages passes' numbers there, memory only."""
    cuts = legal_cuts(st.gm, st.liveness, bindings)
    segments, cut_bytes = segment_table(st.gm, st.liveness, cuts, bindings, st.hardware)
    config = st.config
    costs = _Costs(segments, cut_bytes, num_devices=len(config.devices), num_microbatches=st.num_microbatches,
                   memory_budget=None, upload_bw=math.inf, job_overhead_s=0.0, max_jobs=config.max_jobs)
    return _min_budget(costs, config.max_jobs)


def _capture_shards(st, names):
    """Where the LM head's shard count follows the length (Config.lm_head_shards None, the
    head split): (L -> the shard count a plan at L would choose, K -> a CompileState past
    find_batch and liveness split into K shards, cached; the failed call's K is `st`). None where the shard count does not follow the length."""
    head = st.lm_head
    if (st.mode != "train" or st.config.lm_head_shards is not None
            or not isinstance(head, dict) or not head.get("split")):
        return None
    from . import PASSES, CompileState, _passes_between, max_logit_bytes
    from .cut_points import liveness
    from .lm_head import estimate_num_shards, find_lm_head

    def run(config, stop):
        """The state the pass named `stop` would see."""
        s = CompileState(captured=st.captured, config=config, mode=st.mode, loss_output=st.loss_output_arg,
                         on_devices=st.on_devices, num_microbatches=st.num_microbatches)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _, fn, _ in _passes_between(PASSES[0][0], stop):
                s = fn(s)
        return s

    unsplit = run(st.config, "split_lm_head").gm        # the graph split_lm_head sees
    lm_head = find_lm_head(unsplit)
    if lm_head is None or lm_head.reason is not None:
        return None
    states = {head["K"]: st}

    cap = max_logit_bytes(st.config, st.budget)

    def shards(L):
        return estimate_num_shards(unsplit, lm_head, at=dict.fromkeys(names, L), max_logit_bytes=cap)

    def state(K):
        if K not in states:
            s = run(dataclasses.replace(st.config, lm_head_shards=K), "cut_points")
            s.bindings, s.hardware, s.liveness = st.bindings, st.hardware, liveness(s.gm)
            states[K] = s
        return states[K]
    return shards, state


def _guess(points, budget, lo, hi) -> Optional[float]:
    """Where the parabola through the last three (L, need) points (the line through the last
    two, when only two or the parabola misses the bracket) meets the budget, inside [lo, hi];
    None when neither does."""
    def inside(r):
        return r is not None and math.isfinite(r) and lo <= r <= hi
    (x1, f1), (x2, f2) = points[-2:]
    line = None if f1 == f2 else x1 + (budget - f1) * (x2 - x1) / (f2 - f1)
    if len(points) >= 3:
        x0, f0 = points[-3]
        if len({x0, x1, x2}) == 3:
            # f ~ f2 + d (x - x2) + c (x - x2)(x - x1), in u = x - x2
            d = (f2 - f1) / (x2 - x1)
            c = (d - (f1 - f0) / (x1 - x0)) / (x2 - x0)
            # c u^2 + (d + c (x2 - x1)) u + (f2 - budget) = 0
            A, B, C = c, d + c * (x2 - x1), f2 - budget
            roots = []
            if A == 0:
                if B != 0:
                    roots = [-C / B]
            else:
                disc = B * B - 4 * A * C
                if disc >= 0:
                    q = -(B + math.copysign(math.sqrt(disc), B)) / 2
                    roots = [q / A] + ([C / q] if q != 0 else [])
            cands = [x2 + u for u in roots if inside(x2 + u)]
            if cands:
                return min(cands, key=lambda r: abs(r - line) if inside(line) else 0)
    return line if inside(line) else None


def longest_fitting(need: Callable[[int], int], budget: int, length: int, need_at_length: int):
    """(the largest L in [1, length) with need(L) <= budget, or None when need(1) > budget;
    how many times need was called). need_at_length = need(length) > budget (not called again).
    The result L has need(L) <= budget < need(L + 1). Note [longest length]."""
    calls = 0

    def m(L):
        nonlocal calls
        calls += 1
        return need(L)

    if length <= 1:
        return None, 0
    lo, need_lo = 1, m(1)
    if need_lo > budget:
        return None, calls
    hi = length                                       # invariant: need(lo) <= budget < need(hi)
    points = [(lo, need_lo), (hi, need_at_length)]    # every length evaluated, in order
    steps, checkpoint = 0, hi - lo                    # interpolation steps since the bracket was checkpoint wide
    while hi - lo > 1:
        r = None
        if steps < 2 or 2 * (hi - lo) <= checkpoint:  # else two steps did not halve it: bisect
            if steps == 2:
                steps, checkpoint = 0, hi - lo
            r = _guess(points, budget, lo, hi)
        if r is None:
            x, steps = (lo + hi) // 2, 0
        else:
            x, steps = min(max(math.floor(r), lo + 1), hi - 1), steps + 1
        value = m(x)
        if value <= budget:
            lo = x
        else:
            hi = x
        points.append((x, value))
        if steps == 0:
            checkpoint = hi - lo
    return lo, calls


def planning_error(st, e: PlanningError, rows: int) -> PlanningError:
    """The solver's error `e` as the solve_stages pass raises it, with the longest length that
    fits (Note [longest length]) where the sequence length is symbolic. rows: the rows per
    microbatch the failed call was planned at."""
    message = f"no stage plan fits: {e}"
    max_length = None
    if e.min_budget is not None and st.budget is not None:
        batch_names = {s.name for s in st.batch.symbols} if st.batch is not None else set()
        length, names = length_symbols(st.gm, st.bindings, batch_names)
        if length is not None and length > 1:
            budget = math.floor(st.budget)
            per_shards = _capture_shards(st, names)

            def need(L):
                at = {**st.bindings, **dict.fromkeys(names, L)}
                return min_budget_at(st if per_shards is None else per_shards[1](per_shards[0](L)), at)
            try:
                max_length, _ = longest_fitting(need, budget, length, e.min_budget)
                searched = True
            except ArithmeticError:
                # Note [lengths a model cannot run at]: a size of the graph may be undefined at a
                # shorter length (DeepSeek-V4's compressed attention: `L // (L // 4)`, a division by
                # zero below 4 tokens; bytes that come out negative, the solver's NegativeSize:
                # MiniMax's lightning attention unrolled in blocks of 8 tokens, Min(16, L) - 8 at 1
                # token); the search raised those in place of this PlanningError. Then the error
                # says the budget alone.
                searched = False
            per = f"{rows} row{'s' * (rows != 1)} per microbatch"
            more = ", or use more microbatches" if rows > 1 else ""
            if searched and max_length is None:
                message += f" No sequence length fits this budget at {per}, not even 1 token."
            elif searched:
                message += (f" The longest sequence that fits this budget is {max_length:,} tokens (at {per}; "
                            f"this call's is {length:,}): shorten sequences to that, raise memory_budget to at least "
                            f"{_gib(e.min_budget + st.reserved, up=True)} GiB{more}.")
    # min_budget: the Config.memory_budget to set, the devices' share of the optimizer included
    min_budget = None if e.min_budget is None else e.min_budget + st.reserved
    return PlanningError(message, min_budget=min_budget, stage=e.stage, max_length=max_length)
