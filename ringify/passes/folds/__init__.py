"""Folds: the forms models write (attention by hand, FlexAttention, masks, convolutions,
shifts, scans, casts, in-place writes) rewritten into the canonical nodes the sharding reads."""
