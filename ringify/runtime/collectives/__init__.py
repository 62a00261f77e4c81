"""What moves between ranks: the ring and its transfer seam, layouts, the all-to-all onto heads, sharding, reductions, ops along the sequence, agreement."""
