"""A FlexAttention ``BlockMask`` passed to the model as an input (torchtitan builds it outside
the model: ``model(tokens, positions=..., attention_masks=model.get_attention_masks(...))``).

``torch.export`` takes no ``BlockMask`` input. Each one becomes a ``FlatBlockMask``: its
tensors (the block tables, and every tensor its ``mask_mod`` closes over, such as the
documents' ids) as pytree leaves, and the rest as the spec. So every call's mask is read
from its inputs, never baked into the graph, and the call's signature names the mask's
code, not one object. Inside the export, ``rebuilt`` hands the model a ``BlockMask`` made
from the leaves again, whose ``mask_mod`` reads them: the pass reads it as a mask program
(``passes/folds/flex.py``), as it reads a mask built inside ``forward``.
"""

from __future__ import annotations

import hashlib
import marshal
from dataclasses import dataclass, field

from torch.fx._pytree import register_pytree_flatten_spec
from torch.nn.attention import flex_attention as flex
from torch.nn.attention.flex_attention import BlockMask
from torch.utils import _pytree as pytree

# torch 2.13's own flattening of a BlockMask (``BlockMask._flatten``) lifts the tensors of
# ``mask_mod``'s closure into its leaves; these are the forms it strips a mask_mod to
_STRIPPED = (flex._StrippedClosure, flex._StrippedPartial, flex._PlainFunction)


@dataclass(frozen=True)
class MaskSpec:
    """A BlockMask's non-tensor part. Equal where torch's flattening says the masks are the
    same (its value equality on ``mask_mod``'s code); printed with a digest of that code, so
    that every rank and every call prints it alike."""

    context: tuple = field(repr=False)
    described: str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MaskSpec) and self.context == other.context

    def __hash__(self) -> int:
        return hash(self.described)


@dataclass
class FlatBlockMask:
    """A BlockMask as its tensors (``leaves``) and ``spec``."""

    leaves: list
    spec: MaskSpec


def _codes(stripped) -> list[bytes]:
    """The code of a stripped mask_mod and of every function its closure holds."""
    if isinstance(stripped, flex._PlainFunction):
        return [marshal.dumps(stripped.fn.__code__)]
    own = [marshal.dumps(stripped.code)] if isinstance(stripped, flex._StrippedClosure) else []
    for entry in stripped.leaf_entries:
        if isinstance(entry, flex._CallableLeaf):
            own += _codes(entry.stripped) if isinstance(entry.stripped, _STRIPPED) else []
            own.append(str(entry.callable_spec).encode())
    return own


def flattened(mask: BlockMask) -> FlatBlockMask:
    leaves, context = mask._flatten()
    wrapper = context[BlockMask._CONTEXT_ATTRS.index("mask_mod")]
    if not isinstance(wrapper.fn, _STRIPPED):
        raise ValueError(
            f"ringify: a BlockMask input whose mask_mod is a {type(wrapper.fn).__name__}: "
            "ringify reads a mask_mod that is a function or functools.partial (the tensors it "
            "closes over become the graph's inputs). Make mask_mod a function, or build the "
            "BlockMask inside the model's forward."
        )
    digest = hashlib.sha1(b"".join(_codes(wrapper.fn)) + str(wrapper.callable_spec).encode())
    seq_lengths, block_size = mask.seq_lengths, mask.BLOCK_SIZE
    described = f"BlockMask({seq_lengths}, {block_size}, mask_mod #{digest.hexdigest()[:12]})"
    return FlatBlockMask(list(leaves), MaskSpec(context, described))


def with_flat_block_masks(tree):
    """``tree`` with each BlockMask in it flattened (the rest as it is)."""
    return pytree.tree_map(
        lambda x: flattened(x) if isinstance(x, BlockMask) else x,
        tree,
        is_leaf=lambda x: isinstance(x, BlockMask),
    )


def rebuilt(tree):
    """``tree`` with each FlatBlockMask in it a BlockMask again."""
    return pytree.tree_map(
        lambda x: (
            BlockMask._unflatten(tuple(x.leaves), x.spec.context)
            if isinstance(x, FlatBlockMask)
            else x
        ),
        tree,
        is_leaf=lambda x: isinstance(x, FlatBlockMask),
    )


pytree.register_pytree_node(
    FlatBlockMask,
    lambda m: (m.leaves, m.spec),
    lambda leaves, spec: FlatBlockMask(list(leaves), spec),
    serialized_type_name="ringify.FlatBlockMask",
    flatten_with_keys_fn=lambda m: (
        [(pytree.SequenceKey(i), x) for i, x in enumerate(m.leaves)],
        m.spec,
    ),
)
register_pytree_flatten_spec(FlatBlockMask, lambda m, spec: m.leaves)
