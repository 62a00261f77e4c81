"""What a ring call returns and in which dtypes: the accumulation dtype, the bias dtype of a
block's kernel, outputs laid out in q's dim order and gradients in their inputs'.

Every attention op states its outputs' shapes and strides from these (its fake kernel is
``empty_attention_outputs``), so the graph pass and the running op agree on them.
"""

from __future__ import annotations

import functools

import torch

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Blocks are merged in float32, or float64 when the inputs are float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def bias_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype a block's bias is made in, once, for its kernel: q's own where the kernel adds
    a bias in q's dtype (CUDA's efficient kernel, for fp16/bf16: half the bytes a step keeps,
    and no conversion per call), else the accumulation dtype (the CPU kernels compute in it)."""
    if q.device.type != "cpu" and q.dtype in (torch.float16, torch.bfloat16):
        return q.dtype
    return accumulation_dtype(q.dtype)


def empty_in_dim_order_of(
    q: torch.Tensor, dtype: torch.dtype, last: int | None = None
) -> torch.Tensor:
    """An empty tensor shaped like ``q`` (its last dim ``last`` where given: a value head dim
    other than q's) whose dims lie in memory in q's order (by stride), densely: unlike
    ``empty_like``, also for a q that is a strided slice of a bigger tensor."""
    if last is None or last == q.shape[-1]:
        return torch.empty_strided(q.shape, _dense_strides(q), dtype=dtype, device=q.device)
    shape = (*q.shape[:-1], last)
    strides = _dense_strides_of(shape, q.stride())
    return torch.empty_strided(shape, strides, dtype=dtype, device=q.device)


def in_dim_order_of(
    q: torch.Tensor, out: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``out`` in q's dim order (``empty_in_dim_order_of``) and in ``dtype`` (default its
    own): itself if it already is (strides compared without allocating: nothing launched),
    else a copy."""
    dtype = out.dtype if dtype is None else dtype
    if out.dtype == dtype and is_in_dim_order_of(q, out):
        return out
    return empty_in_dim_order_of(q, dtype).copy_(out)


def is_in_dim_order_of(q: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out`` (q's shape) lies densely in memory in q's dim order."""
    return out.stride() == _dense_strides(q)


def _dense_strides(q: torch.Tensor) -> tuple[int, ...]:
    """The strides of a dense tensor of q's shape whose dims lie in memory in q's order."""
    shape, stride = tuple(q.shape), q.stride()
    try:
        return _kept_dense_strides(shape, stride)
    except TypeError:  # symbolic sizes are not hashable
        return _dense_strides_of(shape, stride)


def _dense_strides_of(shape: tuple, stride: tuple) -> tuple:
    order = sorted(range(len(shape)), key=lambda d: -stride[d])  # outermost first; stable
    strides, size = [0] * len(shape), 1
    for d in reversed(order):
        strides[d], size = size, size * shape[d]
    return tuple(strides)


_kept_dense_strides = functools.lru_cache(maxsize=256)(_dense_strides_of)  # asked in every call


def empty_attention_outputs(
    q: torch.Tensor, value_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty ``(out, lse)`` as the attention ops return them: ``out`` in q's dim order (its
    last dim ``value_dim`` where v's differs from q's), ``lse`` (B, H, S) in the accumulation
    dtype. The ops' fake kernels are this, so the graph pass, which fills ``meta["val"]``
    from the fake kernels, states shapes exactly once."""
    lse = q.new_empty(q.shape[:3], dtype=accumulation_dtype(q.dtype))
    return empty_in_dim_order_of(q, q.dtype, value_dim), lse


def gradients_of(
    inputs: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """Each gradient in its input's dtype and dim order, as SDPA's backward gives them: a model's
    q, k and v are views of its projections, (B, S, H, D) in memory, and a gradient laid out so
    goes back through their transpose and reshape without a copy. Itself where it already is."""
    return tuple(in_dim_order_of(x, g, x.dtype) for x, g in zip(inputs, grads, strict=True))


def empty_gradients_of(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Empty gradients as ``gradients_of`` lays them out (the backward ops' fakes)."""
    return tuple(empty_in_dim_order_of(x, x.dtype) for x in inputs)
