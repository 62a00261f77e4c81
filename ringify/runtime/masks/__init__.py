"""Masks as programs: evaluation, bounds, gradients, each tile pair's visibility, and the per-step plan."""
