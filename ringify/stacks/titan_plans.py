"""torchtitan 0.3's own tensor parallelism read: ``Module.parallelize`` and its ShardingConfigs.

torchtitan 0.3 parallelizes a model from each module's ``ShardingConfig``
(``Module.parallelize(parallel_dims)``): it shards the module's states and wraps its
``forward`` to redistribute the inputs (``in_src`` -> ``in_dst``) and the output (``out_src``
-> ``out_dst``) over each mesh axis. Under its default ``spmd_types`` backend the states are
this rank's local shards (plain tensors) and the redistributions are c10d collectives,
which ``torch.export`` does not record. So while ringify traces (``traced_as_local``), each
wrapped module runs its own class ``forward`` on the local shards, between the TP axis's
redistributions written as ringify's TP ops, which the trace records and the ring's pass
passes through (they act on features, the last dim):

- ``I -> R`` (a replicated input read by a TP region): ``tp_copy``, whose backward sums
  the TP ranks' partial gradients;
- ``P -> I`` or ``P -> R`` (a partial sum, as a row-parallel output): ``tp_reduce``;
- ``S(-1) -> R`` or ``S(-1) -> I``: ``tp_gather``.

Other axes' redistributions are left out: the data axis is FSDP2's, and the context axis
is ringify's own (torchtitan's CP all-gathers K/V at the attention's boundary; the ring
replaces it). Sequence parallel (``S(1)`` over TP) and the DTensor backends are refused,
naming the setting that composes; so is torchtitan's CP wrapper ``apply_cp_to_forward``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from ringify.runtime.collectives.tp_ops import tp_copy, tp_gather, tp_reduce

WRAPPER = "forward_with_redistribution"
_COMPOSES = (
    "What composes: torchtitan's spmd_types backend (its default) with "
    "enable_sequence_parallel=False, tensor_parallel_degree over its own mesh dim, and "
    "ringify over the cp dim (ringify(model, ring_size=cp, mesh=parallel_dims.get_mesh('cp')))."
)


@dataclass(frozen=True)
class TitanModule:
    """A module torchtitan parallelized: its TP group and the redistributions its wrapper made
    over TP, as ringify's ops (argument name or ``"output"`` -> op)."""

    path: str
    group_name: str
    size: int
    redistributes: tuple[tuple[str, object], ...]


def titan_modules(model: nn.Module) -> dict[str, TitanModule]:
    """The modules torchtitan parallelized over a TP or CP dim of more than one rank, by
    path, after refusing what cannot be kept."""
    found = {}
    for path, module in model.named_modules():
        forward = module.__dict__.get("forward")
        name = getattr(forward, "__qualname__", "")
        where = f"{path or 'the model'} ({type(module).__name__})"
        if "apply_cp_to_forward" in name:
            raise ValueError(
                f"{where} runs torchtitan's own context parallelism (apply_cp_to_forward, "
                "context_parallel_degree > 1 under a DTensor backend): ringify is the context "
                f"parallelism. {_COMPOSES}"
            )
        if WRAPPER not in name:
            continue
        dims = closure(forward)["parallel_dims"]
        if dims.tp == 1 and dims.cp == 1:
            continue  # its redistributions over size-1 axes do nothing
        if dims.spmd_backend != "spmd_types":
            raise ValueError(
                f"{where} was parallelized by torchtitan under spmd_backend="
                f"{dims.spmd_backend!r}: its activations are DTensors. {_COMPOSES}"
            )
        found[path] = _read(path, module, dims, where)
    return found


def _read(path: str, module: nn.Module, dims, where: str) -> TitanModule:
    config = module._sharding_config
    mesh = dims.get_optional_mesh("tp") if dims.tp > 1 else None

    def on_tp(layout):  # the layout's type over the TP axis (keys: torchtitan's MeshAxisName)
        types = {} if layout is None else layout.per_axis_spmd_types()
        return next((v for k, v in types.items() if getattr(k, "value", k) == "tp"), None)

    moves = []
    inputs = set(config.in_src_shardings or {}) | set(config.in_dst_shardings or {})
    for arg in sorted(inputs):
        src = on_tp((config.in_src_shardings or {}).get(arg))
        dst = on_tp((config.in_dst_shardings or {}).get(arg))
        moves.append((arg, _op(src, dst if dst is not None else src, where)))
    out_src = config.out_src_shardings
    if isinstance(out_src, tuple):
        if config.out_dst_shardings is not None:
            raise ValueError(f"{where} redistributes several outputs. {_COMPOSES}")
    else:
        src = on_tp(out_src)
        dst = on_tp(config.out_dst_shardings)
        moves.append(("output", _op(src, dst if dst is not None else src, where)))
    for name, layout in config.state_shardings.items():
        kind = on_tp(layout)
        if (_is_shard(kind) and kind.dim not in (0, 1)) or _name(kind) == "V":
            raise ValueError(f"{where} shards its {name} over TP as {kind}. {_COMPOSES}")
    redistributes = tuple((arg, op) for arg, op in moves if op is not None)
    if mesh is None:
        return TitanModule(path, "", 1, ())
    return TitanModule(path, mesh.get_group().group_name, mesh.size(), redistributes)


def _is_shard(kind) -> bool:
    return type(kind).__name__ == "Shard"


def _op(src, dst, where: str):
    """Ringify's TP op for one redistribution over TP (``None``: nothing to do)."""
    src_name, dst_name = _name(src), _name(dst)
    if src_name == dst_name:
        return None
    if (src_name, dst_name) == ("I", "R"):
        return tp_copy
    if src_name == "P" and dst_name in ("I", "R"):
        return tp_reduce
    if src_name == "S(-1)" and dst_name in ("I", "R"):
        return tp_gather
    raise ValueError(
        f"{where} redistributes over TP from {src_name} to {dst_name} (sequence parallel "
        f"shards the sequence over TP: set enable_sequence_parallel=False). {_COMPOSES}"
    )


def _name(kind) -> str | None:
    if kind is None:
        return None
    if _is_shard(kind):
        return "S(-1)" if kind.dim == -1 else f"S({kind.dim})"
    return str(kind).rpartition(".")[2]


@contextmanager
def traced_as_local(model: nn.Module, titan: dict[str, TitanModule]) -> Iterator[None]:
    """While tracing: each module torchtitan wrapped runs its class ``forward`` on its local
    states, between its TP redistributions as ringify's ops; the wrappers restored on exit."""
    wrapped = []
    try:
        for path, t in titan.items():
            module = model.get_submodule(path)
            wrapped.append((module, module.__dict__.pop("forward")))
            module.forward = _local_forward(module, t)
        yield
    finally:
        for module, forward in wrapped:
            module.forward = forward


def _local_forward(module: nn.Module, t: TitanModule):
    moves = dict(t.redistributes)
    names = list(inspect.signature(type(module).forward).parameters)[1:]

    def forward(*args, **kwargs):
        bound = dict(zip(names, args, strict=False)) | kwargs
        for arg, op in moves.items():
            if arg != "output" and bound.get(arg) is not None:
                bound[arg] = op(bound[arg], t.group_name)
        out = type(module).forward(module, **bound)
        return moves["output"](out, t.group_name) if "output" in moves else out

    return forward


def closure(fn) -> dict:
    """A function's free variables by name, with their values (where a wrapper keeps its
    state: a parallel style's layouts, torchtitan's ``parallel_dims``)."""
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells), strict=True))
