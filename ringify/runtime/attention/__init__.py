"""Attention on a ring: the custom ops and their public API, the block kernels, memory attention, dilation."""
