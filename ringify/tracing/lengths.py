"""One trace for many sequence lengths: the rewritten graph with its lengths read at run time.

The pass rewrites a graph traced at one length, and the integers it writes (local and
padded lengths, pad amounts, ``key_len``, slice bounds, reshapes) follow from that
length. When a model is called with a second length of the same inputs (only the
sequence dims differ), ``lift_lengths`` traces it once for all lengths:

1. A symbolic export (``torch.export``, the sequence dims ``Dim.AUTO``) says whether the
   model's graph is one graph for every length: the dims must stay symbolic, and every
   size must be affine in the length (a ``Min`` from a fixed-size slice, say, is not).
   Its range constraints are the lengths the graph holds for.
2. The pass runs at four lengths with its padding steps always in (``MANY_LENGTHS``), and the
   four graphs must match node for node. Every integer that differs is an affine function
   of the length L and the padded length Lp, fitted exactly on three and checked on the
   fourth; any other difference (a float, a string) refuses.
3. In the graph of the call's own length each such integer becomes a node computing it
   from the sequence input's size at run time.

A length outside the range, or a model refused here, is traced per length as before, and
the report and the log say why (``Report.lengths``).

Where export unrolls a loop over the positions (Mamba-1's recurrence in torch: about 15 ms
of export per position and layer, hours at 128K), the symbolic export fixes the length,
but the pass folds the loop into one scan, and what is left is one graph again. So a
first call of a long sequence (``SMALL_FIRST``) to such a model (it runs more ops at a
longer length, counted on fake tensors) is traced at four small lengths instead
(``lift_from_small``): the rewritten graphs must match node for node, their integers
affine in the length.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import Dim
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ringify.config import Config
from ringify.passes.length_integers import (
    NotLiftable,
    check_no_wrapped_regions,
    fitted_integers,
    padded,
    read_at_run_time,
)
from ringify.passes.pipeline import MANY_LENGTHS
from ringify.runtime.collectives.layout import split_multiple
from ringify.stacks.fsdp_units import fsdp_units, unsharded_for_trace
from ringify.stacks.tp_layers import local_for_trace, tp_layers
from ringify.tracing.observers import is_library_hook
from ringify.tracing.trace import Rewritten, buffers_kept, rewrite

log = logging.getLogger("ringify")


@dataclass(frozen=True)
class Lengths:
    """The sequence inputs (flat index -> dim) and the lengths a lifted graph holds for."""

    dims: tuple[tuple[int, int], ...]
    low: int
    high: float
    multiple: int = 1  # only lengths that are multiples of this (outputs="sharded")
    unrolled: bool = False  # traced small: the export unrolled a loop over the positions

    def holds(self, key: tuple) -> bool:
        """Whether a call of signature ``key`` (same family) has a length in range."""
        i, d = self.dims[0]
        length = key[1][i][0][d]
        return self.low <= length <= self.high and length % self.multiple == 0

    def __str__(self) -> str:
        high = "" if self.high == float("inf") else f" to {int(self.high)}"
        every = f", a multiple of {self.multiple}" if self.multiple > 1 else ""
        how = "traced at small lengths: the pass folds the loop export unrolled over them; "
        return (
            f"any length from {self.low}{high}{every} (one graph; "
            f"{how if self.unrolled else ''}the length is read at run time)"
        )


def signature(model: nn.Module, flat: list, spec) -> tuple:
    """What makes a call need its own trace: the same on every rank of a ring for one call."""
    described = tuple(
        (tuple(x.shape), x.dtype, x.device.type, x.requires_grad)
        if isinstance(x, torch.Tensor)
        else x
        for x in flat
    )
    modes = tuple(
        (m.training, len(m._forward_hooks) + len(m._forward_pre_hooks) + _backward_hooks(m))
        for m in model.modules()
    )
    return (str(spec), described, modes)


def _backward_hooks(m: nn.Module) -> int:
    return len(m._backward_hooks) + len(m._backward_pre_hooks)


def sequence_dims(before: tuple, now: tuple) -> tuple[tuple[int, int], ...] | None:
    """The (flat index, dim) that differ between two calls' signatures (``signature``:
    structure, each input's (shape, dtype, device, requires_grad) or value, modes), if
    those are all of one length before and one now and nothing else differs; else ``None``."""
    (spec, inputs, modes), (spec_now, inputs_now, modes_now) = before, now
    if spec != spec_now or modes != modes_now or len(inputs) != len(inputs_now):
        return None
    changed, lengths = [], set()
    for i, (a, b) in enumerate(zip(inputs, inputs_now, strict=True)):
        tensors = isinstance(a, tuple) and isinstance(b, tuple)
        if not tensors or a[1:] != b[1:] or len(a[0]) != len(b[0]):
            if a != b:
                return None
            continue
        for d, (x, y) in enumerate(zip(a[0], b[0], strict=True)):
            if x != y:
                changed.append((i, d))
                lengths.add((x, y))
    return tuple(changed) if len(lengths) == 1 else None


def family(key: tuple, dims: tuple[tuple[int, int], ...]) -> tuple:
    """A signature with the sequence dims' sizes left out: the same for every length."""
    spec, inputs, modes = key
    inputs = list(inputs)
    for i, d in dims:
        shape = list(inputs[i][0])
        shape[d] = None
        inputs[i] = (tuple(shape), *inputs[i][1:])
    return spec, tuple(inputs), modes


SMALL_FIRST = 1024  # a first call this long is traced small where export unrolls its length


def lift_lengths(
    model: nn.Module, config: Config, args, kwargs, dims: tuple[tuple[int, int], ...]
) -> tuple[Rewritten, Lengths]:
    """The rewritten graph of this call, its lengths read at run time; ``NotLiftable``."""
    if config.inputs == "sharded" or config.dilation is not None:
        raise NotLiftable("inputs='sharded' and dilation trace per length")
    flat, spec = pytree.tree_flatten((args, kwargs))
    low, high = _symbolic_range(model, flat, spec, dims)
    done, multiple = _lifted(model, config, args, kwargs, dims)
    return done[0], Lengths(dims, max(low, 2), high, multiple)


def lift_from_small(model: nn.Module, config: Config, args, kwargs) -> tuple | None:
    """For a first call of ``SMALL_FIRST`` positions or more whose export unrolls a loop over
    them: (the graph traced at small lengths, its lengths read at run time; the ``Lengths``
    it holds for, this call's among them); ``None`` where the export does not unroll the
    length, or the lift fails (the call's own length is then traced).

    The sequence inputs are taken to be the dims as long as the longest integer input
    (token ids, positions, masks); a lift that slices any other input is not used."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    integers = [x for x in flat if isinstance(x, torch.Tensor) and not x.is_floating_point()]
    length = max((max(x.shape, default=0) for x in integers), default=0)
    if length < SMALL_FIRST or config.inputs == "sharded" or config.dilation is not None:
        return None
    tensors = [(i, x) for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    dims = tuple((i, d) for i, x in tensors for d, n in enumerate(x.shape) if n == length)
    m = split_multiple(config.ring_size, config.layout)
    if config.outputs == "sharded" and length % m:
        return None  # a length the graph would not hold: its own trace says why
    small = 16 * m

    def cut(n: int) -> tuple:
        leaves = list(flat)
        for i, d in dims:
            leaves[i] = flat[i].narrow(d, 0, n)
        return pytree.tree_unflatten(leaves, spec)

    if not _unrolls(model, [cut(small), cut(small + m)]):
        return None  # its export does not grow with the length: the call's length is traced
    try:
        done, multiple = _lifted(model, config, *cut(small), dims)
    except NotLiftable as e:
        log.info("ringify: not traced at a small length: %s", e)
        return None
    if not set(done[0].sequence_inputs) <= set(dims):
        return None
    lengths = Lengths(dims, small, float("inf"), multiple, unrolled=True)
    return done[0], lengths


def _unrolls(model: nn.Module, calls: list[tuple]) -> bool:
    """Whether the model runs more ops on the second call's (longer) inputs than on the
    first's: a loop over the positions, which export unrolls. Counted on fake tensors (no
    graph is made: a fraction of an export's time), else, where the model cannot run so
    (an op with no fake kernel outside export), in export's own graphs."""
    for count in (_ops_on_fakes, _exported_nodes):
        try:
            first, second = (count(model, *call) for call in calls)
        except Exception:  # a value read on the host, say: no answer here
            continue
        return first < second
    return False


def _ops_on_fakes(model: nn.Module, args, kwargs) -> int:
    hooks = [
        h for m in model.modules() for h in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
    ]  # fmt: skip
    if any(not is_library_hook(h) for h in hooks):
        raise ValueError("the user's hooks would see the fake call")
    counter = _Ops()
    with contextlib.ExitStack() as stack:
        stack.enter_context(buffers_kept(model))
        stack.enter_context(torch.random.fork_rng([]))
        mode = stack.enter_context(_as_traced(model))
        stack.enter_context(mode or FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(counter)
        stack.enter_context(torch.no_grad())
        model(*args, **kwargs)
    return counter.ops


def _exported_nodes(model: nn.Module, args, kwargs) -> int:
    with buffers_kept(model), _as_traced(model):
        return len(torch.export.export(model, args, kwargs, strict=False).graph.nodes)


class _Ops(TorchDispatchMode):
    """Counts the ops dispatched under it."""

    ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _lifted(model: nn.Module, config: Config, args, kwargs, dims) -> tuple[list, int]:
    """The pass at four lengths from the call's, the first's integers read at run time; and
    the multiple of the ring the lengths must be (``outputs="sharded"``, or 1)."""
    flat, _ = pytree.tree_flatten((args, kwargs))
    length = flat[dims[0][0]].shape[dims[0][1]]
    m = split_multiple(config.ring_size, config.layout)
    # outputs="sharded" takes no padding: lengths the ring splits evenly, one graph for them
    multiple = m if config.outputs == "sharded" else 1
    probes = [length + k * m for k in range(4)] if multiple > 1 else _probes(length, m)
    done = []
    for n in probes:
        shapes = {i: _resized(flat[i].shape, d, n) for i, d in dims} if n != length else {}
        try:
            done.append(rewrite(model, config, args, kwargs, shapes, MANY_LENGTHS))
        except Exception as e:  # e.g. a length the model's position table cannot hold
            raise NotLiftable(f"the pass at length {n} failed ({type(e).__name__})") from e
    for r in done:
        check_no_wrapped_regions(r.gm)
    lifts = fitted_integers([r.gm.graph for r in done], probes, m)
    read_at_run_time(done[0].gm.graph, lifts, dims, m)
    return done, multiple


def _probes(length: int, m: int) -> list[int]:
    """The call's length, two more whose (L, Lp) are not collinear with it (so that the fit
    is determined), and one to check the fit on: near the call's length, padded variously."""
    chosen = [length]
    for n in range(length + 1, length + 3 * m + 3):
        if len(chosen) == 3:
            break
        if len(chosen) == 1 or _determinant([*chosen, n], m) != 0:
            chosen.append(n)
    return [*chosen, chosen[-1] + m + 1]


def _determinant(lengths: list[int], m: int) -> int:
    (a, b), (c, d), (e, f) = ((n, padded(n, m)) for n in lengths)
    return (c - a) * (f - b) - (d - b) * (e - a)


def _resized(shape, dim: int, n: int) -> list[int]:
    shape = list(shape)
    shape[dim] = n
    return shape


def _symbolic_range(model: nn.Module, flat: list, spec, dims) -> tuple[int, float]:
    """The lengths the model's graph holds for, from an export with a symbolic length."""
    args, kwargs = pytree.tree_unflatten(flat, spec)
    try:
        positional = list(inspect.signature(model.forward).bind_partial(*args).arguments)
        names = [*positional, *kwargs]  # the order ``_dynamic_shapes`` gives them in
        dynamic = dict(zip(names, _dynamic_shapes(spec, dims), strict=True))
        with buffers_kept(model), _as_traced(model):
            exported = torch.export.export(
                model, tuple(args), kwargs, dynamic_shapes=dynamic, strict=False
            )
    except Exception as e:
        raise NotLiftable(f"no export with a symbolic length ({type(e).__name__})") from e
    nodes = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    user = [s.arg for s in exported.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    sizes = [nodes[user[i].name].meta["val"].shape[d] for i, d in dims]
    symbol = sizes[0].node.expr if isinstance(sizes[0], torch.SymInt) else None
    # a SymInt whose expression is a number: a guard (a loop over positions) fixed it
    if not all(isinstance(n, torch.SymInt) for n in sizes) or not symbol.is_Symbol:
        raise NotLiftable("the export fixed the length (the model branches or loops on it)")
    # every input's length is the one length (the family's): one symbol for all of them
    same = {n.node.expr: symbol for n in sizes[1:] if n.node.expr.is_Symbol}
    for node in exported.graph.nodes:
        value = node.meta.get("val")
        for n in value.shape if isinstance(value, torch.Tensor) else ():
            expr = n.node.expr.xreplace(same) if isinstance(n, torch.SymInt) else None
            if expr is not None and not _affine(expr, symbol):
                raise NotLiftable(f"{node.name} is {expr} long, not affine in the length")
    bounds = exported.range_constraints[symbol]
    return int(bounds.lower), float(bounds.upper)


@contextlib.contextmanager
def _as_traced(model: nn.Module):
    """FSDP2 units seen whole and TP layers local, as the trace sees them
    (``unsharded_for_trace``, ``local_for_trace``): their parameters are fakes of the
    export's own fake mode (yielded; ``None`` where there are none), which export then
    takes as its own."""
    units, layers = fsdp_units(model), tp_layers(model)
    if not units and not layers:
        yield None
        return
    mode = FakeTensorMode(
        shape_env=ShapeEnv(tracked_fakes=[]), allow_non_fake_inputs=True, export=True
    )
    with (
        torch._guards.tracing(torch._guards.TracingContext(mode)),
        unsharded_for_trace(units, mode, layers),
        local_for_trace(model, layers, mode),
    ):
        yield mode


def _dynamic_shapes(spec, dims) -> tuple:
    """export's dynamic shapes: per argument (positional, then keyword), its sequence dims
    ``Dim.AUTO``; ``None`` for an argument with none (a cache object, a flag)."""
    marked: dict[int, dict] = {}
    for i, d in dims:
        marked.setdefault(i, {})[d] = Dim.AUTO
    shapes, start = [], 0
    args_spec, kwargs_spec = spec.children()
    for child in [*args_spec.children(), *kwargs_spec.children()]:
        leaves = range(start, start + child.num_leaves)
        start += child.num_leaves
        if child.is_leaf():
            shapes.append(marked.get(leaves[0]))
        else:
            shapes.append(_as_containers(child, iter(marked.get(i) for i in leaves)))
    return tuple(shapes)


def _as_containers(spec, values):
    """``spec``'s tree with ``values`` at its leaves, a node of another type than a list,
    tuple or dict (an HF cache) as the list of its children, as export expects it."""
    if spec.is_leaf():
        return next(values)
    children = [_as_containers(c, values) for c in spec.children()]
    if spec.type is dict:
        return dict(zip(spec.context, children, strict=True))
    return tuple(children) if spec.type is tuple else children


def _affine(expr, symbol) -> bool:
    """Whether the size ``expr`` (a sympy expression of the shape environment) is a + b L,
    plus sizes the data decides whatever the length (``u0``: an MoE's counts, read with
    ``item``), none of them times L."""
    data = free_unbacked_symbols(expr)
    poly = expr.as_poly(symbol, *data) if expr.free_symbols <= {symbol, *data} else None
    return poly is not None and poly.total_degree() <= 1
