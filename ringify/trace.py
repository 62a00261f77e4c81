"""One input signature's trace: export the model, run the pass, lift the model's state out.

``trace()`` exports the model (``torch.export``, training IR, on fake tensors at
global shapes), runs the pass, and turns every parameter and buffer the graph
reads into a leading input. The graph keeps no tensor of the model: the
ringified module passes the model's current parameters and buffers at each
call, so ``load_state_dict(assign=True)``, ``model.to()`` and swapped
parameters take effect, and buffers the model updates (BatchNorm's running
statistics) are updated in place in the model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import fx, nn
from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from ringify.config import Config
from ringify.export_errors import export_failure
from ringify.parallelized import (
    fsdp_units,
    is_fsdp_hook,
    state_kind,
    units_averaging_over_ring,
    unsharded_for_trace,
)
from ringify.passes.attention import find_attention
from ringify.passes.autocast import inline_autocast_regions
from ringify.passes.checkpoints import CheckpointRecorder, keep_checkpoints
from ringify.passes.constants import drop_empty_concatenated
from ringify.passes.convs import fold_sequence_convs
from ringify.passes.flex import fold_flex_attention
from ringify.passes.fsdp_units import keep_fsdp_units
from ringify.passes.functional import functionalize_writes
from ringify.passes.gqa import fold_repeated_kv
from ringify.passes.handwritten import fold_handwritten_attention
from ringify.passes.identity_index import fold_identity_indexing
from ringify.passes.joints import fold_joint_sequences
from ringify.passes.loss_shift import fold_sliced_loss
from ringify.passes.mask_programs import fold_mask_programs
from ringify.passes.plan import plan_sequence, sharded_input_dims
from ringify.passes.report import Report
from ringify.passes.shard_sequence import shard_sequence
from ringify.passes.shifts import fold_shifts
from ringify.passes.values import record_local_values

log = logging.getLogger("ringify")


@dataclass
class Traced:
    """One input signature's rewritten graph (a plain object, not a submodule).

    ``module(*state, *flat_inputs)`` returns the flat outputs, where ``state`` is the
    model's tensors named by ``state_names`` (read at call time, see ``state_of``).
    """

    module: fx.GraphModule
    before: str
    report: Report
    state_names: tuple[str, ...]
    state_meta: tuple
    tied: tuple[tuple[str, ...], ...]  # names that shared one tensor when traced
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    shared_inputs: tuple[int, ...]  # flat inputs every rank passes whole (fingerprinted)
    lengths: object = None  # ``lengths.Lengths`` where one graph serves many lengths
    sequence_inputs: tuple[tuple[int, int], ...] = ()  # (flat index, dim) the pass sliced


def state_of(model: nn.Module, names: tuple[str, ...]) -> list[torch.Tensor]:
    """The model's current parameters and buffers named by ``names``."""
    tensors = []
    for name in names:
        owner, _, attr = name.rpartition(".")
        tensors.append(getattr(model.get_submodule(owner) if owner else model, attr))
    return tensors


def meta_of(tensors: list[torch.Tensor]) -> tuple:
    """What a traced graph assumed about the model's state: a change means a new trace."""
    return tuple((t.shape, t.dtype, t.device, state_kind(t)) for t in tensors)


def still_fits(traced: Traced, model: nn.Module, state: list[torch.Tensor]) -> bool:
    """Whether ``traced`` still computes the model: same state shapes, dtypes and devices,
    and tied tensors still tied (an untied copy would get no gradient from the graph)."""
    if meta_of(state) != traced.state_meta:
        return False
    return all(len({id(t) for t in state_of(model, names)}) == 1 for names in traced.tied)


def _named_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every name of every parameter and buffer (a tied tensor under each of its names)."""
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]


def _tied(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    names: dict[int, list[str]] = {}
    for name, t in _named_state(model):
        names.setdefault(id(t), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


@dataclass
class Rewritten:
    """One export of the model, rewritten by the pass: what ``finish`` turns into a ``Traced``."""

    gm: fx.GraphModule
    before: str
    report: Report
    exported: torch.export.ExportedProgram
    checkpoints: list
    units: dict
    flat: list
    shared_inputs: tuple[int, ...]
    sequence_inputs: tuple[tuple[int, int], ...]


def trace(model: nn.Module, config: Config, args, kwargs, outer: nn.Module | None = None) -> Traced:
    """``model``'s graph for this call's signature, rewritten; ``outer`` is the module that
    runs it (an FSDP2 root unit around it reduces the gradients of what it holds)."""
    return finish(rewrite(model, config, args, kwargs), model, config, outer)


def rewrite(
    model: nn.Module, config: Config, args, kwargs, shapes: dict | None = None, general=False
) -> Rewritten:
    """Export and rewrite: the inputs at ``shapes`` (flat index -> shape) where given, and
    with ``general`` the padding steps inserted even where the length needs none (the
    graphs that ``lengths.py`` compares across lengths)."""
    units = fsdp_units(model)
    ring = config.ring()
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    dims, gathered = {}, {}
    if config.inputs == "sharded":
        dims, gathered = _sharded_inputs(model, units, spec, flat, config)
        scaled = {i: _scaled(flat[i].shape, d, ring.size) for i, d in (dims | gathered).items()}
        exported, checkpoints = _export(model, units, spec, flat, scaled)
    else:
        exported, checkpoints = _export(model, units, spec, flat, shapes or {})
    gm = exported_module(exported)
    drop_empty_concatenated(gm)  # (the decode step reads its cache through those cats)
    _warn_about_hooks(model)
    plan = plan_sequence(gm, config, dims or None, gathered, general=general)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # inputs the model does not read (HF's labels beside shift_labels) need not agree
    unread = {i for i, n in enumerate(placeholders) if not n.users}
    sequence = tuple(
        (placeholders.index(n), s.dim) for n, s in plan.seeds.items() if n in placeholders
    )
    before = gm.code
    report = shard_sequence(
        gm.graph,
        plan=plan,
        group_name=ring.name,
        inputs_full=config.inputs == "full",
        outputs_full=config.outputs == "full",
        dilation=config.dilation,
        strategy=config.strategy,
    )
    shared = tuple(i for i in tensors if i not in dims and i not in gathered and i not in unread)
    return Rewritten(gm, before, report, exported, checkpoints, units, flat, shared, sequence)


def finish(done: Rewritten, model: nn.Module, config: Config, outer: nn.Module | None) -> Traced:
    """The rewritten graph made runnable: values recorded, state lifted, checkpointed and
    FSDP spans kept."""
    gm, report, ring = done.gm, done.report, config.ring()
    record_local_values(gm, done.flat)
    state_names = lift_state(gm.graph, model)
    checkpointed = keep_checkpoints(gm, done.checkpoints)
    averaged = units_averaging_over_ring(done.units, outer, ring)
    state_names, kept_units = keep_fsdp_units(
        gm, model, done.units, state_names, averaged, ring.size
    )
    report = dataclasses.replace(report, checkpointed=checkpointed, fsdp_units=kept_units)
    module = fx.GraphModule(gm, gm.graph)
    for gather in report.gathers:
        log.warning(
            "ringify: gathered the sequence for %s (%s): %s %s",
            gather.node,
            gather.op,
            gather.reason.value,
            gather.detail,
        )
    log.info("ringify: traced a new input signature\n%s", report)
    return Traced(
        module,
        done.before,
        report,
        state_names,
        meta_of(state_of(model, state_names)),
        _tied(model),
        done.exported.call_spec.in_spec,
        done.exported.call_spec.out_spec,
        done.shared_inputs,
        sequence_inputs=done.sequence_inputs,
    )


def _sharded_inputs(model: nn.Module, units: dict, spec, flat: list, config: Config):
    """The inputs of ``inputs="sharded"`` mode that are this rank's part (see
    ``sharded_input_dims``). The global shapes are not known before they are: they are found
    on a trace at the local shapes. Where that trace fails because an input was passed
    full (a (B, S) padding mask beside (B, S / P) ids), it is traced again with that input
    cut to the local length: an integer or bool input whose dim is ring-size times the
    same dim of another input of as many dims. Inputs passed full stay full."""
    try:
        structure = exported_module(_export(model, units, spec, flat, {})[0])
        full = {}
    except RuntimeError as error:
        full = _passed_full(flat, config.ring_size)
        if not full:
            raise
        try:
            structure = exported_module(_export(model, units, spec, flat, full)[0])
        except RuntimeError:
            raise error from None
    dims, gathered = sharded_input_dims(structure, config)
    return (
        {i: d for i, d in dims.items() if i not in full},
        {i: d for i, d in gathered.items() if i not in full},
    )


def _passed_full(flat: list, ring_size: int) -> dict[int, list[int]]:
    """Input index -> its shape cut to the local length, for inputs that look passed full."""
    tensors = [(i, x) for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    cut = {}
    for i, x in tensors:
        if x.is_floating_point() or x.is_complex():
            continue
        for d, size in enumerate(x.shape):
            if (
                size > ring_size
                and size % ring_size == 0
                and any(
                    j != i and y.dim() == x.dim() and y.shape[d] * ring_size == size
                    for j, y in tensors
                )
            ):
                cut[i] = _scaled(x.shape, d, 1 / ring_size)
                break
    return cut


def _scaled(shape, dim: int, factor: float) -> list[int]:
    shape = list(shape)
    shape[dim] = round(shape[dim] * factor)
    return shape


def lift_state(graph: fx.Graph, model: nn.Module) -> tuple[str, ...]:
    """Turn each read of a model parameter or buffer into a leading input; their names.

    The graph then returns its flat outputs (the call's pytree structure is applied
    by the caller), so it holds no reference to the model's tensors.
    """
    owned = {n for n, _ in _named_state(model)}
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


def _warn_about_hooks(model: nn.Module) -> None:
    """Hooks ran once, during the trace, on fake tensors; say what that means."""
    hooked = [
        name or type(model).__name__
        for name, m in model.named_modules()
        if any(
            not is_fsdp_hook(h)
            for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
        )
    ]
    if hooked:
        log.warning(
            "ringify: forward hooks on %s ran once, while tracing, on fake tensors: what "
            "they compute into the module's output is part of the graph and runs at every "
            "call, but their side effects (logging, storing activations) do not happen at "
            "each call. A hook added or removed later makes ringify trace again. Run such "
            "code outside the model, or on the unmodified model.",
            ", ".join(hooked),
        )


def _fakes(flat: list, shapes: dict[int, list[int]], mode: FakeTensorMode) -> list:
    """Fake tensors like ``flat``'s; input ``i`` of shape ``shapes[i]`` where given."""
    fakes = []
    for i, x in enumerate(flat):
        if not isinstance(x, torch.Tensor):
            fakes.append(x)
            continue
        shape = shapes.get(i, list(x.shape))
        with mode:
            fake = torch.empty(shape, dtype=x.dtype, device=x.device)
        fakes.append(fake.requires_grad_(x.requires_grad))
    return fakes


def _export(model: nn.Module, units: dict, spec, flat: list, shapes: dict[int, list[int]]):
    """The exported program on fake inputs like ``flat`` (input ``i`` of shape ``shapes[i]``
    where given), and the checkpointed modules seen while it ran."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args, kwargs = pytree.tree_unflatten(_fakes(flat, shapes, mode), spec)
    recorder = CheckpointRecorder(model)
    try:
        with unsharded_for_trace(units, mode), recorder:
            exported = torch.export.export(model, tuple(args), kwargs, strict=False)
    except Exception as e:
        recorder.check()
        raise RuntimeError(export_failure(model, e)) from e
    recorder.check()
    return exported, recorder.regions


def exported_module(exported: torch.export.ExportedProgram) -> fx.GraphModule:
    gm = exported.module()
    # export's input-shape guards check global shapes; the signature key already pins them.
    for node in [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
        gm.graph.erase_node(node)
    _check_no_attention_without_grad(gm)
    inline_autocast_regions(gm)
    fold_flex_attention(gm)  # (first: the BlockMask it drops is built by vmapped writes)
    functionalize_writes(gm.graph)
    fold_identity_indexing(gm.graph)
    fold_shifts(gm.graph)
    fold_sliced_loss(gm.graph)
    fold_sequence_convs(gm.graph)
    fold_handwritten_attention(gm.graph)
    fold_repeated_kv(gm.graph)
    fold_joint_sequences(gm)
    fold_mask_programs(gm.graph, find_attention(gm.graph))
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


def dump(traced: Traced, key: tuple) -> None:
    """With RINGIFY_DUMP_DIR set: the graph before and after the pass, and the report."""
    root = os.environ.get("RINGIFY_DUMP_DIR")
    if not root:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    name = hashlib.sha1(repr(key).encode()).hexdigest()[:10]
    folder = Path(root) / f"{name}-rank{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "before.py").write_text(traced.before)
    (folder / "after.py").write_text(traced.module.code)
    (folder / "report.txt").write_text(str(traced.report))
    log.info("ringify: wrote the graphs and report to %s", folder)
