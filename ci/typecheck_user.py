"""A user script that the type checker must accept (.ci/run runs mypy on it; it is not run)."""

import jax, jax.numpy as jnp, optax
import zero_jax as zj

def loss_fn(params: dict, batch: dict) -> jax.Array:
  return jnp.mean((batch["x"] @ params["w"]) ** 2)

mesh = jax.make_mesh((8,), ("data",))
step: zj.ShardedTrainStep = zj.make_sharded_train_step(loss_fn, optax.adam(1e-3), mesh=mesh)
state: zj.TrainState = step.init({"w": jnp.zeros((4, 2))})
state, metrics = step(state, {"x": jnp.ones((8, 4))})
state = state.replace(step=state.step + 1)
loss: float = float(metrics["loss"])
params = step.get_params(state)
