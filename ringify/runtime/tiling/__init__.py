"""How a shard is cut and scheduled: layouts, tiles, the ring schedule, balancing, and moving tiles."""
