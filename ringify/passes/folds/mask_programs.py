"""Attention masks read as programs over O(S) vectors (``ringify/runtime/masks/program.py``).

``fold_mask_programs`` runs on the exported graph before the plan. For each
attention with a mask it reads the mask's subgraph as a program (``mask_reader.py``):
the nodes with both a query and a key dim are the program, the tensors feeding them
its inputs (a query or key dim of size 1: O(S); a table whole). The mask argument
becomes one ``program_mask``
node of the program's text and inputs, and the S x S nodes die: nothing of S x S
size is computed at trace or at run time, nor evaluated to decide what the mask is.
The ring rewrite hands the text and the inputs to the ring op, which bounds and
evaluates it tile by tile and returns the gradient of its learned inputs. A mask
that is not such a program (a tensor the model was given, an op with no tile form or,
on a learned path, no gradient rule) is kept as it is; the attention's node records
why.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ringify.passes.folds.mask_reader import NotAProgram, read_program, writes_only_a_temporary
from ringify.passes.graph.attention_nodes import find_attention
from ringify.passes.graph.crossings import PassState
from ringify.passes.graph.nodes import call, shape, val
from ringify.passes.graph.vocabulary import ASSERTS
from ringify.runtime.attention.blocks import runs_varlen
from ringify.runtime.attention.protocol import bias_dtype
from ringify.runtime.collectives.heads import Transport
from ringify.runtime.masks.call_plan import attention_plan
from ringify.runtime.masks.captures import host_inputs
from ringify.runtime.masks.program import MaskProgram, parse, program_mask
from ringify.runtime.masks.step_masks import step_masks

aten = torch.ops.aten
MASK_NOTE = "ringify_mask"  # node.meta key: why an attention's mask is (not) a program


def fold_mask_programs(gm: fx.GraphModule) -> int:
    """Replace the mask of every attention of ``gm`` by a ``program_mask`` node where it is a
    program; note on each attention node why not; how many."""
    graph, attentions = gm.graph, find_attention(gm.graph)
    sizes, count = _symbolic_sizes(graph), 0
    for att in attentions:
        if att.mask is None:
            continue
        try:
            program, inputs = read_program(att.mask)
            mask_shape = [sizes.get(_expr(s), s) for s in shape(att.mask)]
            if any(isinstance(s, torch.SymInt) for s in mask_shape):
                raise NotAProgram("a symbolic size no node of the graph computes")
        except NotAProgram as e:
            att.node.meta[MASK_NOTE] = str(e)
            continue
        with graph.inserting_before(att.node):
            folded = graph.call_function(
                program_mask, (program.text(), inputs, mask_shape, val(att.mask).device)
            )
        folded.meta["val"] = val(att.mask)
        att.node.replace_input_with(att.mask, folded)
        att.node.meta[MASK_NOTE] = _summary(program)
        count += 1
    _erase_dead(graph)
    return count


def _symbolic_sizes(graph: fx.Graph) -> dict:
    """Symbolic size -> the first node computing it (a graph traced with a dynamic length)."""
    sizes = {}
    for node in graph.nodes:
        if isinstance(val(node), torch.SymInt):
            sizes.setdefault(_expr(val(node)), node)
    return sizes


def _expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else None


def _summary(program: MaskProgram) -> str:
    ops = sorted({op.split(".")[0] for op, _, _ in program.code})
    roles = "".join(sorted(set(program.roles)))
    return f"program of {len(program.code)} ops ({', '.join(ops)}) on {len(program.roles)} O(S) inputs ({roles})"


def _erase_dead(graph: fx.Graph) -> None:
    """Dead code elimination that also drops export's dtype asserts on dead tensors
    (they would keep the S x S mask nodes alive)."""
    changed = True
    while changed:
        changed = False
        for node in list(graph.nodes):
            checked = node.args[0] if node.target in ASSERTS else None
            dead_assert = isinstance(checked, fx.Node) and all(
                u.target in ASSERTS for u in checked.users
            )
            if dead_assert or (not node.users and writes_only_a_temporary(node)):
                graph.erase_node(node)
                changed = True
        changed |= graph.eliminate_dead_code()


def program_inputs(
    folded: fx.Node, state: PassState, is_causal: bool, transport: Transport | None = None
) -> tuple[str, list[fx.Node], fx.Node]:
    """The ring op's ``(mask_program, mask_inputs, plan)`` for a ``program_mask`` node: its
    text, its inputs whole on every rank, padded with the sequence (O(S) each), and the
    ``attention_plan`` node that every ring op under it shares (once per model call)."""
    # Layers often fold a program of their own from the same inputs (HF slices its mask
    # per layer): one set of whole inputs and one plan per program text and inputs.
    program = (folded.args[0], tuple(folded.args[1]))
    if ("program", program) not in state._cache:
        state._cache["program", program] = _whole_inputs(folded, state)
    text, whole = state._cache["program", program]
    return text, whole, step_plan(state, text, whole, is_causal, folded, transport)


def step_plan(
    state: PassState, text: str, whole: list[fx.Node], is_causal: bool, like: fx.Node,
    transport: Transport | None = None,
) -> fx.Node:  # fmt: skip
    """The ``attention_plan`` node of the ring ops under program ``text`` with inputs
    ``whole`` ("" and none: of every unmasked call of the geometry) and ``transport``, made
    once per graph."""
    key = ("plan", text, tuple(whole), is_causal, transport)
    if key not in state._cache:
        # right after its inputs: outside any layer's checkpointed or FSDP span that the
        # program's node may sit in, so that no recompute makes the plan again
        geo, order = state.geo, {n: i for i, n in enumerate(state.graph.nodes)}
        first = next(n for n in state.graph.nodes if n.op == "placeholder")
        latest = max(whole, key=order.__getitem__, default=first)  # no inputs: at the top
        with state.graph.inserting_before(state.after(latest)):
            host = _on_host(state, whole)
            args = (text, host, geo.local, is_causal, state.group_name, geo.layout, geo.length)
            device = val(whole[0]).device.type if whole else ""
            plan = call(state.graph, attention_plan._opoverload, args, {
                "transport": transport, "device_type": device}, like=like)  # fmt: skip
        state.place[plan] = None
        state._cache[key] = plan
    return state._cache[key]


def step_masks_of(
    state: PassState, plan: fx.Node, whole: list[fx.Node], q: fx.Node, softcap: float
) -> list[fx.Node]:
    """The ``step_masks`` of ``plan`` for ring calls of ``q`` (their bias dtype, whether they
    run FA2 varlen calls): made once per graph, right after the plan, from the program's
    inputs ``whole`` on the device (``runtime/masks/step_masks.py``)."""
    q_val = val(q)
    varlen = runs_varlen(q_val, softcap)  # as the ring op decides it
    key = ("step masks", plan, bias_dtype(q_val), varlen, q_val.device, state.geo.local)
    if key not in state._cache:
        with state.graph.inserting_before(state.after(plan)):
            made = call(state.graph, step_masks._opoverload, (whole, plan, *key[2:]), like=q)
            tensors = [call(state.graph, operator.getitem, (made, i)) for i in range(2)]
        for node in (made, *tensors):
            state.place[node] = None
        state._cache[key] = tensors
    return state._cache[key]


def _on_host(state: PassState, whole: list[fx.Node]) -> list[fx.Node]:
    """``whole`` copied to the host by one ``host_inputs`` node: the plan op takes host
    tensors, so that Inductor makes its output (an opaque value) a host value too."""
    if not whole:
        return []
    copied = call(state.graph, host_inputs._opoverload, (whole,))
    host = [call(state.graph, operator.getitem, (copied, i)) for i in range(len(whole))]
    for node in (copied, *host):
        state.place[node] = None
    return host


def _whole_inputs(folded: fx.Node, state: PassState) -> tuple[str, list[fx.Node]]:
    text, inputs = folded.args[:2]
    pad = state.geo.padded - state.geo.length
    whole = []
    for x, role in zip(inputs, parse(text).roles, strict=True):
        if state.sharded(x):
            x = state.gather(x)
        if state.geo.pads and role in ("q", "k"):
            spec = [0, pad] if role == "k" else [0, 0, 0, pad]
            with state.graph.inserting_before(state.after(x)):
                x = call(state.graph, aten.constant_pad_nd.default, (x, spec, 0))
            state.place[x] = None
        if val(x).is_floating_point():  # each rank's ring returns its part of the gradient
            x = state.copy_to_ring(x)
        whole.append(x)
    return text, whole
