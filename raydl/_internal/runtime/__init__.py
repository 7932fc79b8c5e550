"""The process's place in the world: the Ray cluster (start, join, reap), torchrun ranks, environment variables."""
