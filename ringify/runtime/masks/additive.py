"""An SDPA ``attn_mask`` as the float bias the block kernels add to the scores."""

from __future__ import annotations

import torch


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
