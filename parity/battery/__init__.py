"""The equivalence battery and the pytest plugin that runs it (importing this package imports no jax)."""
