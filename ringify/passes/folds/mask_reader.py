"""Reading an attention mask's subgraph as a program over O(S) vectors.

``read_program`` walks back from the mask to where its queries x keys part begins: nodes
with both a query and a key dim are the program (elementwise ops, ``tril``/``triu``, a
crop of a registered triangle buffer, ``F.pad`` and slices, a small table looked up at a
queries x keys index, a buffer constant along its diagonals), the tensors feeding them are
its inputs. ``NotAProgram`` says why a mask is
not one. ``passes/folds/mask_programs.py`` folds what it reads into the graph.
"""

from __future__ import annotations

import torch
from torch import fx

from ringify.passes.graph.nodes import call, is_tensor, shape, slice_bounds, val
from ringify.passes.graph.vocabulary import ANY_CAST, MASK_PASSING, PADS, TRIANGLES
from ringify.runtime.masks.program import DIFFERENTIABLE, ELEMENTWISE, MaskProgram

aten = torch.ops.aten
_FILLED = {aten.full.default: 1, aten.new_full.default: 2, aten.full_like.default: 1}
_CONSTANT = {  # creation ops of a fixed value
    aten.ones.default: 1, aten.new_ones.default: 1, aten.ones_like.default: 1,
    aten.zeros.default: 0, aten.new_zeros.default: 0, aten.zeros_like.default: 0,
}  # fmt: skip
_CREATION = _FILLED.keys() | _CONSTANT.keys()  # read only their input's dtype and device


class NotAProgram(Exception):
    """The mask has no program form; the message says why."""


def read_program(mask: fx.Node) -> tuple[MaskProgram, list[fx.Node]]:
    """The program computing ``mask`` and its input nodes, in order; else ``NotAProgram``."""
    ndim = len(shape(mask))
    if ndim < 2:
        raise NotAProgram("a mask with no query dim")
    reader = _Reader(ndim, *shape(mask)[-2:])
    reader.visit(mask)
    if not reader.code:  # the mask is itself O(S): the program is its input
        reader.code.append(("cast", (reader.visit(mask),), _dtype(mask)))
    return MaskProgram(tuple(reader.roles), tuple(reader.code)), reader.inputs


class _Reader:
    def __init__(self, ndim: int, queries: int, keys: int):
        self.ndim, self.queries, self.keys = ndim, queries, keys
        self.roles: list[str] = []
        self.inputs: list[fx.Node] = []
        self.code: list[tuple] = []
        self._refs: dict[tuple, dict] = {}
        self._learned: set[tuple] = set()  # refs whose value depends on a learned input
        # inside a padded part of the mask: its (top, bottom, left, right) padding
        self._pad = (0, 0, 0, 0)

    def role(self, node: fx.Node) -> str:
        s = shape(node)
        if len(s) > self.ndim:
            raise NotAProgram(f"{node.name} has more dims than the mask")
        q, k = [1, 1, *s][-2:]
        if q > 1 and k > 1:
            if (q, k) != (self.queries, self.keys):
                raise NotAProgram(f"{node.name} is {q} x {k}, not the mask's queries x keys")
            return "pair"
        if q > 1:
            return (
                "q" if q == self.queries else _raise(f"{node.name}: {q} rows, not {self.queries}")
            )
        if k > 1:
            return "k" if k == self.keys else _raise(f"{node.name}: {k} columns, not {self.keys}")
        return "c"

    def visit(self, a):
        """``a``'s reference in the program: an input, an instruction or a literal."""
        if not isinstance(a, fx.Node):
            if isinstance(a, (bool, int, float)) or a is None:
                return a
            raise NotAProgram(f"an argument {a!r} the program cannot hold")
        if (a, self._pad) in self._refs:
            return self._refs[a, self._pad]
        if not is_tensor(a):
            raise NotAProgram(f"{a.name} is not a tensor")
        role = self.role(a)
        if role != "pair":
            ref = self._input(a, role)
        elif a.op == "get_attr" and _diagonals_buffer(a):
            ref = self._diagonals(a)
        elif a.op != "call_function":
            raise NotAProgram(
                f"a {self.queries} x {self.keys} tensor the model was given ({a.name})"
            )
        else:
            ref = self._instruction(a)
        self._refs[a, self._pad] = ref
        return ref

    def _input(self, node: fx.Node, role: str) -> dict:
        if (node, self._pad) in self._refs:
            return self._refs[node, self._pad]
        key = node
        if role in ("q", "k") and any(self._pad):  # an input of a padded part, padded alike
            top, bottom, left, right = self._pad
            spec = [0, 0, top, bottom] if role == "q" else [left, right]
            with node.graph.inserting_after(node):
                node = call(node.graph, aten.constant_pad_nd.default, (node, spec, 0))
        self.roles.append(role)
        self.inputs.append(node)
        ref = self._refs[key, self._pad] = {"in": len(self.inputs) - 1}
        if val(node).is_floating_point() and _reads_inputs(node):  # may be learned
            self._learned.add(_key(ref))
        return ref

    def _instruction(self, node: fx.Node) -> dict:
        target, args = node.target, node.args
        if target in MASK_PASSING:
            before, after = [1, 1, *shape(args[0])][-2:], shape(node)[-2:]
            broadcast = target is aten.expand.default and all(
                b in (1, a) for b, a in zip(before, after, strict=True)
            )
            if before != list(after) and not broadcast:
                raise NotAProgram(f"{node.name} ({target}) reshapes the queries x keys dims")
            return self.visit(args[0])
        if target in ANY_CAST:
            return self._emit("cast", [self.visit(args[0])], node)
        if target in _CONSTANT:
            return self._emit("const", [_CONSTANT[target]], node)
        if target in _FILLED:
            at = _FILLED[target]
            value = args[at] if len(args) > at else node.kwargs.get("fill_value")
            return self._emit("const", [self.visit(value)], node)
        if target is aten.permute.default and args[0].target is aten.embedding.default:
            return self._embedding(node)
        if target is aten.slice.Tensor and (diagonal := _triangle_buffer(node)) is not None:
            kind, offset = diagonal  # nanoGPT's mask: a crop of a registered tril of ones
            return self._emit(kind, [self._emit("const", [1], node), self._shifted(offset)], node)
        if target in TRIANGLES:
            diagonal = args[1] if len(args) > 1 else node.kwargs.get("diagonal", 0)
            kind = target.__name__.split(".")[0]
            return self._emit(kind, [self.visit(args[0]), self._shifted(diagonal)], node)
        if target is aten.slice.Tensor:
            return self._cropped(node)
        if target in PADS:
            return self._padded(node)
        name = _functional(node)
        if getattr(target, "namespace", None) != "aten" or name not in ELEMENTWISE:
            raise NotAProgram(f"{name} on the queries x keys part has no tile form")
        if node.kwargs:
            raise NotAProgram(f"{name} with keyword arguments {sorted(node.kwargs)}")
        return self._emit(name, [self.visit(a) for a in args], node)

    def _shifted(self, diagonal: int) -> int:
        """A triangle's diagonal (key - query) in the coordinates of the padded mask."""
        top, _, left, _ = self._pad
        return diagonal + left - top

    def _part(self, x: fx.Node, around: tuple[int, int, int, int]) -> tuple[dict, int, int]:
        """``x`` read as the part of the queries x keys dims that ``around`` (top, bottom,
        left, right; > 0 padding, < 0 a crop) makes the mask, in the mask's coordinates:
        its inputs padded or cropped alike (O(S)); and the part's queries and keys."""
        top, bottom, left, right = around
        outer = self.queries, self.keys, self._pad
        self.queries, self.keys = self.queries - top - bottom, self.keys - left - right
        self._pad = tuple(a + b for a, b in zip(self._pad, around, strict=True))
        try:
            return self.visit(x), self.queries, self.keys
        finally:
            self.queries, self.keys, self._pad = outer

    def _cropped(self, node: fx.Node) -> dict:
        """A slice of the queries x keys part (a bias made for more positions, cut to the
        call's): the part read in the cropped coordinates; a slice that cuts nothing is the
        part itself."""
        x, ndim = node.args[0], len(shape(node))
        dim, size = node.args[1] % ndim, shape(x)[node.args[1] % ndim]
        start, stop, step = slice_bounds(node, size)
        if (start, stop, step) == (0, size, 1):
            return self.visit(x)
        if step != 1 or dim < ndim - 2:
            raise NotAProgram(f"{node.name}: a strided slice, or one of a leading dim")
        cut = (-start, stop - size)
        return self._part(x, (*cut, 0, 0) if dim == ndim - 2 else (0, 0, *cut))[0]

    def _padded(self, node: fx.Node) -> dict:
        """``F.pad`` of the queries x keys part (a causal mask extended by a prefix, say): the
        part read in the padded coordinates, its inputs padded alike (O(S)), and ``value``
        outside it, where the global positions say so. A pad of nothing is the part itself."""
        x, spec = node.args[:2]
        if node.target is aten.constant_pad_nd.default:
            mode, value = "constant", node.args[2] if len(node.args) > 2 else 0
        else:
            mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
            value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value")
        if not any(spec):
            return self.visit(x)
        if mode != "constant" or len(spec) > 4 or min(spec) < 0:
            raise NotAProgram(f"{node.name}: F.pad other than a constant's on queries x keys")
        left, right, top, bottom = [*spec, 0, 0, 0, 0][:4]
        q0, k0 = self._pad[0] + top, self._pad[2] + left  # the part's first global positions
        part, queries, keys = self._part(x, (top, bottom, left, right))
        inside = [
            self._emit(op, [{"pos": axis}, bound], node, "bool")
            for axis, first, size in (("q", q0, queries), ("k", k0, keys))
            for op, bound in (("ge.Scalar", first), ("lt.Scalar", first + size))
        ]
        while len(inside) > 1:
            inside = [self._emit("logical_and.default", inside[:2], node, "bool"), *inside[2:]]
        value = 0 if value is None else value
        if val(node).dtype == torch.bool:  # export writes F.pad's True as 1.0
            value = bool(value)
        kept = self._emit("where.ScalarOther", [inside[0], part, value], node)
        return self._emit("cast", [kept], node)  # where's type promotion undone

    def _diagonals(self, buffer: fx.Node) -> dict:
        """A buffer of the model constant along each diagonal (ALiBi's ``-|j - i| * slope``
        kept for later calls): its diagonals as a table (``_diagonals_buffer``), looked up at
        each pair's key - query offset, in the buffer's own coordinates."""
        rows, cols = shape(buffer)[-2:]
        g = buffer.graph
        with g.inserting_before(buffer.next):  # in order, right after the buffer
            below = call(g, aten.flip.default, (call(g, aten.select.int, (buffer, -1, 0)), [-1]))
            row = call(g, aten.select.int, (buffer, -2, 0))  # key - query = 0, 1, ...
            flat = call(
                g, aten.cat.default, ([below, call(g, aten.slice.Tensor, (row, -1, 1))], -1)
            )
            flat = call(g, aten.reshape.default, (flat, [-1, rows + cols - 1]))  # (heads, ...)
            table = call(g, aten.permute.default, (flat, [1, 0]))
        top, _, left, _ = self._pad  # the buffer's (i, j) at the mask's (i + top, j + left)
        offset = self._emit("sub.Tensor", [{"pos": "k"}, {"pos": "q"}], buffer, "int64")
        index = self._emit("add.Tensor", [offset, rows - 1 + top - left], buffer, "int64")
        return self._emit("embed", [self._input(table, "p"), index], buffer)

    def _embedding(self, node: fx.Node) -> dict:
        """``embedding(table, index).permute(2, 0, 1)``: a (heads, queries, keys) bias."""
        table, index = node.args[0].args[:2]
        dims = [d % 3 for d in node.args[1]]
        if dims != [2, 0, 1] or len(shape(index)) != 2 or len(shape(table)) != 2:
            raise NotAProgram(f"{node.name}: an embedding not looked up at a queries x keys index")
        return self._emit("embed", [self._input(table, "p"), self.visit(index)], node)

    def _emit(self, op: str, args: list, node: fx.Node, dtype: str | None = None) -> dict:
        self.code.append((op, tuple(args), dtype or _dtype(node)))
        ref = {"op": len(self.code) - 1}
        learned = any(isinstance(a, dict) and _key(a) in self._learned for a in args)
        if learned and val(node).is_floating_point():
            if op not in DIFFERENTIABLE:
                raise NotAProgram(f"{op} on a learned mask has no gradient rule in a program")
            self._learned.add(_key(ref))
        return ref


_LARGEST_TRIANGLE = 1 << 14  # a buffer's side up to which its values are checked, once


def _triangle_buffer(node: fx.Node) -> tuple[str, int] | None:
    """``("tril" | "triu", diagonal)`` if ``node`` crops the top-left corner of a buffer of
    the model (size-1 leading dims) that holds ``tril``/``triu`` of ones, checked by value
    (once per trace: the buffer exists already), else ``None``."""
    x = node
    while x.op == "call_function" and x.target is aten.slice.Tensor:
        ndim = len(shape(x.args[0]))
        dim = x.args[1] % ndim
        start, _, step = slice_bounds(x, shape(x.args[0])[dim])
        crops = shape(x.args[0])[dim] != shape(x)[dim]
        if crops and (start != 0 or step != 1 or dim < ndim - 2):
            return None  # a crop of a leading dim, or not from the corner
        x = x.args[0]
    if x.op != "get_attr" or len(shape(x)) < 2 or max(shape(x)[-2:]) > _LARGEST_TRIANGLE:
        return None
    owner = node.graph.owning_module
    value = owner.get_buffer(x.target) if owner is not None else None
    if value is None or any(d != 1 for d in value.shape[:-2]):
        return None
    square = value.reshape(value.shape[-2:])
    if not torch.all((square == 0) | (square == 1)):
        return None
    square = square != 0
    ones = torch.ones_like(square)
    for kind, diagonal in (
        ("tril", int(square[0].sum()) - 1),
        ("triu", -int(square[:, 0].sum()) + 1),
    ):
        if torch.equal(square, getattr(torch, kind)(ones, diagonal)):
            return kind, diagonal
    return None


_LARGEST_DIAGONALS = 1 << 26  # a buffer's elements up to which its diagonals are checked


def _diagonals_buffer(node: fx.Node) -> bool:
    """Whether ``node`` is a buffer of the model whose values are constant along each
    diagonal of its last two dims, one leading dim at most beyond size 1 (heads): checked by
    value, once per trace (the buffer exists already)."""
    try:
        value = node.graph.owning_module.get_buffer(node.target)
    except AttributeError:  # a parameter: learned, never read as a constant's diagonals
        return False
    if value.numel() > _LARGEST_DIAGONALS or sum(d > 1 for d in value.shape[:-2]) > 1:
        return False
    lengths_ok = value.dim() >= 2 and min(value.shape[-2:]) >= 2
    return lengths_ok and torch.equal(value[..., 1:, 1:], value[..., :-1, :-1])


# ATen's long spellings of elementwise ops (``torch.subtract``, as einx calls it)
_ALIASES = {"subtract": "sub", "multiply": "mul", "divide": "div", "negative": "neg",
            "absolute": "abs", "greater": "gt", "greater_equal": "ge", "less": "lt",
            "less_equal": "le", "not_equal": "ne"}  # fmt: skip


def _functional(node: fx.Node) -> str:
    """The op's name, by its short spelling; an in-place op's functional name where nothing
    else reads the tensor it writes (T5's ``buckets += ...``)."""
    name = getattr(node.target, "__name__", str(node.target))
    op, _, overload = name.partition(".")
    if op.rstrip("_") in _ALIASES:
        op = _ALIASES[op.rstrip("_")] + "_" * op.endswith("_")
        name = f"{op}.{overload}"
    if not op.endswith("_") or op.startswith("_"):
        return name
    if writes_only_a_temporary(node):
        return f"{op[:-1]}.{overload}"
    raise NotAProgram(f"{name} writes {node.args[0]}, which other ops read")


def _key(ref: dict) -> tuple:
    return next(iter(ref.items()))


def _raise(message: str):
    raise NotAProgram(message)


def _dtype(node: fx.Node) -> str:
    return str(val(node).dtype).removeprefix("torch.")


def _reads_inputs(node: fx.Node) -> bool:
    """Whether ``node`` reads the values of a float graph input, parameter or buffer (one
    that may be learned); creation ops read only their input's dtype and device."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr") and val(n).is_floating_point():
            return True
        if n.target not in _CREATION:
            stack.extend(n.all_input_nodes)
    return False


def writes_only_a_temporary(node: fx.Node) -> bool:
    """An in-place op on a tensor the graph made (not a view) that nothing else reads: it
    has no effect beyond its own result."""
    schema = getattr(node.target, "_schema", None)
    written = node.args[0] if node.args else None
    if schema is None or not schema.is_mutable or not isinstance(written, fx.Node):
        return False
    made = getattr(written.target, "_schema", None)
    fresh = made is not None and all(r.alias_info is None for r in made.returns)
    return written.op == "call_function" and fresh and set(written.users) == {node}
