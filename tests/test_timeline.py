"""`zero_jax.gpu.timeline`: the schedule walked, on hand-computed programs (a link shared,
two links whose waits add, loops, memory-bound kernels), and beside `predict` on a real one."""

import jax
import jax.numpy as jnp
import pytest

import zero_jax as zj

from zero_jax.gpu import predict, timeline

# No latency, every matmul at peak: times are bytes over bandwidth and flops over peak.
DEV = predict.Device("test", peak_flops=1e12, hbm_bandwidth=1e11,
                     intra=predict.Link(1e9, 0.0), cross=predict.Link(1e8, 0.0),
                     devices_per_host=4)
MS = 1e-3
# One matmul (500 x 1000) @ (1000 x 1000): 1e9 flops, 1 ms at peak (its 8 MB take 0.08 ms).
DOT = ("f32[500,1000] dot(p, q), lhs_contracting_dims={1}, rhs_contracting_dims={0}")


def program(body: str, extra: str = "") -> str:
  return f"""HloModule m
{extra}
ENTRY main {{
  p = f32[500,1000] parameter(0)
  q = f32[1000,1000] parameter(1)
  x = f32[50000] parameter(2)
  y = f32[25000] parameter(3)
  z = f32[300000] parameter(4)
  v = f32[12500] parameter(5)
{body}
}}
"""


def ag(name: str, operand: str, result: int, groups: str) -> str:
  return (f"  {name} = (f32[{result // 2}], f32[{result}]) all-gather-start({operand}), "
          f"replica_groups={{{groups}}}, dimensions={{0}}")


def done(name: str, result: int) -> str:
  return f"  {name}d = f32[{result}] all-gather-done({name})"


# A: across hosts (devices 3 and 4), 100,000 floats gathered: half of 400 kB at 1e8 B/s = 2 ms.
# C: within a host (0-3), 50,000 floats: 3/4 of 200 kB at 1e9 B/s = 0.15 ms.
# B: within a host, 600,000 floats: 3/4 of 2.4 MB = 1.8 ms.
A, C, B = ("a", "x", 100000, "{3,4}"), ("c", "y", 50000, "{0,1,2,3}"), \
    ("b", "z", 600000, "{0,1,2,3}")
CHAIN = program("\n".join([
    ag(*A), ag(*C), "  d1 = " + DOT, done("a", 100000), ag(*B), "  d2 = " + DOT,
    done("c", 50000), done("b", 600000),
    "  ROOT t = (f32[500,1000], f32[500,1000], f32[100000], f32[50000], f32[600000]) "
    "tuple(d1, d2, ad, cd, bd)"]))


def test_waits_on_two_links_at_different_points_add():
  # A waits at 2 ms (1 ms after d1); B starts then, ends at 3.8 ms, and d2 ends at 3 ms: the
  # step is 3.8 ms. The windows chain (A-C-B) into one group; `predict_scheduled` hides A
  # behind d1 (1 ms exposed) and C + B (1.95 ms) behind d1 and d2 (none exposed) and keeps
  # the worse link: 2 ms of matmuls + 1 ms = 3 ms, a lower bound.
  t = timeline.simulate(CHAIN, DEV)
  assert t.compute == pytest.approx(2 * MS, rel=1e-9)
  assert t.step == pytest.approx(3.8 * MS, rel=1e-9)
  assert t.waiting == pytest.approx(1.8 * MS, rel=1e-9)
  (outside,) = predict.predict_scheduled(CHAIN, DEV)
  assert t.compute + outside.step_exposed == pytest.approx(3 * MS, rel=1e-9)


SHARED = program("\n".join([
    ag("a", "x", 100000, "{0,1,2,3}"), ag("b", "z", 300000, "{0,1,2,3}"),
    done("a", 100000), "  d1 = " + DOT, done("b", 300000),
    "  ROOT t = (f32[500,1000], f32[100000], f32[300000]) tuple(d1, ad, bd)"]))


def test_collectives_on_one_link_share_its_bandwidth():
  # a: 0.3 ms alone, b: 0.9 ms alone, started together on one link: a gets half of it until
  # it ends at 0.6 ms (one after the other, it would end at 0.3), b has 0.6 ms left, done at
  # 1.2 ms, while d1 runs 0.6 -> 1.6 ms.
  t = timeline.simulate(SHARED, DEV)
  assert t.step == pytest.approx(1.6 * MS, rel=1e-9)


ELEMENTWISE = program("\n".join([
    ag("a", "x", 100000, "{3,4}"),
    "  e = f32[300000] fusion(z), kind=kLoop, calls=twice",  # reads z, writes e: 2.4 MB
    "  d1 = " + DOT, done("a", 100000),
    "  ROOT t = (f32[300000], f32[500,1000], f32[100000]) tuple(e, d1, ad)"]), """
twice {
  v = f32[300000] parameter(0)
  ROOT r = f32[300000] add(v, v)
}
""")


def test_only_matmuls_hide_communication_unless_told_otherwise():
  e = 2 * 1.2e6 / 1e11  # 0.024 ms
  hides = timeline.simulate(ELEMENTWISE, DEV, memory_bound_hides=True)
  assert hides.compute == pytest.approx(e + MS, rel=1e-9)
  assert hides.step == pytest.approx(2 * MS, rel=1e-9)  # a (2 ms) hidden by both kernels
  stalls = timeline.simulate(ELEMENTWISE, DEV)  # the default
  assert stalls.step == pytest.approx(e + 2 * MS, rel=1e-9)  # the link waits out e


def test_compute_under_a_collective_is_slowed():
  # d1 (1 ms) runs 1.5x slower while A (2 ms) is in flight: 1.5 ms, then A is waited for.
  slow = DEV._replace(overlap_slowdown=1.5)
  one = program("\n".join([ag(*A), "  d1 = " + DOT, done("a", 100000),
                           "  ROOT t = (f32[500,1000], f32[100000]) tuple(d1, ad)"]))
  assert timeline.simulate(one, slow).step == pytest.approx(2 * MS, rel=1e-9)
  # C (0.15 ms): d1 slowed only while C lasts: 0.15 + (1 - 0.1) ms.
  short = program("\n".join([ag(*C), "  d1 = " + DOT, done("c", 50000),
                             "  ROOT t = (f32[500,1000], f32[50000]) tuple(d1, cd)"]))
  assert timeline.simulate(short, slow).step == pytest.approx(1.05 * MS, rel=1e-9)


def loop_body(name: str, x: int) -> str:
  """A loop body (and its condition, 3 trips) that gathers f32[x] across hosts (devices 3
  and 4) around one DOT; its carry: (counter, p, q, the f32[x] operand)."""
  carry = f"(s32[], f32[500,1000], f32[1000,1000], f32[{x}])"
  return f"""
{name} {{
  s = {carry} parameter(0)
  p = f32[500,1000] get-tuple-element(s), index=1
  q = f32[1000,1000] get-tuple-element(s), index=2
  x = f32[{x}] get-tuple-element(s), index=3
  a = (f32[{x}], f32[{2 * x}]) all-gather-start(x), replica_groups={{{{3,4}}}}, dimensions={{0}}
  d1 = {DOT}
  ad = f32[{2 * x}] all-gather-done(a)
  i = s32[] get-tuple-element(s), index=0
  ROOT r = {carry} tuple(i, d1, q, x)
}}

cond {{
  s = {carry} parameter(0)
  i = s32[] get-tuple-element(s), index=0
  n = s32[] constant(3)
  ROOT lt = pred[] compare(i, n), direction=LT
}}
"""


def run_loop(x: str, size: int, before: str = "", after: str = "", out: str = "") -> str:
  carry = f"(s32[], f32[500,1000], f32[1000,1000], f32[{size}])"
  return program("\n".join(filter(None, [
      before, "  i = s32[] constant(0)", f"  s = {carry} tuple(i, p, q, {x})",
      f"  w = {carry} while(s), condition=cond, body=body, "
      "backend_config={\"known_trip_count\":{\"n\":\"3\"}}", after,
      f"  ROOT t = ({carry}{out}) tuple(w{', ad' if out else ''})"])), loop_body("body", size))


def test_a_loop_runs_its_body_once_per_trip():
  t = timeline.simulate(run_loop("x", 50000), DEV)
  (loop,) = t.loops
  assert (loop.name, loop.trips, loop.runs) == ("body", 3, 1)
  assert loop.seconds == pytest.approx(2 * MS, rel=1e-9)  # d1, then the rest of its 2 ms
  assert t.step == pytest.approx(6 * MS, rel=1e-9) and t.compute == pytest.approx(3 * MS)


def test_a_collective_around_a_loop_gets_only_the_link_time_the_loop_leaves():
  # A (2 ms across hosts) is in flight over a loop of 3 iterations of 1 ms, each sending 0.5
  # ms across hosts itself: A gets 3 - 1.5 ms of the link, and is waited for 0.5 ms more.
  text = run_loop("v", 12500, ag(*A), done("a", 100000), ", f32[100000]")
  t = timeline.simulate(text, DEV)
  assert t.loops[0].seconds == pytest.approx(1 * MS, rel=1e-9)
  assert t.step == pytest.approx(3.5 * MS, rel=1e-9)


def test_without_collectives_the_step_is_predicts_compute():
  f = jax.jit(lambda w, x: jnp.tanh(x @ w) * 2.0)
  text = f.lower(jnp.ones((256, 256)), jnp.ones((64, 256))).compile().as_text()
  t = timeline.simulate(text, predict.H100_SXM)
  want = predict.predict(predict.analyze(text), predict.H100_SXM).compute
  assert t.step == t.compute == pytest.approx(want, rel=1e-12) and want > 0


def test_a_text_without_an_entry_computation_or_a_target_for_a_device_is_refused():
  with pytest.raises(ValueError, match="no ENTRY computation"):
    timeline.simulate("HloModule m\n", DEV)
  with pytest.raises(TypeError, match="device_from_target"):
    timeline.simulate(CHAIN, zj.gpu.H100)


def test_a_conditional_takes_its_slowest_branch_and_lists_only_its_loops():
  # "fast": one DOT (1 ms); "slow": the loop, 3 iterations of 2 ms; "none": 1 iteration.
  text = program("\n".join([
      "  b = s32[] parameter(6)",
      "  i = s32[] constant(0)",
      "  s = (s32[], f32[500,1000], f32[1000,1000], f32[50000]) tuple(i, p, q, x)",
      "  ROOT c = (s32[], f32[500,1000], f32[1000,1000], f32[50000]) conditional(b, s, s), "
      "branch_computations={fast, slow}"]), loop_body("body", 50000) + """
fast {
  s = (s32[], f32[500,1000], f32[1000,1000], f32[50000]) parameter(0)
  i = s32[] get-tuple-element(s), index=0
  p = f32[500,1000] get-tuple-element(s), index=1
  q = f32[1000,1000] get-tuple-element(s), index=2
  x = f32[50000] get-tuple-element(s), index=3
  d = """ + DOT + """
  ROOT r = (s32[], f32[500,1000], f32[1000,1000], f32[50000]) tuple(i, d, q, x)
}

slow {
  s = (s32[], f32[500,1000], f32[1000,1000], f32[50000]) parameter(0)
  ROOT w = (s32[], f32[500,1000], f32[1000,1000], f32[50000]) while(s), condition=cond, """
      """body=body, backend_config={"known_trip_count":{"n":"3"}}
}

none {
  s = (s32[], f32[500,1000], f32[1000,1000], f32[50000]) parameter(0)
  ROOT w = (s32[], f32[500,1000], f32[1000,1000], f32[50000]) while(s), condition=cond, """
      """body=body, backend_config={"known_trip_count":{"n":"1"}}
}
""")
  t = timeline.simulate(text, DEV)
  assert t.step == pytest.approx(6 * MS, rel=1e-9)
  assert [(l.name, l.trips) for l in t.loops] == [("body", 3)]
  # "none" (2 ms) beside "fast" (1 ms): the loop's branch is the slowest again, its one trip
  t = timeline.simulate(text.replace("{fast, slow}", "{none, fast}"), DEV)
  assert t.step == pytest.approx(2 * MS, rel=1e-9) and [l.trips for l in t.loops] == [1]
