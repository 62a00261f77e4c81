"""Attention masks read as programs over O(S) vectors (``ringify/runtime/masks/program.py``).

``fold_mask_programs`` runs on the exported graph before the plan. For each
attention with a mask it walks the mask's subgraph back from the mask to where the
S x S part begins: nodes with both a query and a key dim are the program (they
must be elementwise, or a small table looked up at a queries x keys index: T5's
relative-position bias), the tensors feeding them are its inputs (a query or key dim
of size 1: O(S); the table whole). The mask argument becomes one ``program_mask``
node of the program's text and inputs, and the S x S nodes die: nothing of S x S
size is computed at trace or at run time, nor evaluated to decide what the mask is.
The ring rewrite hands the text and the inputs to the ring op, which bounds and
evaluates it tile by tile and returns the gradient of its learned inputs. A mask
that is not such a program (a tensor the model was given, an op with no tile form or,
on a learned path, no gradient rule) is kept as it is; the attention's node records
why.
"""

from __future__ import annotations

import torch
from torch import fx

from ringify.passes.crossings import PassState
from ringify.passes.nodes import call, is_tensor, shape, slice_bounds, val
from ringify.runtime.masks.grads import DIFFERENTIABLE
from ringify.runtime.masks.plan import attention_plan
from ringify.runtime.masks.program import ELEMENTWISE, MaskProgram, parse, program_mask

aten = torch.ops.aten
MASK_NOTE = "ringify_mask"  # node.meta key: why an attention's mask is (not) a program

_IDENTITY = frozenset({
    aten.expand.default, aten.alias.default, aten.clone.default, aten.contiguous.default,
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
})  # fmt: skip
_CASTS = frozenset({
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
    aten.type_as.default,
})  # fmt: skip
_FILLED = {aten.full.default: 1, aten.new_full.default: 2, aten.full_like.default: 1}
_CONSTANT = {  # creation ops of a fixed value
    aten.ones.default: 1, aten.new_ones.default: 1, aten.ones_like.default: 1,
    aten.zeros.default: 0, aten.new_zeros.default: 0, aten.zeros_like.default: 0,
}  # fmt: skip
_CREATION = _FILLED.keys() | _CONSTANT.keys()  # read only their input's dtype and device
_ASSERTS = frozenset({aten._assert_tensor_metadata.default})


class NotAProgram(Exception):
    """The mask has no program form; the message says why."""


def fold_mask_programs(graph: fx.Graph, attentions) -> None:
    """Replace the mask of every attention in ``attentions`` (read ``Attention`` rows) by a
    ``program_mask`` node where it is a program; note on each attention node why not."""
    sizes = _symbolic_sizes(graph)
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
    _erase_dead(graph)


def _symbolic_sizes(graph: fx.Graph) -> dict:
    """Symbolic size -> the first node computing it (a graph traced with a dynamic length)."""
    sizes = {}
    for node in graph.nodes:
        if isinstance(val(node), torch.SymInt):
            sizes.setdefault(_expr(val(node)), node)
    return sizes


def _expr(size):
    return size.node.expr if isinstance(size, torch.SymInt) else None


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
        self._refs: dict[fx.Node, dict] = {}
        self._learned: set[tuple] = set()  # refs whose value depends on a learned input

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
        if a in self._refs:
            return self._refs[a]
        if not is_tensor(a):
            raise NotAProgram(f"{a.name} is not a tensor")
        role = self.role(a)
        if role != "pair":
            ref = self._input(a, role)
        elif a.op != "call_function":
            raise NotAProgram(
                f"a {self.queries} x {self.keys} tensor the model was given ({a.name})"
            )
        else:
            ref = self._instruction(a)
        self._refs[a] = ref
        return ref

    def _input(self, node: fx.Node, role: str) -> dict:
        if node in self._refs:
            return self._refs[node]
        self.roles.append(role)
        self.inputs.append(node)
        ref = self._refs[node] = {"in": len(self.inputs) - 1}
        if val(node).is_floating_point() and _reads_inputs(node):  # may be learned
            self._learned.add(_key(ref))
        return ref

    def _instruction(self, node: fx.Node) -> dict:
        target, args = node.target, node.args
        if target in _IDENTITY:
            before, after = [1, 1, *shape(args[0])][-2:], shape(node)[-2:]
            broadcast = target is aten.expand.default and all(
                b in (1, a) for b, a in zip(before, after, strict=True)
            )
            if before != list(after) and not broadcast:
                raise NotAProgram(f"{node.name} ({target}) reshapes the queries x keys dims")
            return self.visit(args[0])
        if target in _CASTS:
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
            return self._emit(kind, [self._emit("const", [1], node), offset], node)
        if target in (aten.tril.default, aten.triu.default):
            diagonal = args[1] if len(args) > 1 else node.kwargs.get("diagonal", 0)
            return self._emit(target.__name__.split(".")[0], [self.visit(args[0]), diagonal], node)
        name = _functional(node)
        if getattr(target, "namespace", None) != "aten" or name not in ELEMENTWISE:
            raise NotAProgram(f"{name} on the queries x keys part has no tile form")
        if node.kwargs:
            raise NotAProgram(f"{name} with keyword arguments {sorted(node.kwargs)}")
        return self._emit(name, [self.visit(a) for a in args], node)

    def _embedding(self, node: fx.Node) -> dict:
        """``embedding(table, index).permute(2, 0, 1)``: a (heads, queries, keys) bias."""
        table, index = node.args[0].args[:2]
        dims = [d % 3 for d in node.args[1]]
        if dims != [2, 0, 1] or len(shape(index)) != 2 or len(shape(table)) != 2:
            raise NotAProgram(f"{node.name}: an embedding not looked up at a queries x keys index")
        return self._emit("embed", [self._input(table, "p"), self.visit(index)], node)

    def _emit(self, op: str, args: list, node: fx.Node) -> dict:
        self.code.append((op, tuple(args), _dtype(node)))
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


def _functional(node: fx.Node) -> str:
    """The op's name; an in-place op's functional name where nothing else reads the tensor it
    writes (T5's ``buckets += ...``)."""
    name = getattr(node.target, "__name__", str(node.target))
    op, _, overload = name.partition(".")
    if not op.endswith("_") or op.startswith("_"):
        return name
    if _writes_only_a_temporary(node):
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
            checked = node.args[0] if node.target in _ASSERTS else None
            dead_assert = isinstance(checked, fx.Node) and all(
                u.target in _ASSERTS for u in checked.users
            )
            if dead_assert or (not node.users and _writes_only_a_temporary(node)):
                graph.erase_node(node)
                changed = True
        changed |= graph.eliminate_dead_code()


def _writes_only_a_temporary(node: fx.Node) -> bool:
    """An in-place op on a tensor the graph made (not a view) that nothing else reads: it
    has no effect beyond its own result."""
    schema = getattr(node.target, "_schema", None)
    written = node.args[0] if node.args else None
    if schema is None or not schema.is_mutable or not isinstance(written, fx.Node):
        return False
    made = getattr(written.target, "_schema", None)
    fresh = made is not None and all(r.alias_info is None for r in made.returns)
    return written.op == "call_function" and fresh and set(written.users) == {node}


def program_inputs(
    folded: fx.Node, state: PassState, is_causal: bool
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
    if ("plan", program, is_causal) not in state._cache:
        # right after its inputs: outside any layer's checkpointed or FSDP span that the
        # program's node may sit in, so that no recompute makes the plan again
        geo, order = state.geo, {n: i for i, n in enumerate(state.graph.nodes)}
        first = next(n for n in state.graph.nodes if n.op == "placeholder")
        latest = max(whole, key=order.__getitem__, default=first)  # no inputs: at the top
        with state.graph.inserting_before(state.after(latest)):
            args = (text, whole, geo.local, is_causal, state.group_name, geo.layout, geo.length)
            plan = call(state.graph, attention_plan._opoverload, args, like=folded)
        state.place[plan] = None
        state._cache["plan", program, is_causal] = plan
    return text, whole, state._cache["plan", program, is_causal]


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


def rewrite_program_mask(node: fx.Node, out, state: PassState) -> None:
    """A mask program computed whole (its attention is not a ring): its O(S) inputs are
    gathered."""
    for a in list(node.all_input_nodes):
        if state.sharded(a):
            node.replace_input_with(a, state.gather(a))
