"""The training step: options checked into a spec, the state, init, gradients, the update, offload and memory."""
