"""From a model to its traced, rewritten graph at each call: the trace, the lengths read
at run time, what ranks must agree on, and what the trace keeps of the model's hooks and
caches."""
