"""Which plans a run made: those of the graph's ``attention_plan`` nodes, and those ring calls
made for themselves (given no plan). A test helper: it wraps ringify's own ``plan_for``."""

from __future__ import annotations

import contextlib
from unittest import mock

from ringify.runtime.attention import ops
from ringify.runtime.masks import call_plan as plan_module


class MadePlans:
    def __init__(self) -> None:
        self.by_graph: list = []  # made by ``ringify::attention_plan``, in order
        self.by_calls: list = []  # made inside a ring call given no plan

    def calls(self) -> int:
        """The ring calls (forward and backward) that ran on the graph's plans."""
        return sum(sum(p.calls.values()) for p in self.by_graph)

    def counts(self) -> dict[str, int]:
        """``{"balanced": n, "kept": n}``: the ring calls on a balanced plan and the others."""
        plans = self.by_graph + self.by_calls
        return {k: sum(p.calls[k] for p in plans) for k in ("balanced", "kept")}


@contextlib.contextmanager
def made_plans():
    made, build = MadePlans(), plan_module.plan_for

    def recorder(into):
        def record(*args, **kwargs):
            into.append(build(*args, **kwargs))
            return into[-1]

        return record

    with (
        mock.patch.object(plan_module, "plan_for", recorder(made.by_graph)),
        mock.patch.object(ops, "plan_for", recorder(made.by_calls)),
    ):
        yield made
