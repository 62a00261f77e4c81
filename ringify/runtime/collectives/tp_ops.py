"""Tensor parallelism's collectives, as custom ops the pass puts around a layer's matmul.

A model parallelized for TP (``parallelize_module``, or transformers' ``tp_plan``) is traced
with each TP weight as its local shard (``ringify/stacks/tp_layers.py``); these ops are what
the layer's placements imply, written where the layer reads its weight
(``passes/tp_collectives.py``). They are Megatron's pair and its two neighbours, on the TP
group named ``group_name`` (another group than the ring's):

- ``tp_copy``: the input of a column-parallel layer, replicated. Identity forward; the
  backward sums every TP rank's partial gradient (Megatron's f).
- ``tp_reduce``: the output of a row-parallel layer, each rank's partial sum. All-reduce
  forward; identity backward (Megatron's g). The layer's bias is added after it, once.
- ``tp_gather`` / ``tp_split``: the last dim whole from every rank's columns, and its
  inverse (a column-parallel layer whose output is kept replicated; a row-parallel layer
  given a replicated input).
- ``tp_vocab_embedding``: a lookup in a vocabulary split by rows: the ids of other ranks'
  rows give zeros, and a ``tp_reduce`` after it sums the ranks' rows.

Each acts on the last dim or position by position, so the ring's sequence sharding passes
through them unchanged.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ringify.runtime.collectives.reduce import all_reduce
from ringify.runtime.collectives.ring import ring_by_name

_c10d = torch.ops._c10d_functional


# Functional collectives: the backward formulas below are traced into the backward graph
# under torch.compile, where an eager collective would carry its process group as a value.
def _all_gather_last(x: torch.Tensor, group_name: str) -> torch.Tensor:
    size = ring_by_name(group_name).size
    stacked = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous(), size, group_name))
    return torch.cat(stacked.chunk(size, dim=0), dim=-1)


def _own_columns(x: torch.Tensor, group_name: str) -> torch.Tensor:
    tp = ring_by_name(group_name)
    return x.chunk(tp.size, dim=-1)[tp.rank].contiguous()


@torch.library.custom_op("ringify::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Identity (a fresh tensor: op outputs never alias inputs); see the module's docstring."""
    return x.clone()


@torch.library.custom_op("ringify::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum over the TP group of every rank's ``x``."""
    return all_reduce(x, group_name)


@torch.library.custom_op("ringify::tp_gather", mutates_args=())
def tp_gather(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Every TP rank's ``x`` side by side along the last dim, in rank order."""
    return _all_gather_last(x, group_name)


@torch.library.custom_op("ringify::tp_split", mutates_args=())
def tp_split(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """This TP rank's equal share of the last dim."""
    return _own_columns(x, group_name)


@tp_copy.register_fake
@tp_reduce.register_fake
def _(x, group_name):
    return torch.empty_like(x)


@tp_gather.register_fake
def _(x, group_name):
    return x.new_empty((*x.shape[:-1], x.shape[-1] * ring_by_name(group_name).size))


@tp_split.register_fake
def _(x, group_name):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // ring_by_name(group_name).size))


def _keep_group(ctx, inputs, output):
    ctx.group_name = inputs[1]


tp_copy.register_autograd(
    lambda ctx, grad: (all_reduce(grad, ctx.group_name), None), setup_context=_keep_group
)
tp_reduce.register_autograd(lambda ctx, grad: (grad, None), setup_context=_keep_group)
tp_gather.register_autograd(
    lambda ctx, grad: (_own_columns(grad, ctx.group_name), None), setup_context=_keep_group
)
tp_split.register_autograd(
    lambda ctx, grad: (_all_gather_last(grad, ctx.group_name), None), setup_context=_keep_group
)


def local_state(t: torch.Tensor) -> torch.Tensor:
    """What a graph traced by ringify reads of a state tensor: a TP weight's local shard
    (differentiable: its gradient lands on the DTensor parameter), else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def vocab_rows(vocab: int, rank: int, size: int) -> tuple[int, int]:
    """(first row, rows) of the vocabulary a TP rank holds: ``torch.chunk``'s split, as
    DTensor's ``Shard(0)`` makes it (the last ranks may hold fewer)."""
    rows = -(-vocab // size)
    first = min(rank * rows, vocab)
    return first, min(rows, vocab - first)


def _local_ids(ids: torch.Tensor, vocab: int, group_name: str):
    tp = ring_by_name(group_name)
    first, rows = vocab_rows(vocab, tp.rank, tp.size)
    local = ids - first
    elsewhere = (local < 0) | (local >= rows)
    return local.masked_fill(elsewhere, 0), elsewhere, first, rows


@torch.library.custom_op("ringify::tp_vocab_embedding", mutates_args=())
def tp_vocab_embedding(
    weight: torch.Tensor, ids: torch.Tensor, vocab: int, padding_idx: int, group_name: str
) -> torch.Tensor:
    """``embedding(full_weight, ids)``'s part from this rank's rows ``weight`` of a ``vocab``
    split by rows: zeros where an id is another rank's row."""
    local, elsewhere, _, _ = _local_ids(ids, vocab, group_name)
    return torch.embedding(weight, local).masked_fill(elsewhere.unsqueeze(-1), 0)


@tp_vocab_embedding.register_fake
def _(weight, ids, vocab, padding_idx, group_name):
    return weight.new_empty((*ids.shape, weight.shape[-1]))


def _save_ids(ctx, inputs, output):
    weight, ids, vocab, padding_idx, group_name = inputs
    ctx.save_for_backward(ids)
    ctx.rows, ctx.vocab, ctx.padding_idx, ctx.group_name = (
        weight.shape[0],
        vocab,
        padding_idx,
        group_name,
    )


def _vocab_backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    local, elsewhere, first, rows = _local_ids(ids, ctx.vocab, ctx.group_name)
    padding = ctx.padding_idx - first if 0 <= ctx.padding_idx - first < rows else -1
    grad = grad.masked_fill(elsewhere.unsqueeze(-1), 0)
    dweight = torch.ops.aten.embedding_dense_backward(grad, local, ctx.rows, padding, False)
    return dweight, None, None, None, None


tp_vocab_embedding.register_autograd(_vocab_backward, setup_context=_save_ids)


_ops = torch.ops.ringify
# the graph's targets: ops on the last dim, each position alone; and the split lookup
TP_COPY, TP_REDUCE, TP_GATHER, TP_SPLIT = (
    _ops.tp_copy.default,
    _ops.tp_reduce.default,
    _ops.tp_gather.default,
    _ops.tp_split.default,
)
TP_FEATURE_OPS = (TP_COPY, TP_REDUCE, TP_GATHER, TP_SPLIT)
TP_VOCAB_EMBEDDING = _ops.tp_vocab_embedding.default
