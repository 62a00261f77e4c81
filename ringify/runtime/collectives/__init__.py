"""What moves between ranks: the ring, its courier and P2P transport, sharding, reductions, scan, shift, agreement."""
