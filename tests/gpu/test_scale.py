"""Planning at the cluster sizes users run: 32 hosts x 8 compile-only H100s (256 GPUs), and
ZeRO++'s hpZ claim read from the compiled programs (benchmarks/bench_scale.py does the same
for GPT-2 small and Llama-3-8B's shapes, BENCHMARKS.md "scale")."""

import jax
import jax.numpy as jnp
import optax
import pytest

import zero_jax as zj
from zero_jax.gpu import measure

VOCAB, D, LAYERS, SEQ = 2048, 256, 2, 16
PARAMS = VOCAB * D + LAYERS * D * D   # rows split evenly over 256 GPUs: no padding
FIXED = dict(precision="bf16", stacked=lambda path, _: "blocks" in str(path))


def init():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"embed": 0.02 * jax.random.normal(k1, (VOCAB, D)),
          "blocks": 0.02 * jax.random.normal(k2, (LAYERS, D, D))}


def loss_fn(params, batch, *, prefetch=0):
  x = params["embed"][batch[:, :-1]]
  x, _ = zj.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["blocks"], prefetch=prefetch)
  logits = (x @ params["embed"].T).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def batch(hosts: int):
  return jax.ShapeDtypeStruct((hosts * 8 * 2, SEQ + 1), jnp.int32)


def sent_across(hosts: int, **opts) -> float:
  """Bytes one device sends across hosts per step: stage 3 over every GPU, prefetch 1."""
  mesh = zj.compile_only_mesh((hosts, 8), ("hosts", "data"), gpu="h100", hosts=hosts)
  step = measure.build_step(loss_fn, optax.adamw(1e-3), {"stage": 3, "prefetch": 1,
                                                         "axis_name": ("hosts", "data"), **opts},
                            mesh, FIXED)
  compiled = step.lower(step.abstract_state(init), batch(hosts)).compile(
      compiler_options=measure.FAST_COMPILE)
  return measure.read(compiled, measure.device_for(zj.gpu.H100, 8, "bf16")).cross_bytes


def test_a_plan_for_32_hosts_of_8_gpus_answers_with_a_candidate_that_fits():
  plan = zj.plan(loss_fn, optax.adamw(1e-3), init, batch(32), gpu="h100", hosts=32,
                 per_host=8, max_compiles=1, **FIXED)
  assert plan.best is not None and plan.stopped is None
  assert dict(plan.best.options["mesh"].shape) == {"hosts": 32, "data": 8}
  assert plan.best.cross_bytes > 0 and not plan.best.lossy


@pytest.mark.parametrize("hosts", [2, 32])
def test_with_hpz_each_gpu_sends_across_hosts_a_share_that_does_not_grow_with_the_hosts(hosts):
  # ZeRO++ (arXiv 2306.10209): hpZ's gathers stay within a host. Across hosts go only the
  # reduce-scatter of each GPU's 1/8 of the bf16 gradient and the all-gather that refreshes
  # the secondary copy, rings over the hosts: (h-1)/h of 2 x (bf16 bytes / 8) per GPU, never
  # more than 2 x (bf16 bytes / 8), at 2 hosts or 32 (plus two 4-byte scalars).
  share = 2 * (2 * PARAMS / 8)
  hpz = sent_across(hosts, hpz_axis="data")
  assert hpz == pytest.approx((hosts - 1) / hosts * share, rel=1e-3) and hpz < share
  # Without hpZ every gather crosses hosts as well: rings over all n GPUs, each leaving every
  # host once, so each GPU carries 1/8 of what it sends (`zero_jax.gpu.predict.
  # cross_host_bytes`): the forward gather of every bf16 parameter, the backward re-gather of
  # the blocks (the table is kept from the forward pass) and the reduce-scatter.
  n = 8 * hosts
  flat = sent_across(hosts)
  assert flat == pytest.approx((n - 1) / n * (2 * 2 * PARAMS + 2 * LAYERS * D * D) / 8,
                               rel=1e-3), (flat, hpz)
  assert flat > hpz
