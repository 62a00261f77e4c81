"""How a shard is cut into tiles and how its K/V tiles walk round the ring."""
