"""One process of the multi-process tests (started by tests/test_multiprocess.py).

Importable without side effects: the test process imports the model, the
variants and the batches from here to compute its one-process reference.

  python tests/mp_worker.py parity OUT_DIR [CKPT_DIR]   # the variants, 5 steps each
  python tests/mp_worker.py rows OUT_DIR                # process 1 feeds half the rows
  python tests/mp_worker.py forever OUT_DIR [P [now]]   # trains until killed;
                                                        # process P raises at step 3
                                                        # ("now": and leaves at once,
                                                        # without waiting for its peers)

Each process is configured by the ZERO_JAX_* variables of
zero_jax.processes.launch.start_local_processes.
"""

import json
import os
import sys
import time

import numpy as np

STEPS = 5
GLOBAL_BATCH = 16
# Small leaves on purpose: gloo's reduce-scatter has failed on large (4 MiB)
# chunks (jax issue 40830). Uneven shapes exercise the padding.
SHAPES = {"w1": (6, 9), "b1": (9,), "w2": (9, 3), "b2": (3,)}
VARIANTS = {
    "stage1_adam": dict(stage=1, opt="adam"),
    "stage2_sgd_clip": dict(stage=2, opt="sgd", max_grad_norm=0.05),
    "stage3_adamw": dict(stage=3, opt="adamw"),
    "stage3_sgd": dict(stage=3, opt="sgd"),
    # fp32 on the wire: gloo and the in-process reduction add the 8 fp16
    # gradients in different orders, which in fp16 differs by its rounding.
    "fp16_stage2_adam": dict(stage=2, opt="adam", precision="fp16", comm_dtype="float32"),
    # rng= (a typed key) and model_state= placed on a mesh that spans processes.
    "stage2_adam_rng_state": dict(stage=2, opt="adam", extras=True),
    # Hybrid sharding: a ("replica", "data") = (2, 4) mesh, the replica axis across the
    # two processes (ZeRO within a process, data parallelism between them).
    "hybrid_stage2_adam": dict(stage=2, opt="adam", hybrid=True),
    "hybrid_stage3_sgd": dict(stage=3, opt="sgd", hybrid=True),
    # ZeRO++: hpZ within a process, int8 weights and gradients across (and within) them.
    # Stage 3 in bf16 keeps the split fp32 master as the params (StateMeta.master_in_params)
    # and gathers bf16 casts of it; its gradients are reduce-scattered in bf16.
    "bf16_stage3_sgd": dict(stage=3, opt="sgd", precision="bf16"),
    "hpz_qwz_qgz_stage3_adam": dict(stage=3, opt="adam", hybrid=True, hpz=True,
                                    precision="bf16", quantize=True),
}


def init_params():
  rng = np.random.default_rng(0)
  return {k: (rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32) for k, s in SHAPES.items()}


def global_batch(t):
  rng = np.random.default_rng(100 + t)
  return {"x": rng.normal(size=(GLOBAL_BATCH, 6)).astype(np.float32),
          "y": rng.normal(size=(GLOBAL_BATCH, 3)).astype(np.float32)}


def loss_fn(p, b):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  h = jnp.tanh(b["x"].astype(p["w1"].dtype) @ p["w1"] + p["b1"])
  out = h @ p["w2"] + p["b2"]
  return jnp.mean((out.astype(jnp.float32) - b["y"]) ** 2)


def loss_fn_extras(p, b, model_state, rng):
  """Input noise from the per-device key; a running mean as model state."""
  import jax  # pylint: disable=g-import-not-at-top
  x = b["x"] + 0.1 * jax.random.normal(rng, b["x"].shape)
  new_state = {"mean": 0.9 * model_state["mean"] + 0.1 * x.mean(0)}
  return loss_fn(p, {"x": x - model_state["mean"], "y": b["y"]}), new_state


def logits(p, x, *, model_state=None):
  """The model's outputs (``step.apply``'s function; a state made with model_state= passes
  it, and the "extras" variants' running mean is subtracted from x as their loss does)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  if model_state is not None:
    x = x - model_state["mean"]
  return jnp.tanh(x.astype(p["w1"].dtype) @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def forward_uses(step, state):
  """On the host: ``step.evaluate``'s loss and step on global_batch(STEPS) (each process
  feeding its rows) and ``step.apply``'s logits of its first 4 rows (args replicated)."""
  import jax  # pylint: disable=g-import-not-at-top
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  b = global_batch(STEPS)
  rows = zj.process_batch_slice(GLOBAL_BATCH, step)
  m = zj.metrics_to_host(step.evaluate(state, zj.make_global_batch(
      jax.tree.map(lambda x: x[rows], b), step)))
  out = step.apply(state, logits, b["x"][:4])
  return {"eval_loss": np.float64(m["loss"]), "eval_step": np.int64(m["step"]),
          "apply": np.asarray(out.addressable_data(0)).astype(np.float32)}  # npz: no bf16


def init_kwargs(variant):
  """Extra arguments of step.init for the variant."""
  if not VARIANTS[variant].get("extras"):
    return {}
  import jax  # pylint: disable=g-import-not-at-top
  return {"model_state": {"mean": np.zeros(6, np.float32)}, "rng": jax.random.key(7)}


def optimizer(name):
  import optax  # pylint: disable=g-import-not-at-top
  return {"adam": optax.adam(1e-2), "adamw": optax.adamw(1e-2, weight_decay=0.1),
          "sgd": optax.sgd(0.1)}[name]


def plain_optax(variant, steps=STEPS):
  """One device, plain jax.jit + optax (the reference of the fp32 variants): the params
  after ``steps`` steps and the loss of each step, ``{step number: loss}``."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  v = VARIANTS[variant]
  opt = optimizer(v["opt"])
  if v.get("max_grad_norm"):
    opt = optax.chain(optax.clip_by_global_norm(v["max_grad_norm"]), opt)

  @jax.jit
  def update(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = jax.device_put(init_params(), jax.devices()[0])
  opt_state, losses = opt.init(params), {}
  for t in range(steps):
    params, opt_state, loss = update(params, opt_state, global_batch(t))
    losses[t + 1] = float(loss)
  return {k: np.asarray(x) for k, x in params.items()}, losses


def make_step(variant):
  """The variant's step on all devices: a 1-D "data" mesh, or (2, n/2) for hybrid ones."""
  import jax  # pylint: disable=g-import-not-at-top
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  v = dict(VARIANTS[variant])
  fn = loss_fn_extras if v.pop("extras", False) else loss_fn
  if v.pop("quantize", False):
    v["quantize"] = zj.Quantize(block_size=8)
  if v.pop("hpz", False):
    v.pop("hybrid")
    mesh = jax.make_mesh((2, jax.device_count() // 2), ("replica", "data"))
    v.update(axis_name=("replica", "data"), hpz_axis="data")
  elif v.pop("hybrid", False):
    mesh = jax.make_mesh((2, jax.device_count() // 2), ("replica", "data"))
    v["replica_axis"] = "replica"
  else:
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
  return zj.make_sharded_train_step(fn, optimizer(v.pop("opt")), mesh=mesh, **v)


def collective_groups(step, state, batch):
  """[(op, groups)] of the compiled step, groups as mesh positions -> process indices."""
  from zero_jax.comm import hlo  # pylint: disable=g-import-not-at-top
  owner = [d.process_index for d in step.mesh.devices.flat]
  text = step.lower(state, batch).compile().as_text()
  return [(c.op, [[owner[i] for i in g] for g in c.groups or []], c.shape_text)
          for c in hlo.collectives(text) if c.nbytes > 8]


def _parity(out_dir, ckpt_in):
  import jax  # pylint: disable=g-import-not-at-top
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  me = jax.process_index()
  results, report = {}, {"process": me, "num_devices": jax.device_count(),
                         "local_devices": jax.local_device_count(), "metrics": {},
                         "groups": {}}
  for variant in VARIANTS:
    step = make_step(variant)
    rows = zj.process_batch_slice(GLOBAL_BATCH, step)
    report.setdefault("rows", [rows.start, rows.stop])
    state = step.init(init_params(), **init_kwargs(variant))
    history = []
    for t in range(STEPS):
      local = jax.tree.map(lambda x: x[rows], global_batch(t))
      batch = zj.make_global_batch(local, step)
      if t == 0 and VARIANTS[variant].get("hybrid"):
        report["groups"][variant] = collective_groups(step, state, batch)
      state, metrics = step(state, batch)
      history.append(zj.metrics_to_host(metrics))
      zj.print_main(f"{variant} step {t}: loss {history[-1]['loss']:.6f}")
    for k, x in forward_uses(step, state).items():
      results[f"{variant}/{k}"] = x
    for k, x in step.get_params(state).items():
      results[f"{variant}/{k}"] = np.asarray(x)
    if state.model_state is not None:
      results[f"{variant}/model_state"] = np.asarray(state.model_state["mean"])
    results[f"{variant}/loss"] = np.array([m["loss"] for m in history])
    results[f"{variant}/grad_norm"] = np.array([m["grad_norm"] for m in history])
    report["metrics"][variant] = {k: type(v).__name__ for k, v in history[-1].items()}
    if variant == "stage2_sgd_clip" and ckpt_in:
      _checkpoints(step, state, out_dir, ckpt_in, results)
  np.savez(os.path.join(out_dir, f"parity_{me}.npz"), **results)
  with open(os.path.join(out_dir, f"report_{me}.json"), "w") as f:
    json.dump(report, f)


def _checkpoints(step, state, out_dir, ckpt_in, results):
  """Restores the test process's checkpoint; saves this run's state."""
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  from zero_jax.checkpoint import CheckpointManager  # pylint: disable=g-import-not-at-top
  with CheckpointManager(ckpt_in) as mngr:
    restored = mngr.restore(step, init_params())
  for k, x in step.get_params(restored).items():
    results[f"restored/{k}"] = np.asarray(x)
  results["restored/step"] = np.asarray(restored.step)
  # One more step from the restored state: the optimizer state came back too.
  state_r, _ = step(restored, zj.make_global_batch(
      {k: v[zj.process_batch_slice(GLOBAL_BATCH, step)] for k, v in
       global_batch(STEPS).items()}, step))
  for k, x in step.get_params(state_r).items():
    results[f"restored_plus_one/{k}"] = np.asarray(x)
  with CheckpointManager(os.path.join(out_dir, "ckpt_mp")) as mngr:
    mngr.save(state)
    mngr.wait_until_finished()


def _raise_and_leave_at_once(message):
  """An uncaught exception whose process exits as soon as its hook has run."""
  try:
    raise RuntimeError(message)
  except RuntimeError:
    sys.excepthook(*sys.exc_info())  # the watchdog's hook announces the failure
    sys.stderr.flush()
    os._exit(1)  # pylint: disable=protected-access


def _forever(out_dir, raise_in, leave_at_once=False):
  import jax  # pylint: disable=g-import-not-at-top
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  step = make_step("stage2_sgd_clip")
  rows = zj.process_batch_slice(GLOBAL_BATCH, step)
  state = step.init(init_params())
  local = jax.tree.map(lambda x: x[rows], global_batch(0))
  for t in range(100000):
    state, metrics = step(state, zj.make_global_batch(local, step))
    m = zj.metrics_to_host(metrics)
    print(f"process {jax.process_index()} step {t} loss {m['loss']:.5f}", flush=True)
    if t == 3 and jax.process_index() == raise_in:
      message = f"mp_worker: injected failure in process {raise_in}"
      if leave_at_once:
        _raise_and_leave_at_once(message)
      raise RuntimeError(message)
    time.sleep(0.02)
  del out_dir


def _uneven_rows(out_dir):
  """Process 1 feeds half as many rows as process 0: each must fail naming the rows."""
  import jax  # pylint: disable=g-import-not-at-top
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  step = make_step("stage2_sgd_clip")
  rows = zj.process_batch_slice(GLOBAL_BATCH, step)
  local = jax.tree.map(lambda x: x[rows], global_batch(0))
  if jax.process_index() == 1:
    local = jax.tree.map(lambda x: x[:len(x) // 2], local)
  try:
    zj.make_global_batch(local, step)
  except ValueError as e:
    with open(os.path.join(out_dir, f"rows_{jax.process_index()}.txt"), "w") as f:
      f.write(str(e))


def _nan_warnings(out_dir):
  """Infinite parameters, one step each: the skipped-step warning reaches every process, at
  get_params for one step object and at interpreter exit for the other (in the log)."""
  import warnings  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  inf = jax.tree.map(lambda x: np.full_like(x, np.inf), init_params())  # (NaN != NaN)
  steps = [make_step("stage2_sgd_clip") for _ in range(2)]
  local = jax.tree.map(lambda x: x[zj.process_batch_slice(GLOBAL_BATCH, steps[0])],
                       global_batch(0))
  states = [s(s.init(inf), zj.make_global_batch(local, s))[0] for s in steps]
  with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    steps[0].get_params(states[0])
  with open(os.path.join(out_dir, f"warned_{jax.process_index()}.txt"), "w") as f:
    f.write("\n".join(str(w.message) for w in rec))


def main(argv):
  mode, out_dir = argv[1], argv[2]
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  zj.initialize_distributed()
  if mode == "parity":
    _parity(out_dir, argv[3] if len(argv) > 3 else None)
  elif mode == "misuse":
    _uneven_rows(out_dir)
    _nan_warnings(out_dir)
  elif mode == "forever":
    _forever(out_dir, int(argv[3]) if len(argv) > 3 else None, argv[4:] == ["now"])
  else:
    raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  main(sys.argv)
