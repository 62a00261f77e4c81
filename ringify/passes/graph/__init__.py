"""The ATen graph as every pass reads and writes it: its nodes, its attention nodes, its
losses, what each op does with its dims, where the sequence lives in each value, the state a rewrite shares, the report."""
