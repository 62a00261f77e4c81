"""The pass, in order: what happens to an exported graph before one rank of the ring runs it.

1. ``folded``: each form attention, masks, shifts, convolutions and a loss are written in
   becomes the canonical op the rules read: ``FOLDS``, one tuple of one signature (a fold
   takes the graph module, rewrites it in place and says how many sites it folded; docs/
   design.md section 3.1), then each tensor-parallel layer gets its collectives;
2. ``sharded``: where the sequence is (the plan), then every node rewritten for one rank
   (rules, crossings, attention on its transport), with what was done (the report);
3. ``runnable``: the graph's values recorded, a router's top-k run as ``ringify::topk``
   (its backward opaque to Inductor), the model's state lifted to inputs, and the
   checkpointed spans and FSDP2 units kept.

A ``Composition`` names a way through them, and is what a caller picks: ``ONE_LENGTH``
(``trace.py``: a call's graph), ``MANY_LENGTHS`` (``lengths.py``: the graphs at several
lengths whose integers are fitted, then one made runnable) and ``DECODE_STEP``
(``generation/step.py``: folded, then the decode step's own rewrite, ``passes/decode.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled

from ringify.config import Config
from ringify.passes.checkpoints import keep_checkpoints
from ringify.passes.folds.constants import drop_empty_concatenated
from ringify.passes.folds.convs import fold_sequence_convs
from ringify.passes.folds.flex import fold_flex_attention
from ringify.passes.folds.functional import functionalize_writes
from ringify.passes.folds.gqa import fold_repeated_kv
from ringify.passes.folds.handwritten import fold_handwritten_attention
from ringify.passes.folds.identity_index import fold_identity_indexing
from ringify.passes.folds.joints import fold_joint_sequences
from ringify.passes.folds.loss_shift import fold_sliced_loss
from ringify.passes.folds.mask_programs import fold_mask_programs
from ringify.passes.folds.scans import fold_linear_recurrences, fold_selective_scans
from ringify.passes.folds.shifts import fold_shifts
from ringify.passes.folds.spellings import fold_synonyms
from ringify.passes.folds.wrapped import inline_autocast_regions, inline_no_grad_regions
from ringify.passes.graph.attention_nodes import find_attention
from ringify.passes.graph.report import Report
from ringify.passes.module_regions import keep_fsdp_units
from ringify.passes.sharding.sequence_plan import Plan, plan_sequence
from ringify.passes.sharding.shard_sequence import shard_sequence
from ringify.passes.tp_collectives import place_tp_collectives
from ringify.passes.values import record_local_values
from ringify.runtime.collectives.ring import Ring
from ringify.runtime.topk import opaque_topks
from ringify.stacks.fsdp_units import units_reducing_over_ring
from ringify.stacks.tp_layers import TpLayer

Fold = Callable[[fx.GraphModule], int]

# In order; where an order matters, the line says why.
FOLDS: tuple[Fold, ...] = (
    inline_autocast_regions,  # first: the other folds read the regions' ops as the graph's
    inline_no_grad_regions,
    fold_flex_attention,  # before functionalize_writes: its BlockMask is built by vmapped writes
    functionalize_writes,
    fold_synonyms,  # before the folds that read cat, expand and views in one spelling
    fold_identity_indexing,  # before fold_mask_programs: a mask reads the view as an O(S) input
    fold_shifts,
    fold_sliced_loss,
    fold_sequence_convs,
    fold_selective_scans,
    fold_linear_recurrences,
    fold_handwritten_attention,
    fold_repeated_kv,  # after fold_handwritten_attention: it reads the SDPA that one makes
    fold_joint_sequences,  # after every attention is SDPA: it splits SDPA over joint keys
    fold_mask_programs,  # last: it reads the mask of every attention the folds above left
)


@dataclass(frozen=True)
class Composition:
    """A way through the pass: the folds it runs, in order, and ``general``: the padding
    steps go in whatever the length (a graph whose integers ``lengths.py`` fits)."""

    folds: tuple[Fold, ...]
    general: bool = False


# a decode step reads its cache through cats of empty constants, which the others drop
_FORWARD_FOLDS = (*FOLDS, drop_empty_concatenated)
ONE_LENGTH = Composition(_FORWARD_FOLDS)
MANY_LENGTHS = Composition(_FORWARD_FOLDS, general=True)
DECODE_STEP = Composition(FOLDS)


def folded(
    exported: torch.export.ExportedProgram,
    composition: Composition = ONE_LENGTH,
    layers: dict[str, TpLayer] | None = None,
) -> fx.GraphModule:
    """1. The exported graph with ``composition``'s folds run (docs/design.md, 3.1), and
    tensor parallelism's collectives around its TP ``layers``."""
    gm = exported.module()
    # export's input-shape guards check global shapes; the signature key already pins them.
    for node in [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
        gm.graph.erase_node(node)
    _check_no_attention_without_grad(gm)
    for fold in composition.folds:
        fold(gm)
    place_tp_collectives(gm, layers or {})
    return gm


def _check_no_attention_without_grad(gm: fx.GraphModule) -> None:
    """Raise if an attention runs inside a region export made of ``torch.no_grad()`` (a
    ``wrap_with_set_grad_enabled`` submodule, which the pass does not enter)."""
    for node in gm.graph.nodes:
        if node.target is wrap_with_set_grad_enabled and find_attention(
            getattr(gm, node.args[1].target).graph
        ):
            raise ValueError(
                f"an attention runs inside {node.name}, a region where the model switches "
                "gradients off (torch.no_grad() or torch.set_grad_enabled): ringify does not "
                "rewrite attention there. Run that attention with gradients enabled, or "
                "outside the ringified model."
            )


def sharded(
    gm: fx.GraphModule,
    config: Config,
    composition: Composition,
    dims: dict | None,
    gathered: dict,
    local_outputs: int = 0,
) -> tuple[Plan, str, Report]:
    """2. ``gm`` rewritten in place for one rank: its plan, its code before, the report.
    ``dims``/``gathered``: the inputs passed sharded (``inputs="sharded"``);
    ``local_outputs``: the graph's last outputs that stay on this rank's shard."""
    plan = plan_sequence(gm, config, dims, gathered, general=composition.general)
    before = gm.code
    report = shard_sequence(
        gm.graph,
        plan=plan,
        group_name=config.ring().name,
        inputs_full=config.inputs == "full",
        outputs_full=config.outputs == "full",
        local_outputs=local_outputs,
        dilation=config.dilation,
        strategy=config.transports,
    )
    return plan, before, report


def runnable(
    gm: fx.GraphModule, model: nn.Module, flat: list, checkpoints: list, units: dict,
    outer: nn.Module | None, ring: Ring,
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:  # fmt: skip
    """3. ``gm`` made runnable in place: ``(state names, checkpointed spans, FSDP2 units)``."""
    record_local_values(gm, flat)
    opaque_topks(gm)  # Inductor misorders topk's own backward (runtime/topk.py)
    state_names = lift_state(gm.graph, model)
    checkpointed = keep_checkpoints(gm, checkpoints)
    reduced_outside = units_reducing_over_ring(units, outer, ring)
    state_names, kept_units = keep_fsdp_units(gm, model, units, state_names, reduced_outside)
    return state_names, checkpointed, kept_units


def named_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every name of every parameter and buffer (a tied tensor under each of its names)."""
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]


def lift_state(graph: fx.Graph, model: nn.Module) -> tuple[str, ...]:
    """Turn each read of a model parameter or buffer into a leading input; their names.

    The graph then returns its flat outputs (the call's pytree structure is applied
    by the caller), so it holds no reference to the model's tensors.
    """
    owned = {n for n, _ in named_state(model)}
    reads = [n for n in graph.nodes if n.op == "get_attr" and n.target in owned]
    with graph.inserting_before(next(iter(graph.nodes))):
        lifted = [graph.placeholder(f"state_{node.name}") for node in reads]
    for node, placeholder in zip(reads, lifted, strict=True):
        placeholder.meta = dict(node.meta)
        node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
    graph._codegen = fx.graph.CodeGen()
    graph.lint()
    return tuple(n.target for n in reads)
