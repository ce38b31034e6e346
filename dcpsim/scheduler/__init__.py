"""The rank-independent side: one scheduler decides blocks, positions and content."""
