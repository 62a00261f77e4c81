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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from ringify.config import Config
from ringify.passes.checkpoints import CheckpointRecorder
from ringify.passes.graph.report import Report
from ringify.passes.pipeline import (
    ONE_LENGTH,
    Composition,
    folded,
    named_state,
    runnable,
    sharded,
)
from ringify.passes.sharding.sequence_plan import sharded_input_dims
from ringify.passes.tp_collectives import reported_collectives
from ringify.stacks.block_masks import rebuilt
from ringify.stacks.fsdp_units import fsdp_units, state_kind, unsharded_for_trace
from ringify.stacks.tp_layers import (
    TpLayer,
    check_beside,
    is_tp_backward_hook,
    local_for_trace,
    tp_layers,
)
from ringify.tracing.export_errors import custom_backward_error, custom_backwards, export_failure
from ringify.tracing.observers import Observed, Observers

log = logging.getLogger("ringify")


@dataclass
class Traced:
    """One input signature's rewritten graph (a plain object, not a submodule).

    ``module(*state, *flat_inputs)`` returns the flat outputs (the model's, then what its
    observing hooks were given), where ``state`` is the model's tensors named by
    ``state_names`` (read at call time, see ``state_of``).
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
    # the hooks that observe (``observers.py``): the graph's outputs after the model's are
    # what they were given
    observed: tuple[Observed, ...] = ()


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


def _tied(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    names: dict[int, list[str]] = {}
    for name, t in named_state(model):
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
    observed: tuple[Observed, ...]


def trace(model: nn.Module, config: Config, args, kwargs, outer: nn.Module | None = None) -> Traced:
    """``model``'s graph for this call's signature, rewritten; ``outer`` is the module that
    runs it (an FSDP2 root unit around it reduces the gradients of what it holds)."""
    return finish(rewrite(model, config, args, kwargs), model, config, outer)


def rewrite(
    model: nn.Module, config: Config, args, kwargs, shapes: dict | None = None,
    composition: Composition = ONE_LENGTH,
) -> Rewritten:  # fmt: skip
    """Export and rewrite on ``composition``'s way through the pass (``pipeline.py``): the
    inputs at ``shapes`` (flat index -> shape) where given."""
    units, layers = fsdp_units(model), tp_layers(model)
    ring = config.ring()
    check_beside(layers, ring.group)
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    dims, gathered = {}, {}
    if config.inputs == "sharded":
        dims, gathered = _sharded_inputs(model, units, layers, spec, flat, config)
        scaled = {i: _scaled(flat[i].shape, d, ring.size) for i, d in (dims | gathered).items()}
        exported, checkpoints, observers = _export(model, units, layers, spec, flat, scaled)
    else:
        exported, checkpoints, observers = _export(model, units, layers, spec, flat, shapes or {})
    gm = folded(exported, composition, layers)
    if observers.calls:
        log.info(
            "ringify: hooks that observe, run after each call on this rank's shard: %s",
            ", ".join(sorted({c.path or type(model).__name__ for c in observers.calls})),
        )
    _refuse_backward_hooks(model)
    observed = len(observers.tensors)  # the graph's last outputs: left on this rank's shard
    plan, before, report = sharded(gm, config, composition, dims or None, gathered, observed)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # inputs the model does not read (HF's labels beside shift_labels) need not agree
    unread = {i for i, n in enumerate(placeholders) if not n.users}
    sequence = tuple(
        (placeholders.index(n), s.dim) for n, s in plan.seeds.items() if n in placeholders
    )
    shared = tuple(i for i in tensors if i not in dims and i not in gathered and i not in unread)
    return Rewritten(
        gm, before, report, exported, checkpoints, units, flat, shared, sequence,
        tuple(observers.calls),
    )  # fmt: skip


def finish(done: Rewritten, model: nn.Module, config: Config, outer: nn.Module | None) -> Traced:
    """The rewritten graph made runnable: values recorded, state lifted, checkpointed and
    FSDP spans kept."""
    gm, report, ring = done.gm, done.report, config.ring()
    state_names, checkpointed, kept_units = runnable(
        gm, model, done.flat, done.checkpoints, done.units, outer, ring
    )
    report = dataclasses.replace(
        report,
        checkpointed=checkpointed,
        fsdp_units=kept_units,
        tensor_parallel=reported_collectives(gm),
    )
    module = fx.GraphModule(gm, gm.graph)
    out_spec = done.exported.call_spec.out_spec
    if done.observed:  # (the model's output, what its hooks observed)
        out_spec = out_spec.children()[0]
    for gather in report.gathers:
        log.warning(
            "ringify: gathered the sequence for %s (%s): %s %s",
            gather.node,
            gather.op,
            gather.reason.value,
            gather.detail,
        )
    if report.run_whole_note:  # a cost like a gather's: each runs P times
        log.warning("ringify: %s", report.run_whole_note)
    log.info("ringify: traced a new input signature\n%s", report)
    return Traced(
        module,
        done.before,
        report,
        state_names,
        meta_of(state_of(model, state_names)),
        _tied(model),
        done.exported.call_spec.in_spec,
        out_spec,
        done.shared_inputs,
        sequence_inputs=done.sequence_inputs,
        observed=done.observed,
    )


def _sharded_inputs(
    model: nn.Module, units: dict, layers: dict[str, TpLayer], spec, flat: list, config: Config
):
    """The inputs of ``inputs="sharded"`` mode that are this rank's part (see
    ``sharded_input_dims``). The global shapes are not known before they are: they are found
    on a trace at the local shapes. Where that trace fails because an input was passed
    full (a (B, S) padding mask beside (B, S / P) ids), it is traced again with that input
    cut to the local length: an integer or bool input whose dim is ring-size times the
    same dim of another input of as many dims. Inputs passed full stay full."""
    try:
        structure = folded(_export(model, units, layers, spec, flat, {})[0], ONE_LENGTH, layers)
        full = {}
    except RuntimeError as error:
        full = _passed_full(flat, config.ring_size)
        if not full:
            raise
        try:
            exported = _export(model, units, layers, spec, flat, full)[0]
            structure = folded(exported, ONE_LENGTH, layers)
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


def _refuse_backward_hooks(model: nn.Module) -> None:
    """A module's backward hooks never run: the graph, not the module, computes the backward.
    Refuse them, naming hooks that do run (a TP style's is written in the graph)."""
    hooked = [
        name or type(model).__name__
        for name, m in model.named_modules()
        if any(
            not is_tp_backward_hook(h)
            for h in (*m._backward_hooks.values(), *m._backward_pre_hooks.values())
        )
    ]
    if hooked:
        raise ValueError(
            f"{', '.join(hooked)} have backward hooks (register_full_backward_hook), which "
            "never run on the ringified model: its graph computes the backward, not the "
            "modules. Register them on the parameters instead (p.register_hook or "
            "p.register_post_accumulate_grad_hook run as usual), or remove them."
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


def _export(
    model: nn.Module,
    units: dict,
    layers: dict[str, TpLayer],
    spec,
    flat: list,
    shapes: dict[int, list[int]],
):
    """The exported program on fake inputs like ``flat`` (input ``i`` of shape ``shapes[i]``
    where given), with FSDP2 units whole and TP layers local, and the checkpointed modules
    seen while it ran."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args, kwargs = pytree.tree_unflatten(_fakes(flat, shapes, mode), spec)
    recorder = CheckpointRecorder(model)
    observers = Observers(model)
    try:
        with (
            buffers_kept(model),
            unsharded_for_trace(units, mode, layers),
            local_for_trace(model, layers, mode),
            recorder,
            observers,
        ):
            backwards: list[str] = []  # noted by the wrapper as the model's output is traced
            wrapper = _Exported(model, observers, backwards)
            exported = torch.export.export(wrapper, tuple(args), kwargs, strict=False)
    except Exception as e:
        recorder.check()
        raise RuntimeError(export_failure(model, e)) from e
    recorder.check()
    if backwards:
        raise ValueError(custom_backward_error(backwards))
    return exported, recorder.regions, observers


@contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """The model's buffers as they were before a trace, after it: a forward that registers
    or replaces one as it runs (x-transformers' ALiBi keeps its bias so) would leave a fake
    tensor of the trace in the user's model. The graph computes such a buffer itself."""
    kept = [(m, dict(m._buffers), set(m._non_persistent_buffers_set)) for m in model.modules()]
    try:
        yield
    finally:
        for module, buffers, non_persistent in kept:
            module._buffers.clear()
            module._buffers.update(buffers)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(non_persistent)


def holds_the_models_state(module: nn.Module, model: nn.Module) -> None:
    """``module`` holds ``model`` (not as a submodule) and its parameter, buffer and submodule
    dicts, the same dicts: its names, attribute paths and ``state_dict`` keys are the model's."""
    object.__setattr__(module, "_model", model)
    for shared in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
        object.__setattr__(module, shared, getattr(model, shared))
    module.training = model.training


class _Exported(nn.Module):
    """What is exported: the model called with its BlockMasks rebuilt (``block_masks.py``),
    returning beside its output what its observing hooks were given (``observers.py``), and
    noting the custom autograd Functions its output's gradient would run. It holds the
    model's own parameter, buffer and submodule dicts (not copies), so the export names the
    model's state, and its modules, as the model does."""

    def __init__(self, model: nn.Module, observers: Observers, backwards: list[str]):
        super().__init__()
        holds_the_models_state(self, model)
        object.__setattr__(self, "_observers", observers)
        object.__setattr__(self, "_backwards", backwards)

    def forward(self, *args, **kwargs):
        args, kwargs = rebuilt((args, kwargs))
        out = self._model(*args, **kwargs)
        self._backwards.extend(custom_backwards(out))
        # (known once the model has run: which hooks observed is fixed by the trace)
        return (out, list(self._observers.tensors)) if self._observers.calls else out


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
