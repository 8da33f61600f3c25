"""Does a call agree with a capture's symbolic input shapes? (Note [dynamic lengths] in lengths.py)

A capture holds for every call whose input sizes (1) bind each size symbol to one value (two
dims with one symbol must be equal), (2) equal every fixed size and every size expression, and
(3) satisfy dynamo's guards and the symbols' value ranges (a length the model branched on, the
0/1 specialisation). Batch symbols are bound to the call's batch but not range-checked: the
runner splits the batch, down to one-row microbatches, and checks rows itself (Note [batched
inputs]).
"""
from __future__ import annotations

from typing import Optional

import sympy
import torch


def _expr(size) -> sympy.Expr:
    return size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)


class InputShapes:
    """The symbolic shapes of a capture's inputs, and the sizes each call binds them to."""

    def __init__(self, captured, batch_symbols=frozenset()):
        self.dims = []              # (leaf index, dim, sympy expression)
        for n in captured.placeholders():
            ev = n.meta.get("example_value")
            if n.meta.get("rp_kind") == "input" and isinstance(ev, torch.Tensor):
                self.dims += [(n.meta["rp_index"], d, _expr(s)) for d, s in enumerate(ev.shape)]
        self.batch = {s.name for s in batch_symbols}
        env = captured.shape_env
        self.guards = [env.replace(g.expr) for g in env.guards] if env is not None else []
        self.ranges = dict(env.var_to_range) if env is not None else {}
        self._seen: dict = {}       # input sizes -> bindings or None (steady steps: one lookup)

    def bind(self, leaves) -> Optional[dict]:
        """{symbol name: value} of the call (batch symbols: the whole batch), or None when the
        call's sizes do not agree with the capture."""
        sizes = tuple(tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None for leaf in leaves)
        if sizes not in self._seen:
            self._seen[sizes] = self._bind(sizes)
        return self._seen[sizes]

    def accept(self, leaves) -> dict:
        """The call the capture was made from: agrees by construction (whatever the guards say)."""
        sizes = tuple(tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None for leaf in leaves)
        self._seen[sizes] = self._bind(sizes, check=False)
        return self._seen[sizes]

    def _bind(self, sizes, check=True) -> Optional[dict]:
        env, compound = {}, []
        for leaf, d, expr in self.dims:
            value = sympy.Integer(sizes[leaf][d])
            if expr.is_Symbol:
                if env.setdefault(expr, value) != value and check:
                    return None
            elif expr.is_Integer or not expr.free_symbols:
                if expr != value and check:
                    return None
            else:
                compound.append((expr, value))
        if check and not self._holds(env, compound):
            return None
        return {s.name: int(v) for s, v in env.items()}

    def _holds(self, env, compound) -> bool:
        for expr, value in compound:
            if expr.free_symbols <= env.keys() and expr.xreplace(env) != value:
                return False
        for s, value in env.items():
            r = self.ranges.get(s)
            if s.name not in self.batch and r is not None and value not in r:
                return False
        for g in self.guards:
            if g.free_symbols <= env.keys() and g.xreplace(env) is not sympy.true:
                return False
        return True
