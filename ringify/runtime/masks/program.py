"""An attention mask as a program over O(S) vectors, evaluated one tile pair at a time.

Models build masks by broadcasting index vectors against each other: ``kv <= q``
(causal), ``q - kv < w`` (a sliding window), ``pad[b, kv]`` (padding),
``doc[b, q] == doc[b, kv]`` (packed documents). The pass
(``ringify/passes/folds/mask_programs.py``) cuts the mask's subgraph where the S x S part
begins. Its *inputs* are tensors whose query or key dim has size 1 (O(S) elements):
role ``q`` varies along the queries, ``k`` along the keys, ``c`` along neither;
role ``p`` is a small table read whole (T5's relative-position bias embedding).
Its *code* is the elementwise ops that combine them into the mask, plus ``embed``:
a table looked up at a queries x keys index (the bias of a learned program, whose
gradient ``add_program_grads`` returns).

The ring op cannot take a Python callable, so the program travels as canonical JSON
text: a string argument, identified by its content, which keeps the op opaque to
torch.compile, its fake kernel exact and AOTAutograd's cache the same on every rank.

Per tile pair the op first *bounds* the program (interval arithmetic over the
inputs' per-tile minima and maxima, for all pairs at once): a pair surely all masked
is skipped and one surely all visible runs with no mask, without evaluating
anything of S x S size. Only the rest is evaluated, at the size of one tile pair, and
made the float bias the block kernels add to the scores (``additive_mask``).

The gradient of a learned program (T5's bias table, learned slopes), block by block: the
ring op's backward has each block's dS (``bias_backward``: the gradient of the
mask over that block). This maps it back through the block's program to the
inputs that require a gradient, in reverse over the instructions, by hand: the
op's body runs below autograd, and no S x S graph is ever recorded. Only float
values carry a gradient; comparisons, integer and bool casts, and positions stop
it. The pass keeps a learned mask whose gradient would pass through an op outside
``DIFFERENTIABLE`` (``ringify/passes/folds/mask_programs.py``). The whole-mask op
``program_mask`` (an attention that is not a ring) takes its gradient from here too.
"""

from __future__ import annotations

import collections
import functools
import json
from dataclasses import dataclass

import torch

aten = torch.ops.aten

# Ops a program may hold: elementwise, so that a tile of the output is the op on tiles
# of its inputs. ``cast``, ``const``, ``tril`` and ``triu`` are the program's own.
ELEMENTWISE = frozenset({
    "le.Tensor", "lt.Tensor", "ge.Tensor", "gt.Tensor", "eq.Tensor", "ne.Tensor",
    "le.Scalar", "lt.Scalar", "ge.Scalar", "gt.Scalar", "eq.Scalar", "ne.Scalar",
    "__and__.Tensor", "__or__.Tensor", "__xor__.Tensor", "bitwise_and.Tensor",
    "bitwise_or.Tensor", "bitwise_xor.Tensor", "logical_and.default", "logical_or.default",
    "logical_xor.default", "logical_not.default", "bitwise_not.default",
    "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Scalar", "mul.Tensor",
    "mul.Scalar", "div.Tensor", "div.Scalar", "neg.default", "abs.default",
    "remainder.Scalar", "remainder.Tensor", "floor_divide.default",
    "maximum.default", "minimum.default", "where.self", "where.ScalarSelf",
    "where.ScalarOther", "where.Scalar", "masked_fill.Scalar", "masked_fill.Tensor",
    "log.default", "exp.default", "sqrt.default", "min.other", "max.other",
})  # fmt: skip
OWN_OPS = frozenset({"cast", "const", "tril", "triu", "embed"})
ROLES = frozenset({"q", "k", "c", "p"})


@dataclass(frozen=True)
class MaskProgram:
    """``roles[i]`` of input i (``q``, ``k``, ``c`` or ``p``); ``code``: instructions
    ``(op, args, dtype)`` whose args are literals or references: ``{"in": i}``,
    ``{"op": j}`` (an earlier instruction's result), ``{"pos": "q"|"k"}`` (global
    positions). The last instruction is the mask."""

    roles: tuple[str, ...]
    code: tuple[tuple[str, tuple, str], ...]

    def text(self) -> str:
        return json.dumps({"roles": self.roles, "code": self.code}, sort_keys=True)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.code[-1][2])

    @functools.cached_property
    def last_uses(self) -> dict[int, list[int]]:
        """instruction j -> the earlier results it is the last to read."""
        last = {}
        for j, (_, args, _) in enumerate(self.code):
            for a in args:
                if isinstance(a, dict) and "op" in a:
                    last[a["op"]] = j
        uses: dict[int, list[int]] = {}
        for result, j in last.items():
            uses.setdefault(j, []).append(result)
        return uses


@functools.lru_cache(maxsize=64)
def parse(text: str) -> MaskProgram:
    """The program of ``text`` (cached by content); refuses any op outside the program's set."""
    raw = json.loads(text)
    code = tuple((op, _tuple(args), dtype) for op, args, dtype in raw["code"])
    for op, _, _ in code:
        if op not in ELEMENTWISE and op not in OWN_OPS:
            raise ValueError(f"mask program: {op!r} is not an elementwise op")
    if not set(raw["roles"]) <= ROLES:
        raise ValueError(f"mask program: input roles {raw['roles']} outside {sorted(ROLES)}")
    return MaskProgram(tuple(raw["roles"]), code)


def _tuple(x):
    return tuple(_tuple(a) for a in x) if isinstance(x, list) else x


def as_4d(x: torch.Tensor) -> torch.Tensor:
    return x.view((1,) * (4 - x.dim()) + tuple(x.shape))


def evaluate(program: MaskProgram, inputs, rows: slice, cols: slice, device) -> torch.Tensor:
    """The mask at global query positions ``rows`` and key positions ``cols`` (4-D,
    size-1 dims where it broadcasts), on ``device``."""
    # only the last result is held: each temporary is freed after its last reader
    (mask,) = collections.deque(steps(program, inputs, rows, cols, device, keep=False), 1)
    return as_4d(mask)


def steps(program: MaskProgram, inputs, rows: slice, cols: slice, device, keep: bool):
    """Yields each instruction's result at ``rows`` x ``cols``; unless ``keep``, a
    block-sized temporary is dropped after its last reader."""
    q_pos = torch.arange(rows.start, rows.stop, device=device).view(-1, 1)
    k_pos = torch.arange(cols.start, cols.stop, device=device)
    tiles = input_tiles(program, inputs, rows, cols)
    results: list[torch.Tensor | None] = []
    for j, (op, args, dtype) in enumerate(program.code):
        vals = [resolve(a, tiles, results, q_pos, k_pos, lambda x: x) for a in args]
        results.append(run_op(op, vals, getattr(torch, dtype), q_pos, k_pos, device))
        yield results[-1]
        for done in () if keep else program.last_uses.get(j, ()):
            results[done] = None


def input_tiles(program: MaskProgram, inputs, rows: slice, cols: slice) -> list[torch.Tensor]:
    """The program's inputs at ``rows`` x ``cols`` (views; a ``p`` table whole)."""
    parts = {"q": (Ellipsis, rows, slice(None)), "k": (Ellipsis, cols), "c": (Ellipsis,)}
    return [
        x if role == "p" else as_4d(x)[parts[role]]
        for x, role in zip(inputs, program.roles, strict=True)
    ]


def resolve(a, inputs: list, results: list, q_pos, k_pos, literal):
    """An instruction's argument: an input, an earlier result, positions, or ``literal(a)``."""
    if not isinstance(a, dict):
        return literal(a)
    if "in" in a:
        return inputs[a["in"]]
    if "op" in a:
        return results[a["op"]]
    return q_pos if a["pos"] == "q" else k_pos


def run_op(op: str, args: list, dtype: torch.dtype, q_pos, k_pos, device) -> torch.Tensor:
    # A literal is filled in on the device (a kernel), never copied from the host: a
    # host-to-device copy per block and layer would wait on the host.
    if op == "cast":
        x = args[0]
        if not isinstance(x, torch.Tensor):  # as torch.as_tensor would type the literal
            x = torch.full((), x, dtype=_literal_dtype(x), device=device)
        return x.to(device=device, dtype=dtype)
    if op == "const":
        if isinstance(args[0], torch.Tensor):  # a value the graph computed
            return args[0].to(device=device, dtype=dtype)
        return torch.full((), args[0], dtype=dtype, device=device)
    if op == "embed":  # table[index] with the table's columns (heads) before queries x keys
        table, index = args
        return as_4d(table[index.reshape(index.shape[-2:])].permute(2, 0, 1))
    if op in ("tril", "triu"):  # the kernel's top-left alignment: key - query vs diagonal
        x, diagonal = args
        offset = k_pos - q_pos
        keep = offset <= diagonal if op == "tril" else offset >= diagonal
        return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    name, overload = op.rsplit(".", 1)
    return getattr(getattr(aten, name), overload)(*args)


def _literal_dtype(x) -> torch.dtype:
    if isinstance(x, bool):
        return torch.bool
    return torch.int64 if isinstance(x, int) else torch.get_default_dtype()


def tile_bounds(x: torch.Tensor, role: str, starts, stops):
    """Per-tile (min, max) of input ``x`` over its role's tiles (global position ranges
    ``starts[i]:stops[i]``), as float64 column (``q``) or row (``k``) vectors."""
    x4 = as_4d(x).double()
    if role in ("c", "p"):
        return x4.min().view(1, 1), x4.max().view(1, 1)
    lo, hi = [], []
    for a, b in zip(starts, stops, strict=True):
        part = x4[..., a:b, :] if role == "q" else x4[..., a:b]
        lo.append(part.min())
        hi.append(part.max())
    lo, hi = torch.stack(lo), torch.stack(hi)
    shape = (-1, 1) if role == "q" else (1, -1)
    return lo.view(shape), hi.view(shape)


@torch.library.custom_op("ringify::program_mask", mutates_args=())
def program_mask_op(
    text: str, inputs: list[torch.Tensor], shape: list[int], device: torch.device
) -> torch.Tensor:
    """The whole mask of ``shape`` (queries x keys last): what a graph computes for an
    attention that does not run as a ring (one rank, local, or gathered). A custom op, so
    that torch.compile sees one opaque node and never the program's interpreter."""
    program = parse(text)
    mask = evaluate(program, inputs, slice(0, shape[-2]), slice(0, shape[-1]), device)
    whole = mask.reshape(mask.shape[4 - len(shape) :]).expand(shape)
    return whole.clone(memory_format=torch.contiguous_format)  # the fake's strides


@program_mask_op.register_fake
def _(text, inputs, shape, device):
    return torch.empty(shape, dtype=parse(text).dtype, device=device)


program_mask = program_mask_op._opoverload


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An SDPA ``attn_mask`` (bool: True attends; float: added to the scores) as a float bias;
    on an accelerator with rows 16-byte aligned, as the efficient kernel takes it as it is
    (``_cuda_bias``: a bias made once is then never copied again)."""
    if mask.device.type == "cpu":
        bias = mask.to(dtype)
    else:
        t = mask.shape[-1]
        padded = torch.empty(*mask.shape[:-1], t + (-t % 8), dtype=dtype, device=mask.device)
        bias = padded[..., :t].copy_(mask)
    # log(1) = 0 and log(0) = -inf, exactly (IEEE)
    return bias.log_() if mask.dtype == torch.bool else bias


DIFFERENTIABLE = frozenset({
    "cast", "const", "embed", "tril", "triu", "neg.default", "exp.default",
    "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Scalar",
    "mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar",
    "where.self", "where.ScalarSelf", "where.ScalarOther",
    "masked_fill.Scalar", "masked_fill.Tensor",
})  # fmt: skip


def add_program_grads(
    program: MaskProgram, inputs: list, grads: list, rows: slice, cols: slice, grad_mask
) -> None:
    """Add into ``grads[i]`` (a buffer shaped like ``inputs[i]``, or None: not wanted) the
    gradient of input i, from ``grad_mask``: the gradient of the mask at ``rows`` x ``cols``."""
    device = grad_mask.device
    results = list(steps(program, inputs, rows, cols, device, keep=True))
    tiles = input_tiles(program, inputs, rows, cols)
    into = input_tiles(
        program, [g if g is not None else x for g, x in zip(grads, inputs, strict=True)], rows, cols
    )
    q_pos = torch.arange(rows.start, rows.stop, device=device).view(-1, 1)
    k_pos = torch.arange(cols.start, cols.stop, device=device)
    pending = {len(results) - 1: grad_mask}  # instruction -> the gradient of its result
    for j in reversed(range(len(program.code))):
        g = pending.pop(j, None)
        if g is None:
            continue
        op, args, _ = program.code[j]
        vals = [resolve(a, tiles, results, q_pos, k_pos, lambda x: x) for a in args]
        for a, grad in zip(args, _vjp(op, vals, results[j], g, q_pos, k_pos), strict=True):
            if grad is None or not isinstance(a, dict):
                continue
            if "op" in a and results[a["op"]].is_floating_point():
                grad = sum_to(grad, results[a["op"]].shape)
                pending[a["op"]] = pending[a["op"]] + grad if a["op"] in pending else grad
            elif "in" in a and grads[a["in"]] is not None:
                view = into[a["in"]]
                view += sum_to(grad, view.shape).to(view.dtype)


def _vjp(op: str, vals: list, out, g, q_pos, k_pos) -> list:
    """The gradient of each argument of ``op`` (None where none flows), from ``g``."""
    none = [None] * len(vals)
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    if op == "cast":
        return [g if torch.is_tensor(vals[0]) and vals[0].is_floating_point() else None]
    if op in ("tril", "triu"):
        return [run_op(op, [g, vals[1]], g.dtype, q_pos, k_pos, g.device), None]
    if op == "embed":
        table, index = vals
        return [_embedding_grad(table, index, g), None]
    name = op.split(".")[0]
    alpha = vals[2] if len(vals) > 2 else 1
    if name == "add":
        return [g, g * alpha, None][: len(vals)]
    if name == "sub":
        return [g, -g * alpha, None][: len(vals)]
    if name == "rsub":
        return [-g * alpha, None, None][: len(vals)]
    if name == "neg":
        return [-g]
    if name == "exp":
        return [g * out]
    if name == "mul":
        return [g * vals[1], g * vals[0] if torch.is_tensor(vals[1]) else None]
    if name == "div":
        a, b = vals
        return [g / b, -g * a / (b * b) if torch.is_tensor(b) else None]
    if name == "where":  # (condition, where true, where false)
        return [None, torch.where(vals[0], g, zero), torch.where(vals[0], zero, g)]
    if name == "masked_fill":  # (x, mask, value)
        value = torch.where(vals[1], g, zero).sum() if op == "masked_fill.Tensor" else None
        return [torch.where(vals[1], zero, g), None, value]
    return none


def _embedding_grad(table: torch.Tensor, index: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The table's gradient from ``g`` (…, E, rows, cols) of ``embed``'s result."""
    g = sum_to(g, (1, table.shape[1], *g.shape[-2:]))[0].permute(1, 2, 0)  # rows, cols, E
    index = index.reshape(index.shape[-2:]).expand(g.shape[:2])
    out = torch.zeros(table.shape, dtype=g.dtype, device=g.device)
    return out.index_put_((index,), g, accumulate=True)


def sum_to(g: torch.Tensor, shape) -> torch.Tensor:
    """``g`` summed over the dims along which ``shape`` was broadcast to reach ``g``'s."""
    shape = tuple(shape)
    lead = g.dim() - len(shape)
    g = g.sum(tuple(range(lead))) if lead > 0 else g.reshape((1,) * -lead + tuple(g.shape))
    dims = tuple(d for d, s in enumerate(shape) if s == 1 and g.shape[d] != 1)
    return (g.sum(dims, keepdim=True) if dims else g).reshape(shape)


def _setup_context(ctx, inputs, output):
    text, mask_inputs, shape, _ = inputs
    ctx.text, ctx.shape = text, shape
    ctx.wanted = [x.requires_grad for x in mask_inputs]
    ctx.save_for_backward(*mask_inputs)


def _backward(ctx, grad):
    """A whole mask's program (an attention that is not a ring): its learned inputs' gradient."""
    inputs = ctx.saved_tensors
    grads = [torch.zeros_like(x) if w else None for x, w in zip(inputs, ctx.wanted, strict=True)]
    if any(ctx.wanted):
        rows, cols = (slice(0, n) for n in ctx.shape[-2:])
        add_program_grads(parse(ctx.text), list(inputs), grads, rows, cols, as_4d(grad))
    return None, grads, None, None


program_mask_op.register_autograd(_backward, setup_context=_setup_context)
