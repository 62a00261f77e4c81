"""Masks as programs: evaluation, bounds, gradients, each tile pair's visibility (or FA2 varlen
calls), and the per-step plan."""
