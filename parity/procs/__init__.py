"""Several processes as one run: a loopback launcher and jax.distributed helpers."""
