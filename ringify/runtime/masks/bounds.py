"""Bounds of a mask program over tile pairs: which are surely hidden, surely fully visible.

Interval arithmetic: each input is replaced by its (min, max) over a tile, positions
by the tile's first and last; every instruction maps intervals to an interval that
holds all its possible values, for every (query tile, key tile) pair at once as
(n, m) tensors. A bool mask whose interval is [0, 0] hides the whole pair, [1, 1]
shows all of it; a float mask shows all of it at [0, 0] and hides it at
[-inf, -inf]. Anything the bounds cannot settle (a NaN, an op without an interval
rule) is *mixed*: the op evaluates that pair exactly. Bounds only ever widen, so a
pair is never skipped or unmasked wrongly.
"""

from __future__ import annotations

import torch

from ringify.runtime.masks.program import MaskProgram, resolve

_INF = float("inf")


def program_bounds(program: MaskProgram, inputs: list, q_pos: tuple, k_pos: tuple):
    """(lo, hi) of the mask over every tile pair; ``inputs[i]`` and ``q_pos``/``k_pos``
    are (lo, hi) pairs of float64 tensors: (n, 1) for queries, (1, m) for keys."""
    results: list[tuple] = []
    for op, args, dtype in program.code:
        vals = [resolve(a, inputs, results, q_pos, k_pos, _point) for a in args]
        results.append(_bound(op, vals, dtype, q_pos, k_pos))
    return results[-1]


def _point(a):
    """A literal number as the interval [a, a]."""
    if not isinstance(a, (bool, int, float)):
        return a
    t = torch.tensor(float(a), dtype=torch.float64)
    return t, t


def _unknown():
    return torch.tensor(-_INF, dtype=torch.float64), torch.tensor(_INF, dtype=torch.float64)


def _bool(all_true, any_true):
    """The interval of a bool result that is surely true where ``all_true``, surely false
    where not ``any_true``."""
    return all_true.double(), any_true.double()


def _compare(name: str, a, b):
    (alo, ahi), (blo, bhi) = a, b
    unknown = alo.isnan() | ahi.isnan() | blo.isnan() | bhi.isnan()
    all_true, any_true = _compared(name, alo, ahi, blo, bhi)
    return _bool(all_true & ~unknown, any_true | unknown)


def _compared(name: str, alo, ahi, blo, bhi):
    """(surely true, possibly true) of ``a <name> b`` from the bounds."""
    if name == "le":
        return ahi <= blo, alo <= bhi
    if name == "lt":
        return ahi < blo, alo < bhi
    if name == "ge":
        return alo >= bhi, ahi >= blo
    if name == "gt":
        return alo > bhi, ahi > blo
    same = (alo == ahi) & (blo == bhi) & (alo == blo)
    apart = (ahi < blo) | (bhi < alo)
    return (same, ~apart) if name == "eq" else (apart, ~same)


def _where(c, a, b):
    (clo, chi), (alo, ahi), (blo, bhi) = c, a, b
    lo = torch.where(clo >= 1, alo, torch.where(chi < 1, blo, torch.minimum(alo, blo)))
    hi = torch.where(clo >= 1, ahi, torch.where(chi < 1, bhi, torch.maximum(ahi, bhi)))
    return lo, hi


def _corners(f, a, b):
    values = [f(x, y) for x in a for y in b]
    lo, hi = values[0], values[0]
    for v in values[1:]:
        lo, hi = torch.minimum(lo, v), torch.maximum(hi, v)
    return lo, hi


def _cast(x, dtype: str):
    lo, hi = x
    if dtype == "bool":  # x != 0
        return _bool((lo > 0) | (hi < 0), (lo != 0) | (hi != 0))
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()) and dtype.startswith("int"):
        return _unknown()
    target = getattr(torch, dtype)  # every cast rounds monotonically: cast the bounds
    return lo.to(target).double(), hi.to(target).double()


def _bound(op: str, args: list, dtype: str, q_pos, k_pos):
    name = op.split(".")[0]
    if op == "cast":
        return _cast(args[0], dtype)
    if op == "const":
        return args[0]
    if name in ("le", "lt", "ge", "gt", "eq", "ne"):
        return _compare(name, *args[:2])
    logical = dtype == "bool"
    if logical and name in ("__and__", "bitwise_and", "logical_and"):
        return torch.minimum(args[0][0], args[1][0]), torch.minimum(args[0][1], args[1][1])
    if logical and name in ("__or__", "bitwise_or", "logical_or"):
        return torch.maximum(args[0][0], args[1][0]), torch.maximum(args[0][1], args[1][1])
    if name == "logical_not" or (logical and name == "bitwise_not"):
        lo, hi = _cast(args[0], "bool")
        return 1 - hi, 1 - lo
    if name == "add":
        return args[0][0] + args[1][0], args[0][1] + args[1][1]
    if name == "sub":
        return args[0][0] - args[1][1], args[0][1] - args[1][0]
    if name == "rsub":
        return args[1][0] - args[0][1], args[1][1] - args[0][0]
    if name == "neg":
        return -args[0][1], -args[0][0]
    if name == "mul":
        return _finite_or_unknown(_corners(torch.mul, *args[:2]))
    if name in ("maximum", "max"):
        return torch.maximum(args[0][0], args[1][0]), torch.maximum(args[0][1], args[1][1])
    if name in ("minimum", "min"):
        return torch.minimum(args[0][0], args[1][0]), torch.minimum(args[0][1], args[1][1])
    if name in ("exp", "log", "sqrt"):  # monotone: NaN (log of a negative) is unknown
        f = getattr(torch, name)
        return _finite_or_unknown((f(args[0][0]), f(args[0][1])))
    if op == "embed":  # any entry of the table
        return _finite_or_unknown(args[0])
    if name == "where":
        return _where(*args)
    if name == "masked_fill":
        return _where(args[1], args[2], args[0])
    if name in ("tril", "triu"):
        x, diagonal = args[0], args[1][0]
        offset = (k_pos[0] - q_pos[1], k_pos[1] - q_pos[0])  # key - query
        zero = (torch.zeros(()).double(),) * 2
        below = (offset[1] <= diagonal, offset[0] <= diagonal)  # (all kept, any kept) by tril
        above = (offset[0] >= diagonal, offset[1] >= diagonal)
        every, some = below if name == "tril" else above
        return _where(_bool(every, some), x, zero)
    return _unknown()  # abs, div, remainder, ...: the pair is evaluated


def _finite_or_unknown(bounds):
    lo, hi = bounds
    bad = torch.isnan(lo) | torch.isnan(hi)
    return torch.where(bad, -_INF, lo), torch.where(bad, _INF, hi)


def settled(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype):
    """(surely hidden, surely fully visible) per tile pair, from the mask's bounds."""
    if dtype == torch.bool:
        return hi < 1, lo >= 1
    return hi == -_INF, (lo == 0) & (hi == 0)
