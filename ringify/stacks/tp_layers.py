"""A model parallelized for tensor parallelism before ringify sees it: its TP layers read,
and seen by the trace as one TP rank's local model.

Two ways to parallelize are kept, both on a TP mesh dim beside the ring's:

- torch's ``parallelize_module(model, mesh["tp"], plan)`` with ``ColwiseParallel`` and
  ``RowwiseParallel`` (torchtitan's). Each style left its layouts in the forward hooks it
  registered (``distribute_module``'s closures over the style's ``_prepare_*_fn``).
- transformers' own plan (``config.base_model_tp_plan``, applied by
  ``transformers.distributed.tensor_parallel.apply_tensor_parallelism``). Each style
  replaced the module's ``forward`` by a ``tp_forward`` closure over the style (5.16's
  per-head norms: a backward hook instead).
- torchtitan 0.3's ``Module.parallelize`` (``titan_plans.py``): kind ``"titan"``, its
  states local already, its redistributions traced as ringify's TP ops.

``tp_layers`` reads each layer's placements into a ``TpLayer``, refusing what it cannot
keep with what composes; a style it does not know is refused, never run as it is. While ringify traces (``local_for_trace``), each TP weight is a
fake tensor of its local shard's shape and the styles' hooks and ``tp_forward`` are set
aside (the model's other hooks run); all restored after. The pass then writes the
collectives each layer implies where it reads its weight (``passes/tp_collectives.py``),
and at run time the graph reads each weight's local shard (``local_state``).

Sequence parallelism inside TP (``SequenceParallel``, a ``Shard(1)`` input or output) is
refused: ringify already shards the sequence, over the ring.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ringify.runtime.collectives.ring import ring_by_name
from ringify.stacks.titan_plans import TitanModule, closure, titan_modules, traced_as_local

_COMPOSES = (
    "What composes with ringify: ColwiseParallel and RowwiseParallel on nn.Linear and "
    "nn.Embedding (torch's parallelize_module, without SequenceParallel or loss parallel), or "
    "transformers' colwise, rowwise, colwise_gather_output, rowwise_split_input, "
    "replicated_with_grad_allreduce and embedding_rowwise/embedding_colwise styles (the base_model_tp_plan of Llama, Qwen2, Mistral "
    "and most dense models), with shards of equal size and an embedding's ids whole "
    "(input_layouts=Replicate(), as torchtitan writes it); the ring shards the sequence itself."
)


@dataclass(frozen=True)
class TpLayer:
    """One TP layer: a linear or embedding module and the collectives its placements imply.

    ``kind``: ``"colwise"`` (output columns split), ``"rowwise"`` (input columns split, the
    output a partial sum), ``"vocab"`` (an embedding's rows split), ``"embedding_colwise"``
    (an embedding's columns split) or ``"replicated"`` (whole parameters that act on this
    rank's heads alone, as Qwen3's per-head q_norm: their gradient is partial). ``split_input``: a row-parallel layer given its whole
    input; ``gather_output``: a column-parallel layer whose output is kept whole.
    """

    path: str
    kind: str
    split_input: bool
    gather_output: bool
    group_name: str
    size: int
    vocab: int = 0
    padding_idx: int = -1
    titan: TitanModule | None = None  # kind "titan": what torchtitan's wrapper did over TP

    @property
    def sharded_dim(self) -> int:
        """The dim of the weight split over TP."""
        return 0 if self.kind in ("colwise", "vocab") else 1

    def local_shape(self, name: str, shape) -> list[int]:
        """The shape of one TP rank's shard of the layer's parameter ``name`` (global
        ``shape``): the weight split on ``sharded_dim``, a column-parallel bias with the
        columns, anything else whole."""
        size = list(shape)
        if self.kind == "titan":  # its states are this rank's shards already
            return size
        if name == "weight":
            size[self.sharded_dim] //= self.size
        elif name == "bias" and self.kind == "colwise":
            size[0] //= self.size
        return size

    @property
    def local_outside(self) -> bool:
        """Whether the model around the layer sees a local shard (the columns of a
        column-parallel layer's output, of a row-parallel layer's input). If not, the layer is
        traced as the unparallelized model has it, and the pass makes its weight local."""
        if self.kind == "rowwise":
            return not self.split_input
        return (self.kind != "vocab" and not self.gather_output) or self.kind == "titan"


def tp_layers(model: nn.Module) -> dict[str, TpLayer]:
    """The model's TP layers by module path (none: ``{}``), after refusing what cannot be kept."""
    layers = {
        path: TpLayer(path, "titan", False, False, t.group_name, t.size, titan=t)
        for path, t in titan_modules(model).items()
    }
    for path, module in model.named_modules():
        if path in layers:
            continue
        style, mesh = _style_of(module)
        if style is None:
            continue
        layers[path] = _layer(path, module, style, mesh)
    return layers


def check_beside(layers: dict[str, TpLayer], ring_group) -> None:
    """Raise unless each TP group meets the ring's group in this rank alone: the ring must
    run over ranks that hold the same heads and columns."""
    if ring_group is None:
        return
    ring = set(dist.get_process_group_ranks(ring_group))
    for path, layer in layers.items():
        if layer.size == 1:
            continue  # torchtitan's wrappers over a CP dim alone: no TP
        tp = set(dist.get_process_group_ranks(ring_by_name(layer.group_name).group))
        if len(tp & ring) > 1:
            raise ValueError(
                f"{path} is split over ranks {sorted(tp)}, and the ring runs over "
                f"{sorted(ring)}: a ring over ranks that hold different heads would mix them. "
                "Ringify over another mesh dim than TP's: ringify(model, ring_size=cp, "
                'mesh=mesh["cp"]) on a (tp, cp) mesh.'
            )


def tp_parameters(model: nn.Module, layers: dict[str, TpLayer]) -> set[str]:
    """The names of the TP layers' own parameters (the DTensors a trace sees as local)."""
    return {
        f"{path}.{name}" if path else name
        for path in layers
        for name, _ in model.get_submodule(path).named_parameters(recurse=False)
    }


def traced_shape(layer: TpLayer, name: str, shape) -> list[int]:
    """The shape a trace sees of the TP layer's parameter ``name`` of global ``shape``: its
    local shard's where the model around the layer sees local shapes, else whole."""
    return layer.local_shape(name, shape) if layer.local_outside else list(shape)


@contextmanager
def local_for_trace(model: nn.Module, layers: dict[str, TpLayer], fake_mode) -> Iterator[None]:
    """While tracing: each TP layer's parameters are fakes (of their local shard's shape where
    the model around the layer sees local shapes, ``TpLayer.local_outside``; else whole) and
    its style's hooks or ``tp_forward`` are set aside; all restored, in order, on exit."""
    parameters, hooks, forwards = [], [], []
    try:
        for path, layer in layers.items():
            module = model.get_submodule(path)
            for name, p in list(module._parameters.items()):
                if isinstance(p, DTensor):  # (an FSDP2 unit's are fakes already)
                    parameters.append((module, name, p))
                    size = traced_shape(layer, name, p.shape)
                    with fake_mode:
                        seen = torch.empty(size, dtype=p.dtype, device=p.device)
                    module._parameters[name] = nn.Parameter(seen, p.requires_grad)
            for table in (module._forward_pre_hooks, module._forward_hooks):
                hooks.append((table, dict(table)))
                for key in [k for k, hook in table.items() if is_tp_hook(hook)]:
                    del table[key]
            if "forward" in module.__dict__ and _hf_style(module)[0] is not None:
                forwards.append((module, module.__dict__.pop("forward")))
        titan = {p: layer.titan for p, layer in layers.items() if layer.kind == "titan"}
        with traced_as_local(model, titan):
            yield
    finally:
        for module, forward in forwards:
            module.forward = forward
        for module, name, p in parameters:
            module._parameters[name] = p
        for table, kept in hooks:
            table.clear()
            table.update(kept)


def is_tp_hook(hook) -> bool:
    """Whether a module hook is a torch parallel style's (set aside while tracing)."""
    return _torch_style(hook)[0] is not None


def _torch_style(hook) -> tuple[object, object]:
    """(the torch ParallelStyle's ``_prepare_*_fn`` partial, or a PrepareModule* style, and
    its mesh) behind one of ``distribute_module``'s hook lambdas: any hook that holds a
    ``device_mesh`` (a style ringify does not know is refused, not run as it is);
    ``(None, None)`` if none."""
    if not callable(hook) or not hasattr(hook, "__code__"):
        return None, None
    cells = closure(hook)
    mesh = cells.get("device_mesh")
    if not isinstance(mesh, DeviceMesh):
        return None, None
    fn = cells.get("input_fn") or cells.get("output_fn") or cells.get("self") or hook
    return fn, mesh


def _hf_style(module: nn.Module) -> tuple[object, object]:
    """(transformers' TensorParallelLayer style, its mesh) behind a ``tp_forward``, or behind
    a backward hook its ``install_forward`` registered (transformers 5.16's
    ``ReplicatedWithGradAllReduce``): the style the closure holds, else one named by the
    class whose method made it."""
    made = [module.__dict__.get("forward"), *module._backward_hooks.values()]
    for fn in made:
        if ".install_forward.<locals>." in getattr(fn, "__qualname__", ""):
            cells = closure(fn)
            style = cells.get("self") or _Style(fn.__qualname__.partition(".")[0])
            return style, _mesh_in(cells)
    return None, None


def is_tp_backward_hook(hook) -> bool:
    """Whether a module backward hook is a TP style's (its collective is written in the
    graph instead)."""
    return ".install_forward.<locals>." in getattr(hook, "__qualname__", "")


def _mesh_in(cells: dict, depth: int = 2):
    """The DeviceMesh a closure holds, or a function it holds does (to ``depth``)."""
    for value in cells.values():
        if isinstance(value, DeviceMesh):
            return value
    if depth == 0:
        return None
    for value in cells.values():
        if hasattr(value, "__code__") and (mesh := _mesh_in(closure(value), depth - 1)):
            return mesh
    return None


@dataclass(frozen=True)
class _Style:
    """A style known by its class name and the layouts its hooks hold."""

    name: str
    input_layouts: tuple = ()
    output_layouts: tuple = ()
    use_local_output: bool = True


def _style_of(module: nn.Module):
    """(a style, its mesh) for a module parallelized by torch or transformers, else (None, None)."""
    style, mesh = _hf_style(module)
    if style is not None:
        return style, mesh
    found = [
        _torch_style(h)
        for h in (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
    ]
    found = [(fn, mesh) for fn, mesh in found if fn is not None]
    if not found:
        return None, None
    mesh = found[0][1]
    named, name = {}, ""
    for fn, _ in found:
        func = getattr(fn, "func", None)
        if func is None:  # a PrepareModule* style object itself, or a hook of another style
            return (_Style(fn.__qualname__) if hasattr(fn, "__code__") else fn), mesh
        name = func.__qualname__.partition(".")[0]
        named |= dict(zip(inspect.signature(func).parameters, fn.args, strict=False))
    inputs = named.get("input_layouts", named.get("sequence_sharding", ()))
    outputs = named.get("output_layouts", ())
    use_local = named.get("use_local_output", True)
    return _Style(name, tuple(inputs), tuple(outputs), use_local), mesh


def _layer(path: str, module: nn.Module, style, mesh) -> TpLayer:
    name = getattr(style, "name", None) or type(style).__name__
    where = f"{path} ({type(module).__name__}, {name})"
    inputs = _layouts(getattr(style, "input_layouts", ()))
    outputs = _layouts(getattr(style, "output_layouts", ()))
    hf_embedding = type(style).__module__.startswith("transformers") and isinstance(
        module, nn.Embedding
    )
    if hf_embedding:  # transformers' embeddings: the ids whole, the output whole
        inputs, outputs = _R, _R
    if hasattr(style, "sequence_dim"):  # transformers' SequenceParallel
        inputs = (Shard(style.sequence_dim),)
    if any(isinstance(p, Shard) and p.dim != -1 for p in (*inputs, *outputs)):
        raise ValueError(
            f"{where} shards an activation on a dim other than its features (sequence "
            f"parallel's Shard(1)): ringify shards the sequence itself, over the ring. Leave "
            f"TP's activations Replicate or Shard(-1). {_COMPOSES}"
        )
    kind = _kind(name, module, style)
    if kind is None:
        raise ValueError(f"{where}: ringify cannot keep this parallel style. {_COMPOSES}")
    if not getattr(style, "use_local_output", True):
        raise ValueError(
            f"{where} keeps its output a DTensor (use_local_output=False, e.g. loss parallel): "
            f"ringify's graph runs on local tensors. Use use_local_output=True. {_COMPOSES}"
        )
    allowed_in, allowed_out = _LAYOUTS[kind]
    if inputs[:1] not in allowed_in or outputs[:1] not in allowed_out:
        raise ValueError(
            f"{where}: ringify cannot keep these layouts ({inputs}, {outputs}). {_COMPOSES}"
        )
    if mesh is None or mesh.ndim != 1:
        raise ValueError(f"{where}: ringify keeps TP on a 1-D mesh (mesh['tp']). {_COMPOSES}")
    group, size = mesh.get_group().group_name, mesh.size()
    if kind == "replicated":
        return TpLayer(path, kind, False, False, group, size)
    weight = module.weight
    dim = 0 if kind in ("colwise", "vocab") else 1
    placement = _placement_on(weight, mesh)
    if placement != Shard(dim) or weight.shape[dim] % mesh.size():
        raise ValueError(
            f"{where}: its weight is {placement} over TP of {tuple(weight.shape)}; ringify "
            f"keeps Shard({dim}) into {mesh.size()} equal parts. {_COMPOSES}"
        )
    padding = getattr(module, "padding_idx", None)
    return TpLayer(
        path,
        kind,
        split_input=kind == "rowwise" and inputs[:1] == (Replicate(),),
        gather_output=kind in ("colwise", "embedding_colwise") and outputs[:1] == (Replicate(),),
        group_name=group,
        size=size,
        vocab=weight.shape[0] if kind == "vocab" else 0,
        padding_idx=-1 if padding is None else padding,
    )


def _placement_on(weight, mesh):
    """The weight's placement over the TP mesh (an FSDP2 unit's weight is a DTensor over
    (dp, tp)); ``None`` if it is no DTensor there."""
    if not isinstance(weight, DTensor):
        return None
    if weight.device_mesh == mesh:
        return weight.placements[0]
    names = weight.device_mesh.mesh_dim_names or ()
    tp = (mesh.mesh_dim_names or (None,))[0]
    return weight.placements[names.index(tp)] if tp in names else None


def _kind(name: str, module: nn.Module, style) -> str | None:
    if name == "ReplicatedWithGradAllReduce":
        return "replicated"
    if name == "EmbeddingParallel" and isinstance(module, nn.Embedding):
        return "vocab" if style.shard_dim == 0 else "embedding_colwise"
    if name not in ("ColwiseParallel", "RowwiseParallel"):
        return None
    colwise = name == "ColwiseParallel"
    if isinstance(module, nn.Embedding):
        return "embedding_colwise" if colwise else "vocab"
    if isinstance(module, nn.Linear):
        return "colwise" if colwise else "rowwise"
    return None


_R, _S = (Replicate(),), (Shard(-1),)
# kind -> (the input layouts, the output layouts it keeps); () is a style's default
_LAYOUTS = {
    "colwise": ({(), _R}, {(), _S, _R}),
    "rowwise": ({(), _S, _R}, {(), _R}),
    "vocab": ({_R}, {(), _R}),
    "embedding_colwise": ({_R}, {(), _S, _R}),
    "replicated": ({()}, {()}),
}


def _layouts(value) -> tuple:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
