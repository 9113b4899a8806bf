"""Several processes: jax.distributed set-up, local launch, and the global batch of each process."""
