"""The process's environment: XLA flags, the memory-map limit, garbage collection (no jax imported)."""
