"""Rounding bounds shared by the numerics tests: a step's update against a reference's.

A sharded step and its single-device reference are compared one step at a time, from the
same state (the sharded run's own, read back with `opt_state_of`): every difference is then
rounding, bounded for any order of XLA's arithmetic, whereas two whole runs drift apart as
the training dynamics amplify it, which no rounding bound controls.
"""

import jax
import numpy as np

U32 = 2.0**-24  # float32's unit roundoff
# optax.adam's defaults as the fp32 constants it computes with (1 - B1 is then exact in fp32)
B1, B2, EPS = (float(np.float32(c)) for c in (0.9, 0.999, 1e-8))


def logical(x, shape):
  """The logical view of a (possibly padded) storage array: padding is at the end."""
  return np.asarray(x)[tuple(slice(0, d) for d in shape)]


def opt_state_of(state):
  """The optimizer state as optax holds it on one device: each storage view cut to its
  logical shape (padding is at the end)."""
  leaves, treedef = jax.tree.flatten(state.opt_state)
  return jax.tree.unflatten(treedef, [logical(x, lay.shape) for x, lay
                                      in zip(jax.device_get(leaves), state.meta.opt_layouts)])


def check_update(opt_name, lr, src, opt_before, grad, err, new_src, new_opt, round_to=None):
  """The step's update from ``src`` lies in the optimizer's image of every gradient within
  ``err`` of ``grad`` (interval arithmetic: SGD is linear in it; Adam's moments are monotone
  in g and g**2, its update increasing in mu and decreasing in |nu|), widened by the fp32
  rounding of the update itself (a few u32 of each term, whatever the order), then rounded
  to ``round_to`` (rounding is monotone, so the interval's rounded ends bound it).

  Args:
    opt_name: ``"sgd"`` (``optax.sgd(lr)``) or ``"adam"`` (``optax.adam(lr)``, defaults).
    lr: the learning rate.
    src: the fp32 params before the step; ``opt_before`` the optimizer state then
      (`opt_state_of`).
    grad, err: the reference's gradient and a bound on |step's gradient - grad|.
    (Every tree here is a dict of arrays, as the params.)
    new_src, new_opt: the step's params and optimizer state after it.
    round_to: the dtype the step stores params in, when it has no fp32 master.
  """
  f64 = lambda t: jax.tree.map(lambda x: np.asarray(x, np.float64), t)
  src, grad, err, new_src = f64(src), f64(grad), f64(err), f64(new_src)
  lr = float(np.float32(lr))
  for k in src:
    g_lo, g_hi = grad[k] - err[k], grad[k] + err[k]
    if opt_name == "sgd":
      step_lo, step_hi = lr * g_lo, lr * g_hi
      slack = 2 * U32 * (np.abs(src[k]) + lr * np.maximum(np.abs(g_lo), np.abs(g_hi)))
    else:
      adam = opt_before[0]
      mu, nu, t = np.float64(adam.mu[k]), np.float64(adam.nu[k]), int(adam.count) + 1
      mu_lo, mu_hi = B1 * mu + (1 - B1) * g_lo, B1 * mu + (1 - B1) * g_hi
      g_max = np.maximum(np.abs(g_lo), np.abs(g_hi))
      mu_slack = 3 * U32 * (B1 * np.abs(mu) + (1 - B1) * g_max)
      mu_lo, mu_hi = mu_lo - mu_slack, mu_hi + mu_slack
      sq_hi = np.maximum(g_lo**2, g_hi**2)
      sq_lo = np.where((g_lo <= 0) & (g_hi >= 0), 0.0, np.minimum(g_lo**2, g_hi**2))
      nu_lo = (B2 * nu + (1 - B2) * sq_lo) * (1 - 4 * U32)
      nu_hi = (B2 * nu + (1 - B2) * sq_hi) * (1 + 4 * U32)
      new_adam = new_opt[0]
      assert np.all((mu_lo <= new_adam.mu[k]) & (new_adam.mu[k] <= mu_hi)), k
      assert np.all((nu_lo <= new_adam.nu[k]) & (new_adam.nu[k] <= nu_hi)), k
      # Adam's step f(g) = (a0 + a1 g) / (sqrt(c + d g**2) + eps) couples mu and nu. From a
      # zero state (c = a0 = 0) it is increasing in g: its ends bound it. Otherwise
      # |f(g) - f(grad)| <= max|f'| err with |f'| <= a1 / B + max|a0 + a1 g| sqrt(d) / B**2,
      # B the least denominator on the interval (sqrt(c) > 0).
      c1, c2 = 1 - B1**t, 1 - B2**t
      a0, a1, c, d = B1 * mu / c1, (1 - B1) / c1, B2 * nu / c2, (1 - B2) / c2
      f = lambda g: (a0 + a1 * g) / (np.sqrt(c + d * g**2) + EPS)
      zero = (mu == 0) & (nu == 0)
      g_min = np.where(g_lo * g_hi <= 0, 0.0, np.minimum(np.abs(g_lo), np.abs(g_hi)))
      b_min = np.sqrt(c + d * g_min**2) + EPS
      a_max = np.maximum(np.abs(a0 + a1 * g_lo), np.abs(a0 + a1 * g_hi))
      deriv = a1 / b_min + a_max * np.sqrt(d) / b_min**2
      f_lo = np.where(zero, f(g_lo), f(grad[k]) - deriv * err[k])
      f_hi = np.where(zero, f(g_hi), f(grad[k]) + deriv * err[k])
      # The step's own fp32 rounding: mu (mu_slack), nu (4 u32, half that in f); b**t in
      # fp32 is within 4 u32 of itself (a power evaluated in fp32), so 1 - b**t is within
      # 4 u32 b**t / (1 - b**t) + u32 of itself; then /c1, /c2, sqrt, +eps, / and * lr, each
      # one rounding of f or of what enters it: 8 u32 more.
      rel_c = lambda b: 4 * U32 * b**t / (1 - b**t) + U32
      f_max = np.maximum(np.abs(f_lo), np.abs(f_hi))
      f_slack = ((rel_c(B1) + rel_c(B2) / 2 + 10 * U32) * f_max
                 + np.where(zero, 3 * U32 * f_max, mu_slack / c1 / b_min))
      step_lo, step_hi = lr * (f_lo - f_slack), lr * (f_hi + f_slack)
      slack = 2 * U32 * (np.abs(src[k]) + np.maximum(np.abs(step_lo), np.abs(step_hi)))
    lo, hi = src[k] - step_hi - slack, src[k] - step_lo + slack
    if round_to is not None:
      lo, hi = lo.astype(round_to).astype(np.float64), hi.astype(round_to).astype(np.float64)
    assert np.all((lo <= new_src[k]) & (new_src[k] <= hi)), (
        k, np.max(np.maximum(lo - new_src[k], new_src[k] - hi)))
