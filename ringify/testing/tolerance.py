"""Tolerances for results rounded in float32 or below, measured rather than chosen.

A ring computes the same sums as the unmodified model in another order (a sequence split
over ranks, blocks merged by log-sum-exp, a gradient summed per rank then all-reduced).
In float64 the difference is rounding (1e-16 relative). In float32 and below it depends on
the CPU's kernels: a bound read off one machine fails on another. So the bound is the
unmodified model's own difference under an equivalent reordering (its batch rows in
another order, say) or its own error from a float64 truth, measured on the machine that runs
the test, times a small factor: the ring's reordering is of the same kind, a few times larger
at most.
"""

from __future__ import annotations

import torch

EXACT = 1e-10  # a float64 result: rounding only
FACTOR = 10.0  # the ring reorders more sums than the reference (1.4-2x measured), not 10x
UNDER_INDUCTOR = 1.5  # the ringified model beside the unmodified one, both under Inductor
_ROUNDED = 1e-12  # a reference difference above this was rounded in float32 or below


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` in norm, computed in float64."""
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm().clamp_min(torch.finfo(torch.float64).tiny)).item()


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: relative_difference(got[name], want[name]) for name in want}


def reordering_tolerances(
    want: dict[str, torch.Tensor], reordered: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Per result, its tolerance from the unmodified model's results ``want`` and the same
    model's ``reordered`` ones (an equivalent computation in another order).

    A result held in float32 or below, or one the reordering moved beyond float64 rounding
    (computed in a lower precision inside a float64 model, as Gemma's norms upcast to
    float32 only), gets ``FACTOR`` times the largest such movement, so that one result's
    lucky cancellation does not set its bound, and never less than ``FACTOR`` epsilons of
    a result's own dtype. The others must agree to ``EXACT``.
    """
    moved = differences(reordered, want)
    rounded = {n for n, d in moved.items() if d > _ROUNDED or want[n].dtype.itemsize < 8}
    # A result held in float32 is resolved to its own epsilon at best, even if the
    # reordering happened to round it the same (a float32 loss over a few tokens).
    floor = max(
        (torch.finfo(want[n].dtype).eps for n in rounded if want[n].dtype.itemsize < 8), default=0.0
    )
    scale = FACTOR * max([floor, *(moved[n] for n in rounded)])
    return {n: scale if n in rounded else EXACT for n in want}


def exceeding(differences: dict[str, float], tolerances: dict[str, float]) -> dict[str, tuple]:
    """The results whose difference exceeds their tolerance: {name: (difference, tolerance)}."""
    return {n: (d, tolerances[n]) for n, d in differences.items() if not d <= tolerances[n]}


def truth_tolerance(reference: torch.Tensor, truth: torch.Tensor) -> float:
    """The tolerance of a low-precision result whose float64 ``truth`` is known: ``FACTOR``
    times the unmodified computation's (``reference``, same dtype) own relative error from
    it, and never less than ``FACTOR`` epsilons of that dtype (``EXACT`` in float64, where the
    reference can be the truth itself: SDPA's float64 kernel on a GPU)."""
    floor = rounding(reference.dtype) or EXACT
    return max(FACTOR * relative_difference(reference, truth), floor)


def rounding(dtype: torch.dtype) -> float:
    """The least relative tolerance a result held in ``dtype`` can be compared to: ``FACTOR``
    epsilons of it (0 for float64, whose bound is ``EXACT``). The format's, not a machine's."""
    return FACTOR * torch.finfo(dtype).eps if dtype.itemsize < 8 else 0.0


def inductor_bound(own: float, dtype: torch.dtype = torch.float64) -> float:
    """The bound of a result of the ringified model under Inductor: ``UNDER_INDUCTOR`` times
    the unmodified model's own difference from eager under Inductor (``own``, the test's
    control, measured beside it), never below rounding in ``dtype`` (``EXACT`` in float64)."""
    return max(UNDER_INDUCTOR * own, rounding(dtype) or EXACT)
