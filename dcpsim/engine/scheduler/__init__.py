"""The engine's scheduler: one for all ranks; it decides blocks, positions and content."""
