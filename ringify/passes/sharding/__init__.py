"""Sharding the sequence: the rules table (op -> how its placement is inferred and how it is
rewritten), its families, the graph's plan and the whole-graph rewrite."""
