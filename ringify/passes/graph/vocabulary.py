"""The ops the pass knows by kind, each kind named once.

Every fold, rule and walk that asks "is this a cast?", "a view by sizes?", "a softmax?"
reads the answer here; ``op_dims.py`` beside it says what each op does with its dims.
The kinds are small and exact, and a reader's set is a union of them, written here under
the reader's meaning, so that two readers never keep two lists of one kind.
"""

from __future__ import annotations

import torch

from ringify.runtime.collectives.neighbours import shifted

aten = torch.ops.aten

# one value, one shape, its gradient kept
COPIES = frozenset({aten.clone.default, aten.contiguous.default, aten.alias.default})
# one value, its gradient cut (a lifted constant's copy among them)
DETACHES = frozenset({aten.detach.default, aten.detach_.default, aten.lift_fresh_copy.default})
# the same values, whatever becomes of their gradient
VALUE_PASSING = COPIES | DETACHES
CASTS = frozenset({aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device})
# casts to another tensor's dtype and device: the second tensor is read for those alone
CASTS_LIKE = frozenset({aten.type_as.default, aten.to.other})
ANY_CAST = CASTS | {aten.type_as.default}
# ops of one tensor whose result has its input's shape (copies, casts, dropout)
SAME_SHAPE = COPIES | DETACHES | CASTS | {aten.dropout.default}

SIZED_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
# views by sizes, and those whose arguments name dims (the same for any length)
DIM_VIEWS = frozenset({aten.flatten.using_ints, aten.unflatten.int})
VIEWS = SIZED_VIEWS | DIM_VIEWS
COMPLEX_VIEWS = frozenset({aten.view_as_complex.default, aten.view_as_real.default})
SQUEEZES = frozenset({aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default})
# ops that move dims and keep each one whole
MOVED = SQUEEZES | {
    aten.transpose.int,
    aten.t.default,
    aten.permute.default,
    aten.unsqueeze.default,
}
SELECTS_AND_SLICES = frozenset({aten.select.int, aten.slice.Tensor})
SELECTING_VIEWS = SELECTS_AND_SLICES | {aten.alias.default}
NARROWS = frozenset({aten.slice.Tensor, aten.narrow.default})
SPLITS_BY_SIZE = frozenset({aten.split.Tensor, aten.split_with_sizes.default})
SPLITS = SPLITS_BY_SIZE | {aten.unbind.int}
JOINS = frozenset({aten.cat.default, aten.stack.default})
CAT_SYNONYMS = frozenset({aten.concat.default, aten.concatenate.default})
MOVEDIMS = frozenset({aten.movedim.int, aten.movedim.intlist})
PADS = frozenset({aten.pad.default, aten.constant_pad_nd.default})
# ops that keep a dim's positions in order, some cut or padded at its ends
KEEPS_POSITIONS = PADS | {aten.slice.Tensor, shifted}
# the ops whose argument 1 is a shape
NEW_TENSORS = frozenset({
    aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default,
})  # fmt: skip
EXPANDS = frozenset({aten.expand.default, aten.broadcast_to.default})
SHAPED = SIZED_VIEWS | NEW_TENSORS | {aten.expand.default}
LIKE = frozenset({
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.full_like.default,
})  # fmt: skip
ZEROS = frozenset({aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default})
BLANK_LIKE = frozenset({aten.empty_like.default, aten.zeros_like.default})
# the ops that carry a value's rows as they are: views, copies and casts (dropout left out)
ROWS_CARRIED = (
    SIZED_VIEWS | SAME_SHAPE | CASTS_LIKE
    | {aten.flatten.using_ints, aten.unsqueeze.default, aten.expand.default}
) - {aten.dropout.default}  # fmt: skip
ARANGES = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step})

# values a walk reads through unchanged: what an index passes (casts and added dims of size
# 1), what a mask's values pass (expanded too)
INDEX_PASSING = COPIES | CASTS | SIZED_VIEWS | {aten.unsqueeze.default}
MASK_PASSING = COPIES | SIZED_VIEWS | {aten.expand.default, aten.unsqueeze.default}
# between a flex attention and the rescale of its output: moved or cast, never mixed
RESCALE_PASSING = INDEX_PASSING | {aten.transpose.int}

BATCHED_MATMULS = frozenset({aten.matmul.default, aten.bmm.default})
MATMULS = BATCHED_MATMULS | {aten.mm.default}
# products applied to each routed token's row (MoE experts)
ROW_PRODUCTS = frozenset({aten.linear.default, aten.mm.default, aten.matmul.default})
SCALINGS = frozenset({aten.mul.Tensor, aten.div.Tensor})
ADDS_AND_SUBS = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar})
MASKED_FILLS = frozenset({aten.masked_fill.Scalar, aten.masked_fill.Tensor})
WHERES = frozenset({aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf})
ANDS = frozenset({aten.mul.Tensor, aten.logical_and.default, aten.bitwise_and.Tensor})
# elementwise with broadcasting, as the pointwise tag's ops, but their overloads are untagged
UNTAGGED_POINTWISE = frozenset({
    aten.log_sigmoid.default, aten.hardswish.default, aten.rsub.Tensor, aten.masked_fill.Tensor,
    aten.where.Scalar, aten.where.ScalarOther, aten.where.ScalarSelf, aten.floor_divide.default,
})  # fmt: skip
TRIANGLES = frozenset({aten.tril.default, aten.triu.default})
LAST_TWO_SWAPS = frozenset({aten.mT.default, aten.mH.default, aten.adjoint.default})
SWAPS = frozenset({aten.swapaxes.default, aten.swapdims.default})

NORMS = frozenset({aten.layer_norm.default, aten.rms_norm.default})
# ops of each position alone, by weights of its features
PER_POSITION = NORMS | {aten.linear.default}
SOFTMAXES = frozenset({aten.softmax.int, aten._softmax.default, aten._safe_softmax.default})
# softmaxes called as (input, dim, dtype)
SOFTMAX_INTS = frozenset({aten.softmax.int, aten.log_softmax.int})
# reductions over dims a call names
REDUCTIONS = frozenset({
    aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
    aten.var.correction, aten.std.correction, aten.var.dim, aten.std.dim, aten.logsumexp.default,
    aten.any.dim, aten.all.dim,
})  # fmt: skip
MEANS = frozenset({aten.mean.default, aten.mean.dim})
SUMS_AND_MEANS = frozenset({
    aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim,
})  # fmt: skip
# reductions of a whole tensor to one number
TOTALS = frozenset({aten.sum.default, aten.mean.default, aten.max.default, aten.min.default})
# reductions whose result a rank cannot combine from its part's: run on the whole
LOCAL_REDUCTIONS = frozenset({aten.logsumexp.default, aten.max.dim, aten.min.dim})
# ops along a dim that read across it and keep it
ALONG = frozenset({
    aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int,
    aten.cumsum.default,
})  # fmt: skip
# ops that read across a dim but keep every index of every dim where it was (scans, masks)
IN_PLACE = ALONG | {
    aten.cumprod.default, aten.cummax.default, aten.cummin.default, aten.logcumsumexp.default,
    aten.tril.default, aten.triu.default,
}  # fmt: skip

SORTS = frozenset({aten.sort.default, aten.sort.stable})
ARGSORTS = frozenset({aten.argsort.default, aten.argsort.stable})
COUNTS = frozenset({aten.histc.default, aten.bincount.default})
ITEMS = frozenset({aten.item.default, aten._local_scalar_dense.default})  # a count's number
INDEX_PUTS = frozenset({aten.index_put.default, aten.index_put_.default})
# scatters that mark a routed token's slot
SLOT_MARKS = frozenset({aten.scatter.value, aten.scatter_.value, aten.scatter.src})
SCATTERS = frozenset({
    aten.scatter.value, aten.scatter.src, aten.scatter.reduce, aten.scatter.value_reduce,
})  # fmt: skip
SLICE_SCATTERS = frozenset({aten.select_scatter.default, aten.slice_scatter.default})
DRAWS = frozenset({
    aten.rand_like.default, aten.randn_like.default, aten.uniform.default,
    aten.exponential.default,
})  # fmt: skip

ASSERTS = frozenset({aten._assert_tensor_metadata.default})
CHECKS = ASSERTS | {aten._assert_scalar.default, aten.sym_constrain_range_for_size.default}

# ops of other libraries, by name (their libraries may not be imported)
TITAN_SCATTER_ADD = "torchtitan.deterministic_scatter_add.default"
GROUPED_MM = frozenset({"aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"})
SCATTER_BACK = frozenset({"aten.scatter_add.default", "aten.index_add.default", TITAN_SCATTER_ADD})
