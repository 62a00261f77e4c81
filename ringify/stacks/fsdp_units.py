"""Models parallelized inside before ringify sees them: FSDP2 units kept, the rest refused.

Per-layer FSDP2 (``fully_shard`` on each block, then on the model or on the ringified
module as the root) is kept. Its units' parameters are sharded DTensors between forwards, which
``torch.export`` cannot trace, and its hooks would run on the trace's fake tensors. So
while ringify traces (``unsharded_for_trace``), each unit's sharded parameters are seen
as fake tensors of their full shape and FSDP's own forward hooks are set aside (the
model's other hooks run); both are restored after. After the pass, each unit's span of
the rewritten graph runs inside that unit's FSDP forward hooks (``passes/module_regions.py``).

A unit grouping several modules (``fully_shard([norm, lm_head])``, as torchtitan shards
its last layers, or the tied embedding and head) is kept as one span, from its first
module's first node to its last module's last (``unit_groups``). FSDP mixed precision is
kept (parameters all-gathered in ``param_dtype``, the blocks' inputs cast as FSDP casts
them, gradients reduced in ``reduce_dtype``). Refused, naming what composes: DTensor
parameters outside FSDP and outside tensor-parallel layers (``tp_layers.py``), and a
policy's ``output_dtype``.
A parameter swapped for a DTensor after a trace changes the state's description
(``state_kind``), so the cached graph is traced again rather than run on old weights.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from ringify.runtime.collectives.ring import Ring
from ringify.stacks.tp_layers import TpLayer, tp_layers, tp_parameters, traced_shape

_WORKS = (
    "What composes: FSDP2 per block and on the model or the ringified module (fully_shard(block, "
    'mesh=mesh["dp"]) for each block, then fully_shard(model) before ringify or '
    "fully_shard(ringify(model, ...)) after), or DDP around the ringified module; tensor "
    'parallelism by parallelize_module(model, mesh["tp"], plan) or transformers\' tp_plan, '
    "before FSDP2."
)


def state_kind(t: torch.Tensor) -> str:
    """``"DTensor"`` or ``"Tensor"``: part of what a trace assumed about a state tensor."""
    return "DTensor" if isinstance(t, DTensor) else "Tensor"


def fsdp_units(model: nn.Module) -> dict[str, nn.Module]:
    """The model's FSDP2 units by path (``""``: the model itself), after refusing what
    cannot be kept."""
    units = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    for name, unit in units.items():
        state = unit._get_fsdp_state()
        if state._mp_policy.output_dtype is not None:
            raise ValueError(
                f"the FSDP2 unit {name} has a MixedPrecisionPolicy with output_dtype="
                f"{state._mp_policy.output_dtype}: ringify keeps param_dtype, reduce_dtype and "
                "cast_forward_inputs, not a cast of the block's outputs. Leave output_dtype "
                "unset (cast the model's output yourself)."
            )
    tensor_parallel = tp_parameters(model, tp_layers(model))
    dtensors = [
        name
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if isinstance(t, DTensor)
        and name not in tensor_parallel
        and not any(_under(name, unit) for unit in units)
    ]
    if dtensors:
        raise ValueError(
            f"the model's {dtensors[0]} (and {len(dtensors) - 1} more) are DTensors outside "
            f"FSDP2 and outside any tensor-parallel layer ringify keeps: ringify cannot trace "
            f"them. {_WORKS}"
        )
    return units


def unit_groups(units: dict[str, nn.Module]) -> dict[str, tuple[str, ...]]:
    """Each FSDP2 unit's name -> the paths of its modules, in the model's order: a unit of
    one module is named by its path, one of several (``fully_shard([a, b])``) ``"[a, b]"``."""
    members: dict[int, list[str]] = {}
    for path, unit in units.items():
        members.setdefault(id(unit._get_fsdp_state()), []).append(path)
    return {p[0] if len(p) == 1 else f"[{', '.join(p)}]": tuple(p) for p in members.values()}


def unit_parameters(
    model: nn.Module, units: dict[str, nn.Module], names: tuple[str, ...]
) -> dict[str, list[str]]:
    """Unit name (``unit_groups``) -> the parameter names (of ``names``) its FSDP group
    owns: those under one of its modules and under no deeper unit; ``""`` (the model, or the
    root unit around the ringified module) owns the rest. Buffers are FSDP's to leave
    alone."""
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    unit_of = {"": ""} | {path: n for n, paths in unit_groups(units).items() for path in paths}
    owned: dict[str, list[str]] = {name: [] for name in unit_of.values()}
    for name in (n for n in names if n in parameters):
        deepest = max((path for path in unit_of if _under(name, path)), key=len)
        owned[unit_of[deepest]].append(name)
    return owned


def units_reducing_over_ring(
    units: dict[str, nn.Module], outer: nn.Module | None, ring: Ring
) -> dict[str, int]:
    """The units (by name; ``""``: the model's, or else ``outer``'s, the root unit around
    the ringified module) whose FSDP reduces gradients over groups that hold every rank of
    the ring (FSDP over dp x cp) -> what each ring rank's partial gradient is scaled by.
    That reduction itself sums the ring's partials, so the ring needs no reduction of its
    own: gradients are reduced once, as torchtitan does. FSDP's default divides by the
    whole group, ring included: the partials are scaled by the ring's size, and FSDP's
    average is the data-parallel replicas' average. An explicit divide factor (torchtitan
    sets 1 and divides the loss by the global token count itself) divides the replicas'
    sum: the partials go as they are."""
    if ring.size == 1:
        return {}
    ring_ranks = set(dist.get_process_group_ranks(ring.group))
    paths = {"": outer, **units}
    scales = {}
    for name, members in {"": ("",), **unit_groups(units)}.items():
        unit = paths[members[0]]
        groups = unit._get_fsdp_state()._fsdp_param_groups if isinstance(unit, FSDPModule) else ()
        factors = {group.gradient_divide_factor for group in groups}
        if len(factors) == 1 and all(
            ring_ranks <= set(group.mesh_info.mesh.mesh.flatten().tolist()) for group in groups
        ):
            scales[name] = ring.size if factors == {None} else 1
    return scales


def is_fsdp_hook(hook) -> bool:
    """Whether a module hook is FSDP's own (it runs around the unit's region, not traced):
    a unit of one module hooks its state's bound methods, a unit of several wraps them
    (``functools.wraps``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    while hook is not None:
        if isinstance(getattr(hook, "__self__", None), FSDPState):
            return True
        hook = getattr(hook, "__wrapped__", None)
    return False


@contextmanager
def unsharded_for_trace(
    units: dict[str, nn.Module], fake_mode, layers: dict[str, TpLayer]
) -> Iterator[None]:
    """While tracing: each unit's DTensor parameters are fake tensors of their full shape, or
    of the shape a trace sees of a TP layer's (``traced_shape``), in the dtype FSDP
    all-gathers them to; FSDP's forward hooks on the unit are replaced by what they do to
    values (mixed precision's cast of the block's inputs); all restored, in order, on exit."""
    parameters, hooks, added = [], [], []
    try:
        for path, unit in units.items():
            policy = unit._get_fsdp_state()._mp_policy
            for inner, module in unit.named_modules():
                layer = layers.get(".".join(p for p in (path, inner) if p))
                for name, p in list(module._parameters.items()):
                    if isinstance(p, DTensor):
                        parameters.append((module, name, p))
                        size = p.shape if layer is None else traced_shape(layer, name, p.shape)
                        with fake_mode:
                            full = torch.empty(
                                size, dtype=policy.param_dtype or p.dtype, device=p.device
                            )
                        module._parameters[name] = nn.Parameter(full, p.requires_grad)
            for table in (unit._forward_pre_hooks, unit._forward_hooks):
                hooks.append((table, dict(table)))
                for key in [k for k, hook in table.items() if is_fsdp_hook(hook)]:
                    del table[key]
            if policy.param_dtype is not None and policy.cast_forward_inputs:
                cast = functools.partial(_cast_inputs, policy.param_dtype)
                added.append(unit.register_forward_pre_hook(cast, prepend=True, with_kwargs=True))
        yield
    finally:
        for handle in added:
            handle.remove()
        for module, name, p in parameters:
            module._parameters[name] = p
        for table, kept in hooks:
            table.clear()
            table.update(kept)


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args, kwargs):
    """FSDP mixed precision's cast of a block's floating-point inputs, as the trace sees it."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    return pytree.tree_map_only(torch.Tensor, cast, (args, kwargs))


def _under(name: str, path: str) -> bool:
    return path == "" or name.startswith(path + ".")
