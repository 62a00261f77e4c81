"""The ATen graph as every pass reads and writes it: its nodes, its attention nodes, its
losses, where the sequence lives in each value, the state a rewrite shares, the report."""
