"""The pass: shard the sequence dimension of a whole ATen graph over a ring.

Two phases. Inference (``rules.infer_placements``) gives every node a placement
from its inputs': replicated, or sequence-sharded (``placement.py``). The
rewrite then walks the graph once and makes each rank compute exactly its part:

- sequence inputs are sliced on entry (``inputs_full``), a sequence born inside
  the graph where it is born, and sharded outputs gathered on exit (``outputs_full``);
  sharded inputs that only build masks are gathered on entry (``Plan.gathered``);
- every node whose inputs carry the sequence gets its rule's rewrite
  (``rules.py``): local sizes, replicated operands sliced or copied to the ring,
  reductions over the ring, attention into the ring op;
- a node no rule can shard has its sharded inputs gathered and runs replicated:
  always exact, and reported; unless it and what is computed from it keep another dim
  independent, where they run on a share of that dim instead (``resharded.py``).

A sequence the ring cannot split evenly is padded at the end (``sequence_plan.py``
decides): causal attention never looks at the padding, otherwise the op cuts the
padded keys off (``key_len``); reductions mask it out, cross-entropy targets are
padded with ``ignore_index``, and gathers drop it.
"""

from __future__ import annotations

import dataclasses

from torch import fx

from ringify.config import Auto
from ringify.passes.graph.attention_nodes import Attention, find_attention
from ringify.passes.graph.crossings import PassState
from ringify.passes.graph.placement import Fallback
from ringify.passes.graph.report import AttentionRun, Report
from ringify.passes.sharding.attention_rule import reported
from ringify.passes.sharding.resharded import reshard_plans, rewrite_member
from ringify.passes.sharding.rules import rule_for
from ringify.passes.sharding.sequence_plan import Plan
from ringify.runtime.attention.dilation import Dilation
from ringify.runtime.collectives.heads import Transport


def shard_sequence(
    graph: fx.Graph,
    *,
    plan: Plan,
    group_name: str,
    inputs_full: bool = True,
    outputs_full: bool = True,
    local_outputs: int = 0,
    dilation: Dilation | None = None,
    strategy: Transport | Auto | None = None,
) -> Report:
    """Rewrite ``graph`` in place into what one rank of the ring runs; what was done."""
    attentions = find_attention(graph)
    inference, resharding, whole_because = reshard_plans(
        graph, plan.geometry, plan.seeds, group_name
    )
    place = dict(inference.place.of)
    state = PassState(graph, plan.geometry, group_name, place, dilation, strategy)
    for node in list(graph.nodes):
        if getattr(node, "_erased", False):  # an attention kernel's outputs, already replaced
            continue
        if node in resharding:
            decided = inference.decisions.get(node)
            if isinstance(decided, Fallback) and resharding[node].gathers_for(node):
                state.report_gather(node, decided)
            rewrite_member(node, resharding[node], state)
        elif node in plan.gathered and not inputs_full:
            state.place[node] = plan.gathered[node]
            users = list(node.users)
            full = state.gather(node)
            for user in users:
                user.replace_input_with(node, full)
        elif node in plan.seeds and (inputs_full or node.op != "placeholder"):
            state.place[node] = None  # computed whole on every rank; its users get the slice
            users = list(node.users)
            local = state.slice(node, plan.seeds[node], 0)
            for user in users:
                user.replace_input_with(node, local)
        elif node.op == "output" and outputs_full:
            outputs = list(node.args[0])
            kept = len(outputs) - local_outputs  # the last ``local_outputs`` stay sharded
            node.args = (
                [
                    state.gather(a) if i < kept and state.sharded(a) else a
                    for i, a in enumerate(outputs)
                ],
            )
        elif node in inference.decisions:
            decided = inference.decisions[node]
            if isinstance(decided, Fallback):
                because = whole_because.get(node)
                detail = f"{decided.detail} ({because})".strip() if because else decided.detail
                state.fall_back(node, dataclasses.replace(decided, detail=detail))
            else:
                rule_for(node.target).rewrite(node, decided, state)
    graph.eliminate_dead_code()
    graph.lint()
    geo = plan.geometry
    return Report(
        geo.ring_size,
        geo.layout,
        geo.length,
        geo.padded,
        tuple(n.name for n in plan.births),
        _every_attention(attentions, state),
        tuple(state.gathers),
        resharded=tuple(state.resharded),
    )


def _every_attention(attentions: list[Attention], state: PassState) -> tuple:
    """The report's row of every attention of the graph: those the rules did not run on
    shards ran on the full sequence, gathered or replicated."""
    rows = {row.node: row for row in state.attentions}
    gathered = {g.node for g in state.gathers}
    return tuple(
        rows.get(a.node.name)
        or reported(
            a,
            AttentionRun.GATHERED if a.node.name in gathered else AttentionRun.REPLICATED,
            state,
        )
        for a in attentions
    )
